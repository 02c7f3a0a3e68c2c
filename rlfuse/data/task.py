"""The embedded default task, built on first use and cached: corpus, byte-level BPE tokenizer and a small GPT-2,
both saved with `save_pretrained` so everything downstream loads them exactly as it would load a hub model."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfuse.data.corpus import generate_corpus
from rlfuse.files import atomic_path

TASK_VERSION = 1
BOS = "<|endoftext|>"  # also EOS, as in GPT-2
PAD = "<pad>"


@dataclass(frozen=True)
class DefaultTask:
    root: Path

    @property
    def corpus_path(self) -> Path:
        return self.root / "corpus.jsonl"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def model_dir(self) -> Path:
        """Randomly initialised GPT-2 with the task's tokenizer saved beside its weights."""
        return self.root / "base_model"

    def reviews(self) -> list[str]:
        with self.corpus_path.open(encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]

    def stats(self) -> dict:
        return json.loads((self.root / "stats.json").read_text())


def cache_root() -> Path:
    return Path(os.environ.get("RLFUSE_CACHE", Path.home() / ".cache" / "rlfuse"))


def build_default_task(num_reviews: int, seed: int, n_layer: int, n_embd: int, n_head: int,
                       max_positions: int = 512, log=print) -> DefaultTask:
    """Return the cached task for these settings, building it first if needed (a few seconds)."""
    key = json.dumps([TASK_VERSION, num_reviews, seed, n_layer, n_embd, n_head, max_positions])
    root = cache_root() / f"default-task-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    task = DefaultTask(root)
    if (root / "stats.json").exists():
        return task
    log(f"[task] building the embedded default task in {root}")
    # a shared cache: a concurrent builder's finished copy wins, ours is dropped
    with atomic_path(root, suffix=f".tmp{os.getpid()}", keep_existing=True) as tmp:
        tmp.mkdir(parents=True)
        reviews = generate_corpus(num_reviews, seed)
        with (tmp / "corpus.jsonl").open("w", encoding="utf-8") as f:
            for r in reviews:
                f.write(json.dumps({"text": r}) + "\n")
        tokenizer = _train_tokenizer(reviews)
        tokenizer.save_pretrained(tmp / "tokenizer")
        _init_model(tokenizer, seed, n_layer, n_embd, n_head, max_positions).save_pretrained(tmp / "base_model")
        tokenizer.save_pretrained(tmp / "base_model")
        lengths = np.array([len(ids) for ids in tokenizer(reviews)["input_ids"]])
        stats = {
            "num_reviews": num_reviews, "vocab_size": len(tokenizer),
            "tokens_p50": float(np.percentile(lengths, 50)), "tokens_p95": float(np.percentile(lengths, 95)),
            "tokens_max": int(lengths.max()), "tokens_mean": float(lengths.mean()),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
    log(f"[task] corpus: {num_reviews} reviews, tokens p50={stats['tokens_p50']:.0f} "
        f"p95={stats['tokens_p95']:.0f} max={stats['tokens_max']}, vocab {stats['vocab_size']}")
    return task


def _train_tokenizer(texts: list[str], vocab_size: int = 1024):
    # tokenizers and transformers: only when the default task is first built (the data layer stays light)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=BOS, pad_token=PAD,
                                   unk_token=None, model_max_length=512)


def _init_model(tokenizer, seed: int, n_layer: int, n_embd: int, n_head: int, max_positions: int):
    # torch and transformers: only when the default task is first built
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=max_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # tiny model, short runs: dropout only slows learning
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)
