"""The reference pool: parquet schema checks that name file, column and row; the batch mix ratio."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, ReferenceSample
from dph_async.replay.core import ReplayCore
from dph_async.replay.reference_pool import ReferencePool, ReferencePoolError, write_reference_parquet
from dph_async.tools.bench.transport import synthetic_group


def samples(k: int, prefix: str = "s") -> list[ReferenceSample]:
    rng = np.random.default_rng(0)
    return [
        ReferenceSample(
            f"{prefix}{i}",
            rng.integers(0, 100, 5, dtype=np.int32),
            rng.integers(0, 100, 1 + i % 4, dtype=np.int32),
            -rng.exponential(size=1 + i % 4).astype(np.float32),
            1.0,
            "math",
        )
        for i in range(k)
    ]


def test_round_trip_through_parquet(tmp_path):
    written = samples(10)
    pool = ReferencePool.load(write_reference_parquet(written, tmp_path / "pef.parquet"))
    assert len(pool) == 10
    for s in written:
        got = pool.get(s.sample_id)
        assert got.response_ids.tolist() == s.response_ids.tolist()
        assert got.ref_logprobs.tolist() == s.ref_logprobs.tolist() and got.ref_logprobs.dtype == np.float32
        assert got.prompt_ids.tolist() == s.prompt_ids.tolist() and got.source == "math"


def test_draws_cover_the_pool_before_repeating_and_follow_the_cursor(tmp_path):
    pool = ReferencePool(samples(7), seed=3)
    first = [s.sample_id for s in pool.draw(7)]
    assert sorted(first) == sorted(s.sample_id for s in samples(7))
    later = [s.sample_id for s in pool.draw(5)]
    again = ReferencePool(samples(7), seed=3)
    again.cursor = 7  # a restored cursor continues the same sequence
    assert [s.sample_id for s in again.draw(5)] == later


def test_directory_of_files_and_wider_types_are_accepted(tmp_path):
    write_reference_parquet(samples(3, "a"), tmp_path / "a.parquet")
    table = pa.table(
        {
            "sample_id": ["b0"],
            "prompt_ids": pa.array([[1, 2]], pa.list_(pa.int64())),
            "response_ids": pa.array([[3, 4]], pa.list_(pa.int64())),
            "ref_logprobs": pa.array([[-0.5, -1.0]], pa.list_(pa.float64())),
            "reward": pa.array([1], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "b.parquet")
    pool = ReferencePool.load(tmp_path)
    assert len(pool) == 4 and pool.get("b0").source == "b" and pool.get("b0").response_ids.dtype == np.int32


def _table(**override) -> pa.Table:
    columns = {
        "sample_id": pa.array(["x", "y"]),
        "prompt_ids": pa.array([[1], [2]], pa.list_(pa.int32())),
        "response_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
        "ref_logprobs": pa.array([[-0.1, -0.2], [-0.3]], pa.list_(pa.float32())),
        "reward": pa.array([1.0, 0.0]),
        "source": pa.array(["m", "m"]),
    }
    columns.update(override)
    return pa.table({k: v for k, v in columns.items() if v is not None})


def f32(*rows) -> pa.Array:
    return pa.array(rows, pa.list_(pa.float32()))


def ints(*rows, wide: bool = False) -> pa.Array:
    return pa.array(rows, pa.list_(pa.int64() if wide else pa.int32()))


ROW0, ROW1 = "row 0 (sample_id 'x'): ", "row 1 (sample_id 'y'): "


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"ref_logprobs": None}, "missing column 'ref_logprobs'"),
        (
            {"response_ids": pa.array(["a", "b"])},
            "column 'response_ids' has type string, expected list<int32>",
        ),
        ({"ref_logprobs": f32([-0.1], [-0.3])}, ROW0 + "ref_logprobs and response_ids differ"),
        (
            {"ref_logprobs": f32([-0.1, float("nan")], [-0.3])},
            ROW0 + "ref_logprobs has a value that is not finite",
        ),
        (
            {"ref_logprobs": f32([-0.1, -0.2], [0.5])},
            ROW1 + "ref_logprobs has a value that is not finite or > 0",
        ),
        ({"response_ids": ints([1, 2], [-3])}, ROW1 + "response_ids has a negative token id"),
        (
            {"response_ids": ints([1, 2], [2**40], wide=True)},
            "column 'response_ids': values do not fit int32",
        ),
        (
            {"response_ids": ints([1, 2], []), "ref_logprobs": f32([-0.1, -0.2], [])},
            ROW1 + "response_ids is empty",
        ),
        ({"prompt_ids": ints([5, 6], [])}, ROW1 + "prompt_ids is empty"),
        ({"reward": pa.array(["good", "bad"])}, "column 'reward' has type string, expected a number"),
        ({"sample_id": pa.array(["x", None])}, "column 'sample_id' has null values"),
        ({"sample_id": pa.array(["x", "x"])}, "sample_id 'x' appears twice"),
    ],
)
def test_schema_problems_name_file_column_and_row(tmp_path, override, message):
    path = tmp_path / "pef.parquet"
    pq.write_table(_table(**override), path)
    with pytest.raises(ReferencePoolError) as info:
        ReferencePool.load(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_a_step_of_partial_batches_draws_what_one_batch_would():
    """The learner tops up a step from partial batches when its deadline passes first (an actor still
    starting): 4 + 12 fresh samples must draw the references of 16 at once, or a seeded run would
    depend on the timing (0.125 x 4 rounds up to 1, 0.125 x 12 to 2: 3 instead of 2)."""
    def refs(sizes: list[int]) -> list[str]:
        core = ReplayCore(ReplayConfig(reference_ratio=0.125, wal_dir=None, admission=False), 4,
                          reference=ReferencePool(samples(50)))
        core.ingest([synthetic_group(0, i, n=4, tokens=4) for i in range(8)])
        drawn = []
        for rid, size in enumerate(sizes, 1):
            batch = core.request(BatchRequest(0, size, 0.0, request_id=rid))
            assert len(batch.groups) == size
            drawn.append([r.sample_id for r in batch.reference])
        return drawn

    whole, split = refs([4, 4]), refs([1, 3, 4])
    assert [len(x) for x in whole] == [2, 2] and [len(x) for x in split] == [1, 1, 2]
    assert split[0] + split[1] == whole[0] and split[2] == whole[1]


def test_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "pef.parquet"
    pq.write_table(_table(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReferencePoolError, match=f"{path}: not a readable parquet file"):
        ReferencePool.load(path)
    with pytest.raises(ReferencePoolError, match="no reference parquet file found"):
        ReferencePool.load(tmp_path / "nowhere.parquet")


def test_batches_mix_reference_samples_per_fresh_sample():
    """256 reference samples per 2,048 fresh ones, as in the DPH-RL scripts: 0.125 per sample, rounded."""
    core = ReplayCore(
        ReplayConfig(reference_ratio=256 / 2048, wal_dir=None, admission=False), 4, reference=ReferencePool(samples(50))
    )
    core.ingest([synthetic_group(0, i, n=8, tokens=4) for i in range(12)])
    batch = core.request(BatchRequest(0, 4, 0.0, request_id=1))
    assert batch.num_samples == 32 and len(batch.reference) == 4
    batch = core.request(BatchRequest(0, 3, 0.0, request_id=2))  # 24 samples -> 3
    assert len(batch.reference) == 3
    mix = core.stats().mix
    assert mix.reference_per_fresh_sample == 7 / 56 and mix.last_batch_reference == 3
    retried = core.request(BatchRequest(0, 3, 0.0, request_id=2))
    assert [r.sample_id for r in retried.reference] == [r.sample_id for r in batch.reference]
