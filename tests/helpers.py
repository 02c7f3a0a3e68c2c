"""Tiny local models the tests build themselves (no hub): a byte-level BPE tokenizer and a 2-layer, 64-dim GPT-2."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
IMDB_CSV = SHARED_DATA / "imdb_reviews_2000.csv"
HH_JSONL = SHARED_DATA / "hh_rlhf_harmless_1800.jsonl.gz"


def make_tiny_model(out_dir: Path, texts: list[str], vocab_size: int = 400, n_positions: int = 256) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    # like the hub's GPT-2: no pad token (the loader falls back to EOS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(hf_tok), n_positions=n_positions, n_embd=64, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    return out_dir
