"""What a turn costs in a multi-turn rollout: rlfuse's engine keeping each turn's KV cache against prefilling the
whole conversation again every turn, on SmolLM2-135M-Instruct playing the guessing game of
configs/smollm2_guess.yaml (up to 8 turns of up to 6 tokens; the environment answers higher or lower).

    python -m bench.turn_cache            # SFT once (kept in bench/.work/turn_cache), then 2 rounds; writes the page
    python -m bench.turn_cache --smoke    # 2 prompts, 1 round; prints, writes nothing
    python -m bench.turn_cache --model DIR  # another policy folder (an SFT stage's model/) instead

Needs the real model (bash scripts/install.sh smollm2). The policy is the config's SFT stage (20 steps on games
played by halving the range), so that episodes last several turns as they do in RL. Both modes decode the same
episodes on one engine in one process, alternated A B A B after a warm-up: the episodes must be identical (tokens
and messages), and the page gives the rollout's seconds, the tokens prefilled and the turns per episode.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time

from bench.common import ROOT, machine, machine_short, md_table, today, write_headline, write_section

CONFIG = ROOT / "configs" / "smollm2_guess.yaml"
WORK = ROOT / "bench" / ".work" / "turn_cache"
PAGE = "turn_cache"
MODES = {"kept": True, "re-prefilled": False}
"""Mode name -> whether the engine keeps a finished turn's cache (Capabilities.keeps_turn_kv)."""


def sft_policy() -> str:
    """The config's SFT stage run once into bench/.work/turn_cache (kept: later runs reuse it); its model folder."""
    model = WORK / "sft" / "model"
    if not (model / "config.json").exists():
        cmd = [sys.executable, "-m", "rlfuse", "sft", str(CONFIG), f"run.dir={WORK}", "--resume", str(WORK)] \
            if (WORK / "config.yaml").exists() else [sys.executable, "-m", "rlfuse", "sft", str(CONFIG),
                                                      f"run.dir={WORK}"]
        print(f"[bench] SFT: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    return str(model)


def rollouts(folder: str, prompts: int, k: int, rounds: int) -> dict:
    """Each mode's rollouts of the same prompts and seed: seconds, prefilled tokens, decode steps, turns."""
    import torch

    from rlfuse.config import load_config
    from rlfuse.data.chat import end_of_turn_ids, set_chat_template
    from rlfuse.data.guessing import games
    from rlfuse.data.prompts import encode_prompt
    from rlfuse.models.build import frozen, load_policy, with_dtype
    from rlfuse.models.device import native_bf16
    from rlfuse.models.load import load_tokenizer
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.episodes import EpisodeGenerator, Episodes, episode_prompt
    from rlfuse.rollout.state import SamplingParams

    cfg = load_config(str(CONFIG), [])
    tok = load_tokenizer(folder)
    set_chat_template(tok, cfg.data.chat_template)
    model = load_policy(folder)
    dtype = torch.bfloat16 if native_bf16(torch.device("cpu")) else torch.float32  # as a run decodes
    engine = DecodeEngine(with_dtype(frozen(model, "cpu"), dtype), tok.eos_token_id, tokenizer=tok)
    rows = [(r["prompt"], {"target": r["target"]}) for r in games(prompts, 7, cfg.data.max_operand)]
    ids = [encode_prompt(tok, episode_prompt(p, [])) for p, _ in rows]
    params = SamplingParams(cfg.rl.max_new_tokens, cfg.rl.temperature,
                            stop_token_ids=end_of_turn_ids(tok, getattr(model, "generation_config", None)))
    own = engine.capabilities

    def once(keep: bool, n: int = prompts) -> tuple[list, float, object]:
        engine.capabilities = dataclasses.replace(own, keeps_turn_kv=keep)
        gen = EpisodeGenerator(engine, Episodes.from_config(cfg.rl, tok))
        t = time.perf_counter()
        out = sorted(gen.generate(ids[:n], k, params, seed=11, rows=rows[:n]),
                     key=lambda s: (s.prompt_id, s.sample_index))
        return out, time.perf_counter() - t, gen.stats

    once(True, 1), once(False, 1)  # warm-up: thread pools, first-call set-up
    runs = {m: [] for m in MODES}
    episodes = {}
    for r in range(rounds):
        for mode, keep in MODES.items():
            out, seconds, stats = once(keep)
            runs[mode].append({"seconds": seconds, "prefill_tokens": stats.prefill_tokens,
                               "decode_steps": stats.decode_steps,
                               "turns": statistics.mean(s.episode.turns for s in out),
                               "found": statistics.mean(bool(s.episode.reward) for s in out)})
            episodes[mode] = out
            print(f"[bench] round {r + 1} {mode}: {seconds:.1f} s, {stats.prefill_tokens} tokens prefilled",
                  flush=True)
    a, b = episodes["kept"], episodes["re-prefilled"]
    same = [(x, y) for x, y in zip(a, b) if x.token_ids == y.token_ids and x.episode.messages == y.episode.messages]
    gap = max((float((x.logprobs - y.logprobs).abs().max()) for x, y in same), default=float("nan"))
    return {"runs": runs, "same_episodes": len(same), "logprob_gap": gap, "dtype": str(dtype).removeprefix("torch."),
            "episodes": len(a), "sampled": statistics.mean(sum(s.sampled) for s in a), "prompt_tokens": len(ids[0])}


def report(res: dict, prompts: int, k: int, rounds: int) -> str:
    med = lambda mode, key: statistics.median(r[key] for r in res["runs"][mode])
    rows = [[mode, f"{med(mode, 'seconds'):.1f}", round(med(mode, "prefill_tokens")), round(med(mode, "decode_steps")),
             f"{med(mode, 'turns'):.2f}", f"{med(mode, 'found'):.0%}"] for mode in MODES]
    speedup = med("re-prefilled", "seconds") / med("kept", "seconds")
    m = machine()
    return "\n".join([
        f"Command: `python -m bench.turn_cache`. Machine: {m['cpu']}, {m['cores']} cores, {m['gpu'] or 'no GPU'}; "
        f"torch {m['torch']}, transformers {m['transformers']}, {m['torch_threads']} threads.",
        "",
        f"SmolLM2-135M-Instruct after the SFT stage of configs/smollm2_guess.yaml, decoding in {res['dtype']}: "
        f"{prompts} games x k = {k} ({res['episodes']} episodes of up to 8 turns, {res['sampled']:.1f} tokens "
        f"sampled per episode, prompt {res['prompt_tokens']} tokens). Median of {rounds} rollouts per mode, "
        "alternated; \"found\": the share of games that found the number.",
        "",
        md_table(["turn's KV cache", "rollout seconds", "tokens prefilled", "decode steps", "turns per game", "found"],
                 rows),
        "",
        f"Kept: {speedup:.2f}x the re-prefilling rollout's speed, "
        f"{med('re-prefilled', 'prefill_tokens') / med('kept', 'prefill_tokens'):.1f}x fewer tokens prefilled. "
        f"{res['same_episodes']} of {res['episodes']} episodes are the same token for token both ways (largest "
        f"log-prob gap among them {res['logprob_gap']:.2g}); the others part where the rounding of the two caches "
        f"({res['dtype']}: the kept one written by decode steps, the other by one forward) flips a draw, and go on "
        "as equally likely games. In fp32 the tests find the episodes the same.",
    ]), speedup


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.turn_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 2, one round; prints, writes nothing")
    ap.add_argument("--model", help="a policy folder to decode with instead of the config's SFT stage (prints only)")
    a = ap.parse_args()
    from rlfuse.models.gguf import local_model

    try:
        local_model("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - say what is missing, as the other real-model benches do
        sys.exit(f"[bench] needs the real model: bash scripts/install.sh smollm2 ({e})")
    prompts, k, rounds = (2, 2, 1) if a.smoke else (a.prompts, a.k, a.rounds)
    res = rollouts(a.model or sft_policy(), prompts, k, rounds)
    text, speedup = report(res, prompts, k, rounds)
    print(text)
    if a.smoke or a.model:
        return
    write_section("turn_cache", text, PAGE)
    write_headline("turn_cache", f"{speedup:.2f}x faster guessing-game rollout (64 episodes of up to 8 turns) with "
                   "each turn's KV cache kept: only the answers are prefilled", "rlfuse re-prefilling each turn",
                   "python -m bench.turn_cache", machine_short(), today(),
                   what="Multi-turn rollout: a turn's cache kept", page=PAGE)


if __name__ == "__main__":
    main()
