"""Tiny local models with random weights and a byte-level BPE tokenizer trained on given texts: a 2-layer, 64-wide
GPT-2 or Llama-style model built in a second, no hub. The tests build theirs with these, and so does the TRL
benchmark's long-prompt workload (bench/vs_trl.py (c))."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def tiny_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with the hub GPT-2's one special token and, like it, no pad token (the
    loader falls back to EOS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def make_tiny_model(out_dir: Path, texts: list[str], vocab_size: int = 400, n_positions: int = 256) -> Path:
    """A 2-layer, 64-wide GPT-2 (seed 0) and tiny_tokenizer(texts), saved to out_dir."""
    hf_tok = tiny_tokenizer(texts, vocab_size)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(hf_tok), n_positions=n_positions, n_embd=64, n_layer=2,
                                       n_head=2, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    return out_dir


def make_tiny_llama(out_dir: Path, texts: list[str], vocab_size: int = 400, n_positions: int = 256) -> Path:
    """A 2-layer, 64-wide Llama-style model (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention with 2 KV
    heads for 4 query heads, untied head; seed 0) and tiny_tokenizer(texts), saved to out_dir."""
    hf_tok = tiny_tokenizer(texts, vocab_size)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=n_positions, bos_token_id=0, eos_token_id=0,
                                         tie_word_embeddings=False))
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    return out_dir
