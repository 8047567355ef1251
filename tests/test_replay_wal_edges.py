"""The write-ahead log at its edges (replay/wal.py): the search for the next sound record after damage
for any window size, records whose checksums hold but that no build writes, wal.ack of the wrong shape,
a segment sealed by the process after the one that wrote it, and the counts and words of every loss."""

from __future__ import annotations

import logging
import os
import struct
import uuid
import zlib
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dph_async.replay.wal as wal
from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, encode
from dph_async.replay.core import ReplayCore
from dph_async.replay.wal import (
    HEADER_BYTES,
    MAGIC,
    WAL_SCHEMA,
    Damage,
    IngestRecord,
    ServeRecord,
    WalFormatError,
    WriteAheadLog,
    parse_record,
    record_header,
    scan,
)
from dph_async.tools.bench.transport import synthetic_group

SYNC = record_header(b"")[:4]


def segment(*payloads: bytes) -> bytearray:
    return bytearray(MAGIC + b"".join(record_header(p) + p for p in payloads))


def sound_at(data: bytes, at: int) -> int | None:
    """The payload length of a sound record starting at `at`, or None: the format's definition."""
    if len(data) - at < HEADER_BYTES or data[at : at + 4] != SYNC:
        return None
    length, crc, head_crc = struct.unpack_from("<QII", data, at + 4)
    if zlib.crc32(data[at : at + 16]) != head_crc or length > len(data) - at - HEADER_BYTES:
        return None
    body = at + HEADER_BYTES
    return length if zlib.crc32(data[body : body + length]) == crc else None


def scan_byte_by_byte(data: bytes) -> list[tuple[int, int] | Damage]:
    """What scan() must find, searching one byte at a time: each sound record, and between them the
    damaged spans, each up to the next byte where a sound record starts."""
    found: list[tuple[int, int] | Damage] = []
    offset = len(MAGIC)
    while offset < len(data):
        length = sound_at(data, offset)
        if length is not None:
            found.append((offset + HEADER_BYTES, length))
            offset += HEADER_BYTES + length
            continue
        resume = next((p for p in range(offset + 1, len(data)) if sound_at(data, p) is not None), len(data))
        found.append(Damage(offset, resume, ""))
        offset = resume
    return found


# Payloads that hold syncs of their own (false starts for the search) and whole records (sound ones,
# inside a record that is damaged, the search must find).
PAYLOAD = st.lists(st.one_of(st.binary(max_size=12), st.just(SYNC), st.just(SYNC + b"\0" * 16),
                             st.binary(max_size=6).map(lambda p: record_header(p) + p)), max_size=5).map(b"".join)


@settings(max_examples=300, deadline=None)
# a damaged record holding a false sync, then two sound records: the first of them is where reading resumes
@example(payloads=[SYNC + record_header(b"x") + b"x" + record_header(b"y") + b"y"], flips=[12], cut=0, window=400)
@given(payloads=st.lists(PAYLOAD, min_size=1, max_size=6), flips=st.lists(st.integers(0, 10**6), max_size=4),
       cut=st.integers(0, 30), window=st.one_of(st.integers(1, 40), st.integers(41, 400)))
def test_the_search_after_damage_finds_what_a_byte_by_byte_search_finds_for_any_window(payloads, flips, cut,
                                                                                         window):
    """For any window, syncs inside payloads, damaged records holding sound ones, and a torn tail: the
    same records and damaged spans as a search one byte at a time (a window without its overlap loses a
    sound record across its end; one that goes back or skips a false sync loses or repeats one)."""
    data = segment(*payloads)
    for f in flips:
        data[len(MAGIC) + f % (len(data) - len(MAGIC))] ^= 0x10
    data = bytes(data[: max(len(MAGIC), len(data) - cut)])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wal, "SEARCH_BYTES", window)
        found = list(scan(memoryview(data), len(data)))
    assert [f if isinstance(f, tuple) else (f.offset, f.end) for f in found] == \
        [f if isinstance(f, tuple) else (f.offset, f.end) for f in scan_byte_by_byte(data)]


def test_after_damage_past_the_first_window_the_search_goes_on_from_where_it_was():
    """Damage beyond the first window's bytes with the next sound record two windows further: each
    window follows the one before it, never the segment's start again."""
    data = segment(b"a" * 100, b"b" * 100, b"c" * 100)
    data[len(MAGIC) + 120 + 30] ^= 1  # the second record's payload, at byte 158
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wal, "SEARCH_BYTES", 32)
        found = list(scan(memoryview(bytes(data)), len(data)))
    assert found == [(28, 100), Damage(128, 248, "payload fails its checksum"), (268, 100)]


def serve_payload(**columns: list) -> bytes:
    """An S record's payload of one row with these columns (the others empty): any lengths, checksummed
    as a writer would."""
    row = {"request_id": [1], "version": [2], "group_actor": [[]], "group_seq": [[]], "reference_ids": [[]],
           "dropped_actor": [[]], "dropped_seq": [[]], "dropped_reason": [[]]} | columns
    batch = pa.RecordBatch.from_pydict(row, schema=WAL_SCHEMA)
    return b"S" + batch.serialize().to_pybytes()


def with_string_offsets_out_of_order(payload: bytes) -> bytes:
    """Two reference ids "ab" and "cd", their second start moved before the first's: only a full
    validation of the Arrow offsets sees it, and reading them unchecked reads memory around them."""
    at = payload.index(struct.pack("<iii", 0, 2, 4))
    return payload[: at + 4] + struct.pack("<i", -1) + payload[at + 8 :]


def group_frames_payload(messages: list[list]) -> bytes:
    frames = [bytes(f) for m in messages for f in m]
    head = struct.pack(f"<I{len(messages)}I{len(frames)}Q", len(messages), *(len(m) for m in messages),
                       *(len(f) for f in frames))
    return b"G" + head + b"".join(frames)


UNREADABLE = {
    "unknown kind": (b"X\0", r"^unknown record kind b'X'$"),
    "a group record with a byte after its frames": (
        group_frames_payload([encode(synthetic_group(0, 0, n=1, tokens=2))]) + b"\0",
        r"^group record of \d+ bytes holds \d+$"),
    "a group record of another message": (group_frames_payload([encode(BatchRequest(0, 4, 0.0))]), "BatchRequest"),
    "a group record's counts cut short": (b"G" + struct.pack("<I", 3), r"^group record header: unpack_from requires"),
    "a group record of 2^31 groups": (b"G" + struct.pack("<I", 1 << 31), r"^group record header: unpack_from requires"),
    "a serve record of more actors than seqs": (serve_payload(group_actor=[[1, 2]], group_seq=[[3]]),
                                                "zip.*argument 2 is shorter"),
    "a serve record of more drops than reasons": (
        serve_payload(dropped_actor=[[1]], dropped_seq=[[2]], dropped_reason=[["stale", "stale"]]),
        "zip.*argument 2 is longer"),
    "a serve record's strings out of order": (with_string_offsets_out_of_order(serve_payload(
        reference_ids=[["ab", "cd"]])), "non-monotonic offset"),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_a_sound_record_no_build_writes_is_refused_naming_its_problem(case):
    payload, problem = UNREADABLE[case]
    with pytest.raises(WalFormatError, match=problem):
        parse_record(memoryview(payload))


def test_the_records_a_build_writes_read_back():
    group = synthetic_group(3, 4, n=2, tokens=3)
    serve = ServeRecord(7, 2, [(3, 4), (5, 6)], ["r1"], [((1, 2), "stale"), ((1, 3), "rewound")])
    assert parse_record(memoryview(wal._payload(serve))) == serve
    [back] = parse_record(memoryview(wal._payload(IngestRecord([group])))).groups
    assert [bytes(f) for f in encode(back)] == [bytes(f) for f in encode(group)]


def test_wal_ack_is_read_only_as_two_slots_in_their_places(tmp_path):
    """One sound slot alone, or both a byte out of place, is not what this build writes: refused."""
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    log.close()
    ack = tmp_path / "wal.ack"
    data = ack.read_bytes()
    slot = len(data) // 2
    assert wal.read_ack(ack).writes == 1
    for bad in (data[:slot], data[slot:], b"\0" + data[:-1]):
        ack.write_bytes(bad)
        with pytest.raises(WalFormatError, match=rf"wal\.ack: damaged: of its {len(bad)} bytes \(two slots of "
                                                 rf"{slot}\) neither slot matches its checksum"):
            wal.read_ack(ack)


def test_a_segment_sealed_by_the_next_process_keeps_the_checksum_its_writer_would_have(tmp_path):
    """The segment a killed process was writing is sealed by the next one, its checksum computed from
    the file: a restore that reads it again finds the same records."""
    first = WriteAheadLog(tmp_path)
    first.open()
    groups = [synthetic_group(0, i, n=1, tokens=2) for i in range(3)]
    for g in groups:
        first.append(IngestRecord([g]))
    del first  # killed: never sealed
    second = WriteAheadLog(tmp_path)
    assert len(list(second.records(repair=True))) == 3
    second.open()  # seals segment 0 from its bytes
    manifest = wal.read_manifest(tmp_path / "wal.json")
    assert [s.n for s in manifest.sealed] == [0] and manifest.live == 1
    again = [r.groups[0].group_id for r in WriteAheadLog(tmp_path).records()]
    assert again == [g.group_id for g in groups]


def test_a_torn_write_in_a_segment_started_after_the_last_acknowledgement_is_cut_off(tmp_path):
    """wal.ack acknowledged bytes of the segment before; of the new one, only its magic: a record torn
    there was never acknowledged, so it is truncated, not counted as lost."""
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    log.roll()  # segment 1 named, nothing appended yet
    payload = wal._payload(IngestRecord([synthetic_group(0, 1, n=1, tokens=2)]))
    with open(tmp_path / "seg-00000001.wal", "ab") as f:
        f.write((record_header(payload) + payload)[:30])  # the process died inside the write
    del log
    recovered = WriteAheadLog(tmp_path)
    assert [r.groups[0].seq for r in recovered.records(repair=True)] == [0]
    assert (recovered.damaged_records, recovered.skipped_bytes, recovered.truncated_bytes) == (1, 0, 30)
    assert (tmp_path / "seg-00000001.wal").read_bytes() == MAGIC


def logged(directory: Path, n: int) -> tuple[WriteAheadLog, list[int]]:
    """An open log of n one-group ingest records (seqs 0..n-1), and where each record starts."""
    log = WriteAheadLog(directory)
    log.open()
    starts = []
    for seq in range(n):
        starts.append(log._written)
        log.append(IngestRecord([synthetic_group(0, seq, n=1, tokens=2)]))
    return log, starts


def three_records_and_a_torn_tail(directory: Path) -> tuple[list[int], int]:
    """A segment of four ingest records, the first and third damaged, then a torn fifth: where each
    record starts and the segment's length."""
    log, starts = logged(directory, 4)
    starts.append(log._written)
    path = directory / "seg-00000000.wal"
    with open(path, "ab") as f:
        f.write(record_header(b"G" + bytes(50)) + bytes(10))  # past the acknowledged end
    data = bytearray(path.read_bytes())
    for seq in (0, 2):
        data[starts[seq] + HEADER_BYTES + 3] ^= 1
    path.write_bytes(bytes(data))
    del log
    return starts, len(data)


def test_every_loss_of_one_recovery_is_counted_and_said_with_its_bytes(tmp_path, caplog):
    starts, size = three_records_and_a_torn_tail(tmp_path)
    path = tmp_path / "seg-00000000.wal"
    with caplog.at_level(logging.WARNING, logger="dph_async.replay.wal"):
        recovered = WriteAheadLog(tmp_path)
        assert [r.groups[0].seq for r in recovered.records(repair=True)] == [1, 3]
    lost = (starts[1] - starts[0]) + (starts[3] - starts[2])
    assert (recovered.damaged_records, recovered.skipped_bytes, recovered.truncated_bytes) == \
        (3, lost, size - starts[4])
    assert path.stat().st_size == starts[4]
    assert caplog.messages == [
        *(f"write-ahead log {path}: bytes {starts[s]}-{starts[s + 1] - 1} (payload fails its checksum): skipped, "
          "the record there is lost; the groups it held are not accepted, so their actors generate them again "
          f"when they resume; the {size - starts[s + 1]} bytes after it are read" for s in (0, 2)),
        f"write-ahead log {path}: bytes {starts[4]}-{size - 1} (record cut short): past the acknowledged end "
        f"(byte {starts[4]}), a write a crash cut short, never acknowledged; truncated there, the records before "
        "it are kept",
    ]


def test_reading_without_repair_leaves_a_torn_tail_as_it_is_and_says_so(tmp_path, caplog):
    starts, size = three_records_and_a_torn_tail(tmp_path)
    path = tmp_path / "seg-00000000.wal"
    before = path.read_bytes()
    reader = WriteAheadLog(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dph_async.replay.wal"):
        assert [r.groups[0].seq for r in reader.records()] == [1, 3]
    assert path.read_bytes() == before
    assert (reader.damaged_records, reader.skipped_bytes, reader.truncated_bytes) == (0, 0, 0)
    assert caplog.messages[-1] == (f"write-ahead log {path}: bytes {starts[4]}-{size - 1} (record cut short): "
                                   f"past the acknowledged end (byte {starts[4]}), not read")


def test_a_base_starts_the_count_of_bytes_since_it_from_nothing(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    record = IngestRecord([synthetic_group(0, 0, n=1, tokens=2)])
    log.append(record)
    size = log._written - len(MAGIC)
    assert log.bytes_since_base == size
    log.write_base(ReplayCore(ReplayConfig(), groups_per_batch=1)._write_state)
    assert log.bytes_since_base == 0
    log.append(record)
    assert log.bytes_since_base == size


def test_close_closes_both_files_once_and_again_is_harmless(tmp_path):
    log = WriteAheadLog(tmp_path)
    assert not log.fsync  # by default a record is acknowledged once the OS has it (replay.wal_fsync=false)
    log.open()
    segment, ack = log._file.fileno(), log._ack_fd
    log.close()
    for fd in (segment, ack):
        with pytest.raises(OSError):
            os.fstat(fd)
    log.close()
    assert log._file is None and log._ack_fd is None


@pytest.mark.parametrize("left", [None, b"", MAGIC[:3]])
def test_a_live_segment_named_but_never_written_to_disk_comes_back_empty(tmp_path, left):
    """A power cut after the manifest named the new segment, before its magic reached the disk (or its
    name did): nothing of it was acknowledged, so it reads as empty and the next start seals it whole."""
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    log.roll()
    del log
    live = tmp_path / "seg-00000001.wal"
    live.unlink() if left is None else live.write_bytes(left)
    recovered = WriteAheadLog(tmp_path)
    assert [r.groups[0].seq for r in recovered.records(repair=True)] == [0]
    assert recovered.damaged_records == 0
    recovered.open()
    assert live.read_bytes() == MAGIC and wal.read_manifest(tmp_path / "wal.json").sealed[-1].bytes == len(MAGIC)
    del recovered
    WriteAheadLog(tmp_path).open()  # the sealed segment of its magic alone is the log's, not a leftover
    assert [r.groups[0].seq for r in WriteAheadLog(tmp_path).records()] == [0]


def test_a_damaged_record_in_a_sealed_segment_is_skipped_on_restore_not_taken_for_reordering(tmp_path, caplog):
    """A sealed segment's checksum covers its records; with one of them damaged (and skipped, loudly),
    the rest are still the log's own, not records replaced or reordered."""
    log, starts = logged(tmp_path, 3)
    log.roll()
    log.close()
    sealed = tmp_path / "seg-00000000.wal"
    data = bytearray(sealed.read_bytes())
    data[starts[1] + HEADER_BYTES + 3] ^= 1
    sealed.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="dph_async.replay.wal"):
        assert [r.groups[0].seq for r in WriteAheadLog(tmp_path).records()] == [0, 2]
    assert f"{sealed}: bytes {starts[1]}-{starts[2] - 1} (payload fails its checksum): skipped" in caplog.text


def test_an_unreadable_record_is_named_by_the_byte_where_it_starts(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    at = log._written
    del log
    with open(tmp_path / "seg-00000000.wal", "ab") as f:
        f.write(record_header(b"X") + b"X")
    with pytest.raises(WalFormatError, match=rf"seg-00000000\.wal: the record at byte {at} is not one this build "
                                             r"reads \(unknown record kind b'X'\)"):
        list(WriteAheadLog(tmp_path).records())


@pytest.mark.parametrize(("tail", "problem"), [
    (record_header(b"abc")[:19], "record header cut short"),
    (SYNC + bytes(16), "record header fails its checksum"),
    (record_header(b"abc") + b"ab", "record cut short"),
    (record_header(b"abc") + b"abd", "payload fails its checksum"),
])
def test_each_kind_of_damage_is_named(tail, problem):
    data = bytes(segment(b"sound")) + tail
    assert list(scan(memoryview(data), len(data))) == [(28, 5), Damage(33, len(data), problem)]


def test_segments_are_missing_when_dropped_or_never_written_here(tmp_path):
    """A snapshot's first segment: missing once compaction dropped it, or when the log directory is older
    than the snapshot (its segment never written here); present while the log holds it."""
    log = WriteAheadLog(tmp_path)
    assert log.missing_segments(0)  # nothing written yet
    log.open()
    assert [log.missing_segments(n) for n in range(3)] == [False, True, True]
    log.write_base(ReplayCore(ReplayConfig(), groups_per_batch=1)._write_state)  # segment 0 dropped
    assert [log.missing_segments(n) for n in range(3)] == [True, False, True]
    log.roll()
    assert [log.missing_segments(n) for n in range(4)] == [True, False, False, True]


def test_a_manifest_is_read_up_to_its_size_limit_and_refused_one_byte_past_it(tmp_path):
    manifest = tmp_path / "wal.json"
    manifest.write_bytes(b" " * wal._MAX_MANIFEST)
    with pytest.raises(WalFormatError, match=r"wal\.json: damaged write-ahead log manifest \("):
        wal.read_manifest(manifest)
    manifest.write_bytes(b" " * (wal._MAX_MANIFEST + 1))
    with pytest.raises(WalFormatError) as e:
        wal.read_manifest(manifest)
    assert str(e.value) == f"{manifest}: {wal._MAX_MANIFEST + 1} bytes, more than a manifest holds; {wal._UNTOUCHED}"


def signed(fields: dict) -> bytes:
    """A manifest's bytes with its checksum, as a writer would sign them."""
    fields = {**fields, "crc32": 0}
    return msgspec.json.encode({**fields, "crc32": wal._manifest_crc(fields)})


MANIFESTS = {
    "of another format": ({"format": 5, "wal_id": "x"},
                          "a write-ahead log of format 5; this build reads format 4; {untouched}"),
    "of a field out of range": ({"format": 4, "wal_id": "x", "live": -1},
                                "not a write-ahead log manifest (Expected `int` >= 0 - at `$.live`); {untouched}"),
    "of segments with a gap": ({"format": 4, "wal_id": "x", "sealed": [[1, 8, 0]], "live": 3},
                               "segments [1, 3] and base None are not a log's (consecutive segments, the base at one "
                               "of them); {untouched}"),
    "of a base at no segment": ({"format": 4, "wal_id": "x", "base": [2, 8, 0], "live": 3},
                                "segments [3] and base 2 are not a log's (consecutive segments, the base at one of "
                                "them); {untouched}"),
    "of an earlier build": ({"wal_id": "x", "keep_from": None},
                            "the index of an earlier build's log (format 3 or before, no manifest of its files); this "
                            "build reads format 4; finish its run with that build, or move the directory away to start "
                            "a new log"),
}


@pytest.mark.parametrize("case", MANIFESTS)
def test_a_signed_manifest_that_is_not_this_builds_is_refused_in_full_words(tmp_path, case):
    fields, words = MANIFESTS[case]
    manifest = tmp_path / "wal.json"
    manifest.write_bytes(signed(fields))
    with pytest.raises(WalFormatError) as e:
        wal.read_manifest(manifest)
    assert str(e.value) == f"{manifest}: " + words.format(untouched=wal._UNTOUCHED)


def test_a_manifest_that_fails_its_checksum_names_all_its_bytes(tmp_path):
    manifest = tmp_path / "wal.json"
    data = signed({"format": 4, "wal_id": "x"}).replace(b'"x"', b'"y"')
    manifest.write_bytes(data)
    with pytest.raises(WalFormatError) as e:
        wal.read_manifest(manifest)
    assert str(e.value) == (f"{manifest}: damaged write-ahead log manifest (bytes 0-{len(data) - 1} do not match their "
                            f"checksum); {wal._UNTOUCHED}")


def test_a_log_opened_twice_before_its_first_segment_reads_back_empty(tmp_path):
    WriteAheadLog(tmp_path)
    assert list(WriteAheadLog(tmp_path).records()) == []


def test_a_base_of_other_bytes_is_named_by_its_last_byte(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    log.write_base(ReplayCore(ReplayConfig(), groups_per_batch=1)._write_state)
    base = tmp_path / "base-00000001.arrow"
    data = bytearray(base.read_bytes())
    data[-9] ^= 1  # the trailer's checksum, before its 8-byte magic
    base.write_bytes(bytes(data))
    with pytest.raises(WalFormatError) as e:
        WriteAheadLog(tmp_path).latest_base()
    assert str(e.value) == (f"{base}: not the base {tmp_path / 'wal.json'} names (its checksum trailer ending at byte "
                            f"{len(data) - 1} differs); {wal._UNTOUCHED}")


def test_damage_at_the_end_of_a_sealed_segment_is_acknowledged_data_lost_not_a_torn_write(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    for seq in range(2):
        start = log._written
        log.append(IngestRecord([synthetic_group(0, seq, n=1, tokens=2)]))
    end = log._written
    log.roll()
    del log
    sealed = tmp_path / "seg-00000000.wal"
    data = bytearray(sealed.read_bytes())
    data[end - 1] ^= 1
    sealed.write_bytes(bytes(data))
    recovered = WriteAheadLog(tmp_path)
    assert [r.groups[0].seq for r in recovered.records(repair=True)] == [0]
    assert (recovered.damaged_records, recovered.skipped_bytes, recovered.truncated_bytes) == (1, end - start, 0)
    assert sealed.read_bytes() == bytes(data)


def test_appending_before_open_or_a_short_write_is_an_error_naming_it(tmp_path, monkeypatch):
    log = WriteAheadLog(tmp_path)
    record = IngestRecord([synthetic_group(0, 0, n=1, tokens=2)])
    with pytest.raises(AssertionError, match=r"^WriteAheadLog\.open\(\) first$"):
        log.append(record)
    log.open()
    monkeypatch.setattr(os, "writev", lambda fd, buffers: 1)
    with pytest.raises(OSError, match=rf"^write-ahead log {tmp_path / 'seg-00000000.wal'}: short write$"):
        log.append(record)


def test_the_boot_id_is_the_machines_or_zeros_where_it_has_none(monkeypatch):
    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.exists():
        assert wal._boot_id() == uuid.UUID(boot.read_text().strip()).bytes
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert wal._boot_id() == bytes(16)


def test_a_crash_before_dropped_files_are_deleted_leaves_them_to_the_next_start(tmp_path, monkeypatch, caplog):
    """A base drops the segments before it from the manifest, then deletes them: killed in between, the next
    start deletes them, as it deletes a manifest written to its temporary name but never renamed."""
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError):
            log.write_base(ReplayCore(ReplayConfig(), groups_per_batch=1)._write_state)
        m.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError):
            log.roll()
    del log
    assert {"seg-00000000.wal", "wal.json.tmp"} <= {p.name for p in tmp_path.iterdir()}
    restarted = WriteAheadLog(tmp_path)
    with caplog.at_level(logging.INFO, logger="dph_async.replay.wal"):
        restarted.open()
    assert not (tmp_path / "seg-00000000.wal").exists() and not (tmp_path / "wal.json.tmp").exists()
    assert f"write-ahead log: deleting {tmp_path / 'seg-00000000.wal'}, which its manifest no longer or not yet " \
           "names" in caplog.messages


def test_wal_ack_naming_a_segment_newer_than_the_manifests_is_refused(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    log.close()
    ack = wal.read_ack(tmp_path / "wal.ack")
    ack.segment = 5
    (tmp_path / "wal.ack").write_bytes(ack.pack() * 2)
    with pytest.raises(WalFormatError) as e:
        WriteAheadLog(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'wal.ack'}: acknowledges segment 5, newer than any {tmp_path / 'wal.json'} "
                            f"names; {wal._UNTOUCHED}")


def test_a_restart_counts_the_bytes_since_the_base_from_the_files(tmp_path):
    log = WriteAheadLog(tmp_path)
    log.open()
    log.append(IngestRecord([synthetic_group(0, 9, n=1, tokens=2)]))
    log.keep_from(0)  # a snapshot keeps segment 0, before the base
    log.write_base(ReplayCore(ReplayConfig(), groups_per_batch=1)._write_state)  # at segment 1
    for seq in range(2):
        log.append(IngestRecord([synthetic_group(0, seq, n=1, tokens=2)]))
        log.roll()
    log.append(IngestRecord([synthetic_group(0, 2, n=1, tokens=2)]))
    del log  # segments 1 and 2 sealed, 3 live
    assert (tmp_path / "seg-00000000.wal").exists()
    since = sum((tmp_path / f"seg-{n:08d}.wal").stat().st_size for n in (1, 2, 3))
    restarted = WriteAheadLog(tmp_path)
    restarted.open()
    assert restarted.bytes_since_base == since


def test_no_record_is_read_inside_the_sound_record_before_damage():
    """A sound record ending in the sync's first byte, then bytes that would complete a sound record started
    one byte earlier: the search after the damage starts past the damage's first byte, never inside the record
    before it."""
    after = (record_header(b"q") + b"q")[1:]
    data = bytes(segment(b"p" + SYNC[:1])) + after
    damage = Damage(30, len(data), "record header fails its checksum")
    assert list(scan(memoryview(data), len(data))) == [(28, 2), damage]


def test_a_log_that_names_no_segment_yet_acknowledges_none_and_holds_no_file_without_its_manifest(tmp_path):
    WriteAheadLog(tmp_path)  # never opened: no segment named
    ack = wal.read_ack(tmp_path / "wal.ack")
    ack.segment = 0
    (tmp_path / "wal.ack").write_bytes(ack.pack() * 2)
    with pytest.raises(WalFormatError, match=r"wal\.ack: acknowledges segment 0, newer than any"):
        WriteAheadLog(tmp_path)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "base-00000001.arrow").write_bytes(b"")
    with pytest.raises(WalFormatError, match=r"wal\.json: missing, yet the directory holds log files "
                                             r"\(base-00000001\.arrow, \.\.\.\)"):
        WriteAheadLog(tmp_path / "old")


def test_a_segment_rolls_once_it_reaches_its_size_not_one_byte_before(tmp_path):
    record = IngestRecord([synthetic_group(0, 0, n=1, tokens=2)])
    size = len(MAGIC) + HEADER_BYTES + len(wal._payload(record))
    for limit, segment_after in ((size, 1), (size + 1, 0)):
        log = WriteAheadLog(tmp_path / str(limit), segment_bytes=limit)
        log.open()
        log.append(record)
        assert log.segment == segment_after, limit


def test_a_segment_is_on_disk_once_sealed_even_without_fsync_per_record(tmp_path, monkeypatch):
    log = WriteAheadLog(tmp_path, fsync=False)
    log.open()
    segment = log._file.fileno()
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    log.append(IngestRecord([synthetic_group(0, 0, n=1, tokens=2)]))
    assert segment not in synced  # acknowledged once the OS has it
    log.roll()
    assert segment in synced
