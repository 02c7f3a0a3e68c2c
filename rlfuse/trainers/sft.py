"""Supervised fine-tuning: next-token loss on whole texts or on responses only, full weights or LoRA.

Departures from common practice: none of note; the loss is normalised by the labelled tokens of the whole optimiser
batch, so gradient accumulation gives the same gradient as one large batch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfuse.algos.losses import sft_loss
from rlfuse.config import Config
from rlfuse.data.chat import require_template, set_chat_template
from rlfuse.data.collate import encode, encode_sft, sft_batch
from rlfuse.data.gold import gold_summary
from rlfuse.data.prompts import check_max_length, model_context
from rlfuse.data.stages import rl_prompts, sft_examples
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
from rlfuse.models.load import load_causal_lm, load_tokenizer, resolve_base_model, save_trained_model
from rlfuse.models.quantize import choose_cpu_heap, place
from rlfuse.rollout.engine import DecodeEngine, SamplingParams


@dataclass
class SFTResult:
    model_dir: Path
    val_loss: float
    perplexity: float
    seconds: float
    grammatical_rate: float | None = None
    gold_positive_rate: float | None = None


@torch.no_grad()
def validation_loss(model, items, pad_id: int, micro: int, device, precision: str) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(items), micro):
        b = {k: v.to(device) for k, v in sft_batch(items[s: s + micro], pad_id).items()}
        n = int((b["labels"][:, 1:] != -100).sum())
        with autocast(device, precision):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        total += float(sft_loss(logits, b["labels"], normalizer=1.0))
        count += n
    model.train()
    return total / max(1, count)


def train_sft(cfg: Config, run_dir: Path, log=print, on_trained=None, resume: bool = False,
              on_resumed=None) -> SFTResult:
    """The SFT stage into run_dir/sft: model/ (merged, plain transformers), adapter/ (with LoRA), metrics, summary.
    on_trained(model), if given, gets the in-memory model once it is saved (tests compare it with the reloaded one);
    the result does not hold it, so the pipeline does not keep it alive through later stages. resume: continue
    from sft/checkpoint.pt (StageCheckpoint), then on_resumed("sft step N"); a finished stage is returned as it was
    saved."""
    if resume and (done := run_dir / "sft" / "summary.json").exists():
        log(f"[sft] already finished ({done}): nothing to resume")
        remove_stage_checkpoint(done.parent)
        return SFTResult(**{k: Path(v) if k == "model_dir" else v for k, v in json.loads(done.read_text()).items()})
    t0 = time.perf_counter()
    device = setup_runtime(cfg.run, log, run_dir / "sft" / "threads.txt")
    choose_cpu_heap(cfg.run.cpu_heap)
    name, task = resolve_base_model(cfg, log)
    tokenizer = load_tokenizer(name)
    set_chat_template(tokenizer, cfg.data.chat_template)  # saved with the model: RL renders prompts with it
    if cfg.rl.tools or cfg.rl.environment:  # RL renders each episode as a chat: say so before SFT trains, not after
        require_template(tokenizer, "multi-turn episodes (rl.tools, rl.environment)")
    model = place(load_causal_lm(name, cfg.model, precision=cfg.run.precision, device=device), device)
    check_max_length(cfg.data.max_length, model_context(model.config))
    model.train()
    if cfg.model.lean_activations:
        enable_lean_activations(model)
    train_ex, eval_ex = sft_examples(cfg, task, log)
    enc = lambda ex: encode_sft(tokenizer, ex, cfg.data.max_length, cfg.sft.completion_only)
    train_items, eval_items = [enc(e) for e in train_ex], [enc(e) for e in eval_ex][:512]
    s = cfg.sft
    opt, sched = build_optimizer(model, s.lr, s.weight_decay, s.warmup_steps, s.steps)
    out = run_dir / "sft"
    log(f"[sft] {len(train_items)} train / {len(eval_items)} held-out sequences, model {name}, device {device}")
    ckpt = StageCheckpoint(out, s.ckpt_every, s.steps, model, opt, sched, start_from=name, started=t0)
    start, bad = ckpt.restore("sft", log) if resume else (0, BadSteps())  # bad: steps skipped for a NaN/inf
    # a loss that blows up without a NaN (learn/divergence.py), also against a uniform guess's from the first step
    vocab = getattr(model.config, "vocab_size", None)
    watch = LossWatch(math.log(vocab), f"a uniform guess over its {vocab}-token vocabulary") if vocab else LossWatch()
    if resume and on_resumed is not None:
        on_resumed(f"sft step {start}")
    tracker = stage_tracker(cfg, out, from_step=start)
    val = None
    with Progress(s.steps, "sft", cfg.run.quiet, initial=start) as bar:
        for step, idx in enumerate(batch_indices([len(i) for i, _ in train_items], s.batch_size, s.steps, cfg.run.seed), 1):
            if step <= start:  # the batches are a function of (seed, step): a resumed stage skips those it trained
                continue
            batch = [train_items[i] for i in idx]
            n_tokens = sum(sum(1 for l in labels[1:] if l != -100) for _, labels in batch)
            loss_sum = 0.0
            for m in range(0, len(batch), s.micro_batch_size):
                b = {k: v.to(device) for k, v in sft_batch(batch[m: m + s.micro_batch_size], tokenizer.pad_token_id).items()}
                with autocast(device, cfg.run.precision):
                    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                loss = sft_loss(logits, b["labels"], normalizer=max(1, n_tokens))
                loss.backward()
                loss_sum += float(loss.detach())
            grad_norm = stage_step(model, opt, sched, s, "sft", loss_sum, bad)
            row = {"train/loss": loss_sum, "train/grad_norm": grad_norm, "train/lr": sched.get_last_lr()[0],
                   "train/skipped_steps": bad.skipped}
            if step % s.eval_every == 0 or step == s.steps:
                val = validation_loss(model, eval_items, tokenizer.pad_token_id, s.micro_batch_size, device, cfg.run.precision)
                row["eval/loss"] = val
            tracker.log(step, **row)
            # a batch without labelled tokens (completion-only rows cut before their answer) has loss 0: no measure
            if n_tokens and (found := watch.add(step, loss_sum)) is not None:
                tracker.close()
                raise ckpt.blown("sft", found, watch, s)
            ckpt.save_if_due(step, bad, calm=watch.calm())
            bar.update(loss=loss_sum, val=val)
    if watch.rising():  # the last steps' loss was blowing up (fewer than PATIENCE of them): no model of it either
        tracker.close()
        raise ckpt.blown("sft", watch.blowup(s.steps), watch, s)
    require_finite_weights(model, "sft")
    model_dir = save_trained_model(model, tokenizer, out, base=name)
    if on_trained is not None:
        on_trained(model)
    result = SFTResult(model_dir, val, math.exp(min(val, 50)), 0.0)
    if task is not None and cfg.data.kind == "synthetic" and s.eval_samples:  # the gold scorer knows its reviews only
        _, held_prompts = rl_prompts(cfg, task)
        prompts = held_prompts[: s.eval_samples]
        engine = DecodeEngine(model, tokenizer.eos_token_id)
        samples = sorted(engine.generate([encode(tokenizer, p) for p in prompts], 1, SamplingParams(128), cfg.run.seed),
                         key=lambda x: x.prompt_id)
        texts = [p + tokenizer.decode(x.token_ids, skip_special_tokens=True) for p, x in zip(prompts, samples)]
        gold = gold_summary(texts, [x.finish_reason != "length" for x in samples])
        result.grammatical_rate, result.gold_positive_rate = gold["grammatical_rate"], gold["gold_positive_rate"]
        (out / "samples.json").write_text(json.dumps(texts[:16], indent=1))
    result.seconds = ckpt.seconds()
    summary = {"val_loss": result.val_loss, "perplexity": result.perplexity, "seconds": result.seconds,
               "grammatical_rate": result.grammatical_rate, "gold_positive_rate": result.gold_positive_rate,
               "model_dir": str(model_dir)}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))  # `rlfuse run --resume` reads it
    ckpt.remove()
    tracker.close()
    log(f"[sft] done in {result.seconds:.0f}s: val loss {val:.3f}, perplexity {result.perplexity:.2f}"
        + (f", grammatical rate {result.grammatical_rate:.3f}" if result.grammatical_rate is not None else ""))
    return result
