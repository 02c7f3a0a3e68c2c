"""One base for every role (model.shared_base) scores exactly as separate models do: on a fixed batch, the same
rewards, reference log-probs and critic values (fp32, assert_close defaults), from SFT and reward-model stages trained
with LoRA on a tiny Llama-style model. And the critic's gradient through a checkpointed shared base is its own."""

import pytest
import torch

from conftest import TINY
from helpers import llama_sft_and_rm
from rlfuse.config import load_config
from rlfuse.models.build import build_models
from rlfuse.rollout.engine import Sample
from rlfuse.rollout.score import Scorer
from rlfuse.models.forward import collate, response_values

STAGES = [o for o in TINY if not o.startswith(("model.n_", "sft.eval_samples"))] + ["sft.eval_samples=0",
                                                                                    "model.lora=true"]


@pytest.fixture(scope="module")
def llama_run(tiny_task, tmp_path_factory):
    """SFT then reward model, both LoRA, on a tiny Llama; the run folder."""
    return llama_sft_and_rm(tmp_path_factory.mktemp("shared"), tiny_task.reviews()[:300], STAGES)[1]


def _models(run_dir, shared: bool, *extra):
    cfg = load_config(None, [f"model.shared_base={str(shared).lower()}", "rl.critic_init=rm", "rl.reward=rm",
                             f"run.dir={run_dir}", "rollout.generator_dtype=fp32", *STAGES, *extra])
    models = build_models(cfg, run_dir, torch.device("cpu"))
    torch.manual_seed(1)  # the actor's adapter moves away from zero (as after an update): roles must not see it
    with torch.no_grad():
        for n, p in models.actor.named_parameters():
            if "lora_B" in n and ".default." in n:
                p.normal_(std=0.5)
    return models


def _batch(tok):
    ids = lambda text: [tok.bos_token_id] + tok(text)["input_ids"]
    prompts = [ids("the acting was"), ids("a film"), ids("i did not like the")]
    responses = [ids("truly great")[1:], ids("so dull and slow , a")[1:], ids("plot")[1:] + [tok.eos_token_id]]
    return [Sample(i, 0, p, r, torch.zeros(len(r)), "length") for i, (p, r) in enumerate(zip(prompts, responses))]


def test_shared_base_scores_as_separate_models(llama_run):
    separate, shared = _models(llama_run, False), _models(llama_run, True)
    assert shared.shared_base is shared.actor and shared.ref is None
    assert separate.shared_base is None and not hasattr(separate.critic, "adapter")
    samples = _batch(separate.tokenizer)
    scored = {}
    for name, m in (("separate", separate), ("shared", shared)):
        scorer = Scorer(m.reward_fn, m.tokenizer.pad_token_id, ref=m.ref, actor=m.actor, critic=m.critic)
        scored[name] = scorer.score(samples)
    for a, b in zip(scored["separate"], scored["shared"]):
        torch.testing.assert_close(b.score, a.score)
        torch.testing.assert_close(b.ref_logprobs, a.ref_logprobs)
        torch.testing.assert_close(b.values, a.values)
    assert len({round(s.score, 4) for s in scored["shared"]}) == 3  # a trained reward model: the scores differ


def test_a_wrong_adapter_would_be_seen(llama_run):
    """The equality above can fail: the reward read through the actor's (moved) adapter differs."""
    from rlfuse.models.shared import AdapterRewardModel

    shared = _models(llama_run, True)
    samples = _batch(shared.tokenizer)
    rm = shared.reward_fn.__closure__  # the AdapterRewardModel inside reward_model_fn
    model = next(c.cell_contents for c in rm if isinstance(c.cell_contents, AdapterRewardModel))
    with torch.no_grad():
        right = shared.reward_fn(samples)
        model.adapter = "default"
        wrong = shared.reward_fn(samples)
    assert not torch.allclose(right, wrong, atol=1e-3)


def test_critic_gradient_through_a_checkpointed_shared_base_is_its_own(llama_run):
    """The critic's backward recomputes checkpointed layers after its forward switched back to the actor's adapter:
    the recompute must run the critic's adapter (recompute_with_same_adapter), or its gradients silently change."""
    grads = {}
    for checkpointing in (False, True):
        m = _models(llama_run, True, f"rl.gradient_checkpointing={str(checkpointing).lower()}")
        samples = _batch(m.tokenizer)
        mb = collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], m.tokenizer.pad_token_id, "cpu")
        response_values(m.critic, mb).pow(2).sum().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in m.actor.named_parameters() if ".critic." in n and p.grad is not None}
        assert grads[checkpointing] and not any(p.grad is not None for n, p in m.actor.named_parameters()
                                                if ".default." in n)
    assert grads[True].keys() == grads[False].keys()
    for n in grads[True]:
        torch.testing.assert_close(grads[True][n], grads[False][n], msg=n)


def test_the_critics_adapter_trains_after_a_reference_pass(llama_run):
    """The scorer's reference pass (every adapter off) leaves the critic's adapter trainable: its next backward gets
    gradients (peft freezes every inactive adapter as its disable_adapter context ends; with that flag off at the
    backward, autograd dropped the critic adapter's gradients and only its value head trained)."""
    m = _models(llama_run, True)
    samples = _batch(m.tokenizer)
    flags = {n: p.requires_grad for n, p in m.actor.named_parameters()}
    Scorer(m.reward_fn, m.tokenizer.pad_token_id, ref=m.ref, actor=m.actor, critic=m.critic).score(samples)
    assert {n: p.requires_grad for n, p in m.actor.named_parameters()} == flags
    mb = collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], m.tokenizer.pad_token_id, "cpu")
    response_values(m.critic, mb).pow(2).sum().backward()
    critic = [p for n, p in m.actor.named_parameters() if ".critic." in n and ".lora_" in n]
    assert critic and all(p.grad is not None for p in critic)
    assert any(float(p.grad.abs().max()) > 0 for p in critic)


def _same_actor_adapter(source, target):
    """Copy the actor's LoRA tensors of `source` into `target` by name (both are the actor on the same SFT model)."""
    own = dict(source.actor.named_parameters())
    with torch.no_grad():
        for n, p in target.actor.named_parameters():
            if ".default." in n and ".lora_" in n:
                p.copy_(own[n])


def _decoded(models, prompts, scorer=None):
    """Samples (prompt id, index, tokens, log-probs) of a fixed seed, fused with scoring after every sample when a
    scorer is given (the critic's, the reward's and the adapters-off passes then run between decode steps)."""
    from rlfuse.runtime.local import decode_engine
    from rlfuse.runtime.local import sync_weights
    from rlfuse.rollout.engine import SamplingParams
    from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts

    engine = decode_engine(models, max_rows=4)
    sync = sync_weights(engine, models.actor)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    lengths = lambda pid, j: 3 + 4 * j + pid  # rows finish one by one
    if scorer is None:
        return sync, {(s.prompt_id, s.sample_index): (s.token_ids, s.logprobs)
                      for s in engine.generate(prompts, 2, params, seed=7, lengths=lengths)}
    live_while_scoring, score = [], scorer.score
    scorer.score = lambda samples, *args: live_while_scoring.append(engine.live_rows) or score(samples, *args)
    exp = generate_rollouts(engine, scorer, prompts, 2, params, 7, FusionPolicy(True, score_every=1), lengths)
    assert max(live_while_scoring) > 0  # scored while rows were still decoding: really fused
    return sync, {(int(exp.prompt_index[i]), i % 2): (r, exp.logprobs[i, : len(r)])  # ordered by (prompt, index)
                  for i, r in enumerate(exp.response_ids)}


def test_decoding_from_the_shared_base_gives_the_separate_generators_samples(llama_run):
    """With model.shared_base the engine decodes the base itself (the actor's adapter; no generator copy, no weight
    sync): the same samples and log-probs as the separate path's generator holding the actor's merged weights, even
    with the critic's adapter active before decoding, the actor in training mode with attention dropout and
    checkpointing on, and the scorer switching adapters between decode steps."""
    from rlfuse.metrics.memory import role_modules
    from rlfuse.models.shared import CRITIC, use_adapter
    from rlfuse.rollout.score import Scorer

    separate = _models(llama_run, False)
    shared = _models(llama_run, True, "rl.gradient_checkpointing=true", "rl.disable_dropout=false")
    _same_actor_adapter(separate, shared)
    assert shared.generator is None and separate.generator is not None
    base_tensors = {id(t) for t in list(shared.shared_base.parameters()) + list(shared.shared_base.buffers())}
    for role, module in role_modules(shared).items():  # every role is a view of the one base, plus its head
        extra = [n for n, t in (module.named_parameters() if module is not None else ()) if id(t) not in base_tensors]
        assert all(n.startswith(("head.", "score.")) for n in extra), (role, extra)
    for m in shared.shared_base.modules():  # dropout that eval mode must switch off while decoding
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    shared.actor.train()
    prompts = [s.prompt_ids for s in _batch(shared.tokenizer)]

    sync_sep, want = _decoded(separate, prompts)
    with use_adapter(shared.actor, CRITIC):
        sync_sh, got = _decoded(shared, prompts)
        assert shared.actor.active_adapter == CRITIC  # put back after decoding
    assert sync_sep["sync/bytes"] > 0 and sync_sh["sync/bytes"] == 0
    scorer = Scorer(shared.reward_fn, shared.tokenizer.pad_token_id, ref=None, actor=shared.actor, critic=shared.critic)
    _, fused = _decoded(shared, prompts, scorer)
    assert shared.actor.training and len(want) == 6
    for key, (tokens, logprobs) in want.items():
        for other in (got, fused):
            assert other[key][0] == tokens, key
            torch.testing.assert_close(other[key][1], logprobs)


def test_decoding_on_the_shared_base_runs_the_actors_adapter(llama_run):
    """The equality above can fail: decoding the base with the reward model's adapter gives other samples."""
    from rlfuse.models.shared import REWARD

    separate, shared = _models(llama_run, False), _models(llama_run, True)
    _same_actor_adapter(separate, shared)
    prompts = [s.prompt_ids for s in _batch(shared.tokenizer)]
    _, want = _decoded(separate, prompts)
    import rlfuse.models.shared as shared_module

    shared_module.ACTOR, actor = REWARD, shared_module.ACTOR  # actor_decoding reads the module's name at call time
    try:
        _, wrong = _decoded(shared, prompts)
    finally:
        shared_module.ACTOR = actor
    assert any(wrong[k][0] != want[k][0] for k in want)
