"""Rollout groups as Arrow rows, the one on-disk form of a group (write-ahead log and snapshots).

One row per group; completions are a list of structs, token arrays are Arrow lists, so any Arrow
reader (pyarrow, pandas, DuckDB) can inspect what went into training. Reading back gives numpy
views of the Arrow buffers, not copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from dph_async.protocol import Completion, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult

REWARD_TYPE = pa.struct(
    [
        ("score", pa.float64()),
        ("correct", pa.bool_()),
        ("format_ok", pa.bool_()),
        ("status", pa.string()),
        ("latency_s", pa.float64()),
        ("detail", pa.string()),
    ]
)
COMPLETION_TYPE = pa.struct(
    [
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("reward", REWARD_TYPE),
        ("finish_reason", pa.string()),
        ("policy_weight", pa.float64()),
    ]
)
SAMPLING_TYPE = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int64()),
        ("max_tokens", pa.int64()),
    ]
)
GROUP_FIELDS = [
    pa.field("actor_id", pa.int64()),
    pa.field("seq", pa.int64()),
    pa.field("prompt_id", pa.string()),
    pa.field("data_source", pa.string()),
    pa.field("prompt_ids", pa.list_(pa.int32())),
    pa.field("completions", pa.list_(COMPLETION_TYPE)),
    pa.field("sampling", SAMPLING_TYPE),
    pa.field("created_at", pa.float64()),
    pa.field("finished_at", pa.float64()),
]
GROUP_COLUMNS = [f.name for f in GROUP_FIELDS]
GROUP_SCHEMA = pa.schema(GROUP_FIELDS)


def _offsets(lengths: Sequence[int]) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.array(offsets)


def list_array(arrays: Sequence[np.ndarray], dtype: type[np.generic]) -> pa.ListArray:
    """One Arrow list per numpy array, values concatenated as `dtype`."""
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(_offsets([len(a) for a in arrays]), pa.array(values))


def group_columns(groups: Sequence[RolloutGroup]) -> dict[str, pa.Array]:
    """The GROUP_FIELDS columns for `groups`, in that order."""
    comps = [c for g in groups for c in g.completions]
    rewards = [c.reward for c in comps]
    reward = pa.StructArray.from_arrays(
        [
            pa.array([r.score for r in rewards], pa.float64()),
            pa.array([r.correct for r in rewards], pa.bool_()),
            pa.array([r.format_ok for r in rewards], pa.bool_()),
            pa.array([r.status for r in rewards], pa.string()),
            pa.array([r.latency_s for r in rewards], pa.float64()),
            pa.array([r.detail for r in rewards], pa.string()),
        ],
        fields=list(REWARD_TYPE),
    )
    completion = pa.StructArray.from_arrays(
        [
            list_array([c.token_ids for c in comps], np.int32),
            list_array([c.logprobs for c in comps], np.float32),
            list_array([c.versions for c in comps], np.int32),
            reward,
            pa.array([c.finish_reason for c in comps], pa.string()),
            pa.array([c.policy_weight for c in comps], pa.float64()),
        ],
        fields=list(COMPLETION_TYPE),
    )
    sampling = pa.StructArray.from_arrays(
        [
            pa.array([g.sampling.temperature for g in groups], pa.float64()),
            pa.array([g.sampling.top_p for g in groups], pa.float64()),
            pa.array([g.sampling.top_k for g in groups], pa.int64()),
            pa.array([g.sampling.max_tokens for g in groups], pa.int64()),
        ],
        fields=list(SAMPLING_TYPE),
    )
    return {
        "actor_id": pa.array([g.actor_id for g in groups], pa.int64()),
        "seq": pa.array([g.seq for g in groups], pa.int64()),
        "prompt_id": pa.array([g.prompt_id for g in groups], pa.string()),
        "data_source": pa.array([g.data_source for g in groups], pa.string()),
        "prompt_ids": list_array([g.prompt_ids for g in groups], np.int32),
        "completions": pa.ListArray.from_arrays(_offsets([len(g.completions) for g in groups]), completion),
        "sampling": sampling,
        "created_at": pa.array([g.created_at for g in groups], pa.float64()),
        "finished_at": pa.array([g.finished_at for g in groups], pa.float64()),
    }


def unstorable(group: RolloutGroup) -> str | None:
    """Why `group` cannot be written as a row of GROUP_FIELDS (a value past its column's type), or None."""
    try:
        pa.Table.from_pydict(group_columns([group]), schema=GROUP_SCHEMA)
    except (OverflowError, TypeError, ValueError) as e:  # pyarrow's errors are ValueErrors too
        return f"{type(e).__name__}: {e}"
    return None


def _split(lists: pa.ListArray) -> list[np.ndarray]:
    """A list column as numpy views, one per row."""
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def groups_from(batch: pa.RecordBatch | pa.Table) -> list[RolloutGroup]:
    """The groups in the GROUP_FIELDS columns of `batch` (rows must all be groups)."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else None
        if batch is None:
            return []
    col = {name: batch.column(name) for name in GROUP_COLUMNS}
    comp_lists = col["completions"]
    comp_offsets = comp_lists.offsets.to_numpy()
    comp = comp_lists.values
    comp_fields = dict(zip([f.name for f in COMPLETION_TYPE], comp.flatten(), strict=True))
    token_ids = _split(comp_fields["token_ids"])
    logprobs = _split(comp_fields["logprobs"])
    versions = _split(comp_fields["versions"])
    finish = comp_fields["finish_reason"].to_pylist()
    rewards = [RewardResult(**r) for r in comp_fields["reward"].to_pylist()]
    weights = comp_fields["policy_weight"].to_pylist()
    completions = [
        Completion(token_ids[i], logprobs[i], versions[i], rewards[i], finish[i], weights[i])
        for i in range(len(finish))
    ]
    prompts = _split(col["prompt_ids"])
    samplings = [SamplingInfo(**s) for s in col["sampling"].to_pylist()]
    actor_ids = col["actor_id"].to_pylist()
    seqs = col["seq"].to_pylist()
    prompt_ids = col["prompt_id"].to_pylist()
    sources = col["data_source"].to_pylist()
    created = col["created_at"].to_pylist()
    finished = col["finished_at"].to_pylist()
    return [
        RolloutGroup(
            actor_ids[i],
            seqs[i],
            prompt_ids[i],
            sources[i],
            prompts[i],
            completions[comp_offsets[i] : comp_offsets[i + 1]],
            samplings[i],
            created[i],
            finished[i],
        )
        for i in range(batch.num_rows)
    ]
