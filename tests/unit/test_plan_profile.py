"""`rlfuse plan --profile` measures rates that the cost model can use, and the file round-trips."""

from rlfuse.placement.cost import MachineProfile, gpt2_shape
from rlfuse.placement.profile import BUILTIN_CPU, load_profile, measure_profile


def test_measure_profile_tiny_model(tmp_path):
    p = measure_profile(gpt2_shape("tiny", 2, 64, 2, 256, 128), threads=1, device="cpu", log=lambda m: None)
    # plausible for any CPU this runs on, and far from the 1e-7 floors the fits clamp to (a failed fit lands there)
    plausible = {"flops": (1e8, 1e13), "decode_flops": (1e7, 1e13), "mem_bw": (1e7, 1e12),
                 "layer_call_s": (1e-6, 0.1), "decode_layer_call_s": (1e-6, 0.1), "optimizer_bytes_s": (1e6, 1e12),
                 "sync_bytes_s": (1e6, 1e12), "memory_bytes": (1e9, 1e14), "runtime_bytes": (5e7, 8e9)}
    for name, (low, high) in plausible.items():
        assert low < getattr(p, name) < high, (name, getattr(p, name))
    assert p.device == "cpu" and p.threads == 1 and "rlfuse plan --profile" in p.source
    path = p.save(tmp_path / "machine_profile.json")
    assert load_profile(path) == p == MachineProfile.load(path)


def test_no_profile_file_falls_back_to_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFUSE_CACHE", str(tmp_path))
    said = []
    assert load_profile(log=said.append) == BUILTIN_CPU
    assert "no machine profile" in said[0] and str(tmp_path) in said[0]


def test_a_broken_profile_file_is_one_line(tmp_path):
    import pytest

    from rlfuse.errors import UserError

    path = tmp_path / "machine_profile.json"
    path.write_text('{"name": "half a fi')
    with pytest.raises(UserError, match="is not a machine profile.*rlfuse plan --profile"):
        load_profile(path)
