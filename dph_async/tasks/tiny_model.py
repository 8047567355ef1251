"""A character tokenizer and a tiny Llama-architecture model, built locally from a seed.

Saved with `save_pretrained`, so vLLM, transformers and DeepSpeed load it like any Hugging Face model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dph_async.config import ModelConfig

SPECIAL = ["<pad>", "<s>", "</s>"]


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus pad, BOS and EOS (ids 0, 1, 2)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(dict.fromkeys(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


def build_tiny_llama(cfg: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.tiny_hidden,
        intermediate_size=cfg.tiny_hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=cfg.tiny_heads,
        max_position_embeddings=cfg.max_model_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # A separate LM head: the fused log-prob kernels take it as their weight.
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
