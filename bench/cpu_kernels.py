"""Two CPU kernels the trainers lean on, at SmolLM2-135M-Instruct's shapes, each against the way it ran before:

- the optimiser step: torch's AdamW over all 135 M parameters as a loop of small ops per parameter (foreach=False),
  as foreach (torch's CPU default) and fused (rlfuse.learn.optim.build_adamw's choice), with the weights after 5
  steps compared;
- the LM head's log-probs without the entropy (scoring and the ratio's log-probs): rlfuse's chunks
  (rlfuse.models.forward.chunked_logprobs: the target's logit read, then an in-place log-sum-exp) against a
  log-softmax over each chunk (divide by the temperature, logsumexp, subtract, gather: what the chunks did until
  2026-12), through the same head products, in fp32 and in bf16, on 1024 tokens of the real model's hidden states.

    python -m bench.cpu_kernels     # about a minute; writes docs/benchmarks/cpu_kernels.md and a BENCHMARKS.md row
"""

from __future__ import annotations

import copy

import torch

from bench.common import machine_short, md_table, write_headline, write_section
from rlfuse.models.forward import _Head, chunked_logprobs, head_compute_dtype
from rlfuse.models.gguf import local_model
from rlfuse.models.layout import fastest_seconds
from rlfuse.models.load import load_causal_lm
from rlfuse.plan.memory import LOGIT_CHUNK_TOKENS


def best_of(fn, reps: int) -> float:
    """Seconds: the fastest of reps calls after one warm-up call."""
    fn()
    return fastest_seconds(fn, reps)


ADAMW_KINDS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _adamw(model, kind: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), **ADAMW_KINDS[kind])


def adamw_rows(model) -> tuple[list[list], float]:
    """(one row per kind: step ms, best of 5; the largest weight difference from the loop after 5
    steps from the same gradients)."""
    torch.manual_seed(0)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    rows, weights = [], {}
    for kind in ADAMW_KINDS:
        copy_ = copy.deepcopy(model)
        for p, g in zip(copy_.parameters(), grads):
            p.grad = g.clone()
        opt = _adamw(copy_, kind)
        for _ in range(5):
            opt.step()
        weights[kind] = [p.detach().clone() for p in copy_.parameters()]
        rows.append([kind, 1000 * best_of(opt.step, 5)])
        del copy_, opt
    diff = max(max((a - b).abs().max().item() for a, b in zip(weights[k], weights["loop"])) for k in weights)
    return rows, diff


def log_softmax_chunks(h, weight, targets, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """The chunks' loop as it was: log-softmax over each chunk's logits, then the targets gathered."""
    head = _Head(weight, head_compute_dtype(h))
    flat, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    out = torch.empty(len(tgt))
    for s in range(0, len(tgt), chunk_tokens):
        z, _ = head.logits(flat[s: s + chunk_tokens], tgt[s: s + chunk_tokens], torch.float32)
        z.div_(temperature)
        lse = torch.logsumexp(z, dim=-1)
        out[s: s + chunk_tokens] = z.sub_(lse[:, None]).gather(1, tgt[s: s + chunk_tokens, None]).squeeze(1)
    return out


def head_rows(model, tokens: int = 1024) -> list[list]:
    """ms for `tokens` tokens' log-probs (best of 5), both loops, fp32 and bf16 hidden states; the largest
    difference between their log-probs (the bf16 head's products are the same in both, so it is rounding)."""
    torch.manual_seed(1)
    ids = torch.randint(100, 40000, (4, tokens // 4 + 1))
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[:, :-1].contiguous()
    targets = ids[:, 1:]
    weight = model.lm_head.weight.detach()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = h.to(dtype)
        with torch.no_grad():
            new = lambda: chunked_logprobs(x, weight, targets, 1.0, LOGIT_CHUNK_TOKENS, False)[0]
            old = lambda: log_softmax_chunks(x, weight, targets, 1.0, LOGIT_CHUNK_TOKENS)
            t_new, t_old = best_of(new, 5), best_of(old, 5)
            diff = (new() - old()).abs().max().item()
        rows.append([str(dtype).removeprefix("torch."), 1000 * t_old, 1000 * t_new, t_old / t_new, f"{diff:.1e}"])
    return rows


def main() -> None:
    model = load_causal_lm(str(local_model("smollm2-135m-instruct"))).float()
    n = sum(p.numel() for p in model.parameters())
    adamw, adamw_diff = adamw_rows(model)
    model.requires_grad_(False)
    head = head_rows(model)
    where = machine_short()
    ms = {kind: t for kind, t in adamw}
    text = (f"Machine: {where}. SmolLM2-135M-Instruct, {n / 1e6:.0f} M parameters.\n\n"
            "AdamW step (best of 5; the weights after 5 steps from the same gradients differ from the loop's by at "
            f"most {adamw_diff:.1e}):\n\n" + md_table(["implementation", "step ms"], adamw)
            + f"\n\nLM head log-probs of 1024 tokens without the entropy, chunks of {LOGIT_CHUNK_TOKENS} tokens "
            "(best of 5):\n\n" + md_table(["hidden states", "log-softmax chunks ms", "rlfuse chunks ms", "speed-up",
                                           "largest log-prob difference"], head))
    write_section("cpu_kernels", text, "cpu_kernels")
    bf16 = head[-1]
    write_headline("cpu_kernels", f"AdamW step over 135 M parameters: fused {ms['fused']:.0f} ms, foreach "
                   f"{ms['foreach']:.0f}, loop {ms['loop']:.0f}; bf16 LM head log-probs of 1024 tokens "
                   f"{bf16[2]:.0f} ms against {bf16[1]:.0f} as log-softmax chunks",
                   "torch's own AdamW implementations; the chunks' previous loop", "python -m bench.cpu_kernels",
                   where, what="CPU kernels at SmolLM2's shapes")
    print(text)


if __name__ == "__main__":
    main()
