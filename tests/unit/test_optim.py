"""build_adamw (rlfuse/learn/optim.py): torch's fused AdamW where every parameter is a plain floating tensor on one
device, the default implementation otherwise, and the same weights either way."""

import copy

import torch

from rlfuse.learn.optim import build_adamw, fusable


def _steps(model, opt, n=5):
    torch.manual_seed(0)
    for _ in range(n):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_fused_adamw_trains_to_the_same_weights_as_the_loop():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    looped = copy.deepcopy(model)
    fused = build_adamw(model, 1e-2, 0.1)
    assert fused.defaults["fused"] is True
    plain = torch.optim.AdamW([{"params": [p for p in looped.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in looped.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), foreach=False)
    _steps(model, fused)
    _steps(looped, plain)
    for a, b in zip(model.parameters(), looped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_plain_floating_tensors_on_one_device_type_are_fused():
    assert fusable([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert not fusable([])
    assert not fusable([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not fusable([torch.zeros(2, dtype=torch.int64)])
