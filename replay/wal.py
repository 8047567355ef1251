"""The write-ahead log: every state change is appended here before anyone is told about it.

A directory of numbered segments, each an Arrow IPC stream of records, plus bases (state files,
replay/state.py) that summarise everything before a segment:

    wal.json              {"wal_id": ..., "keep_from": first segment a learner snapshot needs}
    seg-00000007.arrow    records, appended and flushed before the replay acknowledges them
    base-00000007.arrow   the state at the start of segment 7

Two record kinds, one row each per group or batch:
    ingest   an accepted group (all its columns): written before the group is acknowledged
    serve    a batch served: request id, version, group ids, reference ids, and the groups dropped
             since the previous batch; it also confirms the batch before it

Recovery loads the newest base and applies the segments from there on. A record torn by a crash
(a partial final record batch) was never acknowledged, so it is skipped. Segments are deleted once
both the newest base and the newest learner snapshot are past them: a restore re-adds the groups
accepted after its snapshot from these segments, so nothing an actor was told is accepted is lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from dph_async.protocol import RolloutGroup
from replay.records import GROUP_FIELDS, group_columns, groups_from

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
_SEGMENT = re.compile(r"seg-(\d{8})\.arrow$")
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


def _to_batch(record: Record) -> pa.RecordBatch:
    """Every record batch holds one kind; the other kind's columns are null."""
    if isinstance(record, IngestRecord):
        n = len(record.groups)
        columns = {"op": pa.array(["ingest"] * n), **group_columns(record.groups)}
    else:
        n = 1
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
    arrays = [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in WAL_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=WAL_SCHEMA)


def _from_batch(batch: pa.RecordBatch) -> Iterator[Record]:
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
        self._writer: pa.RecordBatchStreamWriter | None = None
        self._written = 0
        self.bytes_since_base = 0

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
        return self.dir / f"seg-{n:08d}.arrow"

    def latest_base(self) -> tuple[int, Path] | None:
        bases = self._numbered(_BASE)
        return max(bases.items()) if bases else None

    def records(self, start: int = 0) -> Iterator[Record]:
        """The records of segments >= start, in order; a torn final record of a segment is skipped."""
        for n, path in sorted(self._numbered(_SEGMENT).items()):
            if n < start or path.stat().st_size == 0:  # 0 bytes: opened, then nothing written
                continue
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            except (pa.ArrowInvalid, OSError):
                log.warning("write-ahead log %s: torn at its start, skipped", path.name)
                continue
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowInvalid, OSError) as e:
                    log.warning("write-ahead log %s: torn final record skipped (%s)", path.name, e)
                    break
                yield from _from_batch(batch)

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
        self._writer = pa.ipc.new_stream(self._file, WAL_SCHEMA)
        self._written = 0
        return self.segment

    def append(self, record: Record) -> None:
        """Write a record to the OS (and to disk with fsync=True): durable once this returns."""
        assert self._writer is not None, "WriteAheadLog.open() first"
        before = self._file.tell()
        self._writer.write_batch(_to_batch(record))
        size = self._file.tell() - before
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
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = None
            self._file = None
