"""The write-ahead log: every state change is appended here before anyone is told about it.

A directory of numbered segments of checksummed records, plus bases (state files, replay/state.py)
that summarise everything before a segment:

    wal.json              {"wal_id": ..., "keep_from": first segment a learner snapshot needs, "crc32": ...}
    seg-00000007.wal      records, appended and flushed before the replay acknowledges them
    base-00000007.arrow   the state at the start of segment 7 (with its own checksums)

A segment is the 8-byte magic b"DPHWAL03", then records, each self-delimiting and checksummed:

    sync        4 bytes             b"\xd7\x1dWR": where a record starts
    length      u64 little-endian   bytes of the payload
    crc32       u32 little-endian   zlib.crc32 of the payload
    head crc32  u32 little-endian   zlib.crc32 of the 16 bytes before it
    payload                         a kind byte, then the record

Two record kinds:
    G  ingest   accepted groups, written before they are acknowledged, as the wire protocol's
                frames (dph_async/protocol.py): u32 groups, per group u32 frames, u64 per frame
                its bytes, then the frames. A group arrives as these frames and leaves the log
                through the same decoder; the Arrow columns this record once held cost 9x the
                CPU per group (0.64 ms against 0.07) on the replay's thread, beside the actors.
    S  serve    a batch served, one Arrow IPC record batch of one row (WAL_SCHEMA): request id,
                version, group ids, reference ids, and the groups dropped since the previous
                batch; it also confirms the batch before it

Damage is never read as data. A record whose header or payload fails its checksum is skipped: the
reader finds the next sound record (a sync whose header and payload checksums both hold) and goes on
from there, so only the damaged record is lost; recovery logs it as an error and counts it
(`damaged_records`, `skipped_bytes`). Its groups were never re-accepted, so the actors that made them
generate their positions again when they resume (replay/core.py). Damage with no sound record after
it ends the segment: a write a crash cut short (never acknowledged), or damage at its end; recovery
truncates the segment there (`truncated_bytes`). Segments are deleted once both the newest base and
the newest learner snapshot are past them: a restore re-adds the groups accepted after its snapshot
from these segments, so nothing an actor was told is accepted is lost.

Logs of earlier builds are read: b"DPHWAL02" segments (records of u64 length and u32 crc32, read up to
their first damaged record and truncated there, since a damaged length leaves nothing to resynchronise
on), b"DPHWAL01" ones (Arrow payloads), an index without a checksum (rewritten with one) and bases
without checksums (replay/state.py). New records always go to a new segment in this build's format.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa

from dph_async.protocol import Limits, ProtocolError, RolloutGroup, decode, encode
from replay.records import GROUP_FIELDS, groups_from

log = logging.getLogger(__name__)

WAL_SCHEMA = pa.schema(
    [
        pa.field("op", pa.string()),
        *GROUP_FIELDS,
        pa.field("request_id", pa.int64()),
        pa.field("version", pa.int64()),
        pa.field("group_actor", pa.list_(pa.int64())),
        pa.field("group_seq", pa.list_(pa.int64())),
        pa.field("reference_ids", pa.list_(pa.string())),
        pa.field("dropped_actor", pa.list_(pa.int64())),
        pa.field("dropped_seq", pa.list_(pa.int64())),
        pa.field("dropped_reason", pa.list_(pa.string())),
    ]
)
_SEGMENT = re.compile(r"seg-(\d{8})\.wal$")
MAGIC = b"DPHWAL03"
MAGIC_V2 = b"DPHWAL02"  # read, never written
MAGIC_V1 = b"DPHWAL01"  # read, never written
_SYNC = b"\xd7\x1dWR"
_HEAD = struct.Struct("<4sQI")  # sync, payload length, crc32 of the payload
_HEAD_CRC = struct.Struct("<I")  # crc32 of _HEAD's bytes
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
_RECORD_V2 = struct.Struct("<QI")  # payload length, crc32 of the payload
_GROUPS, _SERVE = b"G", b"S"
# Our own log, checksummed: the wire's size limits are for peers, and a group accepted under a
# service's raised limits must read back.
_OWN = Limits(max_bytes=1 << 62, max_header_bytes=1 << 62, max_frames=1 << 62, accept=frozenset({RolloutGroup}))
_BASE = re.compile(r"base-(\d{8})\.arrow$")


@dataclass
class IngestRecord:
    groups: list[RolloutGroup]


@dataclass
class ServeRecord:
    request_id: int
    version: int
    group_ids: list[tuple[int, int]]
    reference_ids: list[str]
    dropped: list[tuple[tuple[int, int], str]]  # (group id, reason)


Record = IngestRecord | ServeRecord


def _ids(actors: list[int], seqs: list[int]) -> list[tuple[int, int]]:
    return list(zip(actors, seqs, strict=True))


def _groups_payload(groups: list[RolloutGroup]) -> bytes:
    messages = [encode(g) for g in groups]
    frames = [f for m in messages for f in m]
    sizes = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<I{len(messages)}I{len(sizes)}Q", len(messages), *(len(m) for m in messages), *sizes)
    return b"".join([_GROUPS, head, *frames])


def _groups_from(payload: memoryview) -> list[RolloutGroup]:
    """The groups of a G record's payload (after its kind byte); ProtocolError if it is not one."""
    try:
        (n,) = struct.unpack_from("<I", payload, 0)
        counts = struct.unpack_from(f"<{n}I", payload, 4)
        at = 4 + 4 * n
        sizes = struct.unpack_from(f"<{sum(counts)}Q", payload, at)
    except struct.error as e:
        raise ProtocolError("frames", f"group record header: {e}") from None
    at += 8 * len(sizes)
    frames = []
    for size in sizes:
        frames.append(bytes(payload[at : at + size]))  # copies: the segment's mapping may be truncated
        at += size
    if at != len(payload):
        raise ProtocolError("frames", f"group record of {len(payload)} bytes holds {at}")
    groups, start = [], 0
    for count in counts:
        groups.append(decode(frames[start : start + count], _OWN))
        start += count
    return groups


def _serve_batch(record: ServeRecord) -> pa.RecordBatch:
    columns = {
        "op": pa.array(["serve"]),
        "request_id": pa.array([record.request_id], pa.int64()),
        "version": pa.array([record.version], pa.int64()),
        "group_actor": pa.array([[a for a, _ in record.group_ids]], pa.list_(pa.int64())),
        "group_seq": pa.array([[s for _, s in record.group_ids]], pa.list_(pa.int64())),
        "reference_ids": pa.array([record.reference_ids], pa.list_(pa.string())),
        "dropped_actor": pa.array([[gid[0] for gid, _ in record.dropped]], pa.list_(pa.int64())),
        "dropped_seq": pa.array([[gid[1] for gid, _ in record.dropped]], pa.list_(pa.int64())),
        "dropped_reason": pa.array([[reason for _, reason in record.dropped]], pa.list_(pa.string())),
    }
    arrays = [columns[f.name] if f.name in columns else pa.nulls(1, f.type) for f in WAL_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=WAL_SCHEMA)


def _payload(record: Record) -> bytes:
    if isinstance(record, IngestRecord):
        return _groups_payload(record.groups)
    return _SERVE + _serve_batch(record).serialize().to_pybytes()


class WalFormatError(ValueError):
    """A file of the log is not one this build reads (no magic, a damaged index, or a checksummed record
    it cannot parse): never truncated or rewritten, the file (and where it can, the byte) is named."""


class WalIndex(msgspec.Struct, forbid_unknown_fields=True):
    """wal.json: the log's id (snapshots name it) and the first segment the newest snapshot needs."""

    wal_id: str
    keep_from: int | None = None
    crc32: int | None = None  # of the index's other fields (`_index_crc`); absent in earlier builds' files


def _index_crc(index: WalIndex) -> int:
    return zlib.crc32(msgspec.json.encode([index.wal_id, index.keep_from]))


def read_index(path: Path) -> WalIndex:
    """The index at `path`, checked; WalFormatError naming the file (and the byte, where JSON breaks)."""
    data = path.read_bytes()
    try:
        index = msgspec.json.decode(data, type=WalIndex)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WalFormatError(f"{path}: damaged write-ahead log index ({e}); {_DAMAGED_INDEX}") from None
    if index.crc32 is None:
        log.warning("write-ahead log index %s: written by an earlier build, without a checksum; rewritten with one",
                    path)
    elif index.crc32 != _index_crc(index):
        raise WalFormatError(f"{path}: damaged write-ahead log index (bytes 0-{len(data) - 1} do not match their "
                             f"checksum); {_DAMAGED_INDEX}")
    return index


_DAMAGED_INDEX = "nothing of the log was read; repair the file or move the directory away to start a new log"


@dataclass
class Damage:
    """Bytes [offset, end) of a segment that hold no sound record; `end` is the segment's size when no
    sound record follows."""

    offset: int
    end: int
    problem: str


def record_header(payload: bytes) -> bytes:
    """The header that goes before `payload` in a segment."""
    head = _HEAD.pack(_SYNC, len(payload), zlib.crc32(payload))
    return head + _HEAD_CRC.pack(zlib.crc32(head))


def _frame(view: memoryview, offset: int, size: int) -> tuple[int, int] | str:
    """(payload offset, payload length) of the sound record at `offset`, or what is wrong there."""
    if size - offset < HEADER_BYTES:
        return "record header cut short"
    sync, length, crc = _HEAD.unpack_from(view, offset)
    (head_crc,) = _HEAD_CRC.unpack_from(view, offset + _HEAD.size)
    if sync != _SYNC or zlib.crc32(view[offset : offset + _HEAD.size]) != head_crc:
        return "record header fails its checksum"
    body = offset + HEADER_BYTES
    if length > size - body:
        return "record cut short"
    if zlib.crc32(view[body : body + length]) != crc:
        return "payload fails its checksum"
    return body, length


def _next_record(view: memoryview, start: int, size: int) -> int | None:
    """Where the first sound record at or after `start` begins (its sync, and both its checksums hold)."""
    chunk = 1 << 20
    while start < size:
        window = bytes(view[start : min(size, start + chunk + len(_SYNC) - 1)])
        at = window.find(_SYNC)
        while at >= 0:
            if not isinstance(_frame(view, start + at, size), str):
                return start + at
            at = window.find(_SYNC, at + 1)
        start += chunk
    return None


def scan(view: memoryview, size: int) -> Iterator[tuple[int, int] | Damage]:
    """A DPHWAL03 segment's records as (payload offset, length), and the damaged spans between them."""
    offset = len(MAGIC)
    while offset < size:
        found = _frame(view, offset, size)
        if not isinstance(found, str):
            yield found
            offset = found[0] + found[1]
            continue
        resume = _next_record(view, offset + 1, size)
        yield Damage(offset, size if resume is None else resume, found)
        if resume is None:
            return
        offset = resume


def _from_batch(batch: pa.RecordBatch) -> Iterator[Record]:
    """The records of an Arrow record batch: a serve record, or a DPHWAL01 segment's ingest rows."""
    if batch.num_rows == 0:
        return
    if batch.column("op")[0].as_py() == "ingest":
        yield IngestRecord(groups_from(batch))
        return
    columns = ["request_id", "version", "group_actor", "group_seq", "reference_ids"]
    columns += ["dropped_actor", "dropped_seq", "dropped_reason"]
    for row in batch.select(columns).to_pylist():
        yield ServeRecord(
            row["request_id"],
            row["version"],
            _ids(row["group_actor"], row["group_seq"]),
            row["reference_ids"],
            list(zip(_ids(row["dropped_actor"], row["dropped_seq"]), row["dropped_reason"], strict=True)),
        )


class WriteAheadLog:
    def __init__(self, directory: str | os.PathLike, fsync: bool = False, segment_bytes: int = 256 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        if old := sorted(self.dir.glob("seg-*.arrow")):
            raise WalFormatError(
                f"{old[0]}: a write-ahead log of an older build (segments without checksums); finish its "
                "run with that build, or move the directory away to start a new log"
            )
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        index = self.dir / "wal.json"
        self._meta = read_index(index) if index.exists() else WalIndex(uuid.uuid4().hex)
        if self._meta.crc32 is None:  # new, or an earlier build's
            self._write_meta()
        self.segment = -1  # the segment being written; none until open()
        self._file = None
        self._written = 0
        self.bytes_since_base = 0
        self.damaged_records = 0  # found by recovery: records cut short or failing their checksum
        self.skipped_bytes = 0  # of them, damaged bytes followed by sound records (lost, not truncated)
        self.truncated_bytes = 0

    @property
    def wal_id(self) -> str:
        return self._meta.wal_id

    def _write_meta(self) -> None:
        self._meta.crc32 = _index_crc(self._meta)
        tmp = self.dir / "wal.json.tmp"
        tmp.write_bytes(msgspec.json.encode(self._meta))
        os.replace(tmp, self.dir / "wal.json")

    def _numbered(self, pattern: re.Pattern) -> dict[int, Path]:
        found = {}
        for p in self.dir.iterdir():
            m = pattern.match(p.name)
            if m:
                found[int(m.group(1))] = p
        return found

    def _segment_path(self, n: int) -> Path:
        return self.dir / f"seg-{n:08d}.wal"

    def latest_base(self) -> tuple[int, Path] | None:
        bases = self._numbered(_BASE)
        return max(bases.items()) if bases else None

    def records(self, start: int = 0, repair: bool = False) -> Iterator[Record]:
        """The records of segments >= start, in order, each segment up to its first damaged record.
        repair=True (recovery) truncates a segment at its damage."""
        for n, path in sorted(self._numbered(_SEGMENT).items()):
            if n >= start:
                yield from self._segment_records(path, repair)

    def _segment_records(self, path: Path, repair: bool) -> Iterator[Record]:
        size = path.stat().st_size
        if size < len(MAGIC):  # opened, then nothing (or not all of the magic) written
            if MAGIC.startswith(path.read_bytes()):
                return
            raise WalFormatError(f"{path}: not a write-ahead log segment of this build (no {MAGIC!r} header)")
        buf = pa.memory_map(str(path)).read_buffer()
        magic = buf[: len(MAGIC)].to_pybytes()
        if magic not in (MAGIC, MAGIC_V2, MAGIC_V1):
            raise WalFormatError(f"{path}: not a write-ahead log segment of this build (no {MAGIC!r} header at "
                                 "byte 0)")
        view = memoryview(buf)
        if magic != MAGIC:
            yield from self._earlier_records(path, buf, magic == MAGIC_V1, repair)
            return
        for found in scan(view, size):
            if isinstance(found, Damage):
                self._damaged(path, found, size, repair)
            else:
                body, length = found
                yield self._record(path, body - HEADER_BYTES, view[body : body + length])

    def _earlier_records(self, path: Path, buf: pa.Buffer, arrow: bool, repair: bool) -> Iterator[Record]:
        """An earlier build's segment, up to its first damaged record: with no checksum over a record's
        length, nothing after a damaged one can be found again."""
        size, view = buf.size, memoryview(buf)
        offset = len(MAGIC)
        while offset < size:
            problem = ""
            if size - offset < _RECORD_V2.size:
                problem = "record header cut short"
            else:
                length, crc = _RECORD_V2.unpack_from(view, offset)
                body = offset + _RECORD_V2.size
                if length > size - body:
                    problem = "record cut short"
                elif zlib.crc32(view[body : body + length]) != crc:
                    problem = "checksum mismatch"
            if problem:
                self._damaged(path, Damage(offset, size, problem), size, repair)
                return
            if arrow:
                yield from _from_batch(pa.ipc.read_record_batch(buf.slice(body, length), WAL_SCHEMA))
            else:
                yield self._record(path, offset, view[body : body + length])
            offset = body + length

    @staticmethod
    def _record(path: Path, offset: int, payload: memoryview) -> Record:
        """A checksummed record of this build's segments. One that does not parse is no torn write
        (its checksum held): another build wrote it, so the error names it and truncates nothing."""
        kind = bytes(payload[:1])
        try:
            if kind == _GROUPS:
                return IngestRecord(_groups_from(payload[1:]))
            if kind == _SERVE:
                (record,) = _from_batch(pa.ipc.read_record_batch(pa.py_buffer(payload[1:]), WAL_SCHEMA))
                return record
            problem = f"unknown record kind {kind!r}"
        except (ProtocolError, pa.ArrowException, ValueError, EOFError) as e:
            problem = str(e)
        raise WalFormatError(f"{path}: the record at byte {offset} is not one this build reads ({problem})")

    def _damaged(self, path: Path, damage: Damage, size: int, repair: bool) -> None:
        where = f"write-ahead log {path}: bytes {damage.offset}-{damage.end - 1} ({damage.problem})"
        if damage.end < size:  # sound records follow: acknowledged data was lost, say so loudly
            log.error("%s: skipped, the record there is lost; the groups it held are not accepted, so their "
                      "actors generate them again when they resume; the %d bytes after it are read", where,
                      size - damage.end)
            if repair:
                self.damaged_records += 1
                self.skipped_bytes += damage.end - damage.offset
            return
        if not repair:
            log.warning("%s: the end of the segment, not read", where)
            return
        self.damaged_records += 1
        self.truncated_bytes += size - damage.offset
        log.warning("%s: the end of the segment (a write a crash cut short, never acknowledged, or damage); "
                    "truncated there, the records before it are kept", where)
        os.truncate(path, damage.offset)

    def missing_segments(self, start: int) -> bool:
        """True if segments from `start` on were already deleted (or never written here)."""
        present = self._numbered(_SEGMENT)
        return start not in present and (not present or min(present) > start)

    def open(self) -> None:
        """Start writing: a new segment after every existing one (a torn one is never appended to)."""
        base = self.latest_base()
        self.bytes_since_base = sum(
            p.stat().st_size for n, p in self._numbered(_SEGMENT).items() if base is None or n >= base[0]
        )
        self.roll()

    def roll(self) -> int:
        """Close the current segment and start the next; returns the new segment's number."""
        self.close()
        self.segment = max([*self._numbered(_SEGMENT), *self._numbered(_BASE), self.segment]) + 1
        self._file = open(self._segment_path(self.segment), "wb", buffering=0)  # noqa: SIM115 (see close())
        self._file.write(MAGIC)
        self._written = len(MAGIC)
        return self.segment

    def append(self, record: Record) -> None:
        """Write a record to the OS (and to disk with fsync=True): durable once this returns."""
        assert self._file is not None, "WriteAheadLog.open() first"
        payload = _payload(record)
        header = record_header(payload)
        size = len(header) + len(payload)
        if os.writev(self._file.fileno(), [header, payload]) != size:
            raise OSError(f"write-ahead log {self._segment_path(self.segment)}: short write")
        self._written += size
        self.bytes_since_base += size
        if self.fsync:
            os.fsync(self._file.fileno())
        if self._written >= self.segment_bytes:
            self.roll()

    def write_base(self, write: Callable[[Path, int], None]) -> int:
        """Roll, then have `write(path, segment)` write the state as the base of the new segment;
        then delete what no longer needs keeping."""
        n = self.roll()
        write(self.dir / f"base-{n:08d}.arrow", n)
        self.bytes_since_base = 0
        self._retain()
        return n

    def keep_from(self, segment: int) -> None:
        """A learner snapshot was taken at `segment`: keep segments from there on for its restore."""
        self._meta.keep_from = segment
        self._write_meta()
        self._retain()

    def _retain(self) -> None:
        base = self.latest_base()
        if base is None:
            return
        keep_from = self._meta.keep_from
        keep = base[0] if keep_from is None else min(base[0], keep_from)
        for n, path in self._numbered(_SEGMENT).items():
            if n < keep:
                path.unlink()
        for n, path in self._numbered(_BASE).items():
            if n < base[0]:
                path.unlink()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
