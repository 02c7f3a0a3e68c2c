"""Prefix sharing and token-budget micro-batches (issue 19 items 2 and 3): the same scoring and training work with
rl.share_prompt off and on (and micro-batches by count or by token budget), alternated, on one model and
two workloads, in one process:

  (b) long-tailed: short prompts (8-16 tokens), k = 8, responses long-tailed up to 256 tokens;
  (c) long prompts: hh-rlhf prompts (the conversation up to the last "Assistant:"), k = 8, responses 32-64 tokens.

Model: a randomly initialised GPT-2 of the default task's shape (4 layers, 128 wide), fp32; tokenizer: a byte-level
BPE (16k) trained here on the hh-rlhf conversations, so prompt lengths are about GPT-2's. Per setting it times
(process CPU seconds, median of --reps) the scorer (reference log-probs, critic values, reward) and one training
pass (actor's PPO loss and the critic's value loss, forward and backward, per micro-batch), and counts the prompt
token-forwards sharing saves per pass.

    python -m bench.prefix_sharing [--prompts 8] [--reps 3] [--tokens 3072] [--only b|c]
    python -m bench.prefix_sharing --prompts 4 --tokens 3072     # as measured

Both workloads run (no --only): the table is written to docs/benchmarks/prefix_sharing.md and the (c) figures to
BENCHMARKS.md's row; --no-write prints only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time

import torch

from bench.common import SHARED_DATA, machine_short, md_table, write_headline, write_section

HH = SHARED_DATA / "hh_rlhf_harmless_1800.jsonl.gz"


def hh_prompts_and_tokenizer(n: int, max_prompt: int = 448):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rlfuse.data.sources import split_hh

    rows = [json.loads(line) for line in gzip.open(HH, "rt")]
    texts = [r["chosen"] for r in rows]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16000, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    prompts = [[0] + tok.encode(split_hh(t)[0]).ids[-max_prompt:] for t in texts]
    mean_all = statistics.mean(map(len, prompts))
    return prompts[:n], tok.get_vocab_size(), mean_all


def build(vocab: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlfuse.models.build import disable_dropout
    from rlfuse.models.heads import ValueModel

    torch.manual_seed(seed)
    make = lambda: GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=128, n_layer=4, n_head=4))
    actor, ref = make(), make().eval().requires_grad_(False)
    critic = ValueModel.from_causal_lm(make())
    torch.nn.init.normal_(critic.head.weight, std=0.1)
    for m in (actor, critic):
        disable_dropout(m)
    return actor.train(), ref, critic.train()


def samples_of(prompts, k: int, max_new: int, long_tail: bool, vocab: int):
    from rlfuse.rollout.engine import Sample

    g = torch.Generator().manual_seed(1)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(k):
            n = (min(max_new, max(1, int(torch.distributions.LogNormal(3.5, 1.0).sample().item())))
                 if long_tail else int(torch.randint(max_new // 2, max_new + 1, (1,), generator=g)))
            r = torch.randint(1, vocab, (n,), generator=g).tolist()
            out.append(Sample(p, j, prompt, r, torch.zeros(n), "length"))
    return out


def experience_of(samples):
    from rlfuse.rollout.fusion import Experience

    n, T = len(samples), max(len(s.token_ids) for s in samples)
    mask = torch.zeros(n, T)
    for i, s in enumerate(samples):
        mask[i, : len(s.token_ids)] = 1
    g = torch.Generator().manual_seed(2)
    lp = -3 * torch.rand(n, T, generator=g) * mask
    return Experience([s.prompt_ids for s in samples], [s.token_ids for s in samples], torch.tensor([s.prompt_id for s in samples]),
                      torch.randn(n, generator=g), lp, lp, torch.randn(n, T, generator=g) * mask, mask, ["length"] * n)


def setting(models, samples, share: bool, micro: int, micro_tokens: int | None):
    """-> (run once: (scoring CPU s, training CPU s), prompt token-forwards saved per pass) for one setting."""
    from rlfuse.config import load_config
    from rlfuse.rollout.score import Scorer
    from rlfuse.learn.batches import micro_batches, prompt_tokens_shared
    from rlfuse.learn.losses import micro_policy_loss, micro_value_loss

    actor, ref, critic = models
    exp, n = experience_of(samples), len(samples)
    extra = [f"rl.micro_batch_tokens={micro_tokens}"] if micro_tokens else []
    rl = load_config(None, ["rl.algo=ppo", f"rl.k={n // len({tuple(s.prompt_ids) for s in samples})}",
                            f"rl.share_prompt={str(share).lower()}", f"rl.prompts_per_iter={n // 8}",
                            f"rl.mini_batch_size={n}", f"rl.micro_batch_size={micro}", *extra]).rl
    adv = torch.randn(exp.mask.shape) * exp.mask
    scorer = Scorer(lambda ss: torch.zeros(len(ss)), 0, ref=ref, actor=actor, critic=critic, micro_batch_size=micro,
                    share_prompt=share)
    mini = list(range(n))

    def once() -> tuple[float, float]:
        # process CPU seconds: on a 2-core machine shared with other jobs they vary less than wall seconds
        t = time.process_time()
        scorer.score(samples)
        t_score, t = time.process_time() - t, time.process_time()
        for idx, part in micro_batches(exp, mini, rl.micro_batch_size, 0, 1, rl.micro_batch_tokens, rl.share_prompt):
            loss = micro_policy_loss(actor, exp, idx, adv, rl, 0.1, 0, 1.0)[0] * part["token"]
            loss = loss + micro_value_loss(critic, exp, idx, adv, rl, 0)[0] * part["token"]
            loss.backward()
        t_train = time.process_time() - t
        actor.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        return t_score, t_train

    return once, prompt_tokens_shared(exp, [mini], rl) if share else 0


def time_settings(models, samples, settings, micro: int, reps: int) -> dict:
    """Settings alternated rep by rep after one warm-up run each (the allocator's first use is not counted)."""
    runs = {label: setting(models, samples, share, micro, tokens) for label, share, tokens in settings}
    for once, _ in runs.values():
        once()
    times = {label: [] for label in runs}
    for _ in range(reps):
        for label, (once, _) in runs.items():
            times[label].append(once())
    return {label: {"score_s": statistics.median(t[0] for t in times[label]),
                    "train_s": statistics.median(t[1] for t in times[label]), "saved_per_pass": runs[label][1]}
            for label in runs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_sharing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=0, help="also time rl.micro_batch_tokens=this (0: skip)")
    ap.add_argument("--only", choices=("b", "c"), help="one workload (prints only)")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    hh, vocab, mean_all = hh_prompts_and_tokenizer(args.prompts)
    print(f"hh-rlhf prompts: mean {mean_all:.0f} tokens over all 1800; these {args.prompts}: "
          f"{[len(p) for p in hh]}")
    models = build(vocab)
    g = torch.Generator().manual_seed(3)
    short = [[0] + torch.randint(1, vocab, (int(torch.randint(8, 17, (1,), generator=g)),), generator=g).tolist()
             for _ in range(args.prompts)]
    workloads = {"(b) long-tailed, short prompts, k=8, <=256 new": samples_of(short, 8, 256, True, vocab),
                 "(c) hh-rlhf prompts, k=8, <=64 new": samples_of(hh, 8, 64, False, vocab)}
    settings = [("off", False, None), ("on", True, None)]
    if args.tokens:
        settings += [(f"on, {args.tokens} tokens", True, args.tokens)]
    load0, t0, rows, measured = os.getloadavg(), time.time(), [], {}
    print(f"load: {load0}")
    for name, ss in workloads.items():
        if args.only and not name.startswith(f"({args.only})"):
            continue
        res = measured[name[:3]] = time_settings(models, ss, settings, args.micro, args.reps)
        print(f"\n{name}: {len(ss)} samples, {sum(len(s.prompt_ids) for s in ss)} prompt + "
              f"{sum(len(s.token_ids) for s in ss)} response tokens")
        for i, (label, r) in enumerate(res.items()):
            print(f"  share {label:>18}: scoring {r['score_s']:.2f} CPU s, training pass {r['train_s']:.2f} CPU s, "
                  f"prompt token-forwards saved per pass {r['saved_per_pass']}")
            what = (f"{name} ({len(ss)} samples; prompts of {', '.join(str(len(p)) for p in hh)} tokens)"
                    if name.startswith("(c)") else f"{name} ({len(ss)} samples)")
            setting = f"share {label}".replace(f", {args.tokens} tokens", f", `rl.micro_batch_tokens={args.tokens}`")
            rows.append([what if i == 0 else "", setting, f"{r['score_s']:.2f}", f"{r['train_s']:.2f}",
                         r["saved_per_pass"]])
    load1 = os.getloadavg()
    print(f"load: {load1}")
    if args.only or args.no_write:
        return
    command = " ".join(["python -m bench.prefix_sharing", f"--prompts {args.prompts}",
                        *([f"--reps {args.reps}"] if args.reps != 3 else []),
                        *([f"--micro {args.micro}"] if args.micro != 16 else []),
                        *([f"--tokens {args.tokens}"] if args.tokens else [])])
    loads = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    text = "\n".join([
        f"Machine: {machine_short()}; load average (1, 5, 15 min) {loads(load0)} before, {loads(load1)} after. "
        f"Command: `{command}` (one process, {torch.get_num_threads()} thread(s); a randomly initialised 4-layer "
        f"128-wide GPT-2, fp32; a {vocab}-token byte-level BPE trained on the hh-rlhf conversations, {mean_all:.0f} "
        f"prompt tokens on average over them; {args.prompts} prompts x k = 8; micro-batches of {args.micro} samples"
        + (f" or the update cut by `rl.micro_batch_tokens={args.tokens}`" if args.tokens else "")
        + f"; process CPU seconds, median of {args.reps} after one warm-up run per setting, settings alternated; "
        f"{time.time() - t0:.0f} s).", "",
        md_table(["workload", "setting", "scoring (CPU s)", "training pass (CPU s)",
                  "prompt token-forwards saved per pass"], rows)])
    write_section("prefix_sharing", text, page="prefix_sharing")
    c = measured["(c)"]
    figure = (f"hh-rlhf prompts, k = 8: scoring {c['on']['score_s'] / c['off']['score_s']:.2f}x and a training pass "
              f"{c['on']['train_s'] / c['off']['train_s']:.2f}x the CPU time of sharing off")
    if args.tokens:
        figure += f" ({c[f'on, {args.tokens} tokens']['train_s'] / c['off']['train_s']:.2f}x with the token budget)"
    write_headline("prefix_sharing", figure, "rl.share_prompt=false, the same work", command, machine_short(load0[0]))


if __name__ == "__main__":
    main()
