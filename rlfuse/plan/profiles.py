"""Machine profiles as the planner reads them: the one `rlfuse plan --profile` wrote (its default place, or a given
file), or BUILTIN_CPU, this project's 2-core dev machine, when there is none; older profile files are completed with
the built-in overheads. Measuring a profile needs torch and Ray: rlfuse/runtime/profile.py. Pure: no torch, no Ray."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from rlfuse.errors import UserError
from rlfuse.plan.cost import GiB, MachineProfile, ModelShape

SYNC_LATENCY_S = 0.02
"""Ray object-store put + get round trip of a weight sync, fixed part: not measured by the profile (starting Ray
costs more than the whole profile); 0.04-0.055 s for 7.6 MB in two transfers in the per-strategy runs of docs/benchmarks/placement.md."""

RAY_CALL_S = 0.002
"""Per-iteration driver <-> worker calls on Ray (submit, wait, gather metrics); an estimate from the same runs."""

RAY_WORKER_BYTES = 54 * 2**20
"""What a Ray worker process holds beyond the same imports in a plain process (its core worker and gRPC threads):
438 MiB against 384 MiB, measured on this machine."""

BUILTIN_OVERHEADS = {"ray_round_trip_s": 2.6e-3, "ray_sample_s": 6.9e-4, "allreduce_latency_s": 1.7e-4,
                     "allreduce_bytes_s": 7.7e8, "train_micro_s": 0.012}
"""Ray and gloo overheads (profile_ray.py) as measured on this project's 2-core dev machine (load average 1-4),
for a profile taken without Ray."""

GPU_OVERHEADS = {"allreduce_latency_s": 1e-4, "allreduce_bytes_s": 50e9}
"""NCCL on one node (not measured: the profile's Ray probe runs CPU workers)."""

BUILTIN_CPU = MachineProfile(
    name="builtin: AMD EPYC dev VM (2 cores), 1 thread per worker", device="cpu", threads=1, flops=5.22e10,
    decode_flops=2.75e10, mem_bw=2.52e10, layer_call_s=3.1e-4, decode_layer_call_s=2.0e-4, decode_sample_s=7.7e-4,
    score_call_s=8.1e-4, train_layer_call_s=9.9e-4, bwd_ratio=1.79, optimizer_bytes_s=3.49e9, sync_bytes_s=5.28e8,
    sync_latency_s=SYNC_LATENCY_S, ray_call_s=RAY_CALL_S, **BUILTIN_OVERHEADS, memory_bytes=23.5 * GiB,
    runtime_bytes=0.46 * GiB, slack_fraction=0.1,
    source="rlfuse plan --profile on this project's dev machine, 2026-11-22 03:46 UTC at load average 0.6 "
    "(contention 1.05; its per-model scoring overhead x 3 as score_call_s); Ray overheads measured 04:31 UTC at load "
    "average 1-4; no prefill_call_s")

BUSY_CORES = 0.3
"""Cores that other processes (or the hypervisor's other guests: steal time) may keep busy while the profile times
its rates before its rates are called a busy machine's. This VM idle: 0.00-0.01; one other busy process: 1.0; two:
1.4 (the profile's own process holds the rest of the 2 cores). The spread of the pair slowdowns over their rounds
said nothing of it: 0.2-1.3 idle, and one busy process next to the probe doubled the slowdowns while their spread
stayed at 0.1-0.7."""


def default_profile_path(shape: ModelShape | None = None) -> Path:
    """$RLFUSE_CACHE/machine_profile-<shape>.json for a model shape (where `rlfuse plan CONFIG --profile` writes the
    profile of CONFIG's model), machine_profile.json without one (what older rlfuse wrote for any model)."""
    root = Path(os.environ.get("RLFUSE_CACHE", Path.home() / ".cache" / "rlfuse"))
    return root / ("machine_profile.json" if shape is None else f"machine_profile-{shape.key}.json")


def load_profile(path: str | Path | None = None, log=None, shape: ModelShape | None = None) -> MachineProfile:
    """The profile at `path`; else the one measured on `shape` (the model planned for), else the generic
    machine_profile.json (said in a log line when it was measured on another shape); else BUILTIN_CPU, said too."""
    p = Path(path) if path else default_profile_path(shape)
    if not path and shape is not None and not p.is_file():
        p = default_profile_path()
        if log and p.is_file() and MachineProfile.load(p).shape not in ("", shape.key):
            log(f"[plan] {p} was measured on a {MachineProfile.load(p).shape} model, not this {shape.key}: its rates "
                f"per FLOP and per call are off for this one; `rlfuse plan CONFIG --profile` measures this model's")
    if p.is_file():
        profile = _with_overheads(MachineProfile.load(p), p, log)
        if log and profile.other_cores > BUSY_CORES:
            log(f"[plan] {p} was measured on a busy machine: other work kept {profile.other_cores:.1f} cores busy "
                f"while it timed the rates; the predicted times are rough: `rlfuse plan --profile` again on a "
                f"quieter machine")
        return profile
    if path:
        raise UserError(f"--profile-path {p}: no profile there; run `rlfuse plan --profile --profile-path {p}` first")
    if log:
        log(f"[plan] no machine profile at {p}: using the built-in one ({BUILTIN_CPU.name}); "
            f"`rlfuse plan [CONFIG] --profile` measures this machine on that model (under a minute for the embedded "
            f"one)")
    return BUILTIN_CPU


def _with_overheads(profile: MachineProfile, path: Path, log) -> MachineProfile:
    """A CPU profile written before the Ray overhead terms existed has none of them (they would read as free): it
    gets the built-in ones, and one log line says so."""
    stored = json.loads(path.read_text())
    old = stored.get("ray_slowdown", 1.0)
    if "pair_train_slowdown" not in stored and old > 1:
        # an older profile's ray_slowdown was two busy workers against the profile's process alone: as pair
        # slowdowns it slows only the compute that overlaps
        profile = replace(profile, pair_decode_slowdown=old, pair_train_slowdown=old)
        if log:
            log(f"[plan] {path} measured compute on two busy workers as one figure, {profile.pair_train_slowdown:.2f}x "
                f"(written by an older rlfuse): used where workers compute at once; `rlfuse plan --profile` "
                f"measures decoding and training apart, with their spread")
    missing = [k for k in BUILTIN_OVERHEADS if k not in stored]
    if not missing or profile.device != "cpu":
        return profile
    if log:
        log(f"[plan] {path} has no {', '.join(missing)} (written by an older rlfuse): using the built-in values; "
            f"`rlfuse plan --profile` measures them")
    return replace(profile, **{k: BUILTIN_OVERHEADS[k] for k in missing})
