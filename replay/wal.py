"""The write-ahead log: every state change is appended here before anyone is told about it.

A directory of numbered segments of checksummed records, plus bases (state files, replay/state.py)
that summarise everything before a segment:

    wal.json              {"wal_id": ..., "keep_from": first segment a learner snapshot needs}
    seg-00000007.wal      records, appended and flushed before the replay acknowledges them
    base-00000007.arrow   the state at the start of segment 7

A segment is the 8-byte magic b"DPHWAL02", then records, each

    length  u64 little-endian   bytes of the payload
    crc32   u32 little-endian   zlib.crc32 of the payload
    payload                     a kind byte, then the record

Two record kinds:
    G  ingest   accepted groups, written before they are acknowledged, as the wire protocol's
                frames (dph_async/protocol.py): u32 groups, per group u32 frames, u64 per frame
                its bytes, then the frames. A group arrives as these frames and leaves the log
                through the same decoder; the Arrow columns this record once held cost 9x the
                CPU per group (0.64 ms against 0.07) on the replay's thread, beside the actors.
    S  serve    a batch served, one Arrow IPC record batch of one row (WAL_SCHEMA): request id,
                version, group ids, reference ids, and the groups dropped since the previous
                batch; it also confirms the batch before it

Segments of the previous build (b"DPHWAL01": every payload one Arrow record batch, an ingest
record a row per group) are still read, so a run resumes across the upgrade.

Recovery loads the newest base and applies the segments from there on. In each segment it stops at
the first record that is cut short (a crash inside a write: that record was never acknowledged) or
whose checksum fails (the disk changed it), counts and logs the damage, and truncates the segment
there, so what comes before survives and the damage is never read again. Segments are deleted once
both the newest base and the newest learner snapshot are past them: a restore re-adds the groups
accepted after its snapshot from these segments, so nothing an actor was told is accepted is lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

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
MAGIC = b"DPHWAL02"
MAGIC_V1 = b"DPHWAL01"  # read, never written
_RECORD = struct.Struct("<QI")  # payload length, crc32 of the payload
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
    """A segment is not a log this build reads (no magic, or a checksummed record it cannot parse):
    never truncated, the file is named."""


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
        meta_file = self.dir / "wal.json"
        if meta_file.exists():
            self._meta = json.loads(meta_file.read_text())
        else:
            self._meta = {"wal_id": uuid.uuid4().hex, "keep_from": None}
            self._write_meta()
        self.segment = -1  # the segment being written; none until open()
        self._file = None
        self._written = 0
        self.bytes_since_base = 0
        self.damaged_records = 0  # found by recovery: records cut short or failing their checksum
        self.truncated_bytes = 0

    @property
    def wal_id(self) -> str:
        return self._meta["wal_id"]

    def _write_meta(self) -> None:
        tmp = self.dir / "wal.json.tmp"
        tmp.write_text(json.dumps(self._meta))
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
        if magic not in (MAGIC, MAGIC_V1):
            raise WalFormatError(f"{path}: not a write-ahead log segment of this build (no {MAGIC!r} header)")
        view = memoryview(buf)
        offset = len(MAGIC)
        while offset < size:
            problem = ""
            if size - offset < _RECORD.size:
                problem = "record header cut short"
            else:
                length, crc = _RECORD.unpack_from(view, offset)
                body = offset + _RECORD.size
                if length > size - body:
                    problem = "record cut short"
                elif zlib.crc32(view[body : body + length]) != crc:
                    problem = "checksum mismatch"
            if problem:
                self._damaged(path, offset, size, problem, repair)
                return
            if magic == MAGIC_V1:
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

    def _damaged(self, path: Path, offset: int, size: int, problem: str, repair: bool) -> None:
        if not repair:
            log.warning("write-ahead log %s: damaged at byte %d (%s); records from there on skipped",
                        path.name, offset, problem)
            return
        self.damaged_records += 1
        self.truncated_bytes += size - offset
        log.warning("write-ahead log %s: damaged at byte %d (%s); truncated there, %d bytes dropped "
                    "(records before it are kept)", path.name, offset, problem, size - offset)
        os.truncate(path, offset)

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
        header = _RECORD.pack(len(payload), zlib.crc32(payload))
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
        self._meta["keep_from"] = segment
        self._write_meta()
        self._retain()

    def _retain(self) -> None:
        base = self.latest_base()
        if base is None:
            return
        keep = base[0] if self._meta["keep_from"] is None else min(base[0], self._meta["keep_from"])
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
