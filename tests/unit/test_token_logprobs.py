"""TokenLogprobs (rlfuse/models/forward.py): the training path's log-probs, with logits recomputed chunk by chunk in
the backward, equal autograd through the full log-softmax, values and gradients, with and without a temperature; the
no-grad path (scoring) gives the same values in chunks of any size."""

import pytest
import torch

from rlfuse.models.forward import TokenLogprobs, chunked_logprobs, logsumexp_


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_finite_differences(temperature):
    torch.manual_seed(0)
    h = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    # chunks of 3 tokens: the 10 tokens cross chunk boundaries, and the last chunk is short
    assert torch.autograd.gradcheck(lambda h, w: TokenLogprobs.apply(h, w, targets, temperature, 3, False)[0], (h, w))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_entropy_and_gradients_equal_autograd_through_log_softmax(temperature):
    torch.manual_seed(1)
    h = torch.randn(3, 7, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    upstream = torch.randn(3, 7)
    logp = torch.log_softmax(h @ w.T / temperature, dim=-1)
    want = logp.gather(-1, targets[..., None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    want_grads = torch.autograd.grad((want * upstream).sum(), (h, w))
    got, ent = TokenLogprobs.apply(h, w, targets, temperature, 4, True)
    got_grads = torch.autograd.grad((got * upstream).sum(), (h, w))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ent, want_ent.detach())
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_entropy_is_differentiable_for_an_entropy_bonus(temperature):
    """A loss on the log-probs and the entropy together (an entropy bonus): the gradient equals autograd through the
    full log-softmax, and finite differences."""
    torch.manual_seed(2)
    h = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (2, 5))
    up_lp, up_ent = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    logp = torch.log_softmax(h @ w.T / temperature, dim=-1)
    want = ((logp.gather(-1, targets[..., None]).squeeze(-1) * up_lp).sum()
            + (-(logp.exp() * logp).sum(-1) * up_ent).sum())
    want_grads = torch.autograd.grad(want, (h, w))
    lp, ent = TokenLogprobs.apply(h, w, targets, temperature, 3, True)
    got_grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (h, w))
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg)
    only_entropy = lambda h, w: TokenLogprobs.apply(h, w, targets, temperature, 3, True)[1]
    assert torch.autograd.gradcheck(only_entropy, (h, w))


@pytest.mark.parametrize("chunk_tokens", [1, 4, 21, 256])
def test_scoring_without_a_graph_equals_the_training_path_whatever_the_chunk(chunk_tokens):
    """response_logprobs' no-grad path (scoring) runs chunked_logprobs: the training path's values, with at most
    chunk_tokens tokens' logits at once, whatever the chunk."""
    torch.manual_seed(2)
    h, w = torch.randn(3, 7, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (3, 7))
    want = torch.log_softmax(h @ w.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():
        lp, ent, lse = chunked_logprobs(h, w, targets, 1.0, chunk_tokens, True)
    torch.testing.assert_close(lp.view(3, 7), want)
    torch.testing.assert_close(lse.view(3, 7), torch.logsumexp(h @ w.T, -1))
    assert ent.shape == (21,) and (ent > 0).all()
    assert (chunked_logprobs(h, w, targets, 1.0, chunk_tokens, False)[1] == 0).all()  # no entropy asked: zeros


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_entropy_the_log_probs_equal_the_entropy_paths(temperature, dtype):
    """Without the entropy the chunks read the target's logit and let the log-sum-exp consume the buffer; the
    log-probs and log-sum-exps are the entropy path's, in fp32 and through the shifted bf16 head."""
    torch.manual_seed(3)
    h, w = torch.randn(2, 9, 32, dtype=dtype), torch.randn(300, 32)
    targets = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        lp_fast, _, lse_fast = chunked_logprobs(h, w, targets, temperature, 5, False)
        lp_ent, _, lse_ent = chunked_logprobs(h, w, targets, temperature, 5, True)
    torch.testing.assert_close(lp_fast, lp_ent, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse_fast, lse_ent, rtol=1e-6, atol=1e-5)


def test_in_place_logsumexp_equals_torchs_including_infinite_rows():
    torch.manual_seed(4)
    z = torch.randn(6, 1000) * 20
    z[1] = float("-inf")  # every logit masked
    z[2, 7] = float("inf")
    z[3, :500] = float("-inf")
    want = torch.logsumexp(z, -1)
    got = logsumexp_(z.clone())
    torch.testing.assert_close(got, want)
    assert got[1] == float("-inf") and got[2] == float("inf")
