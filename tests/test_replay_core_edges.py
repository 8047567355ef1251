"""The replay core at its edges (replay/core.py): groups whose completions come from different
versions, a restore at exactly a group's newest version and one before it, a log exactly at its
compaction size and one byte past, a snapshot asked for an older version, and counts that must move
by exactly what happened."""

from __future__ import annotations

import numpy as np

from dph_async.app.bench.transport import synthetic_group
from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest
from replay.core import MiB, ReplayCore
from replay.state import read_state
from replay.wal import WriteAheadLog


def make_core(wal_dir=None, **cfg) -> ReplayCore:
    config = ReplayConfig(**({"max_staleness": 100, "admission": False, "max_version_lead": 100} | cfg))
    wal = WriteAheadLog(wal_dir, segment_bytes=config.wal_segment_mb * 2**20) if wal_dir is not None else None
    return ReplayCore(config, groups_per_batch=4, wal=wal)


def mixed(actor: int, seq: int, versions: list[int]):
    """A group whose completions were generated under different weights: one version per completion."""
    g = synthetic_group(actor, seq, n=len(versions), tokens=3)
    for c, v in zip(g.completions, versions, strict=True):
        c.versions = np.full(3, v, np.int32)
    return g


def held(core: ReplayCore) -> list[tuple[int, int]]:
    return sorted(e.group.group_id for e in core.store)


def test_a_restore_rewinds_every_group_with_a_token_newer_than_the_snapshot_and_keeps_its_pending_batch(tmp_path):
    """Snapshot at version 2: a group whose newest token is of version 2 stays; one with a single
    completion of version 3 among older ones is rewound like a group all of version 3; a group of the
    snapshot's pending batch stays, whatever its versions (the learner has it)."""
    core = make_core(tmp_path / "log")
    core.ingest([mixed(0, 0, [0, 3])])
    core.request(BatchRequest(2, 1, 0.0, request_id=1))  # (0, 0) pending at the snapshot
    core.snapshot(tmp_path / "ckpt")
    core.ingest([mixed(1, 0, [1, 2]), mixed(1, 1, [1, 3]), mixed(1, 2, [3, 3]), mixed(1, 3, [2, 2, 1])])
    detail = core.restore(tmp_path / "ckpt")
    assert detail.endswith("4 accepted after the snapshot re-added, 2 dropped as rewound")
    assert held(core) == [(0, 0), (1, 0), (1, 3)]
    assert core.stats().drops == {"rewound": 2}
    assert [v.status for v in core.ingest([mixed(1, i, [2]) for i in range(4)])] == ["duplicate", "ok", "ok",
                                                                                      "duplicate"]


def test_a_snapshot_is_taken_at_the_newer_of_the_replays_version_and_the_learners(tmp_path):
    core = make_core(tmp_path / "log")
    core.ingest([synthetic_group(0, 0)])
    core.request(BatchRequest(3, 0, 0.0, request_id=1))
    assert core.snapshot(tmp_path / "a.arrow", version=2) == (f"replay snapshot at version 3: 1 groups held, "
                                                               f"written to {tmp_path / 'a.arrow'}")
    assert core.snapshot(tmp_path / "b.arrow", version=4).startswith("replay snapshot at version 4: ")
    assert (read_state(tmp_path / "a.arrow").version, read_state(tmp_path / "b.arrow").version) == (3, 4)
    assert core.version == 4


def test_the_log_is_compacted_one_byte_past_its_size_and_not_at_it(tmp_path):
    probe = make_core(tmp_path / "probe")
    group = synthetic_group(0, 0)
    probe.ingest([group])
    size = probe.wal.bytes_since_base
    at = make_core(tmp_path / "at", wal_compact_mb=size / MiB)
    at.ingest([group])
    assert at.stats().wal.bytes_since_base == size and not list((tmp_path / "at").glob("base-*"))
    past = make_core(tmp_path / "past", wal_compact_mb=(size - 1) / MiB)
    past.ingest([group])
    assert past.stats().wal.bytes_since_base == 0 and [p.name for p in (tmp_path / "past").glob("base-*")] == [
        "base-00000001.arrow"]
