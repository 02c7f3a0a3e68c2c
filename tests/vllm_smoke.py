"""vLLM as the rollout engine on the real model, run by tests/integration/test_vllm.py with a Python that has vLLM
(its own process: vLLM binds threads and may spawn). Prints one JSON line of measurements the test asserts on.

    python tests/vllm_smoke.py RUN_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


def gap(model, samples) -> float:
    """Mean |trainer - engine| log-prob per sampled token."""
    from rlfuse.rollout.score import sampler_gap

    return sampler_gap(model, samples)["mismatch/logprob_abs_mean"]


class TwoTurns:
    """Answers the first turn, ends the episode at the second."""

    def reset(self, **row):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        return "Say it again, in other words.", 0.0, self.turn >= 2


def episode_samples(engine, tok, prompts):
    from rlfuse.data.chat import end_of_turn_ids
    from rlfuse.rollout.episodes import EpisodeGenerator, EpisodeLimits, Episodes
    from rlfuse.rollout.state import SamplingParams

    questions = ("What is 12 + 30?", "Name a colour.")
    episodes = Episodes(tok, {}, TwoTurns, EpisodeLimits(max_turns=2, max_tokens=120, turn_tokens=24),
                        rows={tuple(p): ([{"role": "user", "content": q}], {}) for p, q in zip(prompts, questions)})
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=end_of_turn_ids(tok))
    return sorted(EpisodeGenerator(engine, episodes).generate(prompts, 2, params, seed=3),
                  key=lambda s: (s.prompt_id, s.sample_index))


def main(run_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfuse.models.gguf import local_model
    from rlfuse.models.weights import merged_weights
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams
    from rlfuse.rollout.vllm_engine import VllmEngine

    folder = local_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
    prompts = [tok.encode(chat(q)) for q in ("What is 12 + 30?", "Name a colour.")]
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    out = {}
    engine = VllmEngine(folder, tok.eos_token_id, torch.float32, max_rows=256, max_model_len=256, kv_cache_gb=0.5,
                        eager=True)
    key = lambda s: (s.prompt_id, s.sample_index)
    first = sorted(engine.generate(prompts, 4, params, seed=3), key=key)
    again = sorted(engine.generate(prompts, 4, params, seed=3), key=key)
    other = sorted(engine.generate(prompts, 4, params, seed=4), key=key)
    out["keys"] = [list(key(s)) for s in first]
    out["same_seed_same_samples"] = [a.token_ids for a in first] == [b.token_ids for b in again]
    out["other_seed_differs"] = [a.token_ids for a in first] != [b.token_ids for b in other]
    out["logprobs_per_token"] = all(len(s.logprobs) == len(s.token_ids) and bool(torch.isfinite(s.logprobs).all())
                                    for s in first)
    out["finish_reasons"] = sorted({s.finish_reason for s in first})
    # more prompt tokens than one step prefills: vLLM would prefill some in chunks, which on a CPU breaks its seeded
    # sampling (VllmEngine turns chunked prefill off there)
    out["many_rows"] = len(list(engine.generate(prompts * 32, 4, SamplingParams(max_new_tokens=4), seed=5)))
    own = DecodeEngine(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tok.eos_token_id)
    own_samples = sorted(own.generate(prompts, 4, params, seed=3), key=key)
    out["same_prompts_and_counts_as_own"] = ([(key(s), s.prompt_ids) for s in own_samples] ==
                                             [(key(s), s.prompt_ids) for s in first])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out["gap_base"] = gap(model, first)
    # a 2-turn episode on each engine: the environment answers the first turn, the second ends it
    for name, eng in (("vllm", engine), ("rlfuse", own)):
        episodes = episode_samples(eng, tok, prompts)
        out[f"episode_{name}"] = {
            "turns": [s.episode.turns for s in episodes],
            "roles": [[m["role"] for m in s.episode.messages] for s in episodes],
            "masked": [s.sampled.count(False) for s in episodes],
            "gap": gap(model, episodes)}
    # a LoRA actor whose adapters moved: its merged weights synced into vLLM make vLLM sample the actor
    torch.manual_seed(0)
    actor = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    actor.eval()
    synced_bytes = engine.load_weights(merged_weights(actor, deferred=True))
    after = sorted(engine.generate(prompts, 4, params, seed=3), key=key)
    out["sync_bytes"] = synced_bytes
    out["samples_changed_after_sync"] = [a.token_ids for a in first] != [b.token_ids for b in after]
    out["gap_after_sync_actor"] = gap(actor, after)
    out["gap_after_sync_base"] = gap(model, after)
    # one RL iteration through the CLI, the report included
    cmd = [sys.executable, "-m", "rlfuse", "rl", "configs/smollm2_math.yaml", f"rl.sft_path={folder}",
           f"run.dir={run_dir}", "rl.iterations=1", "rl.eval_prompts=8", "rl.prompts_per_iter=4", "rl.k=4",
           "rl.mini_batch_size=16", "rl.micro_batch_size=16", "rollout.engine=vllm", "rollout.vllm_kv_cache_gb=0.25"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    out["rl_rc"] = run.returncode
    out["rl_tail"] = (run.stdout + run.stderr)[-1500:]
    out["rl_said_engine"] = "[rl] generating with vllm" in run.stdout + run.stderr
    metrics = run_dir / "rl" / "metrics.jsonl"
    out["rl_metrics"] = json.loads(metrics.read_text().splitlines()[0]) if metrics.exists() else {}
    out["report"] = (run_dir / "report.html").exists()
    # the same on a generation worker of its own (placement.strategy=separated): the weights come in buckets
    ray_dir = run_dir.parent / (run_dir.name + "_separated")
    cmd = [c if not c.startswith("run.dir=") else f"run.dir={ray_dir}" for c in cmd]
    cmd += ["placement.strategy=separated", "placement.workers=2"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    out["separated_rc"], out["separated_tail"] = run.returncode, (run.stdout + run.stderr)[-1500:]
    metrics = ray_dir / "rl" / "metrics.jsonl"
    out["separated_metrics"] = json.loads(metrics.read_text().splitlines()[0]) if metrics.exists() else {}
    print("VLLM_SMOKE " + json.dumps(out))


if __name__ == "__main__":  # vLLM may start processes of its own: nothing runs on import
    main(Path(sys.argv[1]))
