"""The replay's whole state as one file: what a snapshot and a write-ahead-log base hold.

An Arrow IPC file: one row per held group (the columns of replay/records.py plus `served`), and
everything else (version, pending batch, accepted seqs, counters, reference draw position,
write-ahead-log position) as JSON in the schema metadata. Written to a temporary name and
renamed, so a crash mid-write leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from dph_async.protocol import RolloutGroup
from replay.records import GROUP_FIELDS, group_columns, groups_from

FORMAT = 1
STATE_FILE = "replay_state.arrow"
_META_KEY = b"dph_async.replay_state"
STATE_SCHEMA = pa.schema([*GROUP_FIELDS, pa.field("served", pa.int64())])


class ReplayStateError(ValueError):
    """A state file is missing, unreadable or of another format; the message names the file."""


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
    os.replace(tmp, target)
    return target


def read_state(path: str | os.PathLike) -> ReplayState:
    source = state_path(path)
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(source)))
        table = reader.read_all()
        meta = json.loads(reader.schema.metadata[_META_KEY])
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
