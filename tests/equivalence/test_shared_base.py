"""One base for every role (model.shared_base) scores exactly as separate models do: on a fixed batch, the same
rewards, reference log-probs and critic values (fp32, assert_close defaults), from SFT and reward-model stages trained
with LoRA on a tiny Llama-style model. And the critic's gradient through a checkpointed shared base is its own."""

import pytest
import torch

from conftest import TINY
from helpers import make_tiny_llama
from rlfuse.cli import main
from rlfuse.config import load_config
from rlfuse.models.build import build_models
from rlfuse.rollout.engine import Sample
from rlfuse.rollout.score import Scorer, collate, response_values

STAGES = [o for o in TINY if not o.startswith(("model.n_", "sft.eval_samples"))] + ["sft.eval_samples=0",
                                                                                    "model.lora=true"]


@pytest.fixture(scope="module")
def llama_run(tiny_task, tmp_path_factory):
    """SFT then reward model, both LoRA, on a tiny Llama; the run folder."""
    root = tmp_path_factory.mktemp("shared")
    model = make_tiny_llama(root / "tiny-llama", tiny_task.reviews()[:300])
    run_dir = root / "run"
    for stage in ("sft", "rm"):
        assert main([stage, f"model.name={model}", f"run.dir={run_dir}", *STAGES]) == 0
    return run_dir


def _models(run_dir, shared: bool, *extra):
    cfg = load_config(None, [f"model.shared_base={str(shared).lower()}", "rl.critic_init=rm", "rl.reward=rm",
                             f"run.dir={run_dir}", *STAGES, *extra])
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
