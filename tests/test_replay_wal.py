"""Durability: the write-ahead log survives a crash (torn tail included); snapshots restore losslessly."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dph_async.cli.commands.status import row
from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, encode
from dph_async.replay.core import ReplayCore
from dph_async.replay.state import ReplayStateError, read_state
from dph_async.replay.wal import HEADER_BYTES, WalFormatError, WriteAheadLog, record_header
from dph_async.runtime.endpoints import Endpoint, Reading
from dph_async.tools.bench.transport import synthetic_group


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
    acked = (tmp_path / "wal.ack").read_bytes()
    core.ingest([synthetic_group(0, i) for i in range(3, 6)])
    segment = _segment(core)
    keep = first_end + cut if cut < 12 else segment.stat().st_size - cut
    segment.write_bytes(segment.read_bytes()[:keep])  # the process died inside the second write,
    (tmp_path / "wal.ack").write_bytes(acked)  # so before it was acknowledged
    recovered = make_core(tmp_path)
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2]  # the torn write was never acked
    assert recovered.stats().wal.damaged_records == 1
    assert recovered.stats().wal.truncated_bytes == keep - first_end
    again = make_core(tmp_path)
    assert again.stats().wal.damaged_records == 0 and len(again.store) == 3


def _three_records(tmp_path) -> tuple[ReplayCore, list, list[int]]:
    """A log of three ingest records of three groups each: the core, the groups, and where each record
    starts and the segment ends."""
    core = make_core(tmp_path)
    sent = [synthetic_group(0, i) for i in range(9)]
    bounds = [_segment(core).stat().st_size]
    for i in range(0, 9, 3):
        core.ingest(sent[i : i + 3])
        bounds.append(_segment(core).stat().st_size)
    return core, sent, bounds


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


# Where in the middle record the byte flips: its sync, its length, its payload's checksum, its header's
# checksum, its kind byte, the middle of its payload.
OFFSET_CLASSES = {"sync": 1, "length": 6, "payload crc": 13, "header crc": 17, "kind": 20, "payload": None}


@pytest.mark.parametrize("where", OFFSET_CLASSES)
def test_a_damaged_record_mid_segment_is_skipped_reported_and_its_positions_reopened(tmp_path, caplog, where):
    core, sent, (_, first_end, second_end, _) = _three_records(tmp_path)
    segment = _segment(core)
    relative = OFFSET_CLASSES[where]
    _flip(segment, first_end + relative if relative is not None else (first_end + second_end) // 2)
    with caplog.at_level("ERROR", logger="dph_async.replay.wal"):
        recovered = make_core(tmp_path)
    # Only the damaged record is lost; the records after it are read (they were acknowledged too).
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2, 6, 7, 8]
    assert all(_wire(e.group) == _wire(sent[e.group.seq]) for e in recovered.store)
    wal = recovered.stats().wal
    assert wal.damaged_records == 1 and wal.skipped_bytes == second_end - first_end and wal.truncated_bytes == 0
    [error] = caplog.messages
    assert f"{segment}: bytes {first_end}-{second_end - 1}" in error and "generate them again" in error
    # The lost positions are open again: a resuming actor generates them, and only them, again.
    resume = recovered.resume(0)
    assert (resume.watermark, resume.accepted_above) == (3, [6, 7, 8])
    assert [v.status for v in recovered.ingest([sent[3], sent[6]])] == ["ok", "duplicate"]
    again = make_core(tmp_path)  # recovery wrote a base: the damage is not read again
    assert again.stats().wal.damaged_records == 0
    assert sorted(e.group.seq for e in again.store) == [0, 1, 2, 3, 6, 7, 8]


def test_a_restore_over_a_damaged_record_reopens_its_positions(tmp_path):
    """A learner resuming from a snapshot: the groups accepted after it come back from the log, but for
    those of a damaged record, whose positions stay open for their actors."""
    core = make_core(tmp_path)
    sent = [synthetic_group(0, i) for i in range(9)]
    core.ingest(sent[:3])
    core.snapshot(tmp_path / "ckpt")
    bounds = [_segment(core).stat().st_size]
    for i in (3, 6):
        core.ingest(sent[i : i + 3])
        bounds.append(_segment(core).stat().st_size)
    _flip(_segment(core), (bounds[0] + bounds[1]) // 2)  # the record of (0, 3) to (0, 5)
    recovered = make_core(tmp_path)
    assert "3 accepted after the snapshot re-added" in recovered.restore(tmp_path / "ckpt")
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2, 6, 7, 8]
    resume = recovered.resume(0)
    assert (resume.watermark, resume.accepted_above) == (3, [6, 7, 8])


def test_status_flags_a_damaged_log(tmp_path):
    core, _, (_, first_end, second_end, _) = _three_records(tmp_path)
    _flip(_segment(core), (first_end + second_end) // 2)
    recovered = make_core(tmp_path)
    samples = {("dph_replay_wal_damaged_records_total", ()): float(recovered.stats().wal.damaged_records)}
    reading = Reading(Endpoint("replay", "http://x", 1, ""), {"status": "ok", "pid": 1}, samples)
    assert "[red]log damaged: 1 records lost at recovery" in row(reading)[-1]


def test_damage_in_the_last_acknowledged_record_is_skipped_never_cut_off(tmp_path, caplog):
    core, _, (*_, second_end, third_end) = _three_records(tmp_path)
    segment = _segment(core)
    _flip(segment, (second_end + third_end) // 2)  # the last record: nothing sound after it, yet acknowledged
    with caplog.at_level("ERROR", logger="dph_async.replay.wal"):
        recovered = make_core(tmp_path)
    assert sorted(e.group.seq for e in recovered.store) == [0, 1, 2, 3, 4, 5]
    wal = recovered.stats().wal
    assert (wal.damaged_records, wal.skipped_bytes, wal.truncated_bytes) == (1, third_end - second_end, 0)
    assert f"{segment}: bytes {second_end}-{third_end - 1}" in caplog.messages[0]
    assert recovered.resume(0).watermark == 6


def test_no_byte_flip_in_a_segment_changes_what_recovery_reads(memory_path):
    """Every header byte of every record, the kind bytes and every 16th payload byte, flipped one at a
    time in a log of ingest and serve records: each is refused naming the file and byte, or recovered with
    the loss counted, the groups read back field for field and the lost ones open for their actors again."""
    core = make_core(memory_path / "log")
    sent = [synthetic_group(0, i, n=2, tokens=4, prompt_tokens=4) for i in range(6)]
    starts = [_segment(core).stat().st_size]
    core.ingest(sent[:2])
    starts.append(_segment(core).stat().st_size)
    core.request(BatchRequest(0, 2, 0.0, request_id=7))
    starts.append(_segment(core).stat().st_size)
    core.ingest(sent[2:4])
    starts.append(_segment(core).stat().st_size)
    core.ingest(sent[4:])
    original = _segment(core).read_bytes()
    index = (memory_path / "log" / "wal.json").read_bytes()
    ack = (memory_path / "log" / "wal.ack").read_bytes()
    offsets = sorted({*range(8), *(s + i for s in starts for i in range(HEADER_BYTES + 1)),
                      *range(starts[0], len(original), 16)})
    for at in offsets:
        where = memory_path / f"flip-{at}"
        where.mkdir()
        (where / "wal.json").write_bytes(index)
        (where / "wal.ack").write_bytes(ack)
        data = bytearray(original)
        data[at] ^= 0x01
        (where / "seg-00000000.wal").write_bytes(bytes(data))
        try:
            recovered = make_core(where)
        except WalFormatError as e:
            assert at < 8 and "seg-00000000.wal: bytes 0-7 hold" in str(e), (at, str(e))
            continue
        assert recovered.stats().wal.damaged_records == 1, at
        for g in sent:
            entry = recovered.store.get(g.group_id)
            if entry is None:  # lost: open for its actor again
                assert g.group_id not in recovered.accepted, at
            else:
                assert _wire(entry.group) == _wire(g), at
        shutil.rmtree(where)


def test_no_byte_flip_in_a_state_file_is_read_as_data(tmp_path):
    """Before the checksums, 8 of 19 flipped bytes of a base changed its data unnoticed (a token id 52211
    read back as -16,725,005)."""
    core = make_core(tmp_path / "log")
    core.ingest([synthetic_group(0, i, n=2, tokens=4, prompt_tokens=4) for i in range(3)])
    core.request(BatchRequest(0, 2, 0.0, request_id=7))
    path = tmp_path / "s.arrow"
    core.snapshot(path)
    original = path.read_bytes()
    assert read_state(path).pending.request_id == 7
    for at in range(len(original)):
        data = bytearray(original)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(ReplayStateError, match=re.escape(str(path)) + r": damaged.* byte") as info:
            read_state(path)
        if "fail their checksum" in str(info.value):  # a data block: named by its bytes
            first, last = map(int, re.search(r"bytes (\d+)-(\d+)", str(info.value)).groups())
            assert first <= at <= last


def test_no_byte_flip_in_the_manifest_is_read_as_data(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    core.snapshot(tmp_path / "s.arrow")  # keep_from set, a segment sealed, a base: every field holds a value
    index = tmp_path / "wal.json"
    original = index.read_bytes()
    for at in range(len(original)):
        data = bytearray(original)
        data[at] ^= 0x01
        index.write_bytes(bytes(data))
        with pytest.raises(WalFormatError, match=re.escape(str(index)) + ": damaged write-ahead log manifest"):
            WriteAheadLog(tmp_path)
    index.write_bytes(original.replace(b'"wal_id":"', b'"wal_id":"\xc4'))  # not UTF-8 (found by fuzzing)
    # msgspec's words for it vary by release ("'utf-8' codec can't decode", "Invalid UTF-8 encoded string").
    with pytest.raises(WalFormatError, match=r"wal\.json: damaged write-ahead log manifest \((?i:.*utf-8)"):
        WriteAheadLog(tmp_path)
    index.write_bytes(b'{"format": 4, "keep_from": x}')
    with pytest.raises(WalFormatError, match=r"wal\.json: damaged write-ahead log manifest \(.*byte 27"):
        WriteAheadLog(tmp_path)


def test_a_log_without_checksums_or_magic_is_named_not_truncated(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    segment = _segment(core)
    data = segment.read_bytes()
    segment.write_bytes(b"XXXXXXXX" + data[8:])
    with pytest.raises(WalFormatError, match=r"seg-\d{8}\.wal: bytes 0-7 hold b'XXXXXXXX', not b'DPHWAL04'"):
        make_core(tmp_path)
    assert segment.read_bytes()[8:] == data[8:]  # left as it was for whoever looks at it
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "seg-00000000.arrow").write_bytes(b"")
    with pytest.raises(WalFormatError, match=r"wal\.json: missing, yet the directory holds log files"):
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


@pytest.mark.parametrize("build", ["wal-v1", "wal-v2", "wal-v3"])
def test_a_log_of_an_earlier_build_is_refused_by_name_and_left_untouched(tmp_path, build):
    # tests/data/wal-v*: written by earlier builds (b"DPHWAL01" Arrow ingest rows; b"DPHWAL02" records
    # without a checksum over their length, and a base without checksums; b"DPHWAL03" with no manifest).
    shutil.copytree(Path(__file__).parent / "data" / build, tmp_path / "wal")
    before = {p.name: p.read_bytes() for p in (tmp_path / "wal").iterdir()}
    with pytest.raises(WalFormatError, match=r"wal\.json: the index of an earlier build's log \(format 3 or before"):
        make_core(tmp_path / "wal")
    assert {p.name: p.read_bytes() for p in (tmp_path / "wal").iterdir()} == before


def test_a_state_file_without_its_checksum_trailer_is_refused(tmp_path):
    with pytest.raises(ReplayStateError, match="an Arrow file without this format's checksum trailer"):
        read_state(Path(__file__).parent / "data" / "wal-v2-snapshot")  # an earlier build's snapshot
    core = make_core(tmp_path / "log")
    core.ingest([synthetic_group(0, 0)])
    path = Path(core.snapshot(tmp_path / "s.arrow").rsplit(" ", 1)[-1])
    data = path.read_bytes()
    arrow_end = data.rindex(b"ARROW1") + len(b"ARROW1")
    path.write_bytes(data[:arrow_end])  # the trailer cut off: what an earlier build's file looked like
    with pytest.raises(ReplayStateError, match=rf"trailer was cut off at byte {arrow_end}\); refused"):
        read_state(path)


def test_a_checksummed_record_this_build_cannot_read_is_named_not_truncated(tmp_path):
    core = make_core(tmp_path)
    core.ingest([synthetic_group(0, 0)])
    segment = _segment(core)
    # an unknown kind; none at all; groups announced but absent; a serve record that is not Arrow
    for payload in (b"X" + b"\0" * 8, b"", b"G" + b"\xff" * 7, b"S" + b"\0" * 16):
        data = segment.read_bytes() + record_header(payload) + payload
        segment.write_bytes(data)
        with pytest.raises(WalFormatError, match=r"seg-\d{8}\.wal: the record at byte \d+ is not one this build"):
            make_core(tmp_path)
        assert segment.read_bytes() == data
        segment.write_bytes(data[: -len(payload) - HEADER_BYTES])
