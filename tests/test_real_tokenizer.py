"""A user's model with a real tokenizer: a byte-level BPE of 32k tokens trained here with `tokenizers`,
a chat template, a tiny Llama over that vocabulary saved as a Hugging Face directory, and chat-format
verl prompts as the actors load them. A user's model runs end to end, family by family, in
tests/test_models_e2e.py; the kernels' vocabulary blocks against float64 in tests/test_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dph_async.config import ModelConfig
from dph_async.kernels import default_block_v
from dph_async.tasks.bpe import CHAT_TEMPLATE, build_bpe, corpus
from dph_async.tasks.dataset import load_prompts, verl_row, write_rows
from dph_async.tasks.embedded import make_splits
from dph_async.tasks.tiny_model import build_tiny_llama, save_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def user_case(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("bpe")
    tokenizer = build_bpe(0)
    # Head dimension 32: vLLM's CPU attention has no kernel for 16.
    model = build_tiny_llama(ModelConfig(tiny_hidden=128, tiny_layers=2, tiny_heads=4), len(tokenizer), seed=0)
    model_dir = save_model(model, tokenizer, root / "model")
    splits = make_splits(0, 64, 16)
    data = {name: write_rows([verl_row(p.prompt, p.data_source, p.ground_truth, i, name)
                              for i, p in enumerate(splits[split])], root / f"{name}.parquet")
            for name, split in (("train", "train"), ("dev", "test"))}
    return model_dir, data["train"], data["dev"]


def test_the_tokenizer_is_a_32k_bpe_with_a_chat_template(user_case):
    model_dir, train, _ = user_case
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) >= 32000 and tok.chat_template == CHAT_TEMPLATE
    # Merges learned: a long random word is a few tokens, not one per byte.
    word = corpus(0, 64)[0].split()[0] * 4
    assert len(tok.encode(word, add_special_tokens=False)) < len(word)
    prompts = load_prompts(train, tok, 48)
    user, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert prompts and all(p.prompt_ids[0] == user and p.prompt_ids[-1] == assistant for p in prompts)
    # A micro-batch of 2,048 tokens meets the kernels in several vocabulary blocks.
    assert default_block_v(2048, len(tok)) < len(tok)
