"""Pipeline stages (rlfuse/models/pipeline_stages.py) chained on right-padded rows give the unsplit body's hidden states and
the unsplit value model's values, for GPT-2 and Llama; what cannot be split says why."""

import pytest
import torch

from helpers import make_tiny_llama, make_tiny_model
from rlfuse.models.heads import ValueModel, backbone_and_head
from rlfuse.models.pipeline_stages import split_actor, split_critic

TEXTS = ["a good film with a fine cast", "a dull plot and a bad ending", "not bad at all, rather good"] * 20


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    make = make_tiny_model if request.param == "gpt2" else make_tiny_llama
    path = make(tmp_path_factory.mktemp(request.param), TEXTS)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def padded_rows():
    ids = (torch.arange(18).view(2, 9) * 31 + 3) % 300
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # the second row is right-padded
    return ids, mask


def chain(stages, ids, mask):
    x = ids
    for stage in stages:
        x = stage(x, mask)
    return x


def test_two_stages_give_the_unsplit_hidden_states(lm):
    ids, mask = padded_rows()
    body, head = backbone_and_head(lm)
    stages = split_actor(lm, 2)
    assert [s.first for s in stages] == [True, False] and stages[1].head is head
    with torch.no_grad():
        want = body(input_ids=ids, attention_mask=mask).last_hidden_state
        got = chain(stages, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real])
        # the partner: without the final norm (the last stage's job) it is not the body's output
        assert not torch.allclose(chain(stages[:1], ids, mask), want)


def test_critic_stages_give_the_value_models_values(lm):
    ids, mask = padded_rows()
    critic = ValueModel.from_causal_lm(lm)
    torch.nn.init.normal_(critic.head.weight, std=0.1)
    stages = split_critic(critic, 2)
    with torch.no_grad():
        want = critic(ids, mask)
        got = stages[1].head(chain(stages, ids, mask)).squeeze(-1).float()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])


def test_what_cannot_be_split_says_why(lm):
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        split_actor(lm, 3)


def test_a_model_of_another_type_is_refused_as_it_loads(lm, monkeypatch):
    """plan/resolve.py checks what it can see before a run; a model named by hub id is checked here, as it loads."""
    monkeypatch.setattr(lm.config, "model_type", "bloom")
    with pytest.raises(ValueError, match="a bloom model .* cannot be split into pipeline stages; splittable: gpt2"):
        split_actor(lm, 2)
