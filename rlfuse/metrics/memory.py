"""Memory per component, measured, in the planner's terms (rlfuse/plan/memory.py predicts the same components):

    base         frozen weights of every role (the generator's copy included), quantised ones at their packed size
    adapters     LoRA tensors of every role and the value / score heads
    gradients    gradients of what trains, read after a backward (before the optimiser drops them)
    optimizer    optimiser states (8-bit ones at their 8-bit size)
    activations  the update's peak above its starting level, less the gradients and new optimiser states
    kv_cache     the rollout's peak above its starting level (the KV cache, with the scoring passes' transients)
    slack        total less the components above (runtime, allocator caching); negative when the rollout's and the
                 update's peaks, counted separately above, never coexist
    total        the process's peak: CUDA allocated on a GPU, resident memory (RSS) on a CPU

Weights, gradients and optimiser states are tensor bytes by owner; activations, KV cache and total are levels of the
process (RSS or CUDA allocated), sampled every few milliseconds by a thread while a phase runs, so the meter never
resets the peaks that the per-iteration mem/ metrics read."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import weakref
from pathlib import Path

import torch

from rlfuse.files import write_text_atomic
from rlfuse.metrics.tracker import peak_rss_mb, reset_peak_rss
from rlfuse.plan.memory import COMPONENTS  # the planner's names: predicted beside measured

try:
    import resource  # Unix: the process's page-fault counts
except ImportError:  # Windows
    resource = None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a bitsandbytes 4-bit weight adds its quantisation state (absmax, code, nested absmax)."""
    n = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)
    if state is not None:
        for part in (getattr(state, "absmax", None), getattr(state, "code", None)):
            n += part.numel() * part.element_size() if isinstance(part, torch.Tensor) else 0
        nested = getattr(state, "state2", None)
        if nested is not None:
            n += sum(p.numel() * p.element_size() for p in (nested.absmax, nested.code) if isinstance(p, torch.Tensor))
    return n


def is_adapter_tensor(name: str) -> bool:
    """LoRA tensors and the heads rlfuse trains or attaches (value head, score head)."""
    return ".lora_" in name or name.startswith(("head.", "score.")) or ".score." in name or ".modules_to_save." in name


def weight_bytes(modules: dict[str, torch.nn.Module]) -> dict[str, int]:
    """{"base", "adapters"}: every parameter and buffer of the named modules once (shared tensors, such as a shared
    base seen through several roles or GPT-2's tied head, are counted once)."""
    seen, out = set(), {"base": 0, "adapters": 0}
    for module in modules.values():
        if module is None or not isinstance(module, torch.nn.Module):
            continue
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            out["adapters" if is_adapter_tensor(name) else "base"] += tensor_bytes(t)  # a fully trained critic: base
    return out


def role_modules(models) -> dict[str, torch.nn.Module]:
    """The modules of a models.build.Models by role (None where a role has none): the reward model is the one inside
    reward_model_fn (a Python reward function has none)."""
    roles = {"actor": models.actor, "generator": models.generator, "reference": models.ref, "critic": models.critic}
    for cell in getattr(models.reward_fn, "__closure__", None) or ():
        if isinstance(cell.cell_contents, torch.nn.Module):
            roles["reward"] = cell.cell_contents
    return roles


def optimizer_bytes(optimizers) -> int:
    return sum(tensor_bytes(v) for opt in optimizers for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def release_freed_memory() -> bool:
    """Hand the C heap's freed pages back to the OS (glibc malloc_trim), so that RSS measured afterwards is what is
    in use, not what loading once used: glibc keeps freed memory mapped, and RSS counts it. False where unsupported."""
    gc.collect()
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def minor_faults(fn) -> int:
    """Minor page faults (a page first touched or reclaimed, no disk) this process takes while fn() runs: on a CPU a
    fresh mapping's pages (models/quantize.fix_cpu_heap), which the planner prices apart (plan/cost.py fault_s).
    0 where the platform does not count them."""
    if resource is None:
        fn()
        return 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def process_level(device) -> int:
    """Bytes the process holds now: CUDA allocated on a GPU, RSS otherwise."""
    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:  # cheaper than psutil, and the sampler reads it every few milliseconds
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rise(fn, device="cpu") -> int:
    """Bytes the process's peak rose above its level before `fn()` ran (freed heap handed back first): on the CPU
    the kernel's own high-water mark, reset through /proc/self/clear_refs (Linux; a PeakSampler where that cannot be
    written), on a GPU the allocator's peak. What one training micro-batch costs, measured as a run pays it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    release_freed_memory()
    if not reset_peak_rss():
        sampler = PeakSampler(device, interval_s=0.002)
        start = process_level(device)
        fn()
        peak = sampler.take()
        sampler.close()
        return peak - start
    start = process_level(device)
    fn()
    return max(int(peak_rss_mb() * 2**20), process_level(device)) - start


class PeakSampler:
    """A daemon thread that keeps the highest process_level seen since the last take(). The thread holds the sampler
    weakly and ends once the sampler is gone (or close() is called): a run that forgets close() leaks no thread."""

    def __init__(self, device, interval_s: float = 0.005):
        self.device = device
        self._peak = process_level(device)
        self._stop = threading.Event()
        threading.Thread(target=_sample, args=(weakref.ref(self), self._stop, interval_s), daemon=True).start()

    def take(self) -> int:
        """The peak since the last take (the level now included), then start again from the level now."""
        now = process_level(self.device)
        peak, self._peak = max(self._peak, now), now
        return peak

    def close(self):
        self._stop.set()

    def __del__(self):
        self._stop.set()


def _sample(ref, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        sampler = ref()
        if sampler is None:
            return
        sampler._peak = max(sampler._peak, process_level(sampler.device))
        del sampler


class MemoryMeter:
    """Measures the table above during an RL run and writes it to `path` (rl/memory.json) as it goes.

    Hooks: learners' on_step (gradients, optimiser states, the update's peak) and watch(rollout) (the rollout's
    peak). Nothing else in the loop changes."""

    def __init__(self, models, learners, device, path: Path | None = None, quantization: str = "none"):
        self.device, self.path, self.quantization = device, path, quantization
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.weights = weight_bytes(role_modules(models))
        self.learners = [l for l in (learners.actor, learners.critic) if l is not None]
        for learner in self.learners:  # weakly: the meter goes with the run's locals (and its sampler thread with it)
            learner.on_step = _weak_call(weakref.WeakMethod(self._on_step))
        self.sampler = PeakSampler(device)
        self.peaks = {"gradients": 0, "optimizer": 0, "activations": 0, "kv_cache": 0, "total": self.sampler.take()}
        self._phase_start, self._opt_start = process_level(device), 0
        self._grads: dict[int, int] = {}

    # ---------------------------------------------------------------------------------------- hooks

    def _on_step(self, learner) -> None:
        """After a learner's optimiser step, before its gradients are dropped."""
        self._grads[id(learner)] = sum(tensor_bytes(p.grad) for p in learner.trained() if p.grad is not None)
        grads = sum(self._grads.values())
        optimizer = optimizer_bytes(l.opt for l in self.learners)
        peak = self.sampler.take()
        self.peaks["gradients"] = max(self.peaks["gradients"], grads)
        self.peaks["optimizer"] = max(self.peaks["optimizer"], optimizer)
        grown = peak - self._phase_start - grads - max(0, optimizer - self._opt_start)
        self.peaks["activations"] = max(self.peaks["activations"], grown)
        self.peaks["total"] = max(self.peaks["total"], peak)
        self.write()

    def watch(self, rollout):
        """The rollout object with its generate() measured (its other methods pass through)."""
        return _WatchedRollout(rollout, self)

    def _start_phase(self) -> int:
        """On a CPU, hand freed heap back first (a few ms): otherwise the phase reuses what the allocator kept from the
        one before (the weight sync's transient copies), and its own growth would not show in RSS."""
        if not self.cuda:
            release_freed_memory()
        return process_level(self.device)

    def _rollout(self, generate, *args, **kwargs):
        self.peaks["total"] = max(self.peaks["total"], self.sampler.take())
        start = self._start_phase()
        try:
            return generate(*args, **kwargs)
        finally:
            peak = self.sampler.take()
            self.peaks["kv_cache"] = max(self.peaks["kv_cache"], peak - start)
            self.peaks["total"] = max(self.peaks["total"], peak)
            self._phase_start = self._start_phase()
            self._opt_start = optimizer_bytes(l.opt for l in self.learners)
            self.write()

    # ---------------------------------------------------------------------------------------- the table

    def table(self) -> dict:
        """Bytes per component (COMPONENTS), and how total was measured."""
        t = {**self.weights, **{k: max(0, v) for k, v in self.peaks.items()}}
        t["slack"] = t["total"] - sum(t[k] for k in COMPONENTS if k not in ("slack", "total"))
        return {"bytes": {k: int(t[k]) for k in COMPONENTS}, "measured_by": "CUDA allocated" if self.cuda else "process RSS",
                "quantization": self.quantization}

    def write(self) -> None:
        if self.path is not None:
            write_text_atomic(self.path, json.dumps(self.table(), indent=2))

    def close(self) -> dict:
        self.sampler.close()
        self.write()
        return self.table()


def _weak_call(method_ref):
    def call(*args):
        method = method_ref()
        if method is not None:
            method(*args)

    return call


class _WatchedRollout:
    def __init__(self, rollout, meter: MemoryMeter):
        self._rollout, self._meter = rollout, meter

    def generate(self, *args, **kwargs):
        return self._meter._rollout(self._rollout.generate, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._rollout, name)


def format_table(table: dict, predicted: dict | None = None) -> list[tuple]:
    """Rows (component, measured MiB[, predicted MiB]) for the report and the benchmark."""
    mib = lambda b: f"{b / 2**20:.1f}"
    head = ("component", f"measured MiB ({table.get('measured_by', '')})") + (("predicted MiB",) if predicted else ())
    rows = [head]
    for k in COMPONENTS:
        row = (k, mib(table["bytes"][k]))
        rows.append(row + ((mib(predicted[k]) if k in predicted else "",) if predicted else ()))
    return rows
