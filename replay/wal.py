"""The write-ahead log: every state change is appended here before anyone is told about it.

A directory that knows what it should hold:

    wal.json              the manifest: the log's id, its base and every segment, checksummed
    wal.ack               how far the live segment was acknowledged: two checksummed slots, written
                          in turn after every append (a torn write spoils one, the other holds)
    seg-00000007.wal      records, appended and flushed before the replay acknowledges them
    base-00000007.arrow   the state at the start of segment 7 (with its own checksums, replay/state.py)

The manifest (`Manifest`) names the newest base by its bytes and digest (its trailer's CRC-32, which
covers every block's), every sealed segment (one no longer written) by its bytes and CRC-32 (of the
magic and every record's sync, length and payload CRC-32), and the live segment, the
one being written, whose bytes are at least what wal.ack says was acknowledged. It is rewritten
(temporary name, fsync, rename, fsync of the directory) whenever a segment is sealed or started, a
base written or a segment dropped, always after the files it names exist on disk and before the
files it stops naming are deleted; wal.ack is one pwrite per append.

A segment is the 8-byte magic b"DPHWAL04", then records, each self-delimiting and checksummed:

    sync        4 bytes             b"\\xd7\\x1dWR": where a record starts
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

What recovery refuses (WalFormatError naming the file, and the byte where it can; nothing is read,
truncated or deleted): a damaged manifest or wal.ack, a log of another format (an earlier build's
index or segment magic), a file the manifest names that is missing, a sealed segment or base of
other bytes or checksum than the manifest's, a live segment shorter than what was acknowledged, a
segment the manifest does not name, or a record whose checksums hold but that this build cannot
parse. What it repairs: past the acknowledged end of the live segment, damage with nothing sound
after it is a write a crash cut short (never acknowledged): truncated (`truncated_bytes`); files
the manifest no longer or not yet names (a crash between the manifest's rewrite and their deletion
or its naming them) are deleted. What it skips, loudly: a record that fails its checksum, with
sound records after it or below the acknowledged end, is logged as an error naming its bytes and
counted (`damaged_records`, `skipped_bytes`); its groups are not accepted, so the actors that made
them generate their positions again when they resume (replay/core.py). One loss is tolerated: with
fsync off and the machine restarted since (another boot id in wal.ack), the records acknowledged
last may have died with the OS's cache, as replay.wal_fsync=false allows; logged and counted too.
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
from typing import Annotated

import msgspec
import pyarrow as pa

from dph_async.protocol import Limits, ProtocolError, RolloutGroup, decode, encode
from dph_async.replay.state import ReplayStateError, digest, fsync_dir

log = logging.getLogger(__name__)

WAL_SCHEMA = pa.schema(
    [
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
FORMAT = 4
MAGIC = b"DPHWAL04"
MANIFEST, ACK = "wal.json", "wal.ack"
_SEGMENT = re.compile(r"seg-(\d{8})\.wal$")
_BASE = re.compile(r"base-(\d{8})\.arrow$")
_SYNC = b"\xd7\x1dWR"
_HEAD = struct.Struct("<4sQI")  # sync, payload length, crc32 of the payload
_HEAD_CRC = struct.Struct("<I")  # crc32 of _HEAD's bytes
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
SEARCH_BYTES = 1 << 20  # how much of a segment the search for the next record after damage reads at once
_GROUPS, _SERVE = b"G", b"S"
_ACK = struct.Struct("<QqQ16s?3x")  # writes so far, segment, bytes acknowledged, boot id, fsync'd
_ACK_CRC = struct.Struct("<I")
_SLOT = _ACK.size + _ACK_CRC.size
_MAX_MANIFEST = 16 << 20
# Our own log, checksummed: the wire's size limits are for peers, and a group accepted under a
# service's raised limits must read back.
_OWN = Limits(max_bytes=1 << 62, max_header_bytes=1 << 62, max_frames=1 << 62, accept=frozenset({RolloutGroup}))
_UNTOUCHED = "nothing of the log was read or changed; repair the file or move the directory away to start a new log"


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


class _ServeRow(msgspec.Struct):
    """A serve record's row, typed: a null or a value of the wrong type is refused, not read."""

    request_id: int
    version: int
    group_actor: list[int]
    group_seq: list[int]
    reference_ids: list[str]
    dropped_actor: list[int]
    dropped_seq: list[int]
    dropped_reason: list[str]


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


def _serve_payload(record: ServeRecord) -> bytes:
    columns = [
        pa.array([record.request_id], pa.int64()),
        pa.array([record.version], pa.int64()),
        pa.array([[a for a, _ in record.group_ids]], pa.list_(pa.int64())),
        pa.array([[s for _, s in record.group_ids]], pa.list_(pa.int64())),
        pa.array([record.reference_ids], pa.list_(pa.string())),
        pa.array([[gid[0] for gid, _ in record.dropped]], pa.list_(pa.int64())),
        pa.array([[gid[1] for gid, _ in record.dropped]], pa.list_(pa.int64())),
        pa.array([[reason for _, reason in record.dropped]], pa.list_(pa.string())),
    ]
    return _SERVE + pa.RecordBatch.from_arrays(columns, schema=WAL_SCHEMA).serialize().to_pybytes()


def _serve_from(payload: memoryview) -> ServeRecord:
    """The serve record of an S record's payload (after its kind byte); ValueError or ArrowException if
    it is not one."""
    batch = pa.ipc.read_record_batch(pa.py_buffer(payload), WAL_SCHEMA)
    batch.validate(full=True)  # offsets inside their buffers before anything is read out of them
    (row,) = batch.to_pylist()
    r = msgspec.convert(row, _ServeRow)
    dropped = list(zip(_ids(r.dropped_actor, r.dropped_seq), r.dropped_reason, strict=True))
    return ServeRecord(r.request_id, r.version, _ids(r.group_actor, r.group_seq), r.reference_ids, dropped)


def _payload(record: Record) -> bytes:
    if isinstance(record, IngestRecord):
        return _groups_payload(record.groups)
    return _serve_payload(record)


def parse_record(payload: memoryview) -> Record:
    """A checksummed record's payload as a Record; WalFormatError's message (without the file) if it is
    not one this build reads."""
    kind = bytes(payload[:1])
    try:
        if kind == _GROUPS:
            return IngestRecord(_groups_from(payload[1:]))
        if kind == _SERVE:
            return _serve_from(payload[1:])
        problem = f"unknown record kind {kind!r}"
    except (ProtocolError, pa.ArrowException, ValueError, EOFError) as e:
        problem = str(e)
    raise WalFormatError(problem)


class WalFormatError(ReplayStateError):
    """A file of the log is not what the manifest says, or not one this build reads: nothing is truncated,
    rewritten or deleted; the file (and where it can, the byte) is named."""


_SegmentNo = Annotated[int, msgspec.Meta(ge=0, lt=10**8)]  # eight digits in its file name
_U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class Sealed(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """A file the log no longer writes: [number, bytes, crc32]."""

    n: _SegmentNo
    bytes: Annotated[int, msgspec.Meta(ge=len(MAGIC), lt=1 << 62)]
    crc32: _U32


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    """wal.json. keep_from: the first segment the newest learner snapshot needs."""

    format: int
    wal_id: str
    keep_from: _SegmentNo | None = None
    base: Sealed | None = None
    sealed: list[Sealed] = []
    live: _SegmentNo | None = None
    crc32: _U32 = 0  # of the manifest's JSON with this field 0

    @property
    def numbers(self) -> list[int]:
        return [s.n for s in self.sealed] + ([] if self.live is None else [self.live])


def _manifest_crc(fields: dict) -> int:
    """Over the JSON the fields were read from, with crc32 0 where it stood (msgspec keeps their order)."""
    return zlib.crc32(msgspec.json.encode({**fields, "crc32": 0}))


def read_manifest(path: Path) -> Manifest:
    """The manifest at `path`, checked; WalFormatError naming the file (and the byte, where JSON breaks)."""
    if path.stat().st_size > _MAX_MANIFEST:
        raise WalFormatError(f"{path}: {path.stat().st_size} bytes, more than a manifest holds; {_UNTOUCHED}")
    data = path.read_bytes()
    try:
        fields = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for bytes not UTF-8
        raise WalFormatError(f"{path}: damaged write-ahead log manifest ({e}); {_UNTOUCHED}") from None
    if isinstance(fields, dict) and "format" not in fields and set(fields) <= {"wal_id", "keep_from", "crc32"}:
        raise WalFormatError(f"{path}: the index of an earlier build's log (format 3 or before, no manifest of its "
                             f"files); this build reads format {FORMAT}; finish its run with that build, or move "
                             "the directory away to start a new log")
    if not isinstance(fields, dict) or fields.get("crc32") != _manifest_crc(fields):
        raise WalFormatError(f"{path}: damaged write-ahead log manifest (bytes 0-{len(data) - 1} do not match "
                             f"their checksum); {_UNTOUCHED}")
    if fields.get("format") != FORMAT:
        raise WalFormatError(f"{path}: a write-ahead log of format {fields.get('format')!r}; this build reads "
                             f"format {FORMAT}; {_UNTOUCHED}")
    try:
        manifest = msgspec.convert(fields, Manifest)
    except msgspec.ValidationError as e:
        raise WalFormatError(f"{path}: not a write-ahead log manifest ({e}); {_UNTOUCHED}") from None
    numbers, base = manifest.numbers, manifest.base
    consecutive = numbers == list(range(numbers[0], numbers[0] + len(numbers))) if numbers else True
    if not consecutive or (base is not None and base.n not in numbers):
        raise WalFormatError(f"{path}: segments {numbers} and base {base and base.n} are not a log's (consecutive "
                             f"segments, the base at one of them); {_UNTOUCHED}")
    return manifest


@dataclass
class Ack:
    """A slot of wal.ack: the `writes`-th append left `segment` `bytes` long."""

    writes: int
    segment: int
    bytes: int
    boot: bytes
    durable: bool  # fsync'd before it was acknowledged

    def pack(self) -> bytes:
        slot = _ACK.pack(self.writes, self.segment, self.bytes, self.boot, self.durable)
        return slot + _ACK_CRC.pack(zlib.crc32(slot))


def read_ack(path: Path) -> Ack:
    """The newer sound slot of wal.ack; WalFormatError if the file is missing or neither slot is sound."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WalFormatError(f"{path}: missing (it says how far the live segment was acknowledged); "
                             f"{_UNTOUCHED}") from None
    slots = []
    for at in range(0, len(data) - _SLOT + 1, _SLOT) if len(data) == 2 * _SLOT else ():
        if zlib.crc32(data[at : at + _ACK.size]) == _ACK_CRC.unpack_from(data, at + _ACK.size)[0]:
            slots.append(Ack(*_ACK.unpack_from(data, at)))
    if not slots:
        raise WalFormatError(f"{path}: damaged: of its {len(data)} bytes (two slots of {_SLOT}) neither slot "
                             f"matches its checksum; {_UNTOUCHED}")
    return max(slots, key=lambda a: a.writes)


def _boot_id() -> bytes:
    """This boot of the machine (what the OS's cache of unsynced writes lives as long as)."""
    try:
        return uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


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
    while start < size:
        # Windows overlap by a sync's bytes less one, so a sync across a window's end is found.
        window = bytes(view[start : min(size, start + SEARCH_BYTES + len(_SYNC) - 1)])
        at = window.find(_SYNC)
        while at >= 0:
            if not isinstance(_frame(view, start + at, size), str):
                return start + at
            at = window.find(_SYNC, at + 1)
        start += SEARCH_BYTES
    return None


def scan(view: memoryview, size: int) -> Iterator[tuple[int, int] | Damage]:
    """A segment's records as (payload offset, length), and the damaged spans between them."""
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


def _add_record(crc: int, header: memoryview | bytes) -> int:
    """A segment's CRC-32 as the manifest keeps it, after one more record: over the record's sync, length
    and payload CRC-32, not the header's own CRC-32, which would cancel out (a CRC-32 over a message and
    its CRC-32 is the same for every message)."""
    return zlib.crc32(header[: _HEAD.size], crc)


def _segment_crc(view: memoryview, size: int) -> int:
    """A sound segment's CRC-32 as the manifest keeps it (see _add_record)."""
    crc = zlib.crc32(view[: len(MAGIC)])
    for found in scan(view, size):
        if not isinstance(found, Damage):
            crc = _add_record(crc, view[found[0] - HEADER_BYTES : found[0]])
    return crc


def _numbered(directory: Path, pattern: re.Pattern) -> dict[int, Path]:
    found = {}
    for p in directory.iterdir():
        m = pattern.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


def _write_durably(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: the old file or the new one survives a crash, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class WriteAheadLog:
    def __init__(self, directory: str | os.PathLike, fsync: bool = False, segment_bytes: int = 256 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.segment = -1  # the segment being written; none until open()
        self._file = None
        self._written = 0
        self._crc = 0  # of the segment being written, as the manifest will keep it
        self._ack_fd: int | None = None
        self._boot = _boot_id()
        self.bytes_since_base = 0
        self.damaged_records = 0  # found by recovery: records cut short or failing their checksum
        self.skipped_bytes = 0  # of them, damaged or missing bytes that were acknowledged (lost, not truncated)
        self.truncated_bytes = 0
        if (self.dir / MANIFEST).exists():
            self._meta = read_manifest(self.dir / MANIFEST)
            self._ack = read_ack(self.dir / ACK)
        else:
            if files := sorted(p.name for p in self.dir.iterdir() if p.name.startswith(("seg-", "base-"))):
                raise WalFormatError(f"{self.dir / MANIFEST}: missing, yet the directory holds log files ({files[0]}, "
                                     f"...): an earlier build's log, or its manifest was lost; {_UNTOUCHED}")
            self._meta = Manifest(FORMAT, uuid.uuid4().hex)
            self._ack = Ack(0, -1, 0, self._boot, fsync)
            _write_durably(self.dir / ACK, self._ack.pack() * 2)
            self._write_meta()
        self._leftovers = self._check()

    @property
    def wal_id(self) -> str:
        return self._meta.wal_id

    def _write_meta(self) -> None:
        self._meta.crc32 = 0
        self._meta.crc32 = zlib.crc32(msgspec.json.encode(self._meta))
        _write_durably(self.dir / MANIFEST, msgspec.json.encode(self._meta))

    def _segment_path(self, n: int) -> Path:
        return self.dir / f"seg-{n:08d}.wal"

    def _base_path(self, n: int) -> Path:
        return self.dir / f"base-{n:08d}.arrow"

    def _acknowledged(self) -> int:
        """Bytes of the live segment that were acknowledged: it is at least this long."""
        if self._file is not None:
            return self._written
        return self._ack.bytes if self._ack.segment == self._meta.live else len(MAGIC)

    def _check(self) -> list[Path]:
        """Every file the manifest names is there at its length; WalFormatError if not. Returns the files it
        no longer or not yet names that a crash can leave behind, for open() to delete; any other file of the
        log's names is refused."""
        m, manifest = self._meta, self.dir / MANIFEST
        expected = {self._segment_path(s.n): s.bytes for s in m.sealed}
        if m.base is not None:
            expected[self._base_path(m.base.n)] = m.base.bytes
        for path, size in expected.items():
            if not path.exists():
                raise WalFormatError(f"{path}: missing; {manifest} names it ({size} bytes); {_UNTOUCHED}")
            if path.stat().st_size != size:
                raise WalFormatError(f"{path}: {path.stat().st_size} bytes, {manifest} says {size} (bytes from "
                                     f"{min(size, path.stat().st_size)} on differ); {_UNTOUCHED}")
        if m.live is not None:
            self._check_live()
        if self._ack.segment > max(m.numbers, default=-1):  # older ones are sealed, or dropped since
            raise WalFormatError(f"{self.dir / ACK}: acknowledges segment {self._ack.segment}, newer than any "
                                 f"{manifest} names; {_UNTOUCHED}")
        leftovers = list(self.dir.glob("*.tmp"))  # a write a crash cut short, before its rename
        first = m.numbers[0] if m.numbers else None
        for n, path in _numbered(self.dir, _SEGMENT).items():
            dropped = first is not None and n < first  # dropped from the manifest, not yet deleted
            started = (m.live is None or n > m.live) and path.stat().st_size <= len(MAGIC) and MAGIC.startswith(
                path.read_bytes())  # started, not yet named: nothing was appended to it
            if dropped or started:
                leftovers.append(path)
            elif n not in m.numbers:
                raise WalFormatError(f"{path}: a segment {manifest} does not name; {_UNTOUCHED}")
        leftovers += [p for n, p in _numbered(self.dir, _BASE).items() if m.base is None or n != m.base.n]
        return sorted(set(leftovers))

    def _check_live(self) -> None:
        path, acked = self._segment_path(self._meta.live), self._acknowledged()
        size = path.stat().st_size if path.exists() else 0
        if size >= acked or self._ack.segment != self._meta.live:  # nothing of it was acknowledged
            return
        if not path.exists():
            raise WalFormatError(f"{path}: missing; {self.dir / MANIFEST} names it as the segment being written, "
                                 f"{acked} bytes of it acknowledged ({self.dir / ACK}); {_UNTOUCHED}")
        if self._ack.durable or self._ack.boot == self._boot:
            raise WalFormatError(f"{path}: {size} bytes, but bytes up to {acked} were acknowledged ({self.dir / ACK}):"
                                 f" acknowledged records from byte {size} on are missing; {_UNTOUCHED}")
        log.error("write-ahead log %s: %d bytes, but bytes up to %d were acknowledged before the machine restarted: "
                  "with replay.wal_fsync=false the OS lost them; their groups are not accepted, so their actors "
                  "generate them again when they resume", path, size, acked)
        self.damaged_records += 1
        self.skipped_bytes += acked - size
        self._ack.bytes = size

    def latest_base(self) -> tuple[int, Path] | None:
        """The base the manifest names, its digest checked."""
        base = self._meta.base
        if base is None:
            return None
        path = self._base_path(base.n)
        if digest(path) != base.crc32:
            raise WalFormatError(f"{path}: not the base {self.dir / MANIFEST} names (its checksum trailer "
                                 f"ending at byte {base.bytes - 1} differs); {_UNTOUCHED}")
        return base.n, path

    def records(self, start: int = 0, repair: bool = False) -> Iterator[Record]:
        """The records of the segments from `start` on, in order, damaged ones skipped. repair=True
        (recovery) truncates the live segment's torn tail."""
        self._check()
        for s in self._meta.sealed:
            if s.n >= start:
                yield from self._segment_records(self._segment_path(s.n), s, s.bytes, repair)
        live = self._meta.live
        if live is not None and live >= start:
            yield from self._segment_records(self._segment_path(live), None, self._acknowledged(), repair)

    def _segment_records(self, path: Path, sealed: Sealed | None, acked: int, repair: bool) -> Iterator[Record]:
        size = path.stat().st_size if sealed is not None or path.exists() else 0
        buf = pa.memory_map(str(path)).read_buffer() if size else pa.py_buffer(b"")
        view = memoryview(buf)
        if bytes(view[: len(MAGIC)]) != MAGIC:
            if sealed is None and size < len(MAGIC) and MAGIC.startswith(bytes(view)):
                return  # the live segment, with nothing acknowledged: its magic never reached the disk
            raise WalFormatError(f"{path}: bytes 0-7 hold {bytes(view[:8])!r}, not {MAGIC!r}: a segment of another "
                                 f"build's format, or damage; {_UNTOUCHED}")
        crc, damaged = zlib.crc32(MAGIC), False
        for found in scan(view, size):
            if isinstance(found, Damage):
                damaged = True
                self._damaged(path, found, size, acked, repair)
                continue
            body, length = found
            crc = _add_record(crc, view[body - HEADER_BYTES : body])
            try:
                yield parse_record(view[body : body + length])
            except WalFormatError as e:
                raise WalFormatError(f"{path}: the record at byte {body - HEADER_BYTES} is not one this build reads "
                                     f"({e}); its checksums hold, so it is no torn write; {_UNTOUCHED}") from None
        if sealed is not None and not damaged and crc != sealed.crc32:
            raise WalFormatError(f"{path}: every record is sound, yet bytes 0-{size - 1} do not match the "
                                 f"checksum {self.dir / MANIFEST} keeps for them (records replaced or reordered); "
                                 f"{_UNTOUCHED}")

    def _damaged(self, path: Path, damage: Damage, size: int, acked: int, repair: bool) -> None:
        where = f"write-ahead log {path}: bytes {damage.offset}-{damage.end - 1} ({damage.problem})"
        if damage.end < size or damage.offset < acked:  # acknowledged data was lost: say so loudly
            log.error("%s: skipped, the record there is lost; the groups it held are not accepted, so their "
                      "actors generate them again when they resume; the %d bytes after it are read", where,
                      size - damage.end)
            if repair:
                self.damaged_records += 1
                self.skipped_bytes += damage.end - damage.offset
            return
        if not repair:
            log.warning("%s: past the acknowledged end (byte %d), not read", where, acked)
            return
        self.damaged_records += 1
        self.truncated_bytes += size - damage.offset
        log.warning("%s: past the acknowledged end (byte %d), a write a crash cut short, never acknowledged; "
                    "truncated there, the records before it are kept", where, acked)
        os.truncate(path, damage.offset)

    def missing_segments(self, start: int) -> bool:
        """True if segments from `start` on were already dropped or never written here (a log directory
        older than the snapshot naming `start`): the log's segments are consecutive, so either way
        `start` is not one of them."""
        return start not in self._meta.numbers

    def open(self) -> None:
        """Start writing: a new segment after every existing one (a torn one is never appended to); the
        files a crash left behind are deleted."""
        base = self._meta.base
        self.bytes_since_base = sum(s.bytes for s in self._meta.sealed if base is None or s.n >= base.n)
        if self._meta.live is not None and self._segment_path(self._meta.live).exists():
            self.bytes_since_base += self._segment_path(self._meta.live).stat().st_size
        self.roll()

    def _seal(self) -> None:
        """Name the live segment in the manifest's sealed list, its bytes and checksum final."""
        n = self._meta.live
        if n is None:
            return
        path = self._segment_path(n)
        if self._file is not None:
            if not self.fsync:  # its records may be in the OS's cache alone; a sealed segment is on disk
                os.fsync(self._file.fileno())
            size, crc = self._written, self._crc
            self._file.close()
            self._file = None
        else:  # the segment an earlier process was writing, as recovery left it
            size = path.stat().st_size if path.exists() else 0
            if size < len(MAGIC):
                path.write_bytes(MAGIC)  # its magic never reached the disk: nothing was acknowledged in it
                size = len(MAGIC)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            crc = _segment_crc(memoryview(pa.memory_map(str(path)).read_buffer()), size)
        self._meta.sealed.append(Sealed(n, size, crc))
        self._meta.live = None

    def roll(self) -> int:
        """Seal the current segment and start the next; returns the new segment's number."""
        n = self._next_segment()
        self._write_meta()
        return n

    def _next_segment(self) -> int:
        """roll() but for the manifest, which names the new segment before anything is appended to it: a
        crash before that leaves a segment of its magic alone, which the next start deletes."""
        if self._ack_fd is None:  # the first write of this process: the files a crash left go first
            for path in self._leftovers:  # (a segment started but never named may have the next number)
                log.info("write-ahead log: deleting %s, which its manifest no longer or not yet names", path)
                path.unlink(missing_ok=True)
            self._leftovers = []
            self._ack_fd = os.open(self.dir / ACK, os.O_WRONLY)
        self._seal()
        self.segment = max([*self._meta.numbers, self.segment]) + 1
        path = self._segment_path(self.segment)
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 (see close())
        self._file.write(MAGIC)
        self._written, self._crc = len(MAGIC), zlib.crc32(MAGIC)
        self._meta.live = self.segment
        return self.segment

    def append(self, record: Record) -> None:
        """Write a record to the OS (and to disk with fsync=True), then say so in wal.ack: acknowledged
        once this returns."""
        assert self._file is not None and self._ack_fd is not None, "WriteAheadLog.open() first"
        payload = _payload(record)
        header = record_header(payload)
        size = len(header) + len(payload)
        if os.writev(self._file.fileno(), [header, payload]) != size:
            raise OSError(f"write-ahead log {self._segment_path(self.segment)}: short write")
        self._written += size
        self._crc = _add_record(self._crc, header)
        self.bytes_since_base += size
        if self.fsync:
            os.fsync(self._file.fileno())
        self._ack = Ack(self._ack.writes + 1, self.segment, self._written, self._boot, self.fsync)
        os.pwrite(self._ack_fd, self._ack.pack(), (self._ack.writes & 1) * _SLOT)
        if self._written >= self.segment_bytes:
            self.roll()

    def write_base(self, write: Callable[[Path, int], None]) -> int:
        """Roll, then have `write(path, segment)` write the state as the base of the new segment (durably,
        as replay/state.py does); then name it in the manifest and delete what no longer needs keeping."""
        n = self._next_segment()  # named with the base, in one manifest: a crash before leaves both unnamed
        path = self._base_path(n)
        write(path, n)
        old = self._meta.base
        self._meta.base = Sealed(n, path.stat().st_size, digest(path))
        self.bytes_since_base = 0
        self._retain([] if old is None else [self._base_path(old.n)])
        return n

    def keep_from(self, segment: int) -> None:
        """A learner snapshot was taken at `segment`: keep segments from there on for its restore."""
        self._meta.keep_from = segment
        self._retain([])

    def _retain(self, drop: list[Path]) -> None:
        """Rewrite the manifest without the segments no base or snapshot needs, then delete them and `drop`."""
        base = self._meta.base
        if base is not None:
            keep = base.n if self._meta.keep_from is None else min(base.n, self._meta.keep_from)
            drop += [self._segment_path(s.n) for s in self._meta.sealed if s.n < keep]
            self._meta.sealed = [s for s in self._meta.sealed if s.n >= keep]
        self._write_meta()
        for path in drop:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._ack_fd is not None:
            os.close(self._ack_fd)
            self._ack_fd = None
