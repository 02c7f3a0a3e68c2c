"""rollout.weight_layout: the generator copy's weight matrices stored column-major where that decodes faster. The
values, shapes, ties and state dict stay those of the model, a weight sync keeps the layout, the engine samples the
row-major copy's tokens with its log-probs to rounding, auto measures only where it can matter (a CPU, a copy of its
own, a model larger than a cache), and a resumed run keeps the first run's answer."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from conftest import TINY
from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.models import layout
from rlfuse.models.layout import column_major, decode_rows, faster_layout, generator_layout, layout_of

GRPO = ["rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=grpo", "rl.k=2"]


def _llama(tied: bool = True):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied)).eval()


def test_column_major_keeps_values_shapes_and_ties():
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert layout_of(model) == "row"
    assert column_major(model) == 2 * 7 + 1  # 7 projections a layer and the (tied) LM head
    assert layout_of(model) == "column"
    w = model.model.layers[0].mlp.gate_proj.weight
    assert w.shape == (64, 32) and w.stride() == (1, 64) and w.t().is_contiguous()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_weight_sync_into_column_major_weights_keeps_the_layout():
    from rlfuse.rollout.weights import copy_weights

    model, source = _llama(), _llama()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    column_major(model)
    copy_weights(model, source.state_dict())
    assert layout_of(model) == "column"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))


@pytest.mark.parametrize("tied", [True, False])
def test_the_engine_decodes_a_column_major_copy_as_the_row_major_one(tied):
    """The engine (its lean Llama decode step, the tied embedding looked up in a column-major matrix) samples the
    same tokens with log-probs equal to rounding."""
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams

    row, col = _llama(tied), _llama(tied)
    column_major(col)
    prompts = [[1, 5, 9, 11], [3, 7]]
    runs = [sorted(DecodeEngine(m, eos_token_id=-1, max_rows=8).generate(prompts, 2, SamplingParams(6), 3),
                   key=lambda s: (s.prompt_id, s.sample_index)) for m in (row, col)]
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]
    for a, b in zip(*runs):
        torch.testing.assert_close(torch.as_tensor(b.logprobs), torch.as_tensor(a.logprobs), atol=1e-5, rtol=0)


def test_which_weights_a_decode_step_multiplies_transposed():
    """W @ h^T only for a plain fp32 nn.Linear stored row-major on the CPU, at up to TRANSPOSED_MAX_ROWS rows; its
    product is F.linear's, transposed."""
    linear = torch.nn.Linear(32, 24)
    rows = layout.TRANSPOSED_MAX_ROWS
    assert layout.multiplies_transposed(linear, rows) and not layout.multiplies_transposed(linear, rows + 1)
    h = torch.randn(5, 32)
    torch.testing.assert_close(layout.transposed_product(linear, 5)(h.t().contiguous()).t(), linear(h))
    column = torch.nn.Linear(32, 24)
    column_major(column)
    bf16 = torch.nn.Linear(32, 24).to(torch.bfloat16)

    class Wrapped(torch.nn.Linear):  # a subclass (bitsandbytes' 4-bit layer is one) runs its own forward
        pass

    assert not any(layout.multiplies_transposed(m, 4) for m in (column, bf16, Wrapped(32, 24), torch.nn.Identity()))


def test_which_lora_layers_a_decode_step_multiplies_transposed():
    """peft's LoRA layer (ours, fused) goes W @ h^T only in the states whose product is B @ (A @ h^T) x scaling on a
    plain base: unmerged, one active adapter of the base's dtype, dropout off, no DoRA, nothing hooked; with adapters
    off the base alone. Where taken, the product is the layer's own forward's."""
    from peft import LoraConfig

    from rlfuse.models.lean import single_lora_adapter
    from rlfuse.models.load import apply_lora

    lora = load_config(None, ["model.lora=true", "model.lora_targets=[q_proj]"]).model
    peft_model = apply_lora(_llama(), lora)
    peft_model.add_adapter("second", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    layer = peft_model.get_base_model().eval().model.layers[0].self_attn.q_proj
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1).eval()  # as peft builds it for a loaded adapter's dropout
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    h = torch.randn(3, 32)

    def taken() -> bool:
        product = layout.transposed_product(layer, 3)
        if product is not None:
            torch.testing.assert_close(product(h.t().contiguous()).t(), layer(h))
        return product is not None

    assert type(layer).__name__ == "FusedLoraLinear" and taken()
    assert single_lora_adapter(layer)[2] == layer.scaling["default"]
    layer.train()  # dropout with p > 0 in training is not a no-op
    assert not taken() and single_lora_adapter(layer) is None
    layer.eval()
    layer.merge()
    assert not taken()
    layer.unmerge()
    layer.enable_adapters(False)
    assert taken() and layout.transposed_product(layer, 3).adapter is None
    layer.enable_adapters(True)
    layer.use_dora["default"] = True
    assert not taken()
    layer.use_dora["default"] = False
    layer.set_adapter(["default", "second"])
    assert not taken()
    layer.set_adapter("default")
    assert taken()
    layer.lora_A["default"].to(torch.bfloat16)
    assert not taken()
    layer.lora_A["default"].to(torch.float32)
    for module in (layer, layer.base_layer, layer.lora_A["default"], layer.lora_B["default"],
                   layer.lora_dropout["default"]):
        for hook in (module.register_forward_hook(lambda *a: None), module.register_forward_pre_hook(lambda *a: None),
                     module.register_full_backward_hook(lambda *a: None)):
            assert not taken()
            hook.remove()
        module.forward = type(module).forward.__get__(module)  # a forward set on the instance (accelerate's hooks)
        assert not taken()
        del module.forward
    assert taken()
    for register in (torch.nn.modules.module.register_module_forward_hook,
                     torch.nn.modules.module.register_module_forward_pre_hook):
        with register(lambda *a: None):
            assert not taken()
    layer.lora_dropout["default"] = torch.nn.Dropout(0.0).train()  # p = 0 in training: a no-op too
    assert taken()
    plain = layer.lora_B["default"].weight
    layer.lora_B["default"].weight = torch.nn.Parameter(SubclassTensor(plain.data))
    assert not taken()
    layer.lora_B["default"].weight = plain

    class Quantised(torch.nn.Linear):  # bitsandbytes' layers are nn.Linear subclasses
        pass

    base = layer.base_layer
    layer.base_layer = Quantised(32, 32, bias=False)
    assert not taken()
    layer.base_layer = base
    assert taken()


class SubclassTensor(torch.Tensor):  # a tensor subclass (a DTensor, a quantised weight) with its own operations
    pass


def test_lean_training_runs_a_hooked_down_projection_as_itself():
    """The lean SwiGLU reads the down projection's weights into its fused product; with a forward or a backward hook
    on it, it calls it."""
    from rlfuse.models.lean import enable_lean_activations

    model = _llama().train()
    enable_lean_activations(model)
    down = model.model.layers[0].mlp.down_proj
    seen = []
    hooks = [down.register_forward_hook(lambda module, args, out: seen.append(("forward", tuple(out.shape)))),
             down.register_full_backward_hook(lambda module, gin, gout: seen.append(("backward", gout[0].shape[1])))]
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert seen == [("forward", (1, 3, 32)), ("backward", 3)]
    for hook in hooks:
        hook.remove()
    seen.clear()
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert not seen


def test_the_decode_step_runs_a_hooked_mlp_as_itself():
    """An MLP with a forward hook, or with a forward of the user's set on it, runs its own forward in the lean decode
    step; lean activations' forward (training only) does not stop the transposed MLP."""
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams

    model = _llama()
    enable_lean_activations(model)
    mlp = model.model.layers[1].mlp
    decode = lambda: list(DecodeEngine(model, eos_token_id=-1, max_rows=4).generate([[1, 5, 9]], 2,
                                                                                   SamplingParams(3), 0))
    calls = []
    products = []
    product = layout.TransposedProduct.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout.TransposedProduct, "__call__",
                      lambda self, ht: products.append(self.module) or product(self, ht))
        decode()
        assert mlp.down_proj in products
        hook = mlp.register_forward_hook(lambda *a: calls.append("hook"))
        products.clear()
        decode()
        assert calls and mlp.down_proj not in products and model.model.layers[0].mlp.down_proj in products
        hook.remove()
        lean = mlp.forward
        mlp.forward = lambda x: calls.append("forward") or lean(x)
        calls.clear()
        decode()
        assert calls == ["forward"] * 3  # the prefill and two decode steps


def test_the_probe_answers_for_the_rows_an_engine_decodes():
    assert decode_rows(16) == [16, 8, 4, 2] and decode_rows(3) == [3, 2, 1] and decode_rows(1) == [1]
    for transposed_step in (True, False):
        assert faster_layout(64, 32, [4, 2], torch.float32, transposed_step) in ("row", "column")  # runs both forms
    # the probe times the MLP's shape: as W @ h^T only where the step multiplies the MLP so (a SwiGLU)
    assert layout.multiplies_mlp_transposed(_llama())
    gelu = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu"))
    assert not layout.multiplies_mlp_transposed(gelu)


def test_auto_measures_only_a_cpu_copy_of_its_own_larger_than_a_cache(tiny_task, monkeypatch):
    def cfg(*more):
        return load_config(None, [f"rl.sft_path={tiny_task.model_dir}", *GRPO, *more])

    model = _llama()
    probed = []
    monkeypatch.setattr(layout, "faster_layout", lambda *a: probed.append(a) or "column")
    assert generator_layout(cfg("model.lora=true"), "cpu", model) == "row" and not probed  # fits in a cache
    monkeypatch.setattr(layout, "PROBE_BYTES", 0)
    assert generator_layout(cfg("model.lora=true"), "cuda", model) == "row" and not probed
    assert generator_layout(cfg("model.lora=true", "rl.prompts_per_iter=4", "rl.mini_batch_size=8",
                                 "rl.micro_batch_size=4"), "cpu", model) == "column"
    assert probed[-1] == (64, 32, [8, 4, 2, 1], torch.float32, True)  # the MLP's shape (the most bytes), 4 x k=2 rows
    # a GPT-2 copy decodes through F.linear: its row-major matrices are timed that way, not as W @ h^T
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    generator_layout(cfg("model.lora=true", "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4"),
                     "cpu", gpt2)
    assert probed[-1][3:] == (torch.float32, False)
    # full fine-tuning's copy (bf16, made at every sync) is measured as any copy is; without one none is asked for
    assert generator_layout(cfg("rollout.generator_dtype=bf16"), "cpu", model.to(torch.bfloat16)) == "column"
    assert probed[-1][3] == torch.bfloat16
    assert generator_layout(cfg("model.lora=true", "rollout.weight_layout=row"), "cpu", model) == "row"


@pytest.mark.parametrize("more,why", [([], "full fine-tuning decodes the actor itself"),
                                      (["model.lora=true", "placement.strategy=flattened", "placement.workers=1"],
                                       "placement.strategy=flattened is not single")])
def test_column_where_there_is_no_copy_of_its_own_is_a_config_error(tiny_task, more, why):
    with pytest.raises(ConfigError, match="rollout.weight_layout") as e:
        load_config(None, [f"rl.sft_path={tiny_task.model_dir}", *GRPO, "rollout.weight_layout=column", *more])
    assert why in str(e.value)


def test_a_run_keeps_its_layout_and_a_resumed_run_reuses_it(tiny_task, tmp_path, capsys):
    """column: the run logs it and keeps it in rl/weight_layout.txt; resumed with auto (row for a model this small),
    the kept answer decodes the rest of the run."""
    from rlfuse.cli import main

    args = ["rl", f"rl.sft_path={tiny_task.model_dir}", *GRPO, "model.lora=true", f"run.dir={tmp_path}", *TINY,
            "rl.prompts_per_iter=2", "rl.mini_batch_size=4", "rl.micro_batch_size=4", "rl.max_new_tokens=8",
            "rl.eval_prompts=0", "rl.ckpt_every=1"]
    assert main([*args, "rollout.weight_layout=column", "rl.iterations=1"]) == 0
    said = capsys.readouterr()
    assert "weights stored column-major" in said.out + said.err
    assert (tmp_path / "rl" / "weight_layout.txt").read_text().strip() == "column"
    assert main(["rl", "--resume", str(tmp_path), "rollout.weight_layout=auto", "rl.iterations=2"]) == 0
    said = capsys.readouterr()
    assert "resumed from" in said.out + said.err and "weights stored column-major" in said.out + said.err
    assert (tmp_path / "rl" / "weight_layout.txt").read_text().strip() == "column"


needs_bf16_packing = pytest.mark.skipif(not layout.packs_bf16(), reason="this torch build's oneDNN packs no bf16 here")


@needs_bf16_packing
@pytest.mark.parametrize("tied", [True, False])
def test_a_bf16_copy_decodes_from_packed_weights_to_the_same_samples(tied, monkeypatch):
    """A bf16 model's plain linears decode from weights oneDNN packed at the generate call (every projection and the LM
    head, SwiGLU MLP included): the same tokens and log-probs, to the bit, as its modules' own forwards; the packs are
    dropped when the call ends and by release_weights."""
    from rlfuse.rollout import kv
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams

    model = _llama(tied).to(torch.bfloat16)
    engine = DecodeEngine(model, eos_token_id=-1, max_rows=8, transient_weights=True)
    prompts = [[1, 5, 9, 11], [3, 7]]
    used = []
    monkeypatch.setattr(layout.PackedProduct, "__call__",
                        lambda self, h, call=layout.PackedProduct.__call__: used.append(self) or call(self, h))
    decode = lambda: sorted(engine.generate(prompts, 2, SamplingParams(6), 3),
                            key=lambda s: (s.prompt_id, s.sample_index))
    packed = decode()
    assert len(set(map(id, used))) == 2 * 7 + 1 and engine.fast_step.packed == {}
    monkeypatch.setattr(kv, "packed_product", lambda module: None)
    used.clear()
    plain = decode()
    assert not used
    assert [s.token_ids for s in packed] == [s.token_ids for s in plain]
    assert all(torch.equal(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs)) for a, b in zip(packed, plain))
    engine.fast_step.refresh()
    engine.release_weights()
    assert engine.fast_step.packed == {}


def test_which_linears_a_decode_step_multiplies_from_packed_weights(monkeypatch):
    """Only a plain bf16 nn.Linear on the CPU, contiguous, without hooks, where oneDNN packs bf16."""
    monkeypatch.setattr(layout, "packs_bf16", lambda: True)
    monkeypatch.setattr(layout, "PackedProduct", lambda weight, bias: ("packed", weight))
    bf16 = torch.nn.Linear(32, 24).to(torch.bfloat16)
    assert layout.packed_product(bf16) == ("packed", bf16.weight)
    assert layout.packed_product(torch.nn.Linear(32, 24)) is None  # fp32: the transposed product's or F.linear
    column = torch.nn.Linear(32, 24).to(torch.bfloat16)
    column.weight.data = column.weight.data.t().contiguous().t()
    assert layout.packed_product(column) is None
    hook = bf16.register_forward_hook(lambda *a: None)
    assert layout.packed_product(bf16) is None
    hook.remove()
    monkeypatch.setattr(layout, "packs_bf16", lambda: False)
    assert layout.packed_product(bf16) is None


@needs_bf16_packing
def test_a_weight_load_during_a_generate_call_repacks_and_one_between_calls_drops_the_packs():
    """Packs never outlive the weights they were made from: a load while a generate call is live packs the new
    weights (the rest of the call decodes from them), a load between calls leaves nothing packed."""
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams

    model, other = _llama().to(torch.bfloat16), _llama().to(torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2.0)
    engine = DecodeEngine(model, eos_token_id=-1, max_rows=8)
    run = engine.generate([[1, 5, 9, 11]], 2, SamplingParams(6), 3)
    head = id(model.lm_head)
    assert torch.equal(engine.fast_step.packed[head].packed.to_dense(), model.lm_head.weight)
    engine.load_weights(other.state_dict())
    assert torch.equal(engine.fast_step.packed[head].packed.to_dense(), other.lm_head.weight)
    list(run)
    assert engine.fast_step.packed == {}
    engine.load_weights(model.state_dict())
    assert engine.fast_step.packed == {}
