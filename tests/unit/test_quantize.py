"""bitsandbytes pieces on CPU: what a 4-bit weight costs, the merged (dequantised) weights a plain model gets, the
8-bit optimisers, and the memory table's accounting."""

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="bitsandbytes is a test dependency (pip install -e .[test])")

from helpers import make_tiny_llama, make_tiny_model  # noqa: E402
from rlfuse.config import load_config  # noqa: E402
from rlfuse.metrics.memory import COMPONENTS, format_table, tensor_bytes, weight_bytes  # noqa: E402
from rlfuse.models.load import load_causal_lm  # noqa: E402
from rlfuse.models.weights import merged_state_dict  # noqa: E402

TEXTS = ["the film was good and the acting was bad"] * 30


@pytest.mark.parametrize("make", [make_tiny_model, make_tiny_llama], ids=["gpt2", "llama"])
def test_merged_state_dict_of_a_4bit_model_is_a_plain_model_computing_the_same(tmp_path, make):
    """The generator and the saved model/ get full-precision weights: dequantised base + LoRA delta, GPT-2's Conv1D
    transposed back to (in, out), no quantisation state. The plain model then computes what the 4-bit one does (to
    the order of float rounding in bitsandbytes' CPU kernel), and not what the unquantised original did."""
    from transformers import AutoModelForCausalLM

    folder = make(tmp_path / "m", TEXTS)
    cfg = load_config(None, ["model.lora=true", "model.quantization=4bit"])
    q = load_causal_lm(str(folder), cfg.model, precision="fp32", device="cpu")
    with torch.no_grad():
        for n, p in q.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(merged_state_dict(q), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # GPT-2's head is tied
    ids = torch.tensor([[1, 5, 9, 30, 2, 7, 11]])
    with torch.no_grad():
        want, got, before = q(input_ids=ids).logits, plain(input_ids=ids).logits, original(input_ids=ids).logits
    # bitsandbytes' CPU kernel accumulates in its own order: 1e-2 on logits of size ~1, while quantisation and the
    # adapters move them by far more than that (checked below)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    assert (before - want).abs().max() > 0.05


def test_4bit_weights_cost_about_half_a_byte_each(tmp_path):
    cfg = load_config(None, ["model.lora=true", "model.quantization=4bit"])
    q = load_causal_lm(str(make_tiny_llama(tmp_path / "m", TEXTS)), cfg.model, precision="fp32", device="cpu")
    layer = q.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    n = layer.in_features * layer.out_features  # 64 x 64
    # packed nibbles n/2 + one 8-bit absmax per 64-weight block (double quantisation) + the 16-value NF4 code (fp32)
    # + the nested 256-value code (fp32) + one fp32 absmax per 256 block absmaxes: 2048 + 64 + 64 + 1024 + 4
    assert tensor_bytes(layer.weight) == n // 2 + n // 64 + 16 * 4 + 256 * 4 + 4 == 3204
    w = weight_bytes({"actor": q, "again": q})  # a module seen twice counts once
    lora = sum(tensor_bytes(p) for name, p in q.named_parameters() if "lora_" in name)
    assert w["adapters"] == lora and w["base"] > 0


@pytest.mark.parametrize("kind", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_optimisers_step_with_8bit_states(kind):
    import bitsandbytes as bnb

    from rlfuse.learn.optim import build_adamw

    model = torch.nn.Linear(256, 256)  # 65536 weights: above bitsandbytes' 4096-element floor for 8-bit states
    opt = build_adamw(model, 1e-2, 0.0, kind)
    assert isinstance(opt, bnb.optim.optimizer.Optimizer8bit)
    before = model.weight.detach().clone()
    model(torch.randn(4, 256)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight)
    assert opt.state[model.weight]["state1"].dtype == torch.uint8


def test_memory_table_rows():
    table = {"bytes": {c: (i + 1) * 2**20 for i, c in enumerate(COMPONENTS)}, "measured_by": "process RSS"}
    rows = format_table(table, {"base": 2**21})
    assert rows[0] == ("component", "measured MiB (process RSS)", "predicted MiB")
    assert rows[1] == ("base", "1.0", "2.0") and rows[-1] == ("total", "8.0", "")


def test_one_cpu_layout_same_arithmetic_in_eval_and_train_and_stable_merged_weights(tmp_path):
    """bitsandbytes repacks 4-bit weights for a bf16 CPU kernel on the first no-grad eval forward (AVX512-BF16 CPUs,
    such as this one): the scorer would then compute in other arithmetic than the update, and the repacked layout
    does not dequantise back. keep_one_cpu_layout stops it; dequantized_weight also unpacks a repacked weight."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    from rlfuse.models.quantize import dequantized_weight

    cfg = load_config(None, ["model.lora=true", "model.quantization=4bit"])
    lm = load_causal_lm(str(make_tiny_llama(tmp_path / "m", TEXTS)), cfg.model, precision="fp32", device="cpu")
    before = merged_state_dict(lm)
    ids = torch.tensor([[1, 5, 9, 30, 2, 7, 11]])
    with torch.no_grad():
        scored = lm.eval()(input_ids=ids).logits
        trained = lm.train()(input_ids=ids).logits
    torch.testing.assert_close(scored, trained)
    after = merged_state_dict(lm)
    for k in before:
        torch.testing.assert_close(after[k], before[k], msg=k)
    layer = lm.base_model.model.model.layers[0].mlp.down_proj.base_layer
    want = dequantized_weight(layer)
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(layer.weight.data, layer.weight.quant_state)
    # bitsandbytes' round trip through the repacked layout re-quantises the block scales (8-bit absmax): within 1%
    # of each weight's block scale, where reading the repacked bytes as the standard layout was 0.14 off
    torch.testing.assert_close(dequantized_weight(layer), want, rtol=0, atol=0.01 * float(want.abs().max()))


HEAP_PROBE = """
import sys, torch
from rlfuse.models.quantize import fix_cpu_heap
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "fix":
    assert fix_cpu_heap("cpu") and fix_cpu_heap("cpu")  # once per process; a second call changes nothing
big = torch.ones(4 << 20); del big  # a freed 16 MiB mapping: glibc's dynamic mmap threshold grows to 16 MiB
start = rss()
w = torch.ones(3 << 20); del w  # as a 4-bit matmul's dequantised fp32 weight: 12 MiB, touched, then freed
print((rss() - start) / 2**20)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt: glibc only")
def test_fixed_heap_thresholds_return_a_dequantised_weights_pages():
    """fix_cpu_heap: a freed multi-MiB buffer leaves the process's RSS; with glibc's defaults it stays resident (the
    bench's 4-bit arm grew by GBs that way)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    kept = {how: float(subprocess.run([sys.executable, "-c", HEAP_PROBE, how], cwd=root, capture_output=True, text=True,
                                      check=True).stdout.split()[-1]) for how in ("fix", "default")}
    assert kept["fix"] < 1 and kept["default"] > 8, kept


REUSE_PROBE = """
import resource, sys, torch
import rlfuse.models.quantize as q
first, then = sys.argv[1].split(",")
q.choose_cpu_heap(first)
assert q.fix_cpu_heap("cpu")
q.choose_cpu_heap(then)  # after the first model load: the thresholds follow
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(12):  # 12 MiB, as one of each micro-batch's activations
    if step == 8:  # glibc's heap settles after a few (it grows past a chunk of the aligned size before reusing one)
        start = faults()
    w = torch.ones(3 << 20); del w
print(faults() - start, int(q.trim_cpu_heap()))
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt: glibc only")
def test_the_reuse_heap_serves_the_next_micro_batch_from_pages_already_in():
    """run.cpu_heap: under lean a freed 12 MiB tensor's pages go back to the OS, so the next one faults all 3072 in
    afresh (4 x 3072 over the last 4 of 12); under reuse (32 MiB threshold) it comes from the heap's pages, already
    in, and trim_cpu_heap leaves them. The policy chosen after the first model load's fix still takes effect."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = {how: subprocess.run([sys.executable, "-c", REUSE_PROBE, how], cwd=root, capture_output=True, text=True,
                               check=True).stdout.split() for how in ("lean,lean", "lean,reuse", "reuse,lean")}
    assert int(out["lean,lean"][0]) >= 4 * 3072 and out["lean,lean"][1] == "1", out
    assert int(out["lean,reuse"][0]) < 100 and out["lean,reuse"][1] == "0", out
    assert int(out["reuse,lean"][0]) >= 4 * 3072 and out["reuse,lean"][1] == "1", out


TRIM_PROBE = """
import sys, torch
import rlfuse.models.quantize as q
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
q.TRIM_CPU_HEAP = sys.argv[1] == "trim"
assert q.fix_cpu_heap("cpu")
pieces = [torch.ones(16 << 10) for _ in range(3200)]  # 64 KiB each, under the fixed mmap threshold: the heap's
kept = pieces[::8]  # one in eight stays in use, as a micro-batch's saved tensors among its freed temporaries
del pieces
start = rss()
ran = q.trim_cpu_heap()
print(int(ran), (start - rss()) / 2**20)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's malloc_trim: glibc only")
def test_trimming_hands_back_the_pages_of_freed_small_tensors():
    """trim_cpu_heap (before each training micro-batch): the pages of 200 MiB of freed 64 KiB tensors, scattered
    among ones still in use, leave the RSS; untrimmed (TRIM_CPU_HEAP off) they stay."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = {how: subprocess.run([sys.executable, "-c", TRIM_PROBE, how], cwd=root, capture_output=True, text=True,
                               check=True).stdout.split() for how in ("trim", "keep")}
    assert out["trim"][0] == "1" and float(out["trim"][1]) > 100, out
    assert out["keep"][0] == "0" and float(out["keep"][1]) < 5, out


UPDATE_PROBE = """
import resource, sys, torch
import rlfuse.models.quantize as q
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
q.choose_cpu_heap(sys.argv[1])
assert q.fix_cpu_heap("cpu")
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def micro_batches():  # 4 MiB, as a weight's gradient a full fine-tuning micro-batch makes afresh
    for step in range(12):
        if step == 8:  # glibc's heap settles after a few
            start = faults()
        w = torch.ones(1 << 20); del w
    return faults() - start

outside = micro_batches()
with q.update_heap():
    inside = micro_batches()
    kept = rss()
print(outside, inside, (kept - rss()) / 2**20)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt: glibc only")
def test_the_update_heap_reuses_pages_inside_an_update_and_hands_them_back_after():
    """run.cpu_heap=update (models/quantize.update_heap): outside an update lean's threshold, so a freed 4 MiB
    tensor's pages go back and the next faults all 1024 in; inside one they come from the heap's pages, already in;
    at its end the heap's free pages leave the RSS. Under lean the context changes nothing."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = {how: [float(v) for v in subprocess.run([sys.executable, "-c", UPDATE_PROBE, how], cwd=root,
                                                   capture_output=True, text=True, check=True).stdout.split()]
           for how in ("update", "lean")}
    outside, inside, handed_back = out["update"]
    assert outside >= 4 * 1024 and inside < 100 and handed_back >= 3, out
    assert out["lean"][1] >= 4 * 1024 and out["lean"][2] < 1, out
