"""Where a decode step's time goes: the lean steps (rlfuse/rollout/kv.py) against transformers' forward, the sampler,
the bare matrix multiplies, and the update's activation function. The per-step numbers in README.md and in the
benchmarks' readings come from here.

    python -m bench.decode_step            # ~1 min on 2 cores; writes docs/benchmarks/decode_step.md and its headline
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import machine, machine_short, md_table, write_headline, write_section


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def models(n_layer: int, n_embd: int, vocab: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rlfuse.models.load import fuse_activations

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=512, n_embd=n_embd, n_layer=n_layer,
                                      n_head=max(1, n_embd // 64)))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=n_embd, intermediate_size=int(n_embd * 8 / 3),
                                         num_hidden_layers=n_layer, num_attention_heads=max(1, n_embd // 64),
                                         num_key_value_heads=max(1, n_embd // 128)))
    return {"GPT-2": fuse_activations(gpt2).eval(), "Llama": llama.eval()}


def decode_ms_per_step(model, rows: int, steps: int, fast: bool, repeats: int) -> float:
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams

    prompts = [[1, 5 + i, 9] for i in range(rows // 4)]
    eng = DecodeEngine(model, eos_token_id=-1, fast_decode=fast)
    seconds = timed(lambda: list(eng.generate(prompts, 4, SamplingParams(steps + 1), seed=0)), repeats)
    return 1000 * seconds / eng.stats.decode_steps


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1023, help="the default task's tokenizer has 1023 tokens")
    ap.add_argument("--rows", type=int, default=16, help="live decode rows (4 prompts x k=4 in bench/vs_trl.py)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from transformers.activations import NewGELUActivation

    from rlfuse.rollout.engine import sample_tokens
    from rlfuse.rollout.streams import stream_keys, stream_uniforms

    t0 = time.time()
    rows = []
    for name, model in models(a.n_layer, a.n_embd, a.vocab).items():
        hf = decode_ms_per_step(model, a.rows, a.steps, False, a.repeats)
        lean = decode_ms_per_step(model, a.rows, a.steps, True, a.repeats)
        rows.append([f"{name} decode step, transformers' forward -> lean step (ms)", hf, lean, hf / lean])

    # the matrix multiplies of one GPT-2 decode step alone: qkv, attention out, MLP in and out per layer, LM head
    E, R = a.n_embd, a.rows
    x_e, x_4e = torch.randn(R, E), torch.randn(R, 4 * E)
    shapes = [(x_e, torch.randn(E, 3 * E)), (x_e, torch.randn(E, E)), (x_e, torch.randn(E, 4 * E)), (x_4e, torch.randn(4 * E, E))]
    head = torch.randn(E, a.vocab)
    bare = sum(timed(lambda x=x, w=w: torch.mm(x, w), 200) for x, w in shapes) * a.n_layer + timed(lambda: x_e @ head, 200)
    rows.append([f"GPT-2 step's {4 * a.n_layer + 1} matrix multiplies alone (ms)", 1000 * bare, "", ""])

    # the sampler: one uniform per row from each sample's own stream (rollout/streams.py), then the inverse CDF
    probs = torch.softmax(torch.randn(R, a.vocab), -1)
    gen = torch.Generator().manual_seed(0)
    keys, drawn = stream_keys(0, torch.arange(R) // 4, torch.arange(R) % 4), torch.full((R,), 17)
    one_generator = timed(lambda: torch.rand(R, generator=gen), 200)
    streams = timed(lambda: stream_uniforms(keys, drawn), 200)
    rows.append(["uniforms for one step: one generator (torch.rand) -> per-sample counter streams (ms)",
                 1000 * one_generator, 1000 * streams, one_generator / streams])
    multinomial = timed(lambda: torch.multinomial(probs, 1, generator=gen), 200)
    inverse_cdf = timed(lambda: sample_tokens(probs, stream_uniforms(keys, drawn)), 200)
    rows.append(["sampling one token per row: torch.multinomial -> streams + inverse CDF (ms)", 1000 * multinomial,
                 1000 * inverse_cdf, multinomial / inverse_cdf])
    lean_gpt2 = rows[0][2]
    rows.append(["sampler (streams + inverse CDF) as a share of the lean GPT-2 step (%)", "",
                 100 * 1000 * inverse_cdf / lean_gpt2, ""])

    # the update's activation: forward + backward over one micro-batch of 4 x 68 tokens at the MLP width
    h = torch.randn(4 * 68, 4 * E, requires_grad=True)
    new_gelu = NewGELUActivation()
    five_ops = timed(lambda: new_gelu(h).sum().backward(), 50)
    fused = timed(lambda: F.gelu(h, approximate="tanh").sum().backward(), 50)
    rows.append(["MLP activation forward + backward, one layer: gelu_new -> fused tanh-GELU (ms)", 1000 * five_ops,
                 1000 * fused, five_ops / fused])

    text = "\n".join([
        f"Machine: {machine()}", "",
        f"Command: `python -m bench.decode_step` ({a.n_layer} layers x {a.n_embd} dims, random weights, vocabulary "
        f"{a.vocab}, {a.rows} live rows, {a.steps} decode steps, median of {a.repeats} runs; fp32).", "",
        md_table(["measurement", "before / alone", "after", "ratio"], rows), "",
        f"Wall time: {time.time() - t0:.0f} s.",
    ])
    print(text)
    if a.no_write:
        return
    # everything here runs on the CPU (bench.decode_graph measures a GPU); on a GPU machine that is its host CPU, whose
    # section and row are kept apart from this VM's
    gpu = "_gpu" if torch.cuda.is_available() else ""
    write_section(f"decode_step{gpu}", text, page="decode_step")
    gpt2, llama, sampler = rows[0], rows[1], rows[4]
    write_headline(f"decode_step{gpu}", f"lean GPT-2 decode step {gpt2[3]:.2f}x transformers' forward ({gpt2[2]:.2f} ms), "
                   f"Llama {llama[3]:.2f}x; sampler {sampler[3]:.2f}x torch.multinomial",
                   "transformers' forward; torch.multinomial", "python -m bench.decode_step",
                   machine_short(os.getloadavg()[0]), page="decode_step",
                   what="Decode step, on the GPU machine's host CPU (not the GPU)" if gpu else None)


if __name__ == "__main__":
    main()
