"""rlfuse vs TRL on identical work: samples/s, tokens/s, peak memory above idle and the fraction of the compute limit.

    pip install -e ".[bench]"                  # TRL pinned (trl==1.16.0)
    python -m bench.vs_trl                     # workloads (a), (b), (c) (about 15 minutes)
    python -m bench.vs_trl --workloads c       # one workload
    python -m bench.vs_trl --small             # every workload at a smaller size, a few minutes; prints only
    python -m bench.vs_trl --matrix            # the earlier system matrix (TRL/rlfuse variants, k sweep, reward rise)

Each workload writes its section of docs/benchmarks/vs_trl.md and its row of BENCHMARKS.md as soon as it ends; the
matrix writes its own section of the same page.

Workloads (RLOO on both sides, alternated A B A B, each run its own process):
  (a) worst case: GPT-2 4 x 256 with random weights, prompts of a few tokens, every sample runs to 64 new tokens,
      so rlfuse's levers (finished rows leave the batch, one prefill per prompt) have nothing to remove;
  (b) long-tailed: the default task's SFT model (trained once into bench/.work) with its natural response lengths,
      up to 256 new tokens, k = 4 and 8;
  (c) long prompts: hh-rlhf conversations up to their last "Assistant:" (hundreds of tokens) from
      ../shared/data/hh_rlhf_harmless_1800.jsonl.gz, k = 8, up to 64 new tokens, on a tiny GPT-2 with 1024 positions
      and a tokenizer trained on those conversations (built once into bench/.work); skipped when the file is absent.

Both systems load the same saved weights and tokenizer, draw prompts from the same pool, and use the same k, new-token
limit, temperature, learning rate, optimiser family (AdamW), KL coefficient (0.05, so both score a reference model),
number of iterations and reward: the default task's gold scorer as a Python function. One iteration = generate
prompts x k completions, score them, one optimiser step. The median iteration after the warm-up is reported. Memory:
peak RSS of the process, and the peak above the footprint right after the models are loaded (the part the algorithm
controls). Fraction of the compute limit: the FLOPs of the work (rlfuse/metrics/flops.py, counted the same way for
both from the model's shape and each iteration's prompt and completion lengths) over the iteration's seconds times a
bare matmul rate measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (SHARED_DATA, WORK, cuda_peaks_mb, machine, machine_short, md_table,
                          peak_rss_mb, reset_cuda_peak, reset_peak_rss, rss_mb, run_child, warm_up, write_headline,
                          write_section)

HH_DATA = SHARED_DATA / "hh_rlhf_harmless_1800.jsonl.gz"
HH_DIR = WORK / "hh_long_prompts"  # the tiny long-context model, its tokenizer and the prompt file

TRL_DEFAULT_PRECISION = False
MICRO_BATCH = 4
# functions whose cumulative time shows each system's stages in the profile
STAGE_FUNCTIONS = {"_generate_single_turn", "_get_per_token_logps_and_entropies", "_calculate_rewards", "compute_loss",
                   "backward", "generate_rollouts", "update_policy", "score", "generate"}
SYSTEMS = {
    "trl-rloo": ("trl", "rloo", {"gc": True}), "trl-rloo-nogc": ("trl", "rloo", {"gc": False}),
    "trl-rloo-b8": ("trl", "rloo", {"gc": True, "micro": 8}),
    "trl-grpo": ("trl", "grpo", {"gc": True}), "trl-grpo-nogc": ("trl", "grpo", {"gc": False}),
    # rollout.fusion: rlfuse's default (auto), and explicitly on (-fused) and off (-unfused)
    "rlfuse-rloo": ("rlfuse", "rloo", {"fusion": "auto"}), "rlfuse-rloo-fused": ("rlfuse", "rloo", {"fusion": True}),
    "rlfuse-rloo-unfused": ("rlfuse", "rloo", {"fusion": False}),
    "rlfuse-grpo": ("rlfuse", "grpo", {"fusion": "auto"}), "rlfuse-grpo-fused": ("rlfuse", "grpo", {"fusion": True}),
    "rlfuse-grpo-unfused": ("rlfuse", "grpo", {"fusion": False}),
    # the update in token-budget micro-batches (rl.micro_batch_tokens) instead of MICRO_BATCH completions each
    "rlfuse-rloo-tokens": ("rlfuse", "rloo", {"fusion": "auto", "tokens": 256}),
}


def text_reward(prompts, completions, **_):
    """TRL reward function: the gold scorer on prompt + completion (the same text rlfuse's function reward sees)."""
    from rlfuse.data.gold import gold_reward

    return gold_reward([p + c for p, c in zip(prompts, completions)])


# ------------------------------------------------------------------------------------------- workload


def prepare_model(n_layer: int, n_embd: int, out: Path) -> Path:
    """A GPT-2 of the given shape with the default task's tokenizer, random weights, saved once for both systems."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from rlfuse.config import load_config
    from rlfuse.data.task import build_default_task

    c = load_config(None)
    task = build_default_task(c.data.num_reviews, 0, c.model.n_layer, c.model.n_embd, c.model.n_head, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(task.tokenizer_dir)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64),
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def prepare_long_prompts(out: Path = HH_DIR, max_new: int = 64, n: int = 400, min_tokens: int = 128) -> Path | None:
    """Workload (c), built once: hh-rlhf conversations up to their last "Assistant:" (rlfuse's own hh_rlhf reader), a
    tiny GPT-2 with 1024 positions and a BPE tokenizer trained on them (rlfuse.models.tiny.make_tiny_model, as the
    tests build theirs), and out/prompts.jsonl with the first `n` prompts of min_tokens .. 1024 - max_new tokens: the long half of the
    conversations (their median is about 107 tokens with this tokenizer), and none that TRL, which does not truncate
    prompts, would run past the context with. None when the data file is absent."""
    if not HH_DATA.exists():
        return None
    if (out / "prompts.jsonl").exists() and (out / "config.json").exists():
        return out
    if (out / "config.json").exists():
        import shutil

        shutil.rmtree(out)  # a half-built folder from an interrupted run
    from transformers import AutoTokenizer

    from rlfuse.config import load_config
    from rlfuse.data.stages import rl_prompts
    from rlfuse.models.tiny import make_tiny_model

    train, held = rl_prompts(load_config(None, ["data.kind=hh_rlhf", f"data.path={HH_DATA}"]), None, log=lambda *_: None)
    texts = train + held
    out.mkdir(parents=True, exist_ok=True)
    make_tiny_model(out, texts, vocab_size=2000, n_positions=1024)
    tok = AutoTokenizer.from_pretrained(out)
    keep = [t for t in texts if min_tokens <= len(tok(t).input_ids) <= 1024 - max_new][:n]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in keep))
    return out


def data_overrides(kind: str) -> list[str]:
    """The prompt source as rlfuse config overrides: both systems read their pool through them."""
    if kind == "imdb":
        return ["data.kind=imdb", f"data.path={SHARED_DATA / 'imdb_reviews_2000.csv'}"]
    if kind == "hh":
        return ["data.kind=jsonl", f"data.path={HH_DIR / 'prompts.jsonl'}", "data.prompt_column=prompt"]
    return []


def prompt_pool(kind: str, n: int = 512) -> list[str]:
    from rlfuse.config import load_config
    from rlfuse.data.stages import rl_prompts

    cfg, task = load_config(None, data_overrides(kind)), None
    if kind == "default":
        from rlfuse.data.task import build_default_task

        task = build_default_task(cfg.data.num_reviews, 0, cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, log=lambda *_: None)
    train, _ = rl_prompts(cfg, task, log=lambda *_: None)
    return train[:n]


def work_flops(model, lengths: list[tuple[list[int], list[int]]], k: int) -> list[float]:
    """FLOPs of each iteration's work from (prompt lengths, completion lengths) per iteration: rlfuse's own count
    (rlfuse/metrics/flops.py) for an RLOO iteration (one reference pass, the actor trained, one epoch)."""
    from rlfuse.metrics.flops import Passes, iteration_flops
    from rlfuse.plan.cost import shape_from_hf_config

    shape = shape_from_hf_config("policy", model.config.to_dict())
    return [iteration_flops(shape, p, c, k, Passes(scoring=1, trained=1))["total"] for p, c in lengths]


# ------------------------------------------------------------------------------------------- children


def child_trl(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from rlfuse.metrics.flops import measure_matmul_rate

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    data = Dataset.from_dict({"prompt": prompt_pool(a.prompts_kind)})
    lengths = []  # (prompt lengths, completion lengths) per iteration, for the FLOPs of its work

    def reward(prompts, completions, completion_ids=None, **kw):
        lengths.append(([len(tok(p).input_ids) for p in prompts], [len(c) for c in completion_ids]))
        return text_reward(prompts, completions)
    steps = a.warmup + a.iters
    n = a.prompts * a.k
    micro = min(a.micro_batch, n) if a.micro_batch else n
    # one optimiser step per generation batch of n completions, trained in micro-batches of `micro` (as rlfuse's)
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                  num_generations=a.k, disable_dropout=True,
                  max_completion_length=a.max_new, learning_rate=a.lr, gradient_checkpointing=a.gc, max_steps=steps,
                  logging_steps=1, report_to="none", save_strategy="no", temperature=1.0, beta=0.05, seed=a.seed,
                  disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                  # TRL's config turns bf16 on by default, also on CPU; this CPU has no native bf16, so every matmul
                  # would be emulated (~40x slower). Both systems run fp32 on CPU, as rlfuse does.
                  **({} if a.trl_default_precision else
                     {"bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported()}))
    Config, Trainer = (RLOOConfig, RLOOTrainer) if a.algo == "rloo" else (GRPOConfig, GRPOTrainer)
    rec = {"step_s": [], "logs": []}

    class Timer(TrainerCallback):
        def on_train_begin(self, *args, **kw):
            rec["matmul_flops_s"] = measure_matmul_rate(str(kw.get("model").device))
            warm_up(kw.get("model"))
            rec["idle_rss_mb"] = rss_mb()
            reset_cuda_peak()
            reset_peak_rss()  # the models are loaded; what follows is the algorithm's

        def on_step_begin(self, *args, **kw):
            rec["t"] = time.perf_counter()

        def on_step_end(self, *args, **kw):
            rec["step_s"].append(time.perf_counter() - rec["t"])

        def on_train_end(self, *args, **kw):
            rec["train_peak_rss_mb"] = peak_rss_mb()
            rec.update(cuda_peaks_mb())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                rec["logs"].append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = Trainer(model=model, reward_funcs=reward, args=Config(**common), train_dataset=data,
                      processing_class=tok, callbacks=[Timer()])
    trainer.train()
    mean_lengths = [l["completions/mean_length"] for l in rec["logs"] if "completions/mean_length" in l]
    rewards = [l["reward"] for l in rec["logs"] if "reward" in l]
    return {"step_s": rec["step_s"], "idle_rss_mb": rec["idle_rss_mb"], "mean_length": mean_lengths, "reward": rewards,
            "flops": work_flops(model, lengths, a.k), "matmul_flops_s": rec["matmul_flops_s"],
            "completions_per_step": a.prompts * a.k, "train_peak_rss_mb": rec["train_peak_rss_mb"],
            **{k: v for k, v in rec.items() if k.startswith("cuda_")}}


def child_rlfuse(a) -> dict:
    from rlfuse.config import load_config
    from rlfuse.metrics.tracker import read_metrics
    from rlfuse.trainers.rl import train_rl

    run_dir = Path(tempfile.mkdtemp())
    data = data_overrides(a.prompts_kind)
    mb = a.prompts * a.k
    micro = min(a.micro_batch, mb) if a.micro_batch else mb
    cfg = load_config(None, [f"run.dir={run_dir}", "run.quiet=true", f"run.seed={a.seed}", f"rl.sft_path={a.model}",
                             "rl.reward=rlfuse.data.gold:gold_reward", f"rl.algo={a.algo}", f"rl.k={a.k}",
                             f"rl.prompts_per_iter={a.prompts}", f"rl.mini_batch_size={mb}", f"rl.micro_batch_size={micro}",
                             "rl.epochs=1", f"rl.max_new_tokens={a.max_new}", "rl.temperature=1.0", f"rl.lr={a.lr}",
                             "rl.kl_coef=0.05", "rl.kl_target=null", f"rl.iterations={a.warmup + a.iters}",
                             "rl.eval_prompts=0", "rl.ckpt_every=100000", f"rollout.fusion={a.fusion}",
                             f"rl.gradient_checkpointing={str(a.gc).lower()}", *data,  # fusion policy: rlfuse defaults
                             *([f"rl.micro_batch_tokens={a.micro_batch_tokens}"] if a.micro_batch_tokens else [])])
    rec = {}
    def ready(models):
        warm_up(models.actor)
        rec["idle_rss_mb"] = rss_mb()
        reset_cuda_peak()
        reset_peak_rss()  # the models are loaded; what follows is the algorithm's

    train_rl(cfg, run_dir, log=lambda *_: None, on_ready=ready)
    rows = read_metrics(run_dir / "rl" / "metrics.jsonl")
    return {"step_s": [r["time/iteration"] for r in rows], "idle_rss_mb": rec["idle_rss_mb"],
            "mean_length": [r["rollout/length_mean"] for r in rows], "reward": [r["reward/mean"] for r in rows],
            "completions_per_step": a.prompts * a.k, "train_peak_rss_mb": rows[-1]["mem/rss_peak_mb"],
            "flops": [r["perf/flops"] for r in rows], "matmul_flops_s": rows[0]["perf/matmul_flops_s"],
            "stage_flops": {k: statistics.median(r[f"perf/flops_{k}"] for r in rows[a.warmup:])
                            for k in ("generation", "scoring", "training")},
            "split": {k: statistics.median(r[f"time/{k}"] for r in rows[a.warmup:]) for k in ("generation", "scoring", "training")},
            # the tracker resets CUDA peaks at every iteration: the run's peak is the largest of them
            **({"cuda_peak_allocated_mb": max(r["mem/cuda_allocated_peak_mb"] for r in rows),
                "cuda_peak_reserved_mb": max(r["mem/cuda_reserved_peak_mb"] for r in rows)}
               if "mem/cuda_allocated_peak_mb" in rows[0] else {})}


def child(a) -> None:
    import torch

    torch.manual_seed(a.seed)
    if a.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    res = (child_trl if a.system == "trl" else child_rlfuse)(a)
    # the peak while training, read before any end-of-run work (rlfuse draws its report after the last iteration)
    res["peak_rss_mb"] = res.pop("train_peak_rss_mb")
    if a.profile:
        prof.disable()
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats("tottime").print_stats(12)
        res["profile"] = s.getvalue()
        res["stage_cum_s"] = {f"{Path(f).name}:{line}:{name}": round(v[3], 3) for (f, line, name), v in stats.stats.items()
                              if name in STAGE_FUNCTIONS and ("trl" in f or "rlfuse" in f or f.endswith("autograd/__init__.py"))}
    print(json.dumps(res))


# ------------------------------------------------------------------------------------------- the matrix


def run(name: str, model: Path, k: int, prompts: int, max_new: int, warmup: int, iters: int, prompts_kind="default",
        profile=False, lr: float | None = None) -> dict:
    system, algo, opts = SYSTEMS[name]
    args = ["--child", "--system", system, "--algo", algo, "--model", str(model), "--k", str(k), "--prompts", str(prompts),
            "--max-new", str(max_new), "--warmup", str(warmup), "--iters", str(iters), "--prompts-kind", prompts_kind,
            "--micro-batch", str(opts.get("micro", MICRO_BATCH))]
    args += ["--gc"] if opts.get("gc") else []
    args += ["--fusion", str(opts.get("fusion", "auto")).lower()]
    args += ["--micro-batch-tokens", str(opts["tokens"])] if "tokens" in opts else []
    args += ["--profile"] if profile else []
    args += ["--lr", str(lr)] if lr is not None else []
    args += ["--trl-default-precision"] if TRL_DEFAULT_PRECISION else []
    return summarise([run_child("bench.vs_trl", args, timeout=1800)], warmup)


def summarise(runs: list[dict], warmup: int) -> dict:
    """One or several alternated runs of one system: the median over all measured iterations (iteration seconds and
    fraction of the compute limit, each iteration's FLOPs over its seconds times its process's matmul rate), the max
    of the peaks."""
    steps = [s for r in runs for s in r["step_s"][warmup:]]
    out = dict(runs[-1])
    out["median_step_s"] = statistics.median(steps)
    out["samples_per_s"] = out["completions_per_step"] / out["median_step_s"]
    lengths = [statistics.mean(r["mean_length"][warmup:] or r["mean_length"]) for r in runs if r["mean_length"]]
    out["mean_completion_length"] = statistics.mean(lengths) if lengths else float("nan")
    out["tokens_per_s"] = out["samples_per_s"] * out["mean_completion_length"]
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    out["peak_above_idle_mb"] = max(r["peak_rss_mb"] - r["idle_rss_mb"] for r in runs)
    for key in ("cuda_peak_allocated_mb", "cuda_peak_reserved_mb"):
        if all(key in r for r in runs):
            out[key] = max(r[key] for r in runs)
    out["completions"] = out["completions_per_step"] * len(steps)
    if all("flops" in r for r in runs):
        from rlfuse.metrics.flops import compute_fraction

        fractions = [compute_fraction(f, t, r["matmul_flops_s"]) for r in runs
                     for f, t in zip(r["flops"][warmup:], r["step_s"][warmup:])]
        out["compute_fraction"] = statistics.median(fractions)
        out["flops_per_sample"] = statistics.median(f for r in runs for f in r["flops"][warmup:]) / out["completions_per_step"]
        out["matmul_flops_s"] = statistics.median(r["matmul_flops_s"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--system")
    ap.add_argument("--algo")
    ap.add_argument("--model")
    ap.add_argument("--gc", action="store_true")
    ap.add_argument("--fusion", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prompts-kind", default="default")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=4,
                    help="completions per forward/backward in the update, both systems (0 = the whole batch at once)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="rlfuse: train in micro-batches of at most this many tokens (rl.micro_batch_tokens) instead")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="alternations A B A B of the throughput matrix")
    ap.add_argument("--mem-budget", type=float, default=1500.0, help="MiB of peak RSS a run may use")
    ap.add_argument("--reward-iters", type=int, default=30, help="iterations of the longer run that checks reward rises")
    ap.add_argument("--reward-lr", type=float, default=3e-4, help="learning rate of that run (the same for both)")
    ap.add_argument("--quick", action="store_true", help="--matrix: one round of RLOO only; prints, writes nothing")
    ap.add_argument("--matrix", action="store_true",
                    help="the earlier system matrix on workload (a) (TRL and rlfuse variants, k = 2, 4, 8, IMDb "
                         "prompts, reward over a longer run, profiles) instead of the three workloads")
    ap.add_argument("--workloads", default="abc", help="which of the workloads a, b, c to run (default all)")
    ap.add_argument("--small", action="store_true",
                    help="workloads at a smaller size (fewer prompts and iterations, one round): a few minutes; "
                         "prints, writes nothing unless --write")
    ap.add_argument("--write", action="store_true",
                    help="--small: write the sections of docs/benchmarks/vs_trl.md and BENCHMARKS.md's rows anyway")
    ap.add_argument("--trl-default-precision", action="store_true",
                    help="leave TRL's own precision default (bf16 on, also on CPU) instead of fp32 for both")
    a = ap.parse_args()
    if a.child:
        return child(a)
    global TRL_DEFAULT_PRECISION, MICRO_BATCH
    TRL_DEFAULT_PRECISION, MICRO_BATCH = a.trl_default_precision, a.micro_batch
    if not a.matrix:
        return workloads(a)
    matrix(a)


def matrix(a) -> None:
    """The earlier system matrix on workload (a); writes the vs_trl section of docs/benchmarks/vs_trl.md."""
    t0 = time.time()
    model = prepare_model(a.n_layer, a.n_embd, WORK / f"gpt2-{a.n_layer}x{a.n_embd}")
    W, N = a.warmup, a.iters
    names = ["trl-rloo", "rlfuse-rloo"] if a.quick else list(SYSTEMS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(1 if a.quick else a.rounds):  # alternate A B A B ...
        for n in names:
            runs[n].append(run(n, model, a.k, a.prompts, a.max_new, W, N))
            print(f"[bench] {n}: {runs[n][-1]['samples_per_s']:.2f} samples/s", file=sys.stderr, flush=True)
    res = {n: summarise(r, W) for n, r in runs.items()}

    def table(results: dict, base: str) -> str:
        cuda = all("cuda_peak_allocated_mb" in r for r in results.values())
        rows = [[n, r["samples_per_s"], r["tokens_per_s"], r["median_step_s"], r["completions"],
                 r["mean_completion_length"], r["peak_rss_mb"], r["peak_above_idle_mb"]]
                + ([r["cuda_peak_allocated_mb"], r["cuda_peak_reserved_mb"]] if cuda else [])
                + [r["samples_per_s"] / results[base]["samples_per_s"]] for n, r in results.items()]
        return md_table(["system", "samples/s", "tokens/s", "median iteration s", "completions measured",
                         "mean completion length", "peak RSS MiB", "peak above idle MiB"]
                        + (["CUDA peak allocated MiB", "CUDA peak reserved MiB"] if cuda else [])
                        + [f"samples/s vs {base}"], rows)

    print(table(res, "trl-rloo"))
    if a.quick:
        return
    sections = [f"Machine: {json.dumps(machine() | {'trl': __import__('trl').__version__})}", "",
                f"Command: `python -m bench.vs_trl --matrix` (GPT-2 {a.n_layer} layers x {a.n_embd} dims, random "
                f"weights, the default task's tokenizer; {a.prompts} prompts x k={a.k} per iteration, up to {a.max_new} "
                f"new tokens, temperature 1.0, lr {a.lr}, KL coefficient 0.05, AdamW; {W} warm-up + {N} measured "
                f"iterations per run, {a.rounds} alternated rounds, median iteration; both update in micro-batches of "
                f"{a.micro_batch} completions (trl-rloo-b8: TRL's default per-device batch of 8), dropout off in both; TRL's gradient "
                "checkpointing on (its default) and off (-nogc)).", "", "### Throughput and memory, default-task prompts", "", table(res, "trl-rloo"), ""]
    if (SHARED_DATA / "imdb_reviews_2000.csv").exists():
        imdb = {n: run(n, model, a.k, a.prompts, a.max_new, W, N, "imdb") for n in ("trl-rloo", "rlfuse-rloo")}
        sections += ["### Real IMDb prompts (RLOO)", "", table(imdb, "trl-rloo"), ""]
    # memory table: RLOO at k = 2, 4, 8
    mem_rows, per_k, mem_systems = [], {}, ("trl-rloo", "trl-rloo-b8", "rlfuse-rloo")
    for k in (2, 4, 8):
        per_k[k] = {n: run(n, model, k, a.prompts, a.max_new, 1, 2) for n in mem_systems}
        t, t8, r = (per_k[k][n] for n in mem_systems)
        mem_rows.append([k, t["peak_rss_mb"], t8["peak_rss_mb"], r["peak_rss_mb"], t["peak_above_idle_mb"],
                         t8["peak_above_idle_mb"], r["peak_above_idle_mb"],
                         r["peak_above_idle_mb"] / t["peak_above_idle_mb"], r["peak_above_idle_mb"] / t8["peak_above_idle_mb"],
                         t["samples_per_s"], r["samples_per_s"]])
    fits = {n: max([k for k in per_k if per_k[k][n]["peak_rss_mb"] <= a.mem_budget], default=None) for n in mem_systems}
    sections += [f"### Memory: RLOO with k = 2, 4, 8 at {a.prompts} prompts", "",
                 f"TRL and rlfuse both train in micro-batches of {a.micro_batch} completions (TRL's gradient "
                 "checkpointing on, its default); trl-b8 is TRL with its own default per-device batch of 8.", "",
                 md_table(["k", "TRL peak RSS", "TRL-b8 peak RSS", "rlfuse peak RSS", "TRL above idle",
                           "TRL-b8 above idle", "rlfuse above idle", "rlfuse/TRL above idle", "rlfuse/TRL-b8 above idle",
                           "TRL samples/s", "rlfuse samples/s"], mem_rows), "",
                 f"Largest measured k within --mem-budget {a.mem_budget:g} MiB of peak RSS: "
                 + ", ".join(f"{n} {fits[n]}" for n in mem_systems) + ".", ""]
    plot_k(per_k, WORK / "vs_trl_k.png")
    # reward rises on a longer run (the default task's SFT model)
    from bench.rollout import ensure_sft_model

    sft = ensure_sft_model()
    rise = {}
    for n in ("trl-rloo", "rlfuse-rloo"):
        r = run(n, sft, 4, 8, 48, 0, a.reward_iters, lr=a.reward_lr)
        rw = r["reward"]
        rise[n] = (statistics.mean(rw[:5]), statistics.mean(rw[-5:])) if len(rw) >= 10 else (float("nan"), float("nan"))
    sections += [f"### Reward over a longer run ({a.reward_iters} iterations, default-task SFT model, 8 prompts x k=4, lr {a.reward_lr:g})", "",
                 md_table(["system", "mean reward, first 5 iterations", "mean reward, last 5 iterations"],
                          [[n, x, y] for n, (x, y) in rise.items()]), ""]
    # where the time goes: rlfuse's own stage split, and a profile of one run of each
    split = res["rlfuse-rloo"]["split"]
    profiled = {n: run(n, model, a.k, a.prompts, a.max_new, 1, 1, profile=True) for n in ("trl-rloo", "rlfuse-rloo")}
    prof = {n: r["profile"] for n, r in profiled.items()}
    sections += ["### Where the time goes", "",
                 f"rlfuse RLOO, median per iteration: generation {split['generation']:.3f} s, scoring "
                 f"{split['scoring']:.3f} s, training {split['training']:.3f} s.", "",
                 "Cumulative seconds per stage function in one profiled run of each (2 iterations, profiler overhead "
                 "included):", ""]
    for n, r in profiled.items():
        sections.append(f"- {n}: " + ", ".join(f"`{f}` {v:.2f}" for f, v in sorted(r["stage_cum_s"].items(), key=lambda x: -x[1])))
    sections.append("")
    for n, p in prof.items():
        sections += [f"<details><summary>cProfile of one {n} run (2 iterations), top functions by own time</summary>",
                     "", "```", "\n".join(p.strip().splitlines()[:30]), "```", "</details>", ""]
    sections.append(f"Wall time of the whole benchmark: {time.time() - t0:.0f} s. Plot: `bench/.work/vs_trl_k.png`.")
    (WORK / "vs_trl.json").write_text(json.dumps({"throughput": res, "memory": {str(k): v for k, v in per_k.items()}}, indent=1, default=str))
    # a GPU run gets its own section, so the CPU tables stay
    write_section("vs_trl_gpu" if __import__("torch").cuda.is_available() else "vs_trl", "\n".join(sections),
                  page="vs_trl")
    print("\n".join(sections))


@dataclass(frozen=True)
class Case:
    """One side-by-side measurement: both systems on the same model, prompts and limits."""
    workload: str
    model: Path
    prompts_kind: str
    k: int
    prompts: int
    max_new: int


WORKLOAD_TITLES = {
    "a": "(a) worst case: GPT-2 {shape}, random weights, default-task prompts of a few tokens, every sample runs to "
         "the limit",
    "b": "(b) long-tailed: the default task's SFT model, natural response lengths",
    "c": "(c) long prompts: hh-rlhf conversations up to the last \"Assistant:\" of 128-960 tokens, random-weight tiny "
         "GPT-2 (2 x 64, 1024 positions, a 2,000-token BPE trained on the conversations)",
}


def workload_cases(a, log=print) -> list[Case]:
    """The cases of the chosen workloads at the run's size; (c) is left out, with a line, without its data."""
    from bench.rollout import ensure_sft_model

    small, cases = a.small, []
    if "a" in a.workloads:
        model = prepare_model(a.n_layer, a.n_embd, WORK / f"gpt2-{a.n_layer}x{a.n_embd}")
        cases.append(Case("a", model, "default", 4, 4, 64))
    if "b" in a.workloads:
        sft = ensure_sft_model(log)
        cases += [Case("b", sft, "default", k, 4 if small else 8, 128 if small else 256) for k in (4, 8)]
    if "c" in a.workloads:
        model = prepare_long_prompts()
        if model is None:
            log(f"[bench] workload (c) skipped: {HH_DATA} not found (the hh-rlhf sample; see tests/helpers.py)")
        else:
            cases.append(Case("c", model, "hh", 8, 2 if small else 4, 64))
    return cases


def mean_prompt_tokens(case: Case) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(case.model)
    pool = prompt_pool(case.prompts_kind)
    return statistics.mean(len(tok(p).input_ids) for p in pool)


def workloads(a) -> None:
    """Workloads (a), (b), (c): TRL RLOO and rlfuse RLOO alternated per case. Each workload's table and target
    verdicts are printed, and (full size, or --write) written to its own section of docs/benchmarks/vs_trl.md and its
    row of BENCHMARKS.md as soon as it ends."""
    import os

    cases = workload_cases(a)
    for w in dict.fromkeys(c.workload for c in cases):
        section, results = measure_workload(a, w, [c for c in cases if c.workload == w])
        print(section, flush=True)
        if a.write or not a.small:
            gpu = "_gpu" if __import__("torch").cuda.is_available() else ""
            write_section(f"vs_trl_workload_{w}{gpu}", section, page="vs_trl")
            figure = headline(w, results)
            if figure:
                write_headline(f"vs_trl_{w}{gpu}", figure, f"TRL {__import__('trl').__version__} RLOO, the same work",
                               workload_command(a, w), machine_short(os.getloadavg()[0]), page="vs_trl")


def workload_command(a, w: str) -> str:
    return f"python -m bench.vs_trl --workloads {w}" + (" --small" if a.small else "")


def headline(w: str, results: dict) -> str | None:
    """A workload's figure for BENCHMARKS.md: rlfuse RLOO's samples/s and memory above idle against TRL's at the
    largest k, and for (a) its fraction of the compute limit."""
    if not results:
        return None
    k = max(k for (_, k) in results)
    t, r = results[(w, k)]["trl-rloo"], results[(w, k)]["rlfuse-rloo"]
    speed, mem = r["samples_per_s"] / t["samples_per_s"], r["peak_above_idle_mb"] / t["peak_above_idle_mb"]
    if w == "a":
        return (f"rlfuse at {r['compute_fraction']:.2f} of the compute limit (target 0.60), TRL at "
                f"{t['compute_fraction']:.2f}; {speed:.2f}x TRL's samples/s")
    return f"{speed:.2f}x TRL's samples/s at k={k}, memory above idle {mem:.2f}x"


def measure_workload(a, w: str, cases: list[Case]) -> tuple[str, dict]:
    """One workload's cases, systems alternated A B A B; -> its markdown section, and the results per (workload, k)
    and system."""
    import os

    t0, load0 = time.time(), os.getloadavg()
    warmup, iters, rounds = (1, 2, 1) if a.small else ((2, 4, 2) if w == "a" else (1, 3, 2))
    # (b): also rlfuse with token-budget micro-batches (most of its samples are short: 4 completions a micro-batch
    # leaves the update overhead-bound)
    names = ("trl-rloo", "rlfuse-rloo") + (("rlfuse-rloo-tokens",) if w == "b" else ())
    rows, results = [], {}
    for case in cases:
        runs = {n: [] for n in names}
        for _ in range(rounds):  # alternate A B A B
            for n in names:
                runs[n].append(run(n, case.model, case.k, case.prompts, case.max_new, warmup, iters, case.prompts_kind))
                print(f"[bench] ({w}) k={case.k} {n}: {runs[n][-1]['samples_per_s']:.2f} samples/s, "
                      f"{runs[n][-1]['compute_fraction']:.3f} of the compute limit", file=sys.stderr, flush=True)
        res = results[(w, case.k)] = {n: summarise(r, warmup) for n, r in runs.items()}
        prompt_tokens, trl = mean_prompt_tokens(case), res["trl-rloo"]
        for n, r in res.items():
            rows.append([n, case.k, f"{case.prompts} x {case.k}", case.max_new, prompt_tokens, r["mean_completion_length"],
                         r["samples_per_s"], r["tokens_per_s"], r["median_step_s"], r["peak_above_idle_mb"],
                         r["compute_fraction"], r["matmul_flops_s"] / r["flops_per_sample"],
                         r["samples_per_s"] / trl["samples_per_s"], r["peak_above_idle_mb"] / trl["peak_above_idle_mb"]])
    load1 = os.getloadavg()
    (WORK / f"vs_trl_workload_{w}.json").write_text(json.dumps({f"k{k}": v for (_, k), v in results.items()},
                                                              indent=1, default=str))
    loads = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    command = workload_command(a, w)
    return "\n".join([
        f"### {WORKLOAD_TITLES[w].format(shape=f'{a.n_layer} x {a.n_embd}')}", "",
        f"Command: `{command}`; wall time {time.time() - t0:.0f} s; load average (1, 5, 15 min) {loads(load0)} before, "
        f"{loads(load1)} after (2 cores: above 2, other work shared them). {warmup} warm-up + {iters} measured "
        f"iterations per run, {rounds} alternated round(s). Machine: "
        f"{json.dumps(machine() | {'trl': __import__('trl').__version__})}", "",
        md_table(["system", "k", "prompts x k", "max new", "mean prompt tokens", "mean completion tokens", "samples/s",
                  "tokens/s", "median iteration s", "peak above idle MiB", "fraction of compute limit",
                  "compute limit samples/s", "samples/s vs TRL", "memory above idle vs TRL"], rows), "",
        *target_verdicts(results), ""]), results


def target_verdicts(results: dict) -> list[str]:
    """Issue 19's targets, each with its measured value: (b) and (c) at k = 8 >= 3x TRL's samples/s and <= 0.5x its
    memory above idle; (a) >= 60% of the compute limit."""
    out = []
    for w in ("b", "c"):
        if (w, 8) in results:
            t = results[(w, 8)]["trl-rloo"]
            for n, r in results[(w, 8)].items():
                if n == "trl-rloo":
                    continue
                speed, mem = r["samples_per_s"] / t["samples_per_s"], r["peak_above_idle_mb"] / t["peak_above_idle_mb"]
                out.append(f"- Target ({w}), k = 8, {n}: samples/s {speed:.2f}x TRL's (target >= 3x: "
                           f"{'met' if speed >= 3 else 'not met'}), memory above idle {mem:.2f}x TRL's (target <= 0.5x: "
                           f"{'met' if mem <= 0.5 else 'not met'}).")
    if ("a", 4) in results:
        r = results[("a", 4)]["rlfuse-rloo"]
        f = r["compute_fraction"]
        out.append(f"- Target (a): rlfuse at {f:.2f} of the compute limit (target >= 0.60: {'met' if f >= 0.6 else 'not met'}).")
    for (w, k), res in results.items():  # where the limit is lost: each stage's FLOPs over its seconds
        for n, r in res.items():
            if n.startswith("rlfuse"):
                out.append(f"- {n} per stage, ({w}) k = {k} (median seconds, fraction of the compute limit): " + ", ".join(
                    f"{st} {r['split'][st]:.3f} s at {r['stage_flops'][st] / (r['split'][st] * r['matmul_flops_s']):.2f}"
                    for st in ("generation", "scoring", "training")) + ".")
    return out


def plot_k(per_k: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(per_k)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for n, label in (("trl-rloo", "TRL RLOO"), ("trl-rloo-b8", "TRL RLOO, per-device batch 8"), ("rlfuse-rloo", "rlfuse RLOO")):
        ax1.plot(ks, [per_k[k][n]["samples_per_s"] for k in ks], marker="o", label=label)
        ax2.plot(ks, [per_k[k][n]["peak_above_idle_mb"] for k in ks], marker="o", label=label)
    ax1.set(xlabel="k (samples per prompt)", ylabel="samples / s", title="Throughput")
    ax2.set(xlabel="k (samples per prompt)", ylabel="MiB", title="Peak RSS above idle footprint")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
