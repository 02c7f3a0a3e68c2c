"""Prefix-shared micro-batches with their continuations packed or right-padded (rlfuse/models/prefix.py,
forward.pack_continuations), on workload d2's own samples: SmolLM2-135M-Instruct decodes d2's 2 hh-rlhf chat prompts
x 8 replies (up to 128 new tokens, temperature 1, `--rollouts` seeds), the replies are cut as rlfuse's update cuts
them (each prompt's 8 shortest first, micro-batches of 4), and each micro-batch runs the reference's scoring pass
(no gradients) and the LoRA policy's forward + backward (rlfuse's default adapters), alternated between the two
layouts in one process. Packed where collate's rule says it pays (token positions <= 0.8 of the padded), so the
micro-batches that do not pack cost the same either way; a micro-batch runs prefix-shared where that cuts its
token positions to 0.8 of the full forward, judged on the continuations as they would run.

    python -m bench.packed_continuations     # about 4 minutes; writes docs/benchmarks/prefix_sharing.md (packed_continuations)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import machine, md_table, write_section
from bench.vs_trl import CHAT_MAX_PROMPT_TOKENS, prepare_chat_prompts, real_model


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.packed_continuations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=2, help="seeds of d2's rollout whose micro-batches are timed")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two layouts")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    import torch

    from rlfuse.config import ModelConfig
    from rlfuse.models import forward
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.models.load import apply_lora, load_causal_lm, load_tokenizer
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams

    folder = real_model()
    prompt_file = prepare_chat_prompts(folder, 2, CHAT_MAX_PROMPT_TOKENS) if folder is not None else None
    if prompt_file is None:
        raise SystemExit("bench.packed_continuations needs SmolLM2 (bash scripts/install.sh smollm2) and the hh-rlhf "
                         "sample in ../shared/data")
    tok = load_tokenizer(str(folder))
    rows = [json.loads(line) for line in prompt_file.read_text().splitlines()][:2]
    prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows]
    base = load_causal_lm(str(folder)).eval()
    engine = DecodeEngine(base, eos_token_id=tok.eos_token_id)  # fresh adapters change nothing: decode the base
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    micro = []  # (prompts, responses) per micro-batch
    with torch.no_grad():
        for seed in range(a.rollouts):
            samples = list(engine.generate(prompts, 8, SamplingParams(128, temperature=1.0), seed=seed))
            for pid in range(len(prompts)):
                mine = sorted((s for s in samples if s.prompt_id == pid), key=lambda s: len(s.token_ids))
                for i in range(0, len(mine), 4):
                    micro.append(([s.prompt_ids for s in mine[i: i + 4]], [s.token_ids for s in mine[i: i + 4]]))
    model = apply_lora(base, ModelConfig(lora=True)).train()
    enable_lean_activations(model)

    rule = forward.pack_continuations

    def batches(packed: bool) -> list:
        # collate's rule, or never (as before continuations packed: collate then also judged sharing against
        # one padded row per reply, and a short prompt before long replies could run unshared)
        forward.pack_continuations = rule if packed else (lambda prompts, continuations: False)
        try:
            return [forward.collate(p, r, pad, "cpu", True) for p, r in micro]
        finally:
            forward.pack_continuations = rule

    def positions(mb) -> int:
        if mb.prefix is None:
            return (mb.packed.ids if mb.packed is not None else mb.input_ids).numel()
        return mb.prefix.prompt_ids.numel() + (mb.prefix.packed.ids if mb.prefix.packed is not None
                                               else mb.prefix.cont_ids).numel()

    layouts = {"one right-padded row per reply": batches(False), "packed where it pays": batches(True)}
    packs = sum(mb.prefix is not None and mb.prefix.packed is not None for mb in layouts["packed where it pays"])
    shared = {name: sum(mb.prefix is not None for mb in mbs) for name, mbs in layouts.items()}
    total = {name: sum(map(positions, mbs)) for name, mbs in layouts.items()}

    def score(mbs) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            for mb in mbs:
                forward.response_logprobs(model, mb)
        return time.perf_counter() - t

    def train(mbs) -> float:
        t = time.perf_counter()
        for mb in mbs:
            model.zero_grad(set_to_none=True)
            forward.response_logprobs(model, mb).sum().backward()
        return time.perf_counter() - t

    seconds = {name: {"scoring": [], "training": []} for name in layouts}
    for mbs in layouts.values():
        score(mbs[:1]), train(mbs[:1])  # warm-up
    for _ in range(a.rounds):
        for name, mbs in layouts.items():
            seconds[name]["scoring"].append(score(mbs))
            seconds[name]["training"].append(train(mbs))
    base = seconds["one right-padded row per reply"]
    rows_out = [[name, shared[name], total[name], f"{statistics.median(s['scoring']):.2f}",
                 f"{statistics.median(base['scoring']) / statistics.median(s['scoring']):.2f}x",
                 f"{statistics.median(s['training']):.2f}",
                 f"{statistics.median(base['training']) / statistics.median(s['training']):.2f}x"]
                for name, s in seconds.items()]
    lengths = [sorted(len(r) for r in resp) for _, resp in micro]
    text = (f"Command: `python -m bench.packed_continuations` (SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} "
            f"threads, LoRA rank 8 with lean MLPs; d2's 2 chat prompts of {len(prompts[0])} and {len(prompts[1])} "
            f"tokens x 8 replies, {a.rollouts} rollouts: {len(micro)} micro-batches of 4 replies, {packs} of them "
            f"packed by collate's rule; reply lengths per micro-batch {lengths}; medians of {a.rounds} alternated "
            f"rounds). Machine: {machine()}.\n\n"
            + md_table(["continuations", "micro-batches prefix-shared", "token positions forwarded", "scoring pass s", "speed-up",
                        "training forward + backward s", "speed-up"], rows_out))
    print(text)
    if not a.no_write:
        write_section("packed_continuations", text, page="prefix_sharing")


if __name__ == "__main__":
    main()
