"""Where a vs_trl child's peak RSS falls, by phase: `python -m bench.vs_trl --child ...` run in this process with
its RSS sampled every 3 ms and each sample charged to the phase running then (decoding, scoring, the policy loss's
forward, the backward, the optimiser step, other). How the d1 peak was traced from the update's backward to the
scoring pass and back (docs/systems.md, lean activations).

    python -m bench.phase_memory --child --system rlfuse --algo rloo --model FOLDER --k 8 --prompts 2 \\
        --max-new 128 --warmup 1 --iters 2 --prompts-kind bench/.work/smollm2_chat/prompts-2-max256.jsonl \\
        --micro-batch 4 --reward reply --model-name smollm2-135m-instruct [--rlfuse-set model.lean_activations=false]

(the arguments are bench.vs_trl's child arguments; the prompt file is the one `python -m bench.vs_trl --workloads d1`
writes). Prints `PEAKS {phase: MiB}` on stderr at exit. With `--rlfuse` first, the rest is an `rlfuse` command run
in this process instead (a single-process run: placement.strategy=single), the critic's loss charged too:

    python -m bench.phase_memory --rlfuse rl configs/smollm2_hh.yaml rl.sft_path=... rl.rm_path=... \
        placement.strategy=single rl.iterations=2 rl.micro_batch_size=4

`--trim` (first, before `--rlfuse` or the child arguments) hands the C heap's free pages back to the OS (glibc's
malloc_trim) before each policy micro-batch and prints `TRIMMED {MiB of RSS before: MiB after}` at each: how much
of the RSS a micro-batch starts from is memory earlier ones freed and the heap kept."""

from __future__ import annotations

import atexit
import ctypes
import runpy
import sys
import threading
import time

import torch

import rlfuse.learn.update as update
import rlfuse.rollout.engine as engine
import rlfuse.rollout.score as score
from bench.common import rss_mb

phase, peaks = ["other"], {}


def trimmed(owner, name: str) -> None:
    """owner.name runs after glibc's malloc_trim(0), printing the RSS before and after the trim."""
    inner, trim = getattr(owner, name), ctypes.CDLL("libc.so.6").malloc_trim

    def run(*a, **k):
        before = rss_mb()
        trim(0)
        print("TRIMMED", {round(before): round(rss_mb())}, file=sys.stderr)
        return inner(*a, **k)

    setattr(owner, name, run)


def sample() -> None:
    while True:
        rss, now = rss_mb(), phase[0]
        peaks[now] = max(peaks.get(now, 0.0), rss)
        time.sleep(0.003)


def charged(owner, name: str, label: str) -> None:
    """owner.name runs charged to `label` (the phase it interrupts resumes after it)."""
    inner = getattr(owner, name)

    def run(*a, **k):
        before, phase[0] = phase[0], label
        try:
            return inner(*a, **k)
        finally:
            phase[0] = before

    setattr(owner, name, run)


def main() -> None:
    if sys.argv[1:2] == ["--trim"]:
        del sys.argv[1]
        trimmed(update, "micro_policy_loss")
    charged(torch.Tensor, "backward", "backward")
    charged(torch.optim.AdamW, "step", "optimizer_step")
    charged(engine.DecodeEngine, "generate", "generate")
    charged(score.Scorer, "score", "score")
    charged(update, "micro_policy_loss", "policy_forward")
    charged(update, "micro_value_loss", "value_forward")
    threading.Thread(target=sample, daemon=True).start()
    atexit.register(lambda: print("PEAKS", {k: round(v) for k, v in peaks.items()}, file=sys.stderr))
    module = "rlfuse" if sys.argv[1:2] == ["--rlfuse"] else "bench.vs_trl"
    sys.argv = [module, *sys.argv[1 + (module == "rlfuse"):]]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
