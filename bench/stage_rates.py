"""The planner's per-call cost model against the calls themselves, on the real model: one forward, one LoRA
forward+backward (and one over 4 sequences of mixed lengths, padded and packed; and one prompt's 8 replies in
micro-batches of 4, in sample order and by length, as workload d1's update runs them; one worker's mini-batch of 8
hh sequences in micro-batches of 4, 2 and 1) and rlfuse's decode engine over one Ray worker's share of
`configs/smollm2_hh.yaml` (4 rows of 115-token prompts, 48 new tokens), timed on one thread as a placement worker
runs them (glibc's threshold fixed and the heap trimmed before each training micro-batch, as in a run), beside what
rlfuse/plan/cost.py predicts for the same call with this machine's profile for SmolLM2's shape (`rlfuse plan
configs/smollm2_hh.yaml --profile` writes it; the built-in profile otherwise). The figures in docs/usage.md's
planner paragraph come from here.

    python -m bench.stage_rates        # ~5 min on 2 cores; prints its table and writes nothing
    python -m bench.stage_rates & python -m bench.stage_rates   # two at once, as 2 placement workers run
"""

from __future__ import annotations

import statistics

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from bench.common import machine, md_table
from rlfuse.config import load_config
from rlfuse.learn.batches import by_length_within_prompts
from rlfuse.metrics.flops import fastest_seconds
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.models.gguf import local_model
from rlfuse.models.quantize import fix_cpu_heap, trim_cpu_heap
from rlfuse.plan.cost import forward_seconds, policy_shape, train_seconds
from rlfuse.plan.memory import weight_bytes
from rlfuse.plan.profiles import load_profile
from rlfuse.rollout.engine import DecodeEngine
from rlfuse.rollout.state import SamplingParams

ROWS, PROMPT, NEW = 4, 115, 48
"""One worker's share of smollm2_hh's iteration on 2 flattened workers (8 prompts, k = 1), its measured mean prompt
(rlfuse plan prints it) and rl.max_new_tokens."""
MIXED_PROMPTS, MIXED_ANSWERS = (83, 119, 158, 81), (20, 30, 40, 25)
"""4 sequences of 103 to 198 tokens: padded 4 x 198 = 792 positions, packed 556."""
D1_PROMPT, D1_REPLIES = 98, (128, 41, 128, 95, 57, 128, 33, 66)
"""One prompt's k = 8 replies as workload d1 (bench/vs_trl.py) draws them: a 98-token chat prompt, replies of mean
84.5 tokens, three stopped at the 128-token limit."""
MINI_PROMPTS, MINI_ANSWERS = (131, 62, 155, 149, 118, 160, 95, 140), (25, 20, 15, 40, 31, 30, 48, 48)
"""One worker's mini-batch of 8 of smollm2_hh's sequences (82 to 190 tokens), in a fixed shuffled order: the
update's micro-batches of 4, 2 and 1 (the plans bench.plan runs) take them in turn."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fastest(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls after a warm-up, as the profile's rates are fitted (CPU: no sync)."""
    return fastest_seconds(fn, repeats, lambda: None)


def main() -> None:
    torch.set_num_threads(1)  # a placement worker's share: placement.cpus_per_worker=1
    fix_cpu_heap("cpu")  # glibc's threshold as a run's first model load fixes it: its page faults are the run's
    torch.manual_seed(0)
    cfg = load_config("configs/smollm2_hh.yaml", [])
    shape = policy_shape(cfg.model)
    profile = load_profile(shape=shape)
    wb = weight_bytes(shape, "fp32")
    model = AutoModelForCausalLM.from_pretrained(local_model(cfg.model.name)).eval()
    ids = torch.randint(0, shape.vocab, (ROWS, PROMPT + NEW // 2))  # a scored sequence: prompt and half a response
    prompts = [[1 + (i * 7 + j) % 400 for j in range(PROMPT)] for i in range(ROWS)]
    rows = []

    def decode(m) -> float:
        engine = DecodeEngine(m, eos_token_id=-1, max_rows=16)  # EOS off: every row runs to the limit
        return fastest(lambda: list(engine.generate(prompts, 1, SamplingParams(max_new_tokens=NEW), seed=0)), 2)

    seq = PROMPT + NEW // 2
    with torch.no_grad():
        rows.append(["forward (logits)", f"{ROWS} x {seq}", fastest(lambda: model(ids), 3),
                     forward_seconds(profile, shape, ROWS, seq, wb)])
        rows.append([f"decode, {NEW} steps", f"{ROWS} x {PROMPT} prompt", decode(model), None])
    lora = get_peft_model(model, LoraConfig(r=cfg.model.lora_r, lora_alpha=cfg.model.lora_alpha,
                                            target_modules=LORA_TARGETS))
    with torch.no_grad():
        rows.append(["LoRA forward (logits)", f"{ROWS} x {seq}", fastest(lambda: lora(ids), 3),
                     forward_seconds(profile, shape, ROWS, seq, wb)])
        rows.append([f"LoRA decode, {NEW} steps", f"{ROWS} x {PROMPT} prompt", decode(lora), None])

    def step():
        lora(ids).logits.float().log_softmax(-1).mean().backward()

    rows.append(["LoRA forward + backward", f"{ROWS} x {seq}", fastest(step, 2),
                 train_seconds(profile, shape, ROWS, seq, wb, 1, False, True)])
    # mixed lengths, as hh-rlhf's chat prompts give them: the update's micro-batch padded to its longest, or packed
    # end to end (models/prefix.py pack_sequences; what collate does with rl.share_prompt where no prompt repeats)
    prompts = [[1 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate(MIXED_PROMPTS)]
    answers = [[5 + j % 300 for j in range(n)] for n in MIXED_ANSWERS]
    mixed = f"{ROWS} of {min(map(sum, zip(MIXED_PROMPTS, MIXED_ANSWERS)))}-{max(map(sum, zip(MIXED_PROMPTS, MIXED_ANSWERS)))}"
    for packed in (False, True):
        mb = collate(prompts, answers, 0, "cpu", share_prompt=packed)
        tokens = mb.packed.ids.numel() if packed else mb.input_ids.numel()

        def mixed_step(mb=mb):
            lora.zero_grad(set_to_none=True)
            response_logprobs(lora, mb).sum().backward()

        rows.append([f"LoRA forward + backward, {'packed' if packed else 'padded'} ({tokens} positions)", mixed,
                     fastest(mixed_step, 2), None])
    # one worker's mini-batch of 8 in micro-batches of 4, 2 and 1, packed as the update runs them: the runs of
    # smollm2_hh train 22% faster at micro 2 than at micro 4, which the cost model (priced per micro-batch at its
    # longest sequence) puts the other way
    prompts = [[1 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate(MINI_PROMPTS)]
    answers = [[5 + j % 300 for j in range(n)] for n in MINI_ANSWERS]
    lengths = [a + b for a, b in zip(MINI_PROMPTS, MINI_ANSWERS)]
    for micro in (4, 2, 1):
        mbs = [collate(prompts[s: s + micro], answers[s: s + micro], 0, "cpu", share_prompt=True)
               for s in range(0, len(prompts), micro)]

        def mini_step(mbs=mbs):
            lora.zero_grad(set_to_none=True)
            for mb in mbs:
                trim_cpu_heap()  # as learn/update.py before each micro-batch
                response_logprobs(lora, mb).sum().backward()

        rows.append([f"LoRA forward + backward, 8 sequences in micro-batches of {micro}, packed",
                     f"{len(mbs)} x {micro} of {min(lengths)}-{max(lengths)}", fastest(mini_step, 2),
                     sum(train_seconds(profile, shape, micro, max(lengths[s: s + micro]), wb, 1, False, True,
                                       scored=max(MINI_ANSWERS[s: s + micro]))
                         for s in range(0, len(lengths), micro))])
    # one prompt's 8 replies in 2 micro-batches of 4, prefix-shared: in sample order each pads to 128; by length
    # (learn/batches.py by_length_within_prompts) the short four pad to 66
    prompt = [1 + j % 400 for j in range(D1_PROMPT)]
    replies = [[5 + j % 300 for j in range(n)] for n in D1_REPLIES]
    for label, order in (("in sample order", list(range(len(replies)))),
                         ("by length", by_length_within_prompts([list(range(len(replies)))], replies))):
        mbs = [collate([prompt] * 4, [replies[i] for i in order[s: s + 4]], 0, "cpu", share_prompt=True)
               for s in (0, 4)]

        def d1_step(mbs=mbs):
            lora.zero_grad(set_to_none=True)
            for mb in mbs:
                response_logprobs(lora, mb).sum().backward()

        rows.append([f"LoRA forward + backward, 8 replies in micro-batches of 4, {label}",
                     f"{D1_PROMPT} + {min(D1_REPLIES)}-{max(D1_REPLIES)}", fastest(d1_step, 2), None])
    print(f"profile: {profile.name} ({profile.source})")
    print(f"machine: {machine()}; one torch thread\n")
    print(md_table(["call", "shape", "measured s", "cost model s", "measured / model"],
                   [[name, size, f"{got:.2f}", "-" if want is None else f"{want:.2f}",
                     "-" if want is None else f"{got / want:.2f}"] for name, size, got, want in rows]))
    print(f"\n(decode: the planner prices a worker's decode inside its generate stage, with migration and prefill "
          f"calls; `rlfuse plan configs/smollm2_hh.yaml --workers 2` prints it; median of measured / model "
          f"{statistics.median(g / w for _, _, g, w in rows if w):.2f})")


if __name__ == "__main__":
    main()
