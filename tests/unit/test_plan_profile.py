"""`rlfuse plan --profile` measures rates that the cost model can use, and the file round-trips."""

from rlfuse.placement.cost import MachineProfile, gpt2_shape
from rlfuse.placement.profile import BUILTIN_CPU, load_profile, measure_profile


def test_measure_profile_tiny_model(tmp_path):
    p = measure_profile(gpt2_shape("tiny", 2, 64, 2, 256, 128), threads=1, device="cpu", log=lambda m: None)
    for name in ("flops", "decode_flops", "mem_bw", "layer_call_s", "decode_layer_call_s", "optimizer_bytes_s",
                 "sync_bytes_s", "memory_bytes", "runtime_bytes"):
        assert getattr(p, name) > 0, name
    assert p.device == "cpu" and p.threads == 1 and "rlfuse plan --profile" in p.source
    path = p.save(tmp_path / "machine_profile.json")
    assert load_profile(path) == p == MachineProfile.load(path)


def test_no_profile_file_falls_back_to_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFUSE_CACHE", str(tmp_path))
    said = []
    assert load_profile(log=said.append) == BUILTIN_CPU
    assert "no machine profile" in said[0] and str(tmp_path) in said[0]
