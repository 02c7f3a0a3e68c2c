"""rollout.generator_dtype: the LoRA generator's own copy of the policy in bf16 where the hardware multiplies bf16
natively, and the update's correction for sampling from it (the decoupled objective around the trained policy)."""

import json

import pytest
import torch

from conftest import TINY
from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.models import device as device_module
from rlfuse.models.build import build_models
from rlfuse.models.device import generator_dtype

GRPO = ["rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=grpo", "rl.k=2"]
CPU = torch.device("cpu")


def _cfg(tiny_task, *more):
    return load_config(None, [f"rl.sft_path={tiny_task.model_dir}", *GRPO, *more])


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_for_a_copy_in_one_process_on_native_hardware(tiny_task, monkeypatch, native):
    monkeypatch.setattr(device_module, "native_bf16", lambda device: native)
    lora = _cfg(tiny_task, "model.lora=true")
    assert generator_dtype(lora, CPU) == (torch.bfloat16 if native else torch.float32)
    # full fine-tuning: a bf16 copy where the update computes in bf16 too (run.precision=auto resolves so on native
    # hardware), else the fp32 actor itself, unless asked
    assert generator_dtype(_cfg(tiny_task), CPU) == (torch.bfloat16 if native else torch.float32)
    assert generator_dtype(_cfg(tiny_task, "run.precision=fp32"), CPU) == torch.float32
    assert generator_dtype(_cfg(tiny_task, "rollout.generator_dtype=fp32"), CPU) == torch.float32
    assert generator_dtype(_cfg(tiny_task, "rollout.generator_dtype=bf16"), CPU) == torch.bfloat16
    # Ray workers decode as the single process does (plan/resolve.py resolves auto once for every process)
    flat = _cfg(tiny_task, "placement.strategy=flattened", "placement.workers=1")
    assert generator_dtype(flat, CPU) == (torch.bfloat16 if native else torch.float32)
    ray = _cfg(tiny_task, "model.lora=true", "placement.strategy=flattened", "placement.workers=1")
    assert generator_dtype(ray, CPU) == (torch.bfloat16 if native else torch.float32)
    assert generator_dtype(_cfg(tiny_task, "model.lora=true", "rollout.generator_dtype=fp32"), CPU) == torch.float32
    assert generator_dtype(_cfg(tiny_task, "model.lora=true", "rollout.generator_dtype=bf16"), CPU) == torch.bfloat16


@pytest.mark.parametrize("more,why", [(["rollout.weight_layout=column"], "full fine-tuning decodes the actor itself"),
                                      (["placement.strategy=flattened", "placement.workers=2",
                                        "rl.train_parallel=fsdp"], "trains and decodes in fp32"),
                                      (["model.lora=true", "model.shared_base=true"], "decodes the shared base"),
                                      (["rollout.generator_dtype=fp16"], "is not one of auto, fp32, bf16")])
def test_bf16_where_there_is_no_copy_of_its_own_is_a_config_error(tiny_task, more, why):
    dtype = [] if any(m.startswith("rollout.") for m in more) else ["rollout.generator_dtype=bf16"]
    field = more[0].split("=")[0] if dtype == [] else "rollout.generator_dtype"
    with pytest.raises(ConfigError, match=field) as e:
        _cfg(tiny_task, *dtype, *more)
    assert why in str(e.value)


def _full_ft_rollout(tiny_task, tmp_path, *more):
    from rlfuse.rollout.fusion import FusionPolicy
    from rlfuse.runtime.local import LocalRollout, decode_engine, local_scorer

    cfg = _cfg(tiny_task, "rollout.generator_dtype=bf16", "rl.prompts_per_iter=2", "rl.mini_batch_size=4",
               "rl.micro_batch_size=2", *more)
    models = build_models(cfg, tmp_path, CPU)
    engine = decode_engine(models, cfg.rollout.max_rows)
    return models, engine, LocalRollout(engine, local_scorer(models, cfg), FusionPolicy(False, 8, 0), cfg.rl)


def _request(models, seed=7):
    from rlfuse.data.collate import encode
    from rlfuse.rollout.engine import SamplingParams
    from rlfuse.rollout.state import RolloutRequest

    tok = models.tokenizer
    return RolloutRequest(0, [encode(tok, "the acting"), encode(tok, "this film")], 2, SamplingParams(8), seed)


def test_full_fine_tuning_in_bf16_decodes_a_copy_it_syncs_and_frees_after_the_rollout(tiny_task, tmp_path):
    """rollout.generator_dtype=bf16 with full fine-tuning: the engine decodes a bf16 copy of its own (half the bytes a
    decode step reads), which every sync writes from the actor's weights and which is freed once the rollout is
    scored, so that the update runs without it; generating before the next sync is an error, not stale samples."""
    from rlfuse.runtime.local import behaviour_differs

    models, engine, rollout = _full_ft_rollout(tiny_task, tmp_path)
    assert not engine.shares_weights and engine.transient_weights and engine.dtype == torch.bfloat16
    assert behaviour_differs(engine, models.actor)
    with torch.no_grad():  # an update moved the actor: the copy must follow
        for p in models.actor.parameters():
            p.add_(0.01)
    assert rollout.sync_weights(models)["sync/bytes"] > 0
    copy = dict(models.generator.named_parameters())
    for n, p in models.actor.named_parameters():
        torch.testing.assert_close(copy[n], p.detach().to(torch.bfloat16), atol=0, rtol=0)
    first = rollout.generate(_request(models))
    assert engine.released and all(p.untyped_storage().nbytes() == 0 for p in models.generator.parameters())
    with pytest.raises(RuntimeError, match="released"):
        rollout.generate(_request(models))
    rollout.sync_weights(models)  # the same weights again: the same samples
    assert not engine.released
    again = rollout.generate(_request(models))
    assert again.response_ids == first.response_ids
    torch.testing.assert_close(again.logprobs, first.logprobs, atol=0, rtol=0)


def test_a_released_copy_takes_back_its_layout_and_only_whole_loads(tiny_task, tmp_path):
    """The copy comes back in the layout it was decoded in (rollout.weight_layout=column: column-major matrices), and
    a load of some tensors only (a bucket) into freed weights is refused: the rest would hold nothing."""
    from rlfuse.models.weights import merged_state_dict

    models, engine, rollout = _full_ft_rollout(tiny_task, tmp_path, "rollout.weight_layout=column")
    assert engine.released  # from the start: the first sync allocates it
    rollout.sync_weights(models)
    strides = {n: p.stride() for n, p in models.generator.named_parameters()}
    assert any(p.dim() == 2 and not p.is_contiguous() for p in models.generator.parameters())
    rollout.generate(_request(models))
    one = dict(list(merged_state_dict(models.actor).items())[:1])
    with pytest.raises(ValueError, match="every one must be loaded"):
        engine.load_weights(one)
    assert engine.released
    rollout.sync_weights(models)
    assert {n: p.stride() for n, p in models.generator.named_parameters()} == strides


def test_only_a_transient_copy_is_released(tiny_task, tmp_path, monkeypatch):
    """A LoRA merged copy lives on between iterations (release_weights refuses); fp32 full fine-tuning has no copy."""
    from rlfuse.runtime.local import decode_engine

    lora = _cfg(tiny_task, "model.lora=true")
    engine = decode_engine(build_models(lora, tmp_path, CPU), lora.rollout.max_rows)
    assert not engine.transient_weights
    with pytest.raises(RuntimeError, match="not transient"):
        engine.release_weights()
    monkeypatch.setattr(device_module, "native_bf16", lambda device: False)
    assert build_models(_cfg(tiny_task), tmp_path, CPU).generator is None  # no native bf16: auto decodes the actor


def _rollout(tiny_task, tmp_path, mini_batch: int, dtype: str = "bf16", *more: str):
    from rlfuse.data.collate import encode
    from rlfuse.rollout.engine import SamplingParams
    from rlfuse.rollout.fusion import FusionPolicy
    from rlfuse.rollout.state import RolloutRequest
    from rlfuse.runtime.local import LocalRollout, behaviour_differs, decode_engine, local_scorer

    cfg = _cfg(tiny_task, "model.lora=true", f"rollout.generator_dtype={dtype}", "rl.prompts_per_iter=2",
               f"rl.mini_batch_size={mini_batch}", "rl.micro_batch_size=2", "rl.epochs=1", *more)
    models = build_models(cfg, tmp_path, CPU)
    with torch.no_grad():  # adapters away from zero: the merged copy is not the SFT model
        for n, p in models.actor.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.3)
    engine = decode_engine(models, cfg.rollout.max_rows)
    bf16 = dtype == "bf16"
    assert engine.dtype == (torch.bfloat16 if bf16 else torch.float32) and behaviour_differs(engine, models.actor) == bf16
    rollout = LocalRollout(engine, local_scorer(models, cfg), FusionPolicy(False, 8, 0), cfg.rl)
    assert rollout.behaviour_differs == bf16
    assert rollout.sync_weights(models)["sync/bytes"] > 0
    tok = models.tokenizer
    prompts = [encode(tok, "the acting"), encode(tok, "this film")]
    return models, rollout.generate(RolloutRequest(0, prompts, 2, SamplingParams(8), 7))


def test_one_step_update_takes_the_proximal_log_probs_from_its_own_forward(tiny_task, tmp_path):
    """A one-step update (mini-batch = the batch) without a KL penalty: no extra scoring pass; the loss gets the
    proximal log-probs from the update's forward (Experience.proximal_from_update), the engine's bf16 log-probs as
    the behaviour's."""
    _, exp = _rollout(tiny_task, tmp_path, 4, "bf16", "rl.kl_coef=0")
    assert exp.proximal_from_update and exp.proximal_logprobs is None


def test_a_kl_penalty_scores_the_proximal_log_probs_even_for_one_step(tiny_task, tmp_path):
    """With a KL penalty the advantages need the trained policy's log-probs before the update (learn/advantages.py),
    so the scoring pass computes them even where the update is one optimiser step."""
    _, exp = _rollout(tiny_task, tmp_path, 4, "bf16", "rl.kl_coef=0.1")
    assert not exp.proximal_from_update and exp.proximal_logprobs is not None
    assert exp.proximal_logprobs.shape == exp.logprobs.shape


@pytest.mark.parametrize("mini_batch", [2, 4])
def test_an_fp32_generator_samples_the_trained_policy(tiny_task, tmp_path, mini_batch):
    """fp32: the engine's log-probs are the policy's own; plain PPO, no proximal pass either way."""
    _, exp = _rollout(tiny_task, tmp_path, mini_batch=mini_batch, dtype="fp32")
    assert not exp.proximal_from_update and exp.proximal_logprobs is None


def test_the_bf16_copy_keeps_its_buffers_and_ties():
    """Only parameters go to bf16: Llama's rotary frequencies (a buffer) stay fp32, and a tied LM head stays tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlfuse.models.build import with_dtype

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    with_dtype(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_multi_step_update_scores_the_proximal_log_probs(tiny_task, tmp_path):
    """Two mini-batches: the proximal policy would move after the first step, so the scoring pass runs the fp32
    actor once more; its log-probs are the trained policy's, the engine's (bf16) near them but not equal."""
    from rlfuse.models.forward import collate, response_logprobs

    models, exp = _rollout(tiny_task, tmp_path, mini_batch=2)
    assert not exp.proximal_from_update and exp.proximal_logprobs is not None
    mb = collate(exp.prompt_ids, exp.response_ids, models.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        want = response_logprobs(models.actor.eval(), mb) * mb.mask
    T = mb.mask.shape[1]
    torch.testing.assert_close(exp.proximal_logprobs[:, :T] * mb.mask, want, atol=1e-5, rtol=0)
    gap = (exp.logprobs[:, :T] - exp.proximal_logprobs[:, :T]).abs()[mb.mask.bool()]
    assert 0 < float(gap.max()) < 0.5  # bf16 rounding: close, not equal


@pytest.mark.parametrize("lora", [True, False])
def test_a_run_with_a_bf16_generator_corrects_for_its_samples(tiny_task, tmp_path, lora):
    from rlfuse.cli import main

    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", *GRPO, f"model.lora={str(lora).lower()}", "rollout.generator_dtype=bf16",
                 f"run.dir={tmp_path}", *TINY, "rl.iterations=2", "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.epochs=1", "rl.max_new_tokens=8",
                 "rl.eval_prompts=0"]) == 0
    rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:  # the behaviour weights pi_fp32 / pi_bf16 are logged and near 1
        assert 0.9 < r["train/behaviour_weight_mean"] < 1.1 and r["train/behaviour_weight_max"] > 1.0


def test_a_resumed_run_may_not_change_the_generator_dtype(tiny_task):
    """The copy's dtype changes the samples (another behaviour policy): refused on resume, unlike the rest of the
    rollout settings."""
    from rlfuse.config.resume import resume_changes
    from rlfuse.errors import UserError

    saved = _cfg(tiny_task, "model.lora=true", "rollout.generator_dtype=fp32")
    with pytest.raises(UserError, match="rollout.generator_dtype"):
        resume_changes(saved, _cfg(tiny_task, "model.lora=true", "rollout.generator_dtype=bf16"))
    assert [c[0] for c in resume_changes(saved, _cfg(tiny_task, "model.lora=true", "rollout.generator_dtype=fp32",
                                                           "rollout.weight_layout=row"))] == ["rollout.weight_layout"]
