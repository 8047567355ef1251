"""Durability: the write-ahead log survives a crash (torn tail included); snapshots restore losslessly."""

from __future__ import annotations

import dataclasses
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from dph_async.app.bench.transport import synthetic_group
from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, encode
from replay.core import ReplayCore
from replay.state import ReplayStateError, read_state
from replay.wal import WalFormatError, WriteAheadLog


def make_core(wal_dir, **cfg) -> ReplayCore:
    """A core on `wal_dir`; dropping it without closing is what a killed process leaves behind."""
    config = ReplayConfig(**({"max_staleness": 100, "admission": False, "max_version_lead": 100} | cfg))
    return ReplayCore(
        config, groups_per_batch=4, wal=WriteAheadLog(wal_dir, segment_bytes=config.wal_segment_mb * 2**20)
    )


def ids(batch) -> list[tuple[int, int]]:
    return [g.group_id for g in batch.groups]


def test_acknowledged_groups_survive_a_crash(tmp_path):
    core = make_core(tmp_path)
    sent = [synthetic_group(0, i, n=3, tokens=10) for i in range(10)]
    assert all(v.status == "ok" for v in core.ingest(sent))
    recovered = make_core(tmp_path)
    assert recovered.recovered == 1 and len(recovered.store) == 10
    got = recovered.store.get((0, 4)).group
    assert got.completions[2].logprobs.tolist() == sent[4].completions[2].logprobs.tolist()
    assert [v.status for v in recovered.ingest(sent[:2])] == ["duplicate", "duplicate"]


def _segment(core: ReplayCore):
    return core.wal.dir / f"seg-{core.wal.segment:08d}.wal"


@pytest.mark.parametrize("cut", [100, 4])  # inside the payload; inside the record's length/checksum header
def test_a_torn_final_record_is_cut_off_and_the_rest_kept(tmp_path, cut):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, i) for i in range(3)])
    first_end = _segment(core).stat().st_size
    core.ingest([synthetic_group(0, i) for i in range(3, 6)])
    segment = _segment(core)
    keep = first_end + cut if cut < 12 else segment.stat().st_size - cut
    segment.write_bytes(segment.read_bytes()[:keep])  # the process died inside the second write
    recovered = make_core(tmp_path)
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2]  # the torn write was never acked
    assert recovered.stats().wal.damaged_records == 1
    assert recovered.stats().wal.truncated_bytes == keep - first_end
    again = make_core(tmp_path)
    assert again.stats().wal.damaged_records == 0 and len(again.store) == 3


def test_a_flipped_byte_fails_the_checksum_and_nothing_after_it_is_read(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, i) for i in range(3)])
    first_end = _segment(core).stat().st_size
    core.ingest([synthetic_group(0, i) for i in range(3, 6)])
    second_end = _segment(core).stat().st_size
    core.ingest([synthetic_group(0, i) for i in range(6, 9)])
    segment = _segment(core)
    data = bytearray(segment.read_bytes())
    at = (first_end + second_end) // 2  # a byte in the second record's payload (a logprob, an id...)
    data[at] ^= 0x40
    segment.write_bytes(bytes(data))
    recovered = make_core(tmp_path)
    # Records after a damaged one are dropped too: the log is a sequence, never read past a hole.
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2]
    assert recovered.stats().wal.damaged_records == 1
    assert recovered.stats().wal.truncated_bytes == len(data) - first_end
    again = make_core(tmp_path)  # the damage was cut off (and recovery wrote a base): never read again
    assert again.stats().wal.damaged_records == 0 and len(again.store) == 3


def test_a_log_without_checksums_or_magic_is_named_not_truncated(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    segment = _segment(core)
    data = segment.read_bytes()
    segment.write_bytes(b"XXXXXXXX" + data[8:])
    with pytest.raises(WalFormatError, match=r"seg-\d{8}\.wal: not a write-ahead log segment"):
        make_core(tmp_path)
    assert segment.read_bytes()[8:] == data[8:]  # left as it was for whoever looks at it
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "seg-00000000.arrow").write_bytes(b"")
    with pytest.raises(WalFormatError, match="an older build"):
        WriteAheadLog(tmp_path / "old")


def test_a_lost_batch_reply_is_served_again_after_a_crash(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, i) for i in range(8)])
    first = core.request(BatchRequest(0, 4, 0.0, request_id=11))
    recovered = make_core(tmp_path)
    again = recovered.request(BatchRequest(0, 4, 0.0, request_id=11))  # the learner never got it
    assert ids(again) == ids(first)
    after = recovered.request(BatchRequest(1, 8, 0.0, request_id=12))  # confirms batch 11
    assert ids(after) == [(0, i) for i in range(4, 8)]
    assert recovered.stats().served.used_up == 4


def test_restore_forgets_later_batches_and_keeps_later_groups(tmp_path):
    core = make_core(tmp_path, max_staleness=5)
    core.ingest([synthetic_group(0, i, version=0) for i in range(6)])
    core.request(BatchRequest(0, 4, 0.0, request_id=1))
    core.snapshot(tmp_path / "ckpt")
    core.ingest([synthetic_group(1, 0, version=0), synthetic_group(1, 1, version=1)])
    core.request(BatchRequest(1, 4, 0.0, request_id=2))  # the learner trains on this, then crashes
    core.request(BatchRequest(2, 4, 0.0, request_id=3))
    detail = core.restore(tmp_path / "ckpt")
    assert "2 accepted after the snapshot re-added, 1 dropped as rewound" in detail
    assert core.version == 0 and core.pending.request_id == 1
    batch = core.request(BatchRequest(1, 10, 0.0, request_id=4))
    assert sorted(ids(batch)) == [(0, 4), (0, 5), (1, 0)]  # served again; (1, 1) came from version 1
    assert core.stats().drops == {"rewound": 1}
    # A rewound group's position is open again: a resuming actor regenerates it with restored weights.
    assert [v.status for v in core.ingest([synthetic_group(1, 1)])] == ["ok"]
    assert [v.status for v in core.ingest([synthetic_group(1, 0)])] == ["duplicate"]
    # The log now starts from the restored state: a crash here recovers it, not the old timeline.
    recovered = make_core(tmp_path, max_staleness=5)
    assert recovered.pending.request_id == 4 and sorted(recovered.pending.group_ids) == sorted(ids(batch))


def test_restore_of_a_snapshot_from_another_log(tmp_path):
    core = make_core(tmp_path / "a")
    core.ingest([synthetic_group(0, 0)])
    core.snapshot(tmp_path / "ckpt")
    other = make_core(tmp_path / "b")
    assert "another log" in other.restore(tmp_path / "ckpt") and len(other.store) == 1


def test_compaction_bounds_the_log_and_recovery_still_agrees(tmp_path):
    core = make_core(tmp_path, wal_compact_mb=0.05, wal_segment_mb=0.02)
    for i in range(0, 200, 10):
        core.ingest([synthetic_group(0, s, n=2, tokens=50) for s in range(i, i + 10)])
        core.request(BatchRequest(i // 10, 8, 0.0, request_id=i + 1))
    segments = sorted(p.name for p in tmp_path.glob("seg-*.wal"))
    bases = sorted(p.name for p in tmp_path.glob("base-*.arrow"))
    assert len(bases) == 1 and segments[0][4:12] >= bases[0][5:13]  # older segments are gone
    recovered = make_core(tmp_path)
    assert sorted(e.group.group_id for e in recovered.store) == sorted(e.group.group_id for e in core.store)
    assert recovered.pending.group_ids == core.pending.group_ids
    assert recovered.stats().accepted == 200 and recovered.stats().served == core.stats().served


def test_snapshot_keeps_the_segments_its_restore_needs(tmp_path):
    core = make_core(tmp_path, wal_compact_mb=0.05, wal_segment_mb=0.02)
    core.ingest([synthetic_group(0, 0)])
    core.snapshot(tmp_path / "ckpt")
    for i in range(1, 60, 10):
        core.ingest([synthetic_group(0, s, n=2, tokens=50) for s in range(i, i + 10)])
    assert "61 groups held" in core.restore(tmp_path / "ckpt").replace("replay restored to version 0: ", "")


def test_state_files_are_checked(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "replay_state.arrow").write_bytes(b"not arrow")
    with pytest.raises(ReplayStateError, match=r"replay_state\.arrow: not a readable replay state file"):
        read_state(tmp_path / "bad")
    with pytest.raises(ReplayStateError, match="nowhere"):
        read_state(tmp_path / "nowhere")


def test_snapshot_round_trips_every_field(tmp_path):
    core = make_core(tmp_path, max_reuse=2)
    core.ingest([synthetic_group(2, i, n=2, tokens=3, version=1) for i in range(5)])
    core.request(BatchRequest(1, 2, 0.0, request_id=5))
    core.request(BatchRequest(2, 2, 0.0, request_id=6))
    core.snapshot(tmp_path / "s.arrow")
    state = read_state(tmp_path / "s.arrow")
    assert state.version == 2 and state.pending.request_id == 6 and sorted(state.served) == [0, 0, 0, 1, 1]
    assert state.accepted == {"2": [5, []]} and state.counters["accepted"] == 5
    assert np.array_equal(
        state.groups[0].prompt_ids, core.store.get(state.groups[0].group_id).group.prompt_ids
    )


def _wire(group) -> list[bytes]:
    """Every field of a group, as the wire protocol writes it: equal lists, equal groups."""
    return [bytes(f) for f in encode(group)]


def test_logged_groups_come_back_field_for_field(tmp_path):
    rng = np.random.default_rng()
    sent = [synthetic_group(int(rng.integers(0, 9)), i, n=int(rng.integers(1, 9)), tokens=int(rng.integers(1, 40)),
                            version=int(rng.integers(0, 5)), rng=rng) for i in range(12)]
    c = sent[3].completions[0]
    c.reward = dataclasses.replace(c.reward, detail="ünïcode détail", status="timeout", latency_s=0.5)
    sent[5].completions[-1].policy_weight = 0.25
    core = make_core(tmp_path)
    core.ingest(sent[:1])  # records of one group and of many
    core.ingest(sent[1:])
    recovered = make_core(tmp_path)
    assert [_wire(recovered.store.get(g.group_id).group) for g in sent] == [_wire(g) for g in sent]


def test_a_log_of_the_previous_build_still_recovers(tmp_path):
    # tests/data/wal-v1: written by the previous build (Arrow ingest rows, b"DPHWAL01"): groups (0, 0)
    # to (0, 3), batch 7 served with (0, 0) and (0, 1), then (0, 4) and (0, 5).
    shutil.copytree(Path(__file__).parent / "data" / "wal-v1", tmp_path / "wal")
    core = make_core(tmp_path / "wal")
    made = {i: synthetic_group(0, i, n=2, tokens=3, prompt_tokens=4) for i in range(6)}
    assert sorted(e.group.seq for e in core.store) == [0, 1, 2, 3, 4, 5]
    assert all(_wire(e.group) == _wire(made[e.group.seq]) for e in core.store)
    assert core.pending.request_id == 7 and ids(core.request(BatchRequest(0, 2, 0.0, request_id=7))) == [(0, 0), (0, 1)]
    core.ingest([synthetic_group(0, 6)])  # appended in this build's format, after the old segment
    again = make_core(tmp_path / "wal")
    assert sorted(e.group.seq for e in again.store) == [0, 1, 2, 3, 4, 5, 6]


def test_a_checksummed_record_this_build_cannot_read_is_named_not_truncated(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    segment = _segment(core)
    # an unknown kind; none at all; groups announced but absent; a serve record that is not Arrow
    for payload in (b"X" + b"\0" * 8, b"", b"G" + b"\xff" * 7, b"S" + b"\0" * 16):
        data = segment.read_bytes() + struct.pack("<QI", len(payload), zlib.crc32(payload)) + payload
        segment.write_bytes(data)
        with pytest.raises(WalFormatError, match=r"seg-\d{8}\.wal: the record at byte \d+ is not one this build"):
            make_core(tmp_path)
        assert segment.read_bytes() == data
        segment.write_bytes(data[: -len(payload) - 12])
