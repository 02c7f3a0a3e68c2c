"""rl.release_reference (rlfuse/models/mapped.py): a frozen model's weights mapped from its folder's safetensors give
the same logits, hand their pages back to the OS on release and map them in again on use; a tensor that differs
from the file (merged adapters, a changed weight) keeps its own copy."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlfuse.models.mapped import map_frozen_weights, release_mapped, safetensors_files


def rss_file_mb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@pytest.fixture
def saved_llama(tmp_path):
    torch.manual_seed(0)
    # wide enough that its mapped pages (~34 MB) stand out of the process's other file-backed pages
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4))
    model.save_pretrained(tmp_path)
    return tmp_path


def frozen(folder):
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)


def test_mapped_weights_give_the_same_logits_and_leave_memory_on_release(saved_llama):
    model = frozen(saved_llama)
    ids = torch.tensor([[1, 5, 9, 300, 17, 4000]])
    with torch.no_grad():
        want = model(ids).logits
    mapped = map_frozen_weights(model, saved_llama)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mapped == weights  # every weight, the tied ones once
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    before = rss_file_mb()
    release_mapped(model)
    after = rss_file_mb()
    if before is not None:  # Linux: the mapped pages left the process (they stay in the page cache)
        assert before - after > 0.8 * weights / 2**20
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # mapped in again on use


def test_a_tensor_that_differs_from_the_file_keeps_its_own_copy(saved_llama):
    model = frozen(saved_llama)
    changed = model.model.layers[0].mlp.up_proj.weight
    changed.data += 1.0  # as merged adapters would differ from the base on disk
    own = changed.data.clone()
    mapped = map_frozen_weights(model, saved_llama)
    assert mapped == sum(p.numel() * p.element_size() for p in model.parameters()) - own.numel() * own.element_size()
    release_mapped(model)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, own)


def test_trainable_weights_and_folders_without_safetensors_are_left_alone(saved_llama, tmp_path):
    model = LlamaForCausalLM.from_pretrained(saved_llama, dtype=torch.float32)  # requires grad: trained, not mapped
    assert map_frozen_weights(model, saved_llama) == 0
    assert safetensors_files(tmp_path / "nothing") == []
    release_mapped(model)  # nothing mapped: nothing to do
    release_mapped(None)
