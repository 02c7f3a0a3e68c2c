"""Reward model: a scalar head on a causal-LM backbone (AutoModelForSequenceClassification, one label), trained with
the Bradley-Terry pairwise loss; accuracy and margin logged on held-out pairs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfuse.algos.losses import pairwise_reward_loss
from rlfuse.config import Config
from rlfuse.data.chat import set_chat_template
from rlfuse.data.collate import encode_pair, pair_batch
from rlfuse.data.prompts import check_max_length, model_context
from rlfuse.data.stages import preference_pairs
from rlfuse.errors import UserError
from rlfuse.files import write_text_atomic
from rlfuse.learn.batches import batch_indices
from rlfuse.learn.checkpoint import StageCheckpoint, remove_stage_checkpoint
from rlfuse.learn.divergence import LossWatch
from rlfuse.learn.optim import build_optimizer
from rlfuse.learn.update import BadSteps, require_finite_weights, stage_step
from rlfuse.metrics.progress import Progress
from rlfuse.metrics.tracker import stage_tracker
from rlfuse.models.device import autocast, setup_runtime
from rlfuse.models.lean import enable_lean_activations
from rlfuse.models.load import load_reward_model, load_tokenizer, resolve_base_model, save_trained_model
from rlfuse.models.quantize import choose_cpu_heap, place


@dataclass
class RMResult:
    model_dir: Path
    accuracy: float
    margin: float
    seconds: float


def pair_rewards(model, items, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected), each (B,), from one forward over the stacked pairs."""
    b = {k: v.to(device) for k, v in pair_batch(items, pad_id).items()}
    r = model(**b).logits.squeeze(-1).float()
    return r[: len(items)], r[len(items):]


@torch.no_grad()
def evaluate_pairs(model, items, pad_id: int, micro: int, device, precision: str) -> dict:
    model.eval()
    correct, margin, loss, n = 0, 0.0, 0.0, 0
    for s in range(0, len(items), micro):
        with autocast(device, precision):
            rc, rr = pair_rewards(model, items[s: s + micro], pad_id, device)
        correct += int((rc > rr).sum())
        margin += float((rc - rr).sum())
        loss += float(pairwise_reward_loss(rc, rr)) * len(rc)
        n += len(rc)
    model.train()
    return {"eval/accuracy": correct / n, "eval/margin": margin / n, "eval/loss": loss / n}


def rm_backbone(cfg: Config, run_dir: Path, log=print) -> str:
    """rm.init=sft: this run's SFT model (or rm.sft_path), a merged plain folder; rm.init=base: the model in
    model.name. The reward model's adapter (with LoRA) names this folder as its base."""
    if cfg.rm.init == "sft":
        for cand in (cfg.rm.sft_path, run_dir / "sft" / "model"):
            if cand and Path(cand).exists():
                return str(cand)
        raise UserError(f"config error: rm.init: sft, but {run_dir / 'sft' / 'model'} does not exist; "
                        "run `rlfuse sft` into the same run.dir first, set rm.sft_path, or set rm.init=base")
    name, _ = resolve_base_model(cfg, log)
    return name


def train_rm(cfg: Config, run_dir: Path, log=print, on_trained=None, resume: bool = False,
             on_resumed=None) -> RMResult:
    """The reward-model stage into run_dir/rm: model/ (merged scalar-head model), adapter/ (with LoRA, based on the
    backbone folder), metrics, summary. on_trained(model), resume and on_resumed as in train_sft."""
    if resume and (done := run_dir / "rm" / "summary.json").exists():
        log(f"[rm] already finished ({done}): nothing to resume")
        remove_stage_checkpoint(done.parent)
        return RMResult(**{k: Path(v) if k == "model_dir" else v for k, v in json.loads(done.read_text()).items()})
    t0 = time.perf_counter()
    device = setup_runtime(cfg.run, log, run_dir / "rm" / "threads.txt")
    choose_cpu_heap(cfg.run.cpu_heap)
    _, task = resolve_base_model(cfg, log)
    name = rm_backbone(cfg, run_dir, log)
    tokenizer = load_tokenizer(name)
    set_chat_template(tokenizer, cfg.data.chat_template)  # conversational pairs are rendered with it
    model = place(load_reward_model(name, cfg.model, pad_token_id=tokenizer.pad_token_id, precision=cfg.run.precision,
                                    device=device), device)
    L = cfg.rm.max_length or cfg.data.max_length
    check_max_length(L, model_context(model.config), "rm.max_length" if cfg.rm.max_length else "data.max_length")
    model.train()
    if cfg.model.lean_activations:
        enable_lean_activations(model)
    train_pairs, eval_pairs = preference_pairs(cfg, task, log)
    train_items = [encode_pair(tokenizer, p, L) for p in train_pairs]
    eval_items = [encode_pair(tokenizer, p, L) for p in eval_pairs][:1024]
    s = cfg.rm
    opt, sched = build_optimizer(model, s.lr, s.weight_decay, s.warmup_steps, s.steps)
    out = run_dir / "rm"
    log(f"[rm] {len(train_items)} train / {len(eval_items)} held-out pairs of at most {L} tokens a side, "
        f"backbone {name}")
    ckpt = StageCheckpoint(out, s.ckpt_every, s.steps, model, opt, sched, start_from=name, started=t0)
    start, bad = ckpt.restore("rm", log) if resume else (0, BadSteps())  # bad: steps skipped for a NaN/inf
    # a loss that blows up without a NaN (learn/divergence.py); no know-nothing reference (a new scalar head on a
    # large model can start well above log 2)
    watch = LossWatch()
    if resume and on_resumed is not None:
        on_resumed(f"rm step {start}")
    tracker = stage_tracker(cfg, out, from_step=start)
    acc = final = None
    lengths = [max(len(c), len(r)) for c, r in train_items]
    with Progress(s.steps, "rm", cfg.run.quiet, initial=start) as bar:
        for step, idx in enumerate(batch_indices(lengths, s.batch_size, s.steps, cfg.run.seed), 1):
            if step <= start:  # the batches are a function of (seed, step): a resumed stage skips those it trained
                continue
            batch = [train_items[i] for i in idx]
            loss_sum, correct = 0.0, 0
            for m in range(0, len(batch), s.micro_batch_size):
                mb = batch[m: m + s.micro_batch_size]
                with autocast(device, cfg.run.precision):
                    rc, rr = pair_rewards(model, mb, tokenizer.pad_token_id, device)
                loss = pairwise_reward_loss(rc, rr) * len(mb) / len(batch)
                loss.backward()
                loss_sum += float(loss.detach())
                correct += int((rc > rr).sum())
            grad_norm = stage_step(model, opt, sched, s, "rm", loss_sum, bad)
            row = {"train/loss": loss_sum, "train/accuracy": correct / len(batch), "train/grad_norm": grad_norm,
                   "train/lr": sched.get_last_lr()[0], "train/skipped_steps": bad.skipped}
            if step % s.eval_every == 0 or step == s.steps:
                evaluated = evaluate_pairs(model, eval_items, tokenizer.pad_token_id, s.micro_batch_size, device,
                                           cfg.run.precision)
                row.update(evaluated)
                acc = evaluated["eval/accuracy"]
                if step == s.steps:  # the trained model's: not evaluated twice
                    final = evaluated
            tracker.log(step, **row)
            if (found := watch.add(step, loss_sum)) is not None:
                tracker.close()
                raise ckpt.blown("rm", found, watch, s)
            ckpt.save_if_due(step, bad, calm=watch.calm())
            bar.update(loss=loss_sum, acc=acc)
    if watch.rising():  # the last steps' loss was blowing up (fewer than PATIENCE of them): no model of it either
        tracker.close()
        raise ckpt.blown("rm", watch.blowup(s.steps), watch, s)
    if final is None:  # a resumed stage whose last step had been trained
        final = evaluate_pairs(model, eval_items, tokenizer.pad_token_id, s.micro_batch_size, device, cfg.run.precision)
    require_finite_weights(model, "rm")
    model_dir = save_trained_model(model, tokenizer, out, base=name)
    if on_trained is not None:
        on_trained(model)
    result = RMResult(model_dir, final["eval/accuracy"], final["eval/margin"], ckpt.seconds())
    write_text_atomic(out / "summary.json", json.dumps({"accuracy": result.accuracy, "margin": result.margin,  # resume
                                                        "seconds": result.seconds, "model_dir": str(model_dir)}, indent=2))
    ckpt.remove()
    tracker.close()
    log(f"[rm] done in {result.seconds:.0f}s: held-out accuracy {result.accuracy:.3f}, margin {result.margin:.2f}")
    return result
