"""The one atomic-write helper: a write that fails leaves the old file or folder whole and no temporary behind."""

import pytest

from rlfuse.files import atomic_path, write_text_atomic


def test_a_file_is_replaced_whole(tmp_path):
    path = write_text_atomic(tmp_path / "sub" / "a.json", "old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_text_atomic(tmp_path / "a.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_folder_is_replaced_whole(tmp_path):
    out = tmp_path / "model"
    for text in ("first", "second"):
        with atomic_path(out) as tmp:
            tmp.mkdir()
            (tmp / "weights").write_text(text)
    assert (out / "weights").read_text() == "second" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_keep_existing_lets_the_first_finished_copy_stand(tmp_path):
    out = tmp_path / "cache"
    with atomic_path(out, suffix=".tmp1", keep_existing=True) as mine:
        mine.mkdir()
        (mine / "stats.json").write_text("mine")
        with atomic_path(out, suffix=".tmp2", keep_existing=True) as theirs:  # another builder finishes first
            theirs.mkdir()
            (theirs / "stats.json").write_text("theirs")
    assert (out / "stats.json").read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_weights_digest_follows_the_weights_not_the_copy(tmp_path):
    import shutil

    import torch
    from safetensors.torch import save_file

    from rlfuse.files import weights_digest

    a = tmp_path / "a"
    a.mkdir()
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(a / "model.safetensors"))
    (a / "config.json").write_text("{}")
    shutil.copytree(a, tmp_path / "copy")  # new file times, the same bytes
    assert weights_digest(a) == weights_digest(tmp_path / "copy") and len(weights_digest(a)) == 16
    (a / "model.gguf").write_bytes(b"GGUF" * 10)  # another format beside the loaded one: not what loads
    assert weights_digest(a) == weights_digest(tmp_path / "copy")
    save_file({"w": torch.arange(300_000, dtype=torch.float32) + 1}, str(a / "model.safetensors"))  # trained again
    assert weights_digest(a) != weights_digest(tmp_path / "copy")
    assert weights_digest("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
