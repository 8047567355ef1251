"""The replay's whole state as one file: what a snapshot and a write-ahead-log base hold.

An Arrow IPC file: one row per held group (the columns of replay/records.py plus `served`), and
everything else (version, pending batch, accepted seqs, counters, reference draw position,
write-ahead-log position) as JSON in the schema metadata. Written to a temporary name and
renamed, so a crash mid-write leaves the previous file intact.

After the Arrow file comes a trailer of checksums, so that damage is refused, never read as data (a
flipped byte once turned token id 52211 into -16,725,005 unnoticed):

    crc32s      u32 x n     zlib.crc32 of each BLOCK_BYTES of the Arrow file (the last block shorter)
    block       u32         BLOCK_BYTES
    length      u64         bytes of the Arrow file
    crc32       u32         of the trailer's bytes before it
    magic       8 bytes     b"DPHSTAT2"

A file that ends with Arrow's own magic instead is an earlier build's, without checksums: it is read
as it is, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from dph_async.protocol import RolloutGroup
from replay.records import GROUP_FIELDS, group_columns, groups_from

log = logging.getLogger(__name__)

FORMAT = 1
STATE_FILE = "replay_state.arrow"
_META_KEY = b"dph_async.replay_state"
STATE_SCHEMA = pa.schema([*GROUP_FIELDS, pa.field("served", pa.int64())])
MAGIC = b"DPHSTAT2"
ARROW_MAGIC = b"ARROW1"  # how an Arrow IPC file ends: an earlier build's state file, without checksums
BLOCK_BYTES = 1 << 16
_TAIL = struct.Struct("<IQ")  # block, length
_CRC = struct.Struct("<I")


class ReplayStateError(ValueError):
    """A state file is missing, damaged, unreadable or of another format; the message names the file
    (and, for damage, its bytes)."""


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
    table = pa.Table.from_pydict(columns, schema=STATE_SCHEMA.with_metadata({_META_KEY: json.dumps(meta)}))
    tmp = target.with_name(target.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _append_checksums(tmp)
    os.replace(tmp, target)
    return target


def _block_crcs(view: memoryview) -> list[int]:
    return [zlib.crc32(view[at : at + BLOCK_BYTES]) for at in range(0, len(view), BLOCK_BYTES)]


def _append_checksums(path: Path) -> None:
    with open(path, "r+b") as f:
        crcs = [zlib.crc32(block) for block in iter(lambda: f.read(BLOCK_BYTES), b"")]
        trailer = struct.pack(f"<{len(crcs)}I", *crcs) + _TAIL.pack(BLOCK_BYTES, f.tell())
        f.write(trailer + _CRC.pack(zlib.crc32(trailer)) + MAGIC)


def _arrow_bytes(source: Path, buf: pa.Buffer) -> pa.Buffer:
    """The Arrow file inside a state file, its checksums verified; ReplayStateError names damage's bytes."""
    size = buf.size
    end = buf.slice(max(size - len(MAGIC), 0)).to_pybytes()
    if end.endswith(ARROW_MAGIC):
        log.warning("replay state %s: written by an earlier build, without checksums: read unchecked", source)
        return buf
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


def read_state(path: str | os.PathLike) -> ReplayState:
    source = state_path(path)
    try:
        reader = pa.ipc.open_file(_arrow_bytes(source, pa.memory_map(str(source)).read_buffer()))
        table = reader.read_all()
        meta = json.loads(reader.schema.metadata[_META_KEY])
    except ReplayStateError:
        raise
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError) as e:
        raise ReplayStateError(f"{source}: not a readable replay state file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise ReplayStateError(f"{source}: state format {meta.get('format')!r}, this build reads {FORMAT}")
    pending = meta["pending"]
    return ReplayState(
        version=meta["version"],
        groups=groups_from(table),
        served=table.column("served").to_pylist(),
        pending=PendingBatch(
            pending["request_id"],
            pending["version"],
            [tuple(g) for g in pending["group_ids"]],
            pending["reference_ids"],
        )
        if pending
        else None,
        accepted=meta["accepted"],
        counters=meta["counters"],
        reference_cursor=meta["reference_cursor"],
        wal_id=meta["wal_id"],
        wal_segment=meta["wal_segment"],
    )
