"""Plain batched sampling through `model.generate`, used for evaluation samples. Prompts are grouped by token length
so no padding is needed (left padding would shift GPT-2's positions)."""

from __future__ import annotations

from collections import defaultdict

import torch

from rlfuse.data.collate import encode


@torch.no_grad()
def sample_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, batch_size: int = 64) -> list[tuple[str, bool]]:
    """One sampled continuation per prompt, in prompt order: (text after the prompt with special tokens removed,
    whether it ended with EOS rather than at the length limit)."""
    device = next(model.parameters()).device
    groups: dict[int, list[int]] = defaultdict(list)
    encoded = [encode(tokenizer, p) for p in prompts]
    for i, ids in enumerate(encoded):
        groups[len(ids)].append(i)
    out: list[tuple[str, bool]] = [("", False)] * len(prompts)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    for _, idx in sorted(groups.items()):
        for s in range(0, len(idx), batch_size):
            chunk = idx[s: s + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], device=device)
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  temperature=temperature, top_k=top_k or None, max_new_tokens=max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            for row, i in enumerate(chunk):
                new = seqs[row, ids.shape[1]:]
                finished = bool((new == tokenizer.eos_token_id).any())
                out[i] = (tokenizer.decode(new, skip_special_tokens=True), finished)
    model.train(was_training)
    return out
