"""A conversational preference data set (TRL's format: message lists in prompt, chosen and rejected) through
`rlfuse run` on a tiny chat model the test builds (ChatML markers as special tokens, the ChatML template): SFT on
the rendered replies, the reward model on rendered pairs, RL on rendered prompts that stop on <|im_end|>."""

import json

import torch

from helpers import _tiny_tokenizer
from rlfuse.cli import main
from rlfuse.data.chat import CHATML

QUESTIONS = ["How do I bake bread?", "What is a good name for a cat?", "How far is the moon?", "Why is the sky blue?"]
GOOD = ["Mix flour, water and yeast, then bake it.", "Whiskers is a good name.", "About 384,000 km away.",
        "Air scatters blue light the most."]
BAD = ["No.", "I will not say.", "Go away.", "Who knows."]
FEW = ["sft.steps=4", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=2", "sft.eval_samples=0",
       "rm.steps=2", "rm.batch_size=4", "rm.micro_batch_size=2", "rm.eval_every=2", "rl.iterations=2",
       "rl.prompts_per_iter=4", "rl.k=2", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.epochs=1",
       "rl.eval_prompts=4", "rl.ckpt_every=2", "rl.max_new_tokens=12", "rollout.micro_batch_size=4",
       "data.max_length=96", "sft.completion_only=true", "run.quiet=true"]


def make_chat_model(folder, texts):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = _tiny_tokenizer(texts, 400)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2, n_head=2,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_conversational_preference_data_runs_sft_rm_rl(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": g}],
             "rejected": [{"role": "assistant", "content": b}]} for q, g, b in zip(QUESTIONS, GOOD, BAD)] * 10
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = make_chat_model(tmp_path / "chat-gpt2", QUESTIONS + GOOD + BAD + ["user assistant"])
    run_dir = tmp_path / "run"
    assert main(["run", f"model.name={model}", "data.kind=jsonl", f"data.path={data}", f"run.dir={run_dir}",
                 *FEW]) == 0
    assert (run_dir / "rl" / "metrics.jsonl").read_text().count("\n") == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "sft" / "model")
    assert tok.chat_template == CHATML  # saved with the SFT model, so RL and later users render the same way
    samples = json.loads((run_dir / "rl" / "samples_after.json").read_text())  # special tokens skipped in these
    assert samples and all(s.startswith("user\n") and "\nassistant\n" in s for s in samples)  # rendered prompts
