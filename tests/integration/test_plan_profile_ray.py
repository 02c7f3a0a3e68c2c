"""The profile's Ray probe end to end (rlfuse/runtime/profile_ray.py): two Ray workers of one CPU each, as
`rlfuse plan --profile` starts them; every overhead it returns is in a plausible range (a failed measurement lands
on a clamp: 1e-5 s, 0, or 1.0)."""

import os

import pytest

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_measure_ray_overheads_on_two_workers(monkeypatch):
    from rlfuse.runtime import profile_ray
    from rlfuse.plan.cost import gpt2_shape

    monkeypatch.setattr(profile_ray, "CHUNKS", 4)  # calls per worker per pattern: enough for a median, fast
    monkeypatch.setattr(profile_ray, "PAIR_ROUNDS", 3)
    said = []

    tiny = gpt2_shape("tiny", 2, 64, 2, 256, 128)
    out = profile_ray.measure_ray_overheads(tiny, threads=1, log=said.append, steps=4)
    plausible = {"ray_round_trip_s": (2e-5, 1.0), "ray_sample_s": (0.0, 0.05), "allreduce_latency_s": (1e-6, 0.5),
                 "allreduce_bytes_s": (1e6, 1e12), "ddp_allreduce_bytes_s": (1e5, 1e12), "fsdp_bytes_s": (0.0, 1e12),
                 "train_micro_s": (0.0, 0.5),
                 "pair_decode_slowdown": (1.0, 20.0), "pair_train_slowdown": (1.0, 20.0),
                 "pair_decode_spread": (0.0, 50.0), "pair_train_spread": (0.0, 50.0)}
    assert set(out) == set(plausible)
    for name, (low, high) in plausible.items():
        assert low <= out[name] < high, (name, out[name])
    assert out["ddp_allreduce_bytes_s"] <= out["allreduce_bytes_s"]  # ranks that compute never sync faster than idle
    assert "[profile] Ray, 2 workers" in said[0]
    if len(os.sched_getaffinity(0)) >= 2:  # it started Ray: its workers keep to a core each, as a run's do
        first, second = sorted(os.sched_getaffinity(0))[:2]
        assert f"workers on cores {first} and {second};" in said[0]
    assert not ray.is_initialized()  # it started Ray, so it shut it down
