"""The replay's whole state as one file: what a snapshot and a write-ahead-log base hold.

An Arrow IPC file: one row per held group (the columns of replay/records.py plus `served`), and
everything else (version, pending batch, accepted seqs, counters, reference draw position,
write-ahead-log position) as JSON in the schema metadata. Written to a temporary name, flushed to
disk and renamed, so a crash mid-write leaves the previous file intact and a finished one is durable.

After the Arrow file comes a trailer of checksums, so that damage is refused, never read as data (a
flipped byte once turned token id 52211 into -16,725,005 unnoticed):

    crc32s      u32 x n     zlib.crc32 of each BLOCK_BYTES of the Arrow file (the last block shorter)
    block       u32         BLOCK_BYTES
    length      u64         bytes of the Arrow file
    crc32       u32         of the trailer's bytes before it
    magic       8 bytes     b"DPHSTAT2"

The trailer's own CRC-32 covers every block's, so it stands for the whole file (`digest`): the
write-ahead log's manifest names a base by it. A file that ends with Arrow's own magic instead has no
checksums (an earlier build's, or one whose trailer was cut off): it is refused, never read unchecked.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
import pyarrow as pa

from dph_async.protocol import RolloutGroup
from dph_async.replay.records import GROUP_FIELDS, group_columns, groups_from

FORMAT = 1
STATE_FILE = "replay_state.arrow"
_META_KEY = b"dph_async.replay_state"
STATE_SCHEMA = pa.schema([*GROUP_FIELDS, pa.field("served", pa.int64())])
MAGIC = b"DPHSTAT2"
ARROW_MAGIC = b"ARROW1"  # how an Arrow IPC file ends: a state file without checksums
BLOCK_BYTES = 1 << 16
_TAIL = struct.Struct("<IQ")  # block, length
_CRC = struct.Struct("<I")


class ReplayStateError(ValueError):
    """A state file (or a file of the write-ahead log: replay.wal.WalFormatError) is missing, damaged,
    unreadable or of another format; the message names the file (and, for damage, its bytes)."""


class _Pending(msgspec.Struct, forbid_unknown_fields=True):
    request_id: int
    version: int
    group_ids: list[tuple[int, int]]
    reference_ids: list[str]


class _Meta(msgspec.Struct, forbid_unknown_fields=True):
    """The schema metadata, typed: a file is a stranger's, so a field of the wrong type is refused here."""

    format: int
    version: int
    pending: _Pending | None
    accepted: dict[int, tuple[int, list[int]]]  # actor -> (watermark, accepted above it)
    counters: dict[str, int]
    reference_cursor: int
    wal_id: str
    wal_segment: int


@dataclass
class PendingBatch:
    """The last batch served, kept until the learner asks for the next one (so a retry gets it again)."""

    request_id: int
    version: int
    group_ids: list[tuple[int, int]]
    reference_ids: list[str]


@dataclass
class ReplayState:
    version: int = 0
    groups: list[RolloutGroup] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    pending: PendingBatch | None = None
    accepted: dict[str, list] = field(default_factory=dict)  # replay.dedup.AcceptedSeqs.to_state()
    counters: dict[str, int] = field(default_factory=dict)
    reference_cursor: int = 0
    wal_id: str = ""  # the log this state belongs to, and the first segment after it
    wal_segment: int = 0


def state_path(path: str | os.PathLike) -> Path:
    """A snapshot path names a directory (made if needed) holding STATE_FILE; a *.arrow path is the file."""
    p = Path(path)
    return p if p.suffix == ".arrow" else p / STATE_FILE


def write_state(path: str | os.PathLike, state: ReplayState) -> Path:
    target = state_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": state.version,
        "pending": asdict(state.pending) if state.pending else None,
        "accepted": state.accepted,
        "counters": state.counters,
        "reference_cursor": state.reference_cursor,
        "wal_id": state.wal_id,
        "wal_segment": state.wal_segment,
    }
    columns = group_columns(state.groups)
    columns["served"] = pa.array(state.served, pa.int64())
    table = pa.Table.from_pydict(columns, schema=STATE_SCHEMA.with_metadata({_META_KEY: msgspec.json.encode(meta)}))
    tmp = target.with_name(target.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _append_checksums(tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    return target


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _block_crcs(view: memoryview) -> list[int]:
    return [zlib.crc32(view[at : at + BLOCK_BYTES]) for at in range(0, len(view), BLOCK_BYTES)]


def _append_checksums(path: Path) -> None:
    with open(path, "r+b") as f:
        crcs = [zlib.crc32(block) for block in iter(lambda: f.read(BLOCK_BYTES), b"")]
        trailer = struct.pack(f"<{len(crcs)}I", *crcs) + _TAIL.pack(BLOCK_BYTES, f.tell())
        f.write(trailer + _CRC.pack(zlib.crc32(trailer)) + MAGIC)
        f.flush()
        os.fsync(f.fileno())


def digest(path: Path) -> int:
    """The CRC-32 of a state file's trailer, which covers every block's: one number for the whole file.
    Only as good as the file: read_state checks the blocks against it."""
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - len(MAGIC) - _CRC.size, 0))
        end = f.read()
    if len(end) < len(MAGIC) + _CRC.size or not end.endswith(MAGIC):
        raise ReplayStateError(f"{path}: no {MAGIC!r} checksum trailer at its end; refused, nothing of it was read")
    return _CRC.unpack_from(end)[0]


def _arrow_bytes(source: Path, buf: pa.Buffer) -> pa.Buffer:
    """The Arrow file inside a state file, its checksums verified; ReplayStateError names damage's bytes."""
    size = buf.size
    end = buf.slice(max(size - len(MAGIC), 0)).to_pybytes()
    if end.endswith(ARROW_MAGIC):
        raise ReplayStateError(f"{source}: an Arrow file without this format's checksum trailer (an earlier build's "
                               f"state file, or its trailer was cut off at byte {size}); refused, nothing of it was "
                               "read")
    crc_at = size - len(MAGIC) - _CRC.size
    if crc_at - _TAIL.size < 0:
        raise ReplayStateError(f"{source}: not a readable replay state file (only {size} bytes)")
    if end != MAGIC:
        raise ReplayStateError(f"{source}: damaged or not a replay state file: bytes {size - len(MAGIC)}-{size - 1} "
                               f"are neither {MAGIC!r} nor Arrow's end")
    view = memoryview(buf)
    block, length = _TAIL.unpack_from(view, crc_at - _TAIL.size)
    blocks = -(-length // block) if block else -1
    sound = blocks >= 0 and length + 4 * blocks + _TAIL.size == crc_at
    if not sound or zlib.crc32(view[length:crc_at]) != _CRC.unpack_from(view, crc_at)[0]:
        raise ReplayStateError(f"{source}: damaged: the checksum trailer ending at byte {size - 1} fails its own "
                               "checksum; nothing of it was read")
    stored = struct.unpack_from(f"<{blocks}I", view, length)
    for i, (want, got) in enumerate(zip(stored, _block_crcs(view[:length]), strict=True)):
        if want != got:
            first = i * block
            raise ReplayStateError(f"{source}: damaged: bytes {first}-{min(first + block, length) - 1} fail their "
                                   "checksum; nothing of it was read")
    return buf.slice(0, length)


def _has_nulls(array: pa.Array) -> bool:
    if array.null_count:
        return True
    if pa.types.is_struct(array.type):
        return any(_has_nulls(child) for child in array.flatten())
    return pa.types.is_list(array.type) and _has_nulls(array.values)


def read_state(path: str | os.PathLike) -> ReplayState:
    source = state_path(path)
    try:
        buf = pa.memory_map(str(source)).read_buffer()
    except (OSError, pa.ArrowException) as e:
        raise ReplayStateError(f"{source}: not a readable replay state file ({type(e).__name__}: {e})") from None
    return decode_state(_arrow_bytes(source, buf), source)


def decode_state(arrow: pa.Buffer, source: str | os.PathLike) -> ReplayState:
    """The state in an Arrow file whose checksums held; ReplayStateError naming `source` if it is not one."""
    try:
        reader = pa.ipc.open_file(arrow)
        table = reader.read_all()
        table.validate(full=True)  # offsets inside their buffers before anything is read out of them
        if not table.schema.equals(STATE_SCHEMA):
            raise ValueError(f"columns {table.schema.names} of other types or names than a replay state's")
        if any(_has_nulls(chunk) for column in table.columns for chunk in column.chunks):
            raise ValueError("null values, which no field of a group has")
        meta = msgspec.json.decode((reader.schema.metadata or {})[_META_KEY], type=_Meta)
        if meta.format != FORMAT:
            raise ValueError(f"state format {meta.format}, this build reads {FORMAT}")
        groups = groups_from(table)
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError) as e:
        raise ReplayStateError(f"{source}: not a readable replay state file ({type(e).__name__}: {e})") from None
    pending = meta.pending
    return ReplayState(
        version=meta.version,
        groups=groups,
        served=table.column("served").to_pylist(),
        pending=PendingBatch(pending.request_id, pending.version, pending.group_ids, pending.reference_ids)
        if pending
        else None,
        accepted={str(k): list(v) for k, v in meta.accepted.items()},
        counters=meta.counters,
        reference_cursor=meta.reference_cursor,
        wal_id=meta.wal_id,
        wal_segment=meta.wal_segment,
    )
