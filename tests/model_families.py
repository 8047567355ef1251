"""A user's own model, built here: tiny random Hugging Face models of several families over a
byte-level BPE with a ChatML template, taught the answer formats, and math rows in the verl format.

What each family varies is what a run must get right about it: grouped-query attention (every
family: 2 query heads share 1 key/value head), a tied or separate LM head, q/k/v biases (Qwen2), q/k
norms (Qwen3), a sliding window (Mistral). Head size 32: vLLM's CPU attention has no kernel for less.

The random models are right nowhere, so no reward would vary and no weight would move. A short
supervised warm start (`teach`) makes each answer in the math formats, with a digit drawn from the
answers' range: right about a quarter of the time, varied within a group, wrong often enough that
D_exp is not empty.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from dph_async.tasks.bpe import build_bpe
from dph_async.tasks.dataset import verl_row, write_rows

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BPE_VOCAB = 4096
ANSWERS = range(1, 5)  # every ground truth, and every digit the taught model answers


def chatml_bpe(seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE of BPE_VOCAB tokens learned from random words and math text (so "####" and
    "\\boxed{" are tokens, as in a math model's vocabulary), plus ChatML's two markers; <|im_end|>
    ends a turn (EOS)."""
    rows = math_rows(400, seed, "corpus")
    texts = [f"{r['prompt'][0]['content']} {answer_text(r, d)}" for r in rows for d in ANSWERS]
    tok = build_bpe(seed, BPE_VOCAB, words=50_000, texts=texts)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["####", "\\boxed{"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


@dataclass(frozen=True)
class Family:
    """A tiny config of one architecture: `extra` is what sets this family apart."""

    name: str
    model_type: str
    tied: bool
    extra: dict

    def config(self, vocab: int, max_len: int):
        return AutoConfig.for_model(
            self.model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=max_len,
            tie_word_embeddings=self.tied, bos_token_id=1, pad_token_id=0, **self.extra)


FAMILIES = {f.name: f for f in (
    Family("llama", "llama", tied=False, extra={}),
    Family("qwen2", "qwen2", tied=True, extra={}),
    Family("mistral", "mistral", tied=False, extra={"sliding_window": 4096}),
    Family("qwen3", "qwen3", tied=True, extra={}),
)}


def math_rows(n: int, seed: int, split: str) -> list[dict]:
    """GSM8K-style rows ("#### n" solutions, data_source openai/gsm8k) and boxed-answer rows (MATH's
    "\\boxed{n}", data_source math), alternating."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, answer = rng.randint(1, 3), rng.choice(ANSWERS)
        if i % 2 == 0:
            question = f"Tom has {a} apples and buys some; now he has {answer + a}. How many did he buy?"
            rows.append(verl_row(question, "openai/gsm8k", f"{answer + a} - {a} = {answer}\n#### {answer}", i,
                                 split))
        else:
            question = f"Solve for $x$: $x + {a} = {answer + a}$."
            rows.append(verl_row(question, "math", f"\\boxed{{{answer}}}", i, split))
    return rows


def answer_text(row: dict, digit: int) -> str:
    return f"#### {digit}" if row["data_source"] == "openai/gsm8k" else f"\\boxed{{{digit}}}"


def teach(model, tok: PreTrainedTokenizerFast, rows: list[dict], steps: int, seed: int, end: bool = True) -> None:
    """Supervised steps on (prompt, an answer in the row's format with a random digit): the model learns
    the format, not the arithmetic. `end`: the target closes the turn (else the model rambles on)."""
    from dph_async.tasks.dataset import encode_prompt

    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompts = [encode_prompt(r["prompt"], tok) for r in rows]
    model.train()
    for _ in range(steps):
        seqs, masks = [], []
        for i in rng.sample(range(len(rows)), min(16, len(rows))):
            target = tok.encode(answer_text(rows[i], rng.choice(ANSWERS)), add_special_tokens=False)
            target += [tok.eos_token_id] if end else []
            seqs.append(prompts[i] + target)
            masks.append([0] * len(prompts[i]) + [1] * len(target))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = (F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none") * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


def build_user_model(family: Family, tok: PreTrainedTokenizerFast, rows: list[dict], out: Path, *,
                     max_len: int = 128, teach_steps: int = 40, end: bool = True, seed: int = 0) -> Path:
    """A random model of `family` over `tok`, taught the answer formats on `rows`, saved with the
    tokenizer as a Hugging Face directory."""
    torch.manual_seed(seed)
    config = family.config(len(tok), max_len)
    config.eos_token_id = tok.eos_token_id
    model = AutoModelForCausalLM.from_config(config)
    teach(model, tok, rows, teach_steps, seed, end)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_math_data(root: Path, n_train: int, n_dev: int) -> tuple[Path, Path]:
    return (write_rows(math_rows(n_train, 0, "train"), root / "train.parquet"),
            write_rows(math_rows(n_dev, 1, "dev"), root / "dev.parquet"))
