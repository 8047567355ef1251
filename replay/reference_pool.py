"""The reference pool: D_pef samples with per-token pi_0 log-probs, loaded from parquet.

Schema (one row per sample; docs/data_plane.md):
    sample_id     string, unique            required
    prompt_ids    list<int32>               required (list<int64> accepted if the values fit)
    response_ids  list<int32>, >= 1 token   required (idem)
    ref_logprobs  list<float32>, one per response token, finite, <= 0   required (list<float64> accepted)
    reward        float64                   required (any integer or floating type accepted)
    source        string                    optional (default: the file name)

A file that is not parquet, lacks a column, has a column of the wrong type, nulls, or rows whose
lengths or values are wrong fails at load with the file name, the column and the row.

Samples are drawn without replacement in a seeded random order, a new permutation each pass; the
draw position is the pool's whole state, so a snapshot restores the exact sequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dph_async.protocol import ReferenceSample
from dph_async.replay.records import list_array

LOGPROB_TOLERANCE = 1e-3


class ReferencePoolError(ValueError):
    """A reference file is unreadable or does not follow the schema; the message names file and column."""


def _list_column(path: Path, table: pa.Table, name: str, value_kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column, checked and cast to int32 or float32."""
    col = table.column(name).combine_chunks()
    typ = col.type
    inner = typ.value_type if pa.types.is_list(typ) or pa.types.is_large_list(typ) else None
    ok = inner is not None and (
        pa.types.is_integer(inner) if value_kind == "int" else pa.types.is_floating(inner) or pa.types.is_integer(inner)
    )
    if not ok:
        want = "list<int32>" if value_kind == "int" else "list<float32>"
        raise ReferencePoolError(f"{path}: column {name!r} has type {typ}, expected {want}")
    flat = col.flatten()
    if col.null_count or flat.null_count:
        raise ReferencePoolError(f"{path}: column {name!r} has null values")
    target = pa.int32() if value_kind == "int" else pa.float32()
    try:
        values = flat.cast(target)  # a safe cast: fails on overflow instead of wrapping
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ReferencePoolError(f"{path}: column {name!r}: values do not fit {target} ({e})") from None
    offsets = col.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0], values.to_numpy()


def _scalar_column(path: Path, table: pa.Table, name: str, check, want: str) -> pa.Array:
    col = table.column(name).combine_chunks()
    if not check(col.type):
        raise ReferencePoolError(f"{path}: column {name!r} has type {col.type}, expected {want}")
    if col.null_count:
        raise ReferencePoolError(f"{path}: column {name!r} has null values")
    return col


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


class ReferencePool:
    def __init__(self, samples: list[ReferenceSample], seed: int = 0):
        self._samples = samples
        self._index = {s.sample_id: i for i, s in enumerate(samples)}
        self.seed = seed
        self.cursor = 0  # samples drawn so far, over all passes
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._samples)

    @classmethod
    def load(cls, path: str | Path, seed: int = 0, tolerance: float = LOGPROB_TOLERANCE) -> ReferencePool:
        """Load a parquet file, or every *.parquet file of a directory (in name order)."""
        root = Path(path)
        files = sorted(root.glob("*.parquet")) if root.is_dir() else [root]
        if not files or not files[0].exists():
            raise ReferencePoolError(f"{root}: no reference parquet file found")
        samples: list[ReferenceSample] = []
        origin: dict[str, Path] = {}
        for file in files:
            for sample in _load_file(file, tolerance):
                if sample.sample_id in origin:
                    first = origin[sample.sample_id]
                    raise ReferencePoolError(f"{file}: sample_id {sample.sample_id!r} appears twice (also in {first})")
                origin[sample.sample_id] = file
                samples.append(sample)
        return cls(samples, seed)

    def _order(self, position: int) -> int:
        epoch, offset = divmod(position, len(self._samples))
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._samples))
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def draw(self, k: int) -> list[ReferenceSample]:
        """The next k samples of the seeded order (none if the pool is empty)."""
        if not self._samples:
            return []
        drawn = [self._samples[self._order(self.cursor + i)] for i in range(k)]
        self.cursor += k
        return drawn

    def get(self, sample_id: str) -> ReferenceSample | None:
        i = self._index.get(sample_id)
        return None if i is None else self._samples[i]


def _load_file(path: Path, tolerance: float) -> list[ReferenceSample]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ReferencePoolError(f"{path}: not a readable parquet file ({e})") from None
    for name in ("sample_id", "prompt_ids", "response_ids", "ref_logprobs", "reward"):
        if name not in table.column_names:
            raise ReferencePoolError(
                f"{path}: missing column {name!r} (columns present: {', '.join(table.column_names)})"
            )
    ids = _scalar_column(path, table, "sample_id", _is_text, "string").to_pylist()
    rewards = _scalar_column(path, table, "reward", _is_number, "a number").cast(pa.float64()).to_numpy()
    if "source" in table.column_names:
        sources = _scalar_column(path, table, "source", _is_text, "string").to_pylist()
    else:
        sources = [path.stem] * table.num_rows
    p_off, p_val = _list_column(path, table, "prompt_ids", "int")
    r_off, r_val = _list_column(path, table, "response_ids", "int")
    l_off, l_val = _list_column(path, table, "ref_logprobs", "float")
    r_len, l_len = np.diff(r_off), np.diff(l_off)

    def fail(rows: np.ndarray, problem: str) -> None:
        if rows.size:
            row = int(rows[0])
            raise ReferencePoolError(f"{path}: row {row} (sample_id {ids[row]!r}): {problem}")

    fail(np.flatnonzero(np.diff(p_off) == 0), "prompt_ids is empty")  # the learner's forward needs a prompt
    fail(np.flatnonzero(r_len == 0), "response_ids is empty")
    fail(np.flatnonzero(r_len != l_len), "ref_logprobs and response_ids differ in length")
    for name, values, offsets in (("prompt_ids", p_val, p_off), ("response_ids", r_val, r_off)):
        bad = np.flatnonzero(values < 0)
        if bad.size:
            fail(np.searchsorted(offsets, bad[:1], side="right") - 1, f"{name} has a negative token id")
    bad = np.flatnonzero(~(np.isfinite(l_val) & (l_val <= tolerance)))
    if bad.size:
        fail(
            np.searchsorted(l_off, bad[:1], side="right") - 1,
            "ref_logprobs has a value that is not finite or > 0",
        )
    return [
        ReferenceSample(
            ids[i],
            p_val[p_off[i] : p_off[i + 1]],
            r_val[r_off[i] : r_off[i + 1]],
            l_val[l_off[i] : l_off[i + 1]],
            float(rewards[i]),
            sources[i],
        )
        for i in range(table.num_rows)
    ]


def write_reference_parquet(samples: Iterable[ReferenceSample], path: str | Path) -> Path:
    """Write samples in the schema above (what the pre-sampling stage produces)."""
    samples = list(samples)
    table = pa.table(
        {
            "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
            "prompt_ids": list_array([s.prompt_ids for s in samples], np.int32),
            "response_ids": list_array([s.response_ids for s in samples], np.int32),
            "ref_logprobs": list_array([s.ref_logprobs for s in samples], np.float32),
            "reward": pa.array([s.reward for s in samples], pa.float64()),
            "source": pa.array([s.source for s in samples], pa.string()),
        }
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path
