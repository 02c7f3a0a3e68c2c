"""`rlfuse plan --profile` measures rates that the cost model can use, and the file round-trips."""

from pathlib import Path

import pytest

from rlfuse.plan.cost import MachineProfile, gpt2_shape
from rlfuse.plan.profiles import BUILTIN_CPU, BUILTIN_OVERHEADS, load_profile
import rlfuse.runtime.profile as profile_module
from rlfuse.runtime.profile import measure_profile


def test_measure_profile_tiny_model(tmp_path):
    lines = []
    p = measure_profile(gpt2_shape("tiny", 2, 64, 2, 256, 128), threads=1, device="cpu", log=lines.append,
                        ray=False)
    # a line as it starts and one per pass: a real model's profile runs for many minutes
    assert lines[0].startswith("[profile] timing tiny") and "3 passes" in lines[0] and "Ray" not in lines[0]
    assert [l.split(" in ")[0] for l in lines[1:4]] == [f"[profile] pass {i}/3" for i in (1, 2, 3)]
    # plausible for any CPU this runs on, and far from the 1e-7 floors the fits clamp to (a failed fit lands there)
    plausible = {"flops": (1e8, 1e13), "decode_flops": (1e7, 1e13), "mem_bw": (1e7, 1e12),
                 "layer_call_s": (1e-6, 0.1), "decode_layer_call_s": (1e-6, 0.1), "optimizer_bytes_s": (1e6, 1e12),
                 "sync_bytes_s": (1e6, 1e12), "memory_bytes": (1e9, 1e14), "runtime_bytes": (5e7, 8e9),
                 "lora_train_layer_call_s": (1e-6, 0.1), "lora_bwd_ratio": (0.1, 10), "lora_fwd_ratio": (0.99, 5)}
    for name, (low, high) in plausible.items():
        assert low < getattr(p, name) < high, (name, getattr(p, name))
    assert 0 <= p.lora_layer_call_s < 0.1  # adapters' extra cost per layer: a difference of timings, may be 0
    # a fresh mapping's page, faulted in (glibc's threshold fixed: Linux with glibc, where this suite runs); a page
    # costs between 50 ns and 50 us on any machine
    if __import__("platform").libc_ver()[0] == "glibc":
        assert 5e-8 < p.fault_s < 5e-5, p.fault_s
    # a LoRA micro-batch's resident line, measured and kept (a tiny model's two sizes differ by a few MB, within the
    # heap's noise: its slope is any positive number)
    assert p.lora_train_ratio > 0 and p.lora_train_resident_bytes >= 0
    assert any(line.startswith("[profile] a LoRA training micro-batch holds") for line in lines)
    assert p.device == "cpu" and p.threads == 1 and "rlfuse plan --profile" in p.source
    assert "fastest of 3 passes' timings" in p.source  # the passes pooled, and which rate moved most over them
    # each pass's contention logged, and the one applied (profile_contention) named in the profile's source
    per_pass = next(line for line in lines if line.startswith("[profile] contention per pass"))
    assert len(per_pass.split(": ")[1].split(";")[0].split(", ")) == 3
    taken = per_pass.split("; ")[1].split(" taken")[0]
    assert f"contention {taken} (rates divided by it)" in p.source
    assert 1e-6 < p.ray_call_s < 0.5  # the driver's own work per iteration, measured in this process
    # without the Ray probe the Ray overheads are the built-in ones (scaled like every per-call cost)
    assert p.ray_round_trip_s == BUILTIN_OVERHEADS["ray_round_trip_s"] and p.train_micro_s > 0
    path = p.save(tmp_path / "machine_profile.json")
    assert load_profile(path) == p == MachineProfile.load(path)


@pytest.mark.skipif(__import__("platform").system() != "Linux", reason="counts faults with Linux's ru_minflt")
def test_the_fault_probe_times_a_fresh_mapping_page_by_page(monkeypatch):
    """Its own anonymous mapping: every page faults, whatever the allocator's heap holds (a tensor from the allocator
    can land in a free heap chunk and fault none), so the price is never a silent 0 on Linux."""
    assert 5e-8 < profile_module._fault_seconds(repeats=3) < 5e-5
    # faults counted per 2 MiB page (transparent huge pages set to always): no price per 4 KiB page, 0 (and
    # measure_profile warns)
    monkeypatch.setattr(profile_module, "minor_faults", lambda fn: (fn(), 8)[1])
    assert profile_module._fault_seconds(repeats=3) == 0.0


def test_no_profile_file_falls_back_to_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFUSE_CACHE", str(tmp_path))
    said = []
    assert load_profile(log=said.append) == BUILTIN_CPU
    assert "no machine profile" in said[0] and str(tmp_path) in said[0]


def test_a_profile_serves_the_model_shape_it_was_measured_on(tmp_path, monkeypatch):
    """`rlfuse plan CONFIG --profile` writes machine_profile-<shape>.json; planning that model reads it, another model
    falls back to the generic file (saying it was measured on another shape) or to the built-in profile."""
    from dataclasses import replace

    from rlfuse.plan.cost import KNOWN_SHAPES, gpt2_shape
    from rlfuse.plan.profiles import default_profile_path

    monkeypatch.setenv("RLFUSE_CACHE", str(tmp_path))
    smol, tiny = KNOWN_SHAPES["smollm2-135m-instruct"], gpt2_shape("embedded", 4, 128, 4, 1024, 512)
    assert default_profile_path(smol).name == "machine_profile-llama-L30-H576-h9-kv3-F1536-V49152.json"
    own = replace(BUILTIN_CPU, name="smol", shape=smol.key).save(default_profile_path(smol))
    generic = replace(BUILTIN_CPU, name="tiny", shape=tiny.key).save(default_profile_path())
    said = []
    assert load_profile(shape=smol, log=said.append).name == "smol" and said == []
    other = KNOWN_SHAPES["gpt2"]
    assert load_profile(shape=other, log=said.append).name == "tiny"
    assert f"measured on a {tiny.key} model, not this {other.key}" in said[0]
    own.unlink(), generic.unlink()
    assert load_profile(shape=smol) == BUILTIN_CPU


def test_a_broken_profile_file_is_one_line(tmp_path):
    import pytest

    from rlfuse.errors import UserError

    path = tmp_path / "machine_profile.json"
    path.write_text('{"name": "half a fi')
    with pytest.raises(UserError, match="is not a machine profile.*rlfuse plan --profile"):
        load_profile(path)


def test_probe_worker_in_process(monkeypatch):
    """The Ray probe's pieces in this process, as rank 0 of a one-rank gloo group: a decode chunk, replies with
    samples, collectives, and the training micro-batch's overhead over the bare forward + backward."""
    import torch.distributed as dist

    pytest.importorskip("ray", reason="ray is not installed: the Ray probe's module imports it")
    from rlfuse.runtime.probe import decode_chunk, fake_samples
    from rlfuse.runtime.process import free_port
    from rlfuse.runtime.profile_ray import ProbeWorker

    tiny = gpt2_shape("tiny", 2, 64, 2, 256, 128)
    w = ProbeWorker(tiny, 0, 1)
    busy, samples = w.chunk(4, 3)
    assert 0 < busy < 5 and len(samples) == 3 and len(samples[0].sample.token_ids) == len(samples[0].values)
    assert decode_chunk(w.model, 2) > 0 and len(fake_samples(0)) == 0
    w.join("127.0.0.1", free_port())
    try:
        latency, big = w.collectives(2**20, repeats=3)
        assert 0 < latency < 1 and 0 < big < 5
        assert 0 <= w.micro_batch_overhead(rows=2, repeats=3) < 1
    finally:
        w.shutdown()
    assert not dist.is_initialized()


def test_an_older_profile_gets_the_built_in_overheads(tmp_path):
    import json

    path = tmp_path / "machine_profile.json"
    old = {k: v for k, v in json.loads(BUILTIN_CPU.to_json()).items() if k not in BUILTIN_OVERHEADS}
    path.write_text(json.dumps(old | {"allreduce_latency_s": 0.5}))  # one it had, kept; the rest were never measured
    said = []
    p = load_profile(path, log=said.append)
    assert p.ray_round_trip_s == BUILTIN_OVERHEADS["ray_round_trip_s"] and p.allreduce_latency_s == 0.5
    assert "train_micro_s" in said[0] and "rlfuse plan --profile" in said[0]
    path.write_text(BUILTIN_CPU.to_json())  # a current one: as written, nothing said
    assert load_profile(path, log=said.append) == BUILTIN_CPU and len(said) == 1


def test_an_older_single_ray_slowdown_becomes_the_pair_slowdowns(tmp_path):
    import json

    path = tmp_path / "machine_profile.json"
    old = {k: v for k, v in json.loads(BUILTIN_CPU.to_json()).items() if not k.startswith("pair_")}
    path.write_text(json.dumps(old | {"ray_slowdown": 1.7}))  # two busy workers over one process, as one figure
    said = []
    p = load_profile(path, log=said.append)
    assert (p.pair_decode_slowdown, p.pair_train_slowdown) == (1.7, 1.7)
    assert "1.70x" in said[0] and "rlfuse plan --profile" in said[0]


def test_pair_spread_in_the_note():
    from rlfuse.runtime.probe import pair_note, spread

    assert spread([1.0, 1.2, 1.1]) == pytest.approx(0.2 / 1.1)
    quiet = {"pair_decode_slowdown": 1.1, "pair_train_slowdown": 1.3, "pair_decode_spread": 0.05,
             "pair_train_spread": 0.1}
    assert "decode 1.10x (spread 5%), train 1.30x (spread 10%)" in pair_note(quiet, 7)


def test_probe_worker_compute_units():
    pytest.importorskip("ray", reason="ray is not installed: the Ray probe's module imports it")
    from rlfuse.runtime.profile_ray import ProbeWorker

    w = ProbeWorker(gpt2_shape("tiny", 2, 64, 2, 256, 128), 0, 1)
    assert 0 < w.compute("decode", 2) < 5 and 0 < w.compute("train", 2) < 5


def test_a_busy_machines_profile_says_so_when_loaded(tmp_path):
    from dataclasses import replace

    said = []
    quiet = replace(BUILTIN_CPU, other_cores=0.05, pair_train_spread=0.9).save(tmp_path / "quiet.json")
    load_profile(quiet, log=said.append)
    assert said == []  # a wide spread of the pair rounds alone is this VM idle
    busy = replace(BUILTIN_CPU, other_cores=1.0).save(tmp_path / "busy.json")
    load_profile(busy, log=said.append)
    assert len(said) == 1 and "busy machine" in said[0] and "1.0 cores" in said[0] and "rlfuse plan --profile" in said[0]


def test_other_cores_by_hand():
    from rlfuse.runtime.profile import other_cores

    # 10 s: the machine's cores busy 25 s in all, 8 s of it this process: others kept 1.7 cores busy
    assert other_cores((100.0, 50.0, 0.0), (125.0, 58.0, 10.0)) == pytest.approx(1.7)
    assert other_cores((100.0, 50.0, 0.0), (105.0, 56.0, 10.0)) == 0.0  # never below 0 (sampling skew)


def test_a_near_flat_fit_is_capped_by_a_bare_matmul(monkeypatch):
    """A busy machine can flatten the forward's timings in rows (a slope near 0 once gave 4.5e15 FLOP/s): the rate
    is then the bare matrix multiply's, never above it."""
    import rlfuse.runtime.profile as profile

    monkeypatch.setattr(profile, "_fit", lambda times: (1e-3, 1e-12))
    p = measure_profile(gpt2_shape("tiny", 2, 64, 2, 256, 128), threads=1, device="cpu", log=lambda m: None, ray=False)
    assert 1e8 < p.flops < 1e13 and p.decode_flops <= p.flops


def test_core_offsets_give_each_worker_its_own_whole_cores():
    from rlfuse.runtime.process import core_offsets

    assert core_offsets([1, 1], [None, None]) == [0, 1]
    assert core_offsets([2, 1, 2], ["a", "a", "b"]) == [0, 2, 0]  # counted per node
    assert core_offsets([0.5, 1, 1.5, 1], ["a"] * 4) == [None, 0, None, 1]  # a fractional share floats


def test_pin_to_cores_pins_every_thread_of_the_process():
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and 2 cores")
    want = sorted(os.sched_getaffinity(0))[1]
    code = ("import os, threading, time; from rlfuse.runtime.process import pin_to_cores\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"  # a thread started before pinning
            "print(pin_to_cores(1, 1), sorted({min(os.sched_getaffinity(int(x))) for x in os.listdir('/proc/self/task')}),"
            " pin_to_cores(5000, 1))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root).stdout.split()
    assert out == [f"[{want}]", f"[{want}]", "[]"]  # every thread on the second core; too few cores: left as is


def test_core_list_and_when_auto_pins():
    from rlfuse.runtime.ray_driver import core_list, pins_cores

    assert (core_list([0]), core_list([2, 3, 4]), core_list([0, 2]), core_list([])) == ("0", "2-4", "0,2", "")
    assert pins_cores(None, True, None)  # auto: a local Ray this run started
    assert not pins_cores(None, True, "ray://head:10001")  # a cluster: other jobs' workers may hold the cores
    assert not pins_cores(None, False, None)  # a Ray someone else started (a notebook, a test)
    assert pins_cores(True, False, "auto") and not pins_cores(False, True, None)  # as set


def test_extra_seconds_is_the_median_paired_difference():
    import time

    from rlfuse.runtime.probe import extra_seconds

    calls = []
    slow = lambda: (calls.append("slow"), time.sleep(0.004))
    fast = lambda: calls.append("fast")
    assert 0.003 < extra_seconds(slow, fast, 5) < 0.05
    assert calls == ["slow", "fast"] * 6  # a warm-up pair, then 5 back-to-back pairs
    assert extra_seconds(fast, slow, 3) == 0.0  # never below 0


def test_contention_is_the_least_pass_on_a_quiet_machine_and_the_median_on_a_busy_one():
    """An idle VM's passes measured 1.15, 1.21, 1.04: its own jitter, not what a run shares the cores with; work
    that kept other cores busy over the profile is, and the median keeps it."""
    from rlfuse.plan.profiles import BUSY_CORES
    from rlfuse.runtime.profile import profile_contention

    assert profile_contention([1.15, 1.21, 1.04], others=0.0) == 1.04
    assert profile_contention([1.15, 1.21, 1.04], others=BUSY_CORES + 0.5) == 1.15
