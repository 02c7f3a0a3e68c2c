"""Online RL: PPO with a critic, RLOO and GRPO, on the rollout engine and the pure functions in rlfuse/algos.

Departures from the papers, on purpose:
- the engine's sampling log-probs serve as the old log-probs (they equal a full forward to 1e-4, tested), so no
  extra actor pass is spent on them;
- RLOO folds the KL into the sequence reward (as Ahmadian et al.); GRPO keeps it in the loss (k3, as DeepSeekMath);
  PPO folds it into per-token rewards (Ziegler et al.);
- every random draw (prompt batch, sampling, mini-batch order) is a function of (seed, iteration), so a resumed
  run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlfuse.algos.advantages import ADVANTAGE_FNS, gae_advantages
from rlfuse.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty, kl_shaped_rewards
from rlfuse.algos.losses import ppo_policy_loss, value_loss
from rlfuse.algos.stats import explained_variance, masked_mean, whiten
from rlfuse.config import Config, RLConfig
from rlfuse.data.collate import encode
from rlfuse.data.stages import rl_prompts
from rlfuse.errors import ConfigError, UserError
from rlfuse.metrics.tracker import JsonlTracker, memory_metrics, read_metrics
from rlfuse.models.heads import ValueModel
from rlfuse.models.load import apply_lora, load_causal_lm, load_reward_model, load_tokenizer, save_model
from rlfuse.progress import Progress
from rlfuse.rollout.engine import DecodeEngine, SamplingParams
from rlfuse.rollout.fusion import Experience, FusionPolicy, generate_rollouts
from rlfuse.rollout.score import Scorer, collate, function_reward_fn, response_logprobs, response_values, reward_model_fn
from rlfuse.trainers.checkpoint import load_checkpoint, save_checkpoint
from rlfuse.trainers.common import build_optimizer, setup_runtime
from rlfuse.trainers.sft import resolve_base_model


@dataclass
class Models:
    tokenizer: object
    actor: torch.nn.Module
    ref: torch.nn.Module | None  # None: the actor with its LoRA adapters disabled
    critic: ValueModel | None
    reward_fn: object


# ------------------------------------------------------------------------------------------------ setup


def _folder(given: str | None, default: Path, field: str, stage: str) -> str:
    path = Path(given) if given else default
    if not path.exists():
        raise UserError(f"config error: {field}: {path} does not exist; run `rlfuse {stage}` into this run.dir "
                        f"first or set {field}=<folder>")
    return str(path)


def load_reward_function(spec: str):
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError("rl.reward", f"cannot import {spec!r} ({type(e).__name__})",
                          "give module:function of an importable function of a list of texts") from None


def build_models(cfg: Config, run_dir: Path, device) -> Models:
    rl = cfg.rl
    sft_dir = _folder(rl.sft_path, run_dir / "sft" / "model", "rl.sft_path", "sft")
    tokenizer = load_tokenizer(sft_dir)
    actor = load_causal_lm(sft_dir)
    if hasattr(actor, "merge_and_unload"):  # an SFT adapter: merged, so "adapters off" means the SFT policy
        actor = actor.merge_and_unload()
    ref = None
    if cfg.model.lora:
        actor = apply_lora(actor, cfg.model)
    else:
        ref = load_causal_lm(sft_dir).eval().requires_grad_(False)
        ref = ref.merge_and_unload() if hasattr(ref, "merge_and_unload") else ref
    needs_rm = rl.reward == "rm" or (rl.algo == "ppo" and rl.critic_init == "rm")
    rm_dir = _folder(rl.rm_path, run_dir / "rm" / "model", "rl.rm_path", "rm") if needs_rm else None
    if rl.reward == "rm":
        rm = load_reward_model(rm_dir, pad_token_id=tokenizer.pad_token_id).eval().requires_grad_(False).to(device)
        reward_fn = reward_model_fn(rm, tokenizer.eos_token_id, tokenizer.pad_token_id)
    else:
        reward_fn = function_reward_fn(load_reward_function(rl.reward), tokenizer)
    actor = actor.to(device).train()
    if rl.disable_dropout:
        disable_dropout(actor)
    if rl.gradient_checkpointing:
        enable_gradient_checkpointing(actor)
    critic = None
    if rl.algo == "ppo":
        if rl.critic_init == "rm":
            critic = ValueModel.from_reward_model(load_reward_model(rm_dir, pad_token_id=tokenizer.pad_token_id))
        elif rl.critic_init == "sft":
            critic = ValueModel.from_causal_lm(load_causal_lm(sft_dir))
        else:
            critic = ValueModel.from_causal_lm(actor)
        critic = critic.to(device).train()
        if rl.disable_dropout:
            disable_dropout(critic)
        if rl.gradient_checkpointing and rl.critic_init != "actor":
            enable_gradient_checkpointing(critic.backbone)
    return Models(tokenizer, actor, ref.to(device) if ref is not None else None, critic, reward_fn)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere in the model, in training mode too: nn.Dropout modules and the float attention-dropout
    attributes that attention implementations read at call time (Llama-style `attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """transformers' per-layer activation checkpointing, non-reentrant (works with LoRA's frozen inputs and with the
    backbone called directly, as response_logprobs does). It acts only in training mode: the engine decodes in eval."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prompt_batch(prompts: list[list[int]], iteration: int, n: int, seed: int) -> list[list[int]]:
    """The iteration's prompts: a function of (seed, iteration), so no data position needs restoring."""
    rng = np.random.default_rng([seed, iteration])
    return [prompts[i] for i in rng.choice(len(prompts), size=n, replace=len(prompts) < n)]


# ------------------------------------------------------------------------------------------- the math


def compute_advantages(exp: Experience, rl: RLConfig, kl_coef: float):
    """-> (advantages (N, T) or (N,), returns (N, T) or None, per-token KL (N, T)); calls only pure functions."""
    kl = kl_penalty(exp.logprobs, exp.ref_logprobs, rl.kl_estimator) * exp.mask
    if rl.algo == "ppo":
        rewards = kl_shaped_rewards(exp.scores, kl, exp.mask, kl_coef)
        adv, returns = gae_advantages(rewards, exp.values, exp.mask, rl.gamma, rl.lam)
        return (whiten(adv, exp.mask) if rl.whiten_advantages else adv), returns, kl
    seq_reward = exp.scores - (kl_coef * kl.sum(1) if rl.algo == "rloo" else 0.0)
    adv = ADVANTAGE_FNS[rl.algo](seq_reward, rl.k)
    if rl.whiten_advantages and rl.algo == "rloo":
        adv = whiten(adv, torch.ones_like(adv))
    return adv, None, kl


def micro_batch_loss(models: Models, exp: Experience, idx: list[int], adv, returns, rl: RLConfig, kl_coef: float,
                     weight: float):
    """Loss of one micro-batch, pre-scaled by its share of the mini-batch (so accumulation equals one big batch)."""
    mb = collate([exp.prompt_ids[i] for i in idx], [exp.response_ids[i] for i in idx], models.tokenizer.pad_token_id,
                 next(models.actor.parameters()).device)
    T, dev = mb.mask.shape[1], mb.mask.device
    take = lambda t: t[idx][:, :T].to(dev)
    new_lp, entropy = response_logprobs(models.actor, mb, rl.temperature, with_entropy=True)
    a = adv[idx].to(dev) if adv.dim() == 1 else take(adv)
    loss, st = ppo_policy_loss(new_lp, take(exp.logprobs), a, mb.mask, rl.clip, rl.loss_level)
    stats = {"train/policy_loss": loss.detach(), "train/clip_frac": st["clip_frac"], "train/approx_kl": st["approx_kl"],
             "train/entropy": masked_mean(entropy.detach(), mb.mask)}
    if rl.algo == "grpo":  # KL to the reference inside the loss
        kl_term = masked_mean(kl_penalty(new_lp, take(exp.ref_logprobs), "k3"), mb.mask)
        loss = loss + kl_coef * kl_term
    critic_loss = None
    if models.critic is not None:
        values = response_values(models.critic, mb)
        vloss, vst = value_loss(values, take(exp.values), take(returns), mb.mask, rl.vf_clip)
        critic_loss = vloss * weight
        stats.update({"train/value_loss": vloss.detach(), "train/value_clip_frac": vst["clip_frac"]})
    return loss * weight, critic_loss, stats


def update_policy(models: Models, opts: list, scheds: list, exp: Experience, adv, returns, rl: RLConfig,
                  kl_coef: float, seed: int, iteration: int, bad: dict) -> dict:
    """Epochs x mini-batches x micro-batches of the clipped objective (and the value loss with a critic)."""
    gen = torch.Generator().manual_seed(seed * 7919 + iteration)
    n = len(exp)
    group = rl.k if rl.algo != "ppo" else 1  # keep a prompt's samples in one mini-batch
    sums: dict[str, float] = {}
    count, steps, norm_sum = 0, 0, 0.0
    timers = {"actor": 0.0, "critic": 0.0}  # forward+backward; the critic's forward is timed with the actor's
    params = list({id(p): p for m in (models.actor, models.critic) if m is not None
                   for p in m.parameters() if p.requires_grad}.values())  # a shared backbone counts once
    for _ in range(rl.epochs):
        order = (torch.randperm(n // group, generator=gen)[:, None] * group + torch.arange(group)).view(-1).tolist()
        for s in range(0, n, rl.mini_batch_size):
            mini = order[s: s + rl.mini_batch_size]
            tokens = float(exp.mask[mini].sum()) if rl.loss_level == "token" else float(len(mini))
            ok = True
            for m in range(0, len(mini), rl.micro_batch_size):
                idx = mini[m: m + rl.micro_batch_size]
                share = (float(exp.mask[idx].sum()) if rl.loss_level == "token" else float(len(idx))) / tokens
                t = time.perf_counter()
                loss, critic_loss, stats = micro_batch_loss(models, exp, idx, adv, returns, rl, kl_coef, share)
                if not torch.isfinite(loss) or (critic_loss is not None and not torch.isfinite(critic_loss)):
                    ok = False
                    break
                if critic_loss is not None and rl.critic_init == "actor":  # one graph through the shared body
                    (loss + critic_loss).backward()
                    timers["actor"] += time.perf_counter() - t
                else:
                    loss.backward()
                    timers["actor"] += time.perf_counter() - t
                    if critic_loss is not None:
                        t = time.perf_counter()
                        critic_loss.backward()
                        timers["critic"] += time.perf_counter() - t
                for key, v in stats.items():  # tensors: no host sync per micro-batch
                    sums[key] = sums.get(key, 0.0) + v.detach()
                count += 1
            if not ok:  # skip the step, count it; repeated failures end the run
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                bad["skipped"] += 1
                bad["consecutive"] += 1
                if bad["consecutive"] >= rl.max_bad_steps:
                    raise UserError(f"training diverged: {bad['consecutive']} consecutive updates had a NaN/inf loss "
                                    "(lower rl.lr, raise rl.kl_coef, or check the reward); last checkpoint kept")
                continue
            bad["consecutive"] = 0
            grad_norm = torch.nn.utils.clip_grad_norm_(params, rl.grad_clip if rl.grad_clip > 0 else float("inf"))
            norm_sum, steps = norm_sum + grad_norm.detach(), steps + 1
            for opt, sched in zip(opts, scheds):
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
    return ({k: float(v) / max(1, count) for k, v in sums.items()} | {"train/grad_norm": float(norm_sum) / max(1, steps)}
            | {"time/train_actor": timers["actor"], "time/train_critic": timers["critic"]})


# ------------------------------------------------------------------------------------------- evaluation


def evaluate(models: Models, engine: DecodeEngine, prompts: list[list[int]], rl: RLConfig, seed: int,
             gold: bool) -> tuple[dict, list[str]]:
    """Held-out prompts, one sample each: reward, KL to the reference, length; gold and grammar on the default task."""
    scorer = Scorer(models.reward_fn, models.tokenizer.pad_token_id, ref=models.ref, actor=models.actor,
                    temperature=rl.temperature, micro_batch_size=32)
    params = SamplingParams(rl.max_new_tokens, rl.temperature, rl.top_k, rl.top_p, tuple(rl.stop or ()))
    exp = generate_rollouts(engine, scorer, prompts, 1, params, seed, FusionPolicy(True))
    tok = models.tokenizer
    texts = [tok.decode(p + r, skip_special_tokens=True) for p, r in zip(exp.prompt_ids, exp.response_ids)]
    out = {
        "reward_mean": float(exp.scores.mean()),
        "kl": float((kl_penalty(exp.logprobs, exp.ref_logprobs, "k1") * exp.mask).sum(1).mean()),
        "mean_length": float(exp.mask.sum(1).mean()),
    }
    if gold:
        from rlfuse.data.gold import gold_summary

        out.update(gold_summary(texts, [r != "length" for r in exp.finish_reasons]))
    return out, texts


# ------------------------------------------------------------------------------------------- the loop


def rollout_metrics(exp: Experience, kl, returns, kl_coef: float, max_new: int) -> dict:
    lengths = exp.mask.sum(1)
    m = {
        "reward/mean": float(exp.scores.mean()), "reward/std": float(exp.scores.std()) if len(exp) > 1 else 0.0,
        "reward/kl": float(kl.sum(1).mean()), "reward/kl_coef": kl_coef,
        "rollout/length_mean": float(lengths.mean()), "rollout/length_p50": float(lengths.median()),
        "rollout/length_p95": float(torch.quantile(lengths, 0.95)), "rollout/length_max": float(lengths.max()),
        "rollout/hit_limit": float((lengths >= max_new).float().mean()), "rollout/samples": len(exp),
    }
    if returns is not None:
        m["train/explained_variance"] = float(explained_variance(exp.values, returns, exp.mask))
    return m


def train_rl(cfg: Config, run_dir: Path, log=print, resume: bool = False, on_ready=None) -> dict:
    """The RL stage. on_ready(models), if given, is called once the models are loaded, before the first iteration
    (benchmarks read the idle memory footprint there)."""
    rl, t_start = cfg.rl, time.perf_counter()
    if not (run_dir / "config.yaml").exists():  # called as a library rather than through the CLI
        from rlfuse.config import save_config

        save_config(cfg, run_dir)
    device = setup_runtime(cfg.run)
    _, task = resolve_base_model(cfg, log) if cfg.data.kind == "synthetic" else (None, None)
    models = build_models(cfg, run_dir, device)
    tok = models.tokenizer
    train_text, held_text = rl_prompts(cfg, task, log)
    train_prompts = [encode(tok, p) for p in train_text]
    held_prompts = [encode(tok, p) for p in held_text][: rl.eval_prompts]
    engine = DecodeEngine(models.actor, tok.eos_token_id, max_rows=cfg.rollout.max_rows, tokenizer=tok)
    scorer = Scorer(models.reward_fn, tok.pad_token_id, ref=models.ref, actor=models.actor, critic=models.critic,
                    temperature=rl.temperature, micro_batch_size=cfg.rollout.micro_batch_size,
                    unfinished_penalty=rl.unfinished_penalty)
    fusion = FusionPolicy(cfg.rollout.fusion, cfg.rollout.score_every, cfg.rollout.live_below)
    params = SamplingParams(rl.max_new_tokens, rl.temperature, rl.top_k, rl.top_p, tuple(rl.stop or ()))
    opt_a, sched_a = build_optimizer(models.actor, rl.lr, 0.0, 0, 10**9)
    opts, scheds = [opt_a], [sched_a]
    opt_c = None
    if models.critic is not None:
        # a value head on the actor: the critic's optimiser owns only the head; the shared body is the actor's
        critic_part = models.critic.head if rl.critic_init == "actor" else models.critic
        opt_c, sched_c = build_optimizer(critic_part, rl.critic_lr, 0.0, 0, 10**9)
        opts.append(opt_c)
        scheds.append(sched_c)
    kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target is not None
              else FixedKLController(rl.kl_coef))
    out = run_dir / "rl"
    out.mkdir(parents=True, exist_ok=True)
    ckpt, start, bad = out / "checkpoint.pt", 0, {"skipped": 0, "consecutive": 0}
    gold = cfg.data.kind == "synthetic"
    if resume and ckpt.exists():
        state = load_checkpoint(ckpt, models.actor, models.critic, opt_a, opt_c)
        start, kl_ctl.coef, bad = state["iteration"], state["kl_coef"], state["counters"]
        _truncate_metrics(out / "metrics.jsonl", start)
        log(f"[rl] resumed from {ckpt} at iteration {start}")
    before_path = out / "eval_before.json"
    if before_path.exists():
        before = json.loads(before_path.read_text())
    else:
        before, before_texts = evaluate(models, engine, held_prompts, rl, cfg.run.seed + 12345, gold) if held_prompts else ({}, [])
        before_path.write_text(json.dumps(before | {"samples": before_texts[:16]}, indent=2))
    tracker = JsonlTracker(out / "metrics.jsonl", tensorboard=True)
    if on_ready is not None:
        on_ready(models)
    log(f"[rl] {rl.algo}: {rl.iterations} iterations x {rl.prompts_per_iter} prompts x k={rl.k}, fusion "
        f"{'on' if fusion.enabled else 'off'}")
    with Progress(rl.iterations, f"rl/{rl.algo}", cfg.run.quiet, unit="iter") as bar:
        bar.update(start)
        for it in range(start, rl.iterations):
            t0, role_times = time.perf_counter(), dict(scorer.times)
            # 1. generate and score: scoring runs on finished samples while the tail decodes (fusion on)
            prompts = prompt_batch(train_prompts, it, rl.prompts_per_iter, cfg.run.seed)
            exp = generate_rollouts(engine, scorer, prompts, rl.k, params, cfg.run.seed * 1_000_003 + it, fusion)
            if not torch.isfinite(exp.scores).all():
                bad["skipped"] += 1
                log(f"[rl] iteration {it + 1}: non-finite reward, update skipped")
                continue
            # 2. KL-shaped rewards and advantages (pure functions in rlfuse/algos)
            adv, returns, kl = compute_advantages(exp, rl, kl_ctl.coef)
            # 3. optimise the actor (and critic): epochs x mini-batches x micro-batches
            t1 = time.perf_counter()
            stats = update_policy(models, opts, scheds, exp, adv, returns, rl, kl_ctl.coef, cfg.run.seed, it, bad)
            t2 = time.perf_counter()
            kl_ctl.update(float(kl.sum(1).mean()), len(exp))
            # 4. record and checkpoint
            row = rollout_metrics(exp, kl, returns, kl_ctl.coef, rl.max_new_tokens) | stats
            row |= {f"time/{k}": v for k, v in exp.timing.items() if not k.startswith("decode")}
            row |= {f"time/score_{k}": v - role_times.get(k, 0.0) for k, v in scorer.times.items()}
            row |= memory_metrics(device) | iteration_gold(exp, tok, gold)
            row |= {"time/training": t2 - t1, "time/iteration": t2 - t0, "train/skipped_steps": bad["skipped"],
                    "rollout/samples_per_s": len(exp) / (t2 - t0),
                    "rollout/tokens_per_s": float(exp.mask.sum()) / (t2 - t0)}
            tracker.log(it + 1, **row)
            if (it + 1) % rl.ckpt_every == 0 or it + 1 == rl.iterations:
                save_checkpoint(ckpt, iteration=it + 1, actor=models.actor, critic=models.critic, opt_actor=opt_a,
                                opt_critic=opt_c, kl_coef=kl_ctl.coef, counters=bad)
            (out / "last_rewards.json").write_text(json.dumps(exp.scores.tolist()))
            bar.update(reward=row["reward/mean"], kl=row["reward/kl"], sps=row["rollout/samples_per_s"])
    tracker.close()
    after, after_texts = evaluate(models, engine, held_prompts, rl, cfg.run.seed + 12345, gold) if held_prompts else ({}, [])
    result = {"before": before_without_samples(before), "after": after}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2))
    (out / "samples_after.json").write_text(json.dumps(after_texts[:16], indent=1))
    save_model(models.actor, tok, out / "model")
    result["seconds"] = time.perf_counter() - t_start
    from rlfuse.metrics.report import write_report

    result["report"] = str(write_report(run_dir))
    return result


def iteration_gold(exp: Experience, tok, gold: bool) -> dict:
    """Default task: the gold score of this iteration's samples, to watch real improvement beside the reward."""
    if not gold:
        return {}
    from rlfuse.data.gold import gold_summary

    texts = [tok.decode(p + r, skip_special_tokens=True) for p, r in zip(exp.prompt_ids, exp.response_ids)]
    g = gold_summary(texts, [r != "length" for r in exp.finish_reasons])
    return {"reward/gold_mean": g["gold_mean"], "reward/gold_positive_rate": g["gold_positive_rate"]}


def before_without_samples(before: dict) -> dict:
    return {k: v for k, v in before.items() if k != "samples"}


def _truncate_metrics(path: Path, iteration: int) -> None:
    """Drop rows logged after the checkpoint: the resumed run logs those iterations again."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= iteration]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)


def eval_table(result: dict) -> str:
    keys = ["gold_positive_rate", "gold_mean", "reward_mean", "kl", "grammatical_rate", "mean_length"]
    lines = [f"  {'metric':<20}{'before':>10}{'after':>10}"]
    for k in keys:
        if k in result["before"] or k in result["after"]:
            b, a = result["before"].get(k, math.nan), result["after"].get(k, math.nan)
            lines.append(f"  {k:<20}{b:>10.3f}{a:>10.3f}")
    return "\n".join(lines)
