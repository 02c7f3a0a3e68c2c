"""Online RL: PPO with a critic, RLOO and GRPO, on the rollout engine and the pure functions in rlfuse/algos.
Build (rlfuse/models/build.py) -> loop (train_rl) -> update (rlfuse/learn/update.py) -> record.

Departures from the papers, on purpose:
- the engine's sampling log-probs serve as the old log-probs (they equal a full forward to 1e-4, tested), so no
  extra actor pass is spent on them;
- RLOO folds the KL into the sequence reward (as Ahmadian et al.); GRPO keeps it in the loss (k3 by default, as
  DeepSeekMath); PPO folds it into per-token rewards (Ziegler et al.). One estimator (rl.kl_estimator_used) serves
  the penalty, the logged reward/kl and the adaptive controller;
- the actor and the critic are two updates over the same experience and the same mini-batch order, each clipping
  its own gradient norm and stepping its own optimiser; a value head on the actor's body (rl.critic_init=actor)
  joins the actor's update instead (see learn/update.py update_actor);
- the generator is its own model: it gets the actor's weights through DecodeEngine.load_weights before every
  rollout and evaluation, never by sharing the optimiser's tensors (with model.shared_base the engine decodes the
  shared base itself, with the actor's adapter: no copy, no sync);
- with rl.share_prompt (default) a prompt's k samples stay in one mini-batch for ppo too (as for rloo and grpo), so
  that their forwards share the prompt (rlfuse/models/prefix.py; equal numbers, fewer token-forwards);
- every random draw (prompt batch, sampling, mini-batch order) and the scheduled temperature are functions of
  (seed, iteration), so a resumed run repeats an uninterrupted one exactly;
- with a temperature schedule each iteration optimises softmax(logits / T_it): sampling, the reference log-probs
  and the update's log-probs all use T_it, while the before/after evaluation keeps one fixed temperature;
- step 1 (sync, generate, score) and step 4 (update, checkpoints) are a `rollout` and a `trainer` object
  (rlfuse/runtime/protocols.py): this process, or Ray worker groups by placement.strategy (training data-parallel
  or pipelined on the actor's group); the evaluation and the saved model stay in this process for every strategy.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfuse.algos.kl import AdaptiveKLController, FixedKLController
from rlfuse.algos.stats import in_spread_groups, spread_groups_first
from rlfuse.algos.schedules import scheduled_value
from rlfuse.config import Config, RLConfig, fusion_on, save_config
from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.data.chat import require_template, set_chat_template
from rlfuse.data.curriculum import prompt_batch
from rlfuse.data.prompts import encode_prompts, model_context, prompt_budget
from rlfuse.data.stages import rl_prompt_rows
from rlfuse.errors import said_where
from rlfuse.evaluation import evaluate, evaluate_before, iteration_gold, prompt_difficulty, sampling_params
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.batches import minibatches, truncated_masked, update_batches
from rlfuse.learn.checkpoint import checkpoint_bytes, read_checkpoint
from rlfuse.learn.learners import build_learners
from rlfuse.learn.update import BadSteps, count_abstained, count_nonfinite_rewards, stop_if_blown
from rlfuse.metrics.audit import health_watch
from rlfuse.metrics.flops import compute_meter_for_run
from rlfuse.metrics.memory import MemoryMeter
from rlfuse.metrics.progress import Progress
from rlfuse.metrics.tracker import memory_metrics, stage_tracker
from rlfuse.models.build import Models, build_models, load_reward_function
from rlfuse.models.device import dtype_name, setup_runtime
from rlfuse.models.layout import keep_layout, kept_layout, layout_of
from rlfuse.models.load import resolve_base_model, save_trained_model
from rlfuse.models.prompt_workload import resolve_measured
from rlfuse.models.quantize import choose_cpu_heap
from rlfuse.models.rewards import attach_rows, reset_reward_metrics, reward_metrics
from rlfuse.plan.planner import predicted_memory
from rlfuse.rollout.episodes import EpisodeGenerator, Episodes, check_episode_template, episode_prompt
from rlfuse.rollout.fusion import Experience, FusionPolicy, take_samples
from rlfuse.rollout.state import RolloutRequest, SamplingParams
from rlfuse.runtime.backend import build_placement, uses_ray
from rlfuse.runtime.local import (LocalTrainer, behaviour_differs, build_generator, local_scorer, release_decode_copy,
                                  sync_weights)
from rlfuse.trainers.observe import due, evaluate_during, group_metrics, rollout_metrics, sample_table


def iteration_temperature(rl: RLConfig, iteration: int) -> float:
    """Sampling temperature of 0-based `iteration`: rl.temperature -> rl.temperature_final by rl.temperature_schedule."""
    final = rl.temperature if rl.temperature_final is None else rl.temperature_final
    return scheduled_value(rl.temperature_schedule, rl.temperature, final, iteration, rl.iterations)


def sampling_note(rl: RLConfig) -> str:
    """'temperature 1 -> 0.7 (linear), curriculum by reward' for the run's first log line."""
    note = f"temperature {rl.temperature:g}"
    if rl.temperature_schedule != "constant":
        note += f" -> {rl.temperature_final:g} ({rl.temperature_schedule})"
    return note + (f", curriculum by {rl.curriculum}" if rl.curriculum != "none" else "")


KL_PLACES = {"token_reward": "in each token's reward", "sequence_reward": "in the sequence reward", "loss": "in the loss"}


def settings_line(rl: RLConfig) -> str:
    """'grpo: 40 iterations x 8 prompts x k=4, lr 0.0001, 4 epochs, KL k3 in the loss, fixed at 0.04': what the
    algorithm runs with, presets included, said once at the start."""
    kl = (f"adaptive from {rl.kl_coef:g} to a KL of {rl.kl_target:g}" if rl.kl_target is not None else
          f"fixed at {rl.kl_coef:g}")
    return (f"{rl.algo}: {rl.iterations} iterations x {rl.prompts_per_iter} prompts x k={rl.k}, lr {rl.lr:g}, "
            f"{rl.epochs} epochs, KL {rl.kl_estimator_used} {KL_PLACES[ALGORITHMS[rl.algo].kl_in]}, {kl}")


def precision_note(engine, models: Models) -> str:
    """'bfloat16 autocast, decoding in bfloat16': the arithmetic of the update and of the sampler, when they differ
    corrected by the decoupled objective (train/behaviour_weight_* in the metrics)."""
    train = dtype_name(models.compute_dtype or torch.float32)
    note = f"{train} autocast" if models.compute_dtype is not None else train
    if behaviour_differs(engine, models.actor, models.compute_dtype):
        note += f", decoding in {dtype_name(engine.dtype)}"
    if models.generator is not None and layout_of(models.generator) == "column":  # rollout.weight_layout
        note += ", the generator's weights stored column-major"
    return note


def train_rl(cfg: Config, run_dir: Path, log=print, resume: bool = False, on_ready=None, on_resumed=None) -> dict:
    """The RL stage: build -> loop -> save the policy. Returns {"before", "after", "samples_after", "seconds"}; the
    CLI writes eval.json and the report. on_ready(models), if given, is called once the models are loaded, before
    the first iteration (benchmarks read the idle memory footprint there); on_resumed("iteration N"), once a
    resumed run's checkpoint is read (the API records the settings changed on resume with it)."""
    cfg = resolve_measured(cfg, log)  # a Config used directly (the API and the CLI resolved theirs: no change)
    rl, t_start, seed = cfg.rl, time.perf_counter(), cfg.run.seed
    if not (run_dir / "config.yaml").exists():  # called as a library rather than through the CLI
        save_config(cfg, run_dir)
    device = setup_runtime(cfg.run, log, run_dir / "rl" / "threads.txt")
    choose_cpu_heap(cfg.run.cpu_heap)
    _, task = resolve_base_model(cfg, log) if cfg.data.kind == "synthetic" else (None, None)
    layout_file = run_dir / "rl" / "weight_layout.txt"
    models = build_models(cfg, run_dir, device, weight_layout=kept_layout(layout_file, cfg) if resume else None)
    keep_layout(layout_file, models.generator)
    tok, gold = models.tokenizer, cfg.data.kind == "synthetic"
    episodes = episode_settings(cfg, tok)  # None: single-turn completions
    run_prompts = build_prompts(cfg, models, task, log, episodes)
    train_prompts, held_prompts = run_prompts.train, run_prompts.held_out
    held_rows = run_prompts.held_out_rows
    response_tokens = episodes.limits.max_tokens if episodes is not None else rl.max_new_tokens
    max_model_len = max(len(p) for p in train_prompts + held_prompts) + response_tokens  # vLLM's requests
    engine = build_generator(cfg, models, max_model_len, log)
    if episodes is not None:  # a generator whose samples are whole episodes (rollout/episodes.py)
        engine = EpisodeGenerator(engine, episodes)
        log(f"[rl] episodes: {episodes.describe()}")
    scorer = local_scorer(models, cfg)
    fusion = FusionPolicy(fusion_on(cfg), cfg.rollout.score_every, cfg.rollout.live_below)
    params = sampling_params(models, rl, rl.temperature)
    trainer = LocalTrainer(models, build_learners(models, rl), rl)
    kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target is not None
              else FixedKLController(rl.kl_coef))
    out = run_dir / "rl"
    out.mkdir(parents=True, exist_ok=True)
    # memory per component of this process's roles (run.memory_table); on Ray the roles live in the workers
    # (worker/<rank>/rss_*)
    meter = (MemoryMeter(models, trainer.learners, device, out / "memory.json", cfg.model.quantization)
             if cfg.run.measures_memory(cfg.model) and not uses_ray(cfg) else None)
    if meter is not None:  # the planner's prediction, shown beside the measurement (rlfuse/plan/memory.py)
        (out / "memory_predicted.json").write_text(json.dumps({"bytes": predicted_memory(cfg)}))
    ckpt, start, bad, earlier_s = out / "checkpoint.pt", 0, BadSteps(), 0.0
    if resume and ckpt.exists():  # on Ray the trainers restore it (below); this process needs only the counters
        state = read_checkpoint(ckpt) if uses_ray(cfg) else trainer.load_checkpoint(ckpt)
        counters = dict(state["counters"])
        # the processes before this one, up to the checkpoint: the stage's seconds count them (as SFT's and RM's do)
        earlier_s = float(counters.pop("seconds", 0.0))
        start, kl_ctl.coef, bad = state["iteration"], state["kl_coef"], BadSteps(**counters)
        log(f"[rl] resumed from {ckpt} at iteration {start}" + ("" if start < rl.iterations else
            f": rl.iterations={rl.iterations} are done, nothing left to train (raise rl.iterations to go on)"))
    elif resume:
        log(f"[rl] --resume: no RL checkpoint in {out} yet (the run stopped before its first, which comes every "
            f"rl.ckpt_every={rl.ckpt_every} iterations): RL starts at iteration 0")
    if resume and on_resumed is not None:
        on_resumed(f"iteration {start}")
    sync_weights(engine, models.actor)
    with said_where("the held-out evaluation before RL"):
        before = evaluate_before(out / "eval_before.json", models, engine, held_prompts, rl, seed + 12345, gold,
                                 held_rows)
        difficulty = prompt_difficulty(models, engine, train_prompts, rl, seed + 23456, out / "difficulty.json", log,
                                       run_prompts.train_rows)
    release_decode_copy(engine)
    reset_reward_metrics(models.reward_fn)  # the evaluations' calls are not the first iteration's
    tracker = stage_tracker(cfg, out, from_step=start)
    flops = compute_meter_for_run(cfg, models, device)  # perf/: FLOPs done over the bare matmul rate (< 1 s)
    if on_ready is not None:
        on_ready(models)
    log(f"[rl] {settings_line(rl)}, {sampling_note(rl)}, {precision_note(engine, models)}, fusion "
        f"{'on' if fusion.enabled else 'off'}")
    if cfg.run.precision == "bf16" and models.compute_dtype is None:
        why = "model.quantization (its layers compute in bf16)" if cfg.model.quantization != "none" else \
            f"rl.train_parallel={cfg.rl.train_parallel} (its stages train in fp32 for now)"
        log(f"[rl] warning: run.precision=bf16, but the update and scoring run without autocast with {why}")
    requests = IterationRequests(train_prompts, difficulty, rl, params, seed, run_prompts.train_rows)
    health = health_watch(rl, out / "metrics.jsonl", start)  # the detectors, live: one line per finding per run
    # the tracker closes however the loop ends (a stop for divergence included): its sinks flush what they hold
    with closing(tracker), build_placement(cfg, run_dir, engine, scorer, fusion, trainer, requests, log,
                                             max_model_len) as \
            (rollout, trainer), Progress(rl.iterations, f"rl/{rl.algo}", cfg.run.quiet, unit="iter", initial=start) as bar:
        if start and not isinstance(trainer, LocalTrainer):
            trainer.load_checkpoint(ckpt)
        rollout.begin_at(ckpt, start)  # asynchronous: a resumed run takes back the batches generated ahead
        rollout = meter.watch(rollout) if meter is not None else rollout
        for it in range(start, rl.iterations):
            t0 = time.perf_counter()
            # 1. the actor's weights into the generator(s): an explicit copy, never the optimiser's own tensors
            # (asynchronous: they decode the batch of iteration it + rl.max_staleness while this one trains)
            sync = rollout.sync_weights(models)
            # 2. generate and score at the iteration's temperature (sampling and reference log-probs alike); scoring
            # runs on finished samples while the tail decodes (fusion on; on Ray workers, per the placement)
            request = requests(it)
            temperature = request.params.temperature
            shared_before = scorer.prompt_tokens_shared  # this process's scorer (Ray workers score on their own)
            with said_where(f"iteration {it + 1}"):  # a reward function's failure names the iteration it broke
                exp = rollout.generate(request)
                refills = {}
                if rl.dynamic_sampling:  # more prompt groups until enough have rewards that differ (DAPO)
                    exp, refills = dynamically_sampled(exp, rollout, requests, it, rl)
            shared_scoring = scorer.prompt_tokens_shared - shared_before
            # 3. KL-shaped rewards and advantages (pure functions in rlfuse/algos)
            adv, returns, kl = compute_advantages(exp, rl, kl_ctl.coef)
            # 4. update actor and critic (skipped, and counted, when a reward is not finite)
            t1, stats = time.perf_counter(), {}
            if not count_nonfinite_rewards(exp, rl, bad):
                trained = truncated_masked(exp) if rl.mask_truncated else exp  # their tokens leave the loss
                batches = update_batches(trained, rl, kl, kl_ctl.coef, minibatches(len(exp), rl, seed, it))
                stats = trainer.update(trained, adv, returns, kl_ctl.coef, batches, bad, temperature)
                kl_ctl.update(float(kl.sum(1).mean()), len(exp))
            t2 = time.perf_counter()
            # 5. record (every iteration, skipped or not) and checkpoint
            row = rollout_metrics(exp, kl, returns, kl_ctl.coef, rl.max_new_tokens) | stats | sync | refills
            row |= rollout.metrics(exp)
            row |= memory_metrics(device) | iteration_gold(exp, tok, gold) | reward_metrics(models.reward_fn)
            row |= flops.metrics([len(p) for p in exp.prompt_ids], [len(r) for r in exp.response_ids], t2 - t0,
                                 trained=bool(stats))
            row |= trainer.learning_rates() | group_metrics(exp, rl.k)
            if due(rl.eval_every, it + 1) and it + 1 < rl.iterations:  # the last one is the "after" evaluation
                row |= evaluate_during(trainer, models, engine, held_prompts, rl, seed + 12345, gold, held_rows)
                reset_reward_metrics(models.reward_fn)  # the evaluation's calls are not the next iteration's
            if due(rl.log_samples_every, it + 1):
                tracker.log_table(it + 1, "samples", sample_table(exp, tok, gold))
            row |= {"perf/prompt_tokens_shared": shared_scoring + stats.get("perf/prompt_tokens_shared_train", 0),
                    "rollout/temperature": temperature, "time/training": t2 - t1, "time/iteration": t2 - t0,
                    "train/skipped_steps": bad.skipped,
                    "rollout/samples_per_s": len(exp) / (t2 - t0), "rollout/tokens_per_s": float(exp.mask.sum()) / (t2 - t0)}
            tracker.log(it + 1, **row)
            for finding in health.update({"step": it + 1, **row}):
                log(f"[rl] health: {finding.line()} (rlfuse audit {run_dir})")
            bad.stop_if_diverged(rl.max_bad_steps)
            stop_if_blown(stats, it + 1, rl, ckpt, start)  # before the checkpoint: the one on disk is good
            count_abstained(row.get("reward/all_abstained"), bad, rl.max_bad_steps, log)
            if (it + 1) % rl.ckpt_every == 0 or it + 1 == rl.iterations:
                rollout.save_in_flight(ckpt, it + 1)  # first: the trainer's checkpoint says which one it goes with
                trainer.save_checkpoint(ckpt, iteration=it + 1, kl_coef=kl_ctl.coef, counters={
                    **dataclasses.asdict(bad), "seconds": earlier_s + time.perf_counter() - t_start})
            (out / "last_rewards.json").write_text(json.dumps(exp.scores.tolist()))
            bar.update(reward=row["reward/mean"], kl=row["reward/kl"], sps=row["rollout/samples_per_s"])
        trainer.pull_into(models)
    sync_weights(engine, models.actor)
    with said_where("the held-out evaluation after RL"):
        after, after_texts = evaluate(models, engine, held_prompts, rl, seed + 12345, gold, held_rows)
    save_trained_model(models.actor, tok, out, base=models.policy_source)
    if ckpt.exists():  # weights and optimiser states, the last two: several times the model, said where they are
        log(f"[rl] checkpoints kept to go on with `rlfuse rl --resume {run_dir} rl.iterations=N`: "
            f"{checkpoint_bytes(ckpt) / 2**30:.2f} GiB in {ckpt}*; delete them if you will not")
    return {"before": before, "after": after, "samples_after": after_texts, "prompts": run_prompts.info(),
            "seconds": earlier_s + time.perf_counter() - t_start}


@dataclass
class IterationRequests:
    """What each iteration generates (rollout/state.py RolloutRequest), a function of the iteration alone: its
    prompts (data/curriculum.py), its scheduled temperature and its seed. So a resumed run repeats an uninterrupted
    one, and an asynchronous rollout asks for later iterations' batches ahead."""
    prompts: list[list[int]]
    difficulty: object
    rl: RLConfig
    params: SamplingParams
    seed: int
    rows: list | None = None
    """Episodes: the prompts' data rows (RunPrompts.train_rows), drawn with them."""

    def __call__(self, it: int, draw: int = 0) -> RolloutRequest:
        """draw >= 1: dynamic sampling's further prompt groups for iteration `it` (rl.dynamic_sampling), other
        prompts and sampling seeds for each draw, the same in every run."""
        rl = self.rl
        picked = prompt_batch(list(range(len(self.prompts))), it, rl.prompts_per_iter, self.seed + 104_729 * draw,
                              self.difficulty, rl.iterations, rl.curriculum_start)
        params = dataclasses.replace(self.params, temperature=iteration_temperature(rl, it))
        rows = None if self.rows is None else [self.rows[i] for i in picked]
        return RolloutRequest(it, [self.prompts[i] for i in picked], rl.k, params,
                              self.seed * 1_000_003 + it + 1_000_000_007 * draw, draw, rows)


def dynamically_sampled(exp: Experience, rollout, requests: IterationRequests, it: int, rl: RLConfig):
    """rl.dynamic_sampling (DAPO): while fewer than rl.prompts_per_iter prompt groups have rewards that differ, draw
    rl.prompts_per_iter more (at most rl.max_refills times), then keep that many groups, those with a spread first
    (algos/stats.py spread_groups_first). -> (the iteration's experience, its rollout/refills and
    rollout/spread_groups metrics)."""
    parts = [exp]
    count = lambda: sum(int(in_spread_groups(p.scores, rl.k).sum()) // rl.k for p in parts)
    while count() < rl.prompts_per_iter and len(parts) <= rl.max_refills:
        parts.append(rollout.generate(requests(it, draw=len(parts))))
    picks = spread_groups_first([p.scores for p in parts], rl.k, rl.prompts_per_iter)
    kept = take_samples(parts, picks)
    return kept, {"rollout/refills": len(parts) - 1,
                  "rollout/spread_groups": min(count(), rl.prompts_per_iter) / rl.prompts_per_iter}


@dataclass
class RunPrompts:
    """The RL stage's prompts as token ids, cut to the budget the model's context leaves (BOS kept in front)."""
    train: list[list[int]]
    held_out: list[list[int]]
    """The first rl.eval_prompts held-out prompts: the before/after evaluation's."""
    budget: int
    cut: int
    cut_held_out: int
    train_rows: list | None = None
    held_out_rows: list | None = None
    """Episodes only: each prompt's data row (prompt, columns), which its rollouts carry (RolloutRequest.rows)."""

    def info(self) -> dict:
        """What rl/summary.json and the report say of the prompts."""
        return {"prompt_budget": self.budget, "prompts_truncated": self.cut, "prompts": len(self.train),
                "eval_prompts_truncated": self.cut_held_out}


def check_user_code(cfg: Config) -> None:
    """What the RL stage would refuse of the user's own code, checked before SFT and the reward model train (minutes
    to hours) rather than after them: reward functions that do not import, tools whose JSON schemas cannot be built,
    an environment that is not a class with reset. Imports the user's modules (config validation only looks them
    up)."""
    for spec in cfg.rl.reward_functions:
        load_reward_function(spec)
    if cfg.rl.tools or cfg.rl.environment:
        Episodes.from_config(cfg.rl, tokenizer=None).schemas  # noqa: B018 - built for the errors it raises


def episode_settings(cfg: Config, tokenizer) -> Episodes | None:
    """rl.tools and rl.environment loaded, with the episode limits; None where neither is set."""
    return Episodes.from_config(cfg.rl, tokenizer) if cfg.rl.tools or cfg.rl.environment else None


def build_prompts(cfg: Config, models: Models, task, log, episodes: Episodes | None = None) -> RunPrompts:
    """The data's RL prompt rows encoded (data/stages.py rl_prompt_rows), each prompt's row handed to the reward
    functions that read its columns (and to the episodes' environments), and one log line when any prompt was cut.
    With episodes, each prompt is rendered as a chat with the tools described in its system turn, after checking
    that the chat template appends a turn without rewriting the earlier ones."""
    tok = models.tokenizer
    set_chat_template(tok, cfg.data.chat_template)
    train_rows, held_rows = rl_prompt_rows(cfg, task, log)
    held_rows = held_rows[: cfg.rl.eval_prompts]
    budget = prompt_budget(cfg.rl, model_context(models.actor.config))
    shown = lambda rows: [r.prompt for r in rows]
    if episodes is not None:
        require_template(tok, "multi-turn episodes (rl.tools, rl.environment)")
        schemas = episodes.schemas
        shown = lambda rows: [episode_prompt(r.prompt, schemas) for r in rows]
        check_episode_template(tok, shown(train_rows[:1])[0], episodes)
    train, cut = encode_prompts(tok, shown(train_rows), budget)
    held, cut_held = encode_prompts(tok, shown(held_rows), budget)
    clashes = attach_rows(models.reward_fn, train + held, train_rows + held_rows)
    if clashes and episodes is None:  # an episode carries its own row (RolloutRequest.rows); a completion does not
        log(f"[rl] warning: {clashes} prompts read the same as another row's but have other columns; the reward "
            "functions see one row per prompt text (the last): make each prompt's text distinct")
    as_rows = lambda rows: [(r.prompt, r.columns) for r in rows]
    if episodes is not None:  # by token ids for callers without rows; a rollout hands each episode its own
        episodes.rows = dict(zip(map(tuple, train + held), as_rows(train_rows + held_rows)))
    if cut or cut_held:  # left-truncated: the end of a prompt is what the response continues
        log(f"[rl] prompts cut to their last {budget} tokens: {cut} of {len(train)} train, {cut_held} of "
            f"{len(held)} held out")
    if episodes is None:
        return RunPrompts(train, held, budget, cut, cut_held)
    return RunPrompts(train, held, budget, cut, cut_held, as_rows(train_rows), as_rows(held_rows))
