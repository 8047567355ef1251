"""Prompt datasets as parquet in the verl / DPH-RL row format, so their files load unchanged.

A row: `prompt` (a list of chat messages {role, content}, or a plain string), `data_source`,
`reward_model` ({"ground_truth": ...}), optional `extra_info` (a struct; `index` names the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from dph_async.errors import UserError
from dph_async.rewards.worker import ScoreRequest

if TYPE_CHECKING:  # only a type here; importing transformers costs seconds
    from transformers import PreTrainedTokenizerBase

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


class DatasetError(UserError):
    """A dataset file is missing, unreadable, or has a wrong column; the message names file and column."""


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: str
    data_source: str
    text: str  # the prompt as the user wrote it (last user message), for verifiers and reports
    prompt_ids: tuple[int, ...]
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)

    def score_request(self, response: str) -> ScoreRequest:
        """What the reward for this prompt needs; verifiers also get the question."""
        return ScoreRequest(self.data_source, response, self.ground_truth, {**self.extra_info, "question": self.text})


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(text: str, data_source: str, ground_truth: Any, index: int, split: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": text}],
        "data_source": data_source,
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"index": index, "split": split},
    }


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in value]
    raise DatasetError(f"{where}: column 'prompt' must be a string or a list of {{role, content}} messages")


def encode_prompt(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of a prompt: the chat template when the tokenizer has one, else BOS + the text."""
    if getattr(tokenizer, "chat_template", None):
        # transformers 5 returns a BatchEncoding (whose list is its keys) unless told otherwise.
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    text = "".join(m["content"] for m in messages)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class Row:
    """One checked row of a prompt dataset, before tokenization."""

    index: int
    messages: list[dict[str, str]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]


def read_rows(path: str | Path, limit: int | None = None) -> list[Row]:
    """Read a verl-format parquet file and check every row; each problem is reported with the file name."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing} (have: {table.column_names}); "
                           "expected the verl row format: prompt, data_source, reward_model.ground_truth")
    rows = []
    for i, row in enumerate(table.slice(0, limit).to_pylist() if limit else table.to_pylist()):
        where = f"{path} row {i}"
        rm = row["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise DatasetError(f"{where}: column 'reward_model' must be a struct with a 'ground_truth' field")
        if not isinstance(row["data_source"], str) or not row["data_source"]:
            raise DatasetError(f"{where}: column 'data_source' must be a non-empty string")
        extra = row.get("extra_info") or {}
        rows.append(Row(i, _messages(row["prompt"], where), row["data_source"], rm["ground_truth"],
                        extra if isinstance(extra, dict) else {"value": extra}))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def load_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int,
                 limit: int | None = None) -> list[PromptRecord]:
    """Read, check and tokenize a verl-format parquet file."""
    records = []
    for row in read_rows(path, limit):
        ids = encode_prompt(row.messages, tokenizer)
        if len(ids) > max_prompt_tokens:
            raise DatasetError(f"{path} row {row.index}: prompt is {len(ids)} tokens, longer than the "
                               f"{max_prompt_tokens} the model's context leaves after sampling.max_tokens (raise "
                               "model.max_model_len or lower sampling.max_tokens)")
        records.append(PromptRecord(
            prompt_id=f"{Path(path).stem}:{row.extra_info.get('index', row.index)}",
            data_source=row.data_source,
            text=row.messages[-1]["content"],
            prompt_ids=tuple(ids),
            ground_truth=row.ground_truth,
            extra_info=row.extra_info,
        ))
    return records
