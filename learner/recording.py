"""The learner's recording: every batch it trained on, in order, so that a run can be re-executed.

    <rl_dir>/recording.json          what the trainer was built from: its config file and model directory
    <rl_dir>/learner_config.yaml     the learner's own config (after the run spec was applied)
    <rl_dir>/batches.rec             the batches, one record per step

`batches.rec` is the 8-byte magic b"DPHREC01", then one record per learner step, written before the
step trains (a step that fails is still on record):

    length  u64 little-endian   bytes of the payload
    crc32   u32 little-endian   zlib.crc32 of the payload
    payload                     u32 frames, u64 per frame its bytes, then the frames: the step's
                                `Batch` in the wire protocol's own encoding (dph_async/protocol.py)

A record holds the batch exactly as `Trainer.train_step` got it: the fresh groups and the reference
samples drawn for it, in order, and the drop counts logged with the step. The mini-batch and epoch
plan is not recorded: it is a function of the seed, the version and the batch (learner/trainer.py).
Reading trusts nothing: a length is checked against the file before anything is read, the checksum
before anything is parsed, and the batch goes through the protocol's bounded, validated decoder.
Damage is refused with the file and the byte offset, never read as data.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dph_async.config import RunConfig, dump_config
from dph_async.protocol import Batch, Limits, ProtocolError, decode, encode

RECORDING = "batches.rec"
RUN_INFO = "recording.json"
LEARNER_CONFIG = "learner_config.yaml"
MAGIC = b"DPHREC01"
log = logging.getLogger(__name__)
_RECORD = struct.Struct("<QI")  # payload length, crc32 of the payload
_COUNT = struct.Struct("<I")
_SIZE = struct.Struct("<Q")


class RecordingError(ValueError):
    """A recording that cannot be read as it stands: the message names the file and the byte offset."""


@dataclass(frozen=True)
class RunInfo:
    """What a rerun builds the trainer from."""

    config: Path  # the learner's config file
    model_dir: Path  # the model the trainer started from (pi_0)
    recording: Path


def write_run_info(rl_dir: Path, cfg: RunConfig, model_dir: str | Path) -> None:
    """Write the learner's config and where its model is. A model inside the run's tree is named
    relative to `rl_dir`, so that a copied or moved run directory still finds it."""
    (rl_dir / LEARNER_CONFIG).write_text(dump_config(cfg))
    model, root = Path(model_dir).resolve(), rl_dir.resolve()
    # rl_dir is <run>/rl/<mode>: pi_0 of the embedded default is <run>/base_model.
    named = os.path.relpath(model, root) if model.is_relative_to(root.parent.parent) else str(model)
    info = {"config": LEARNER_CONFIG, "model_dir": named, "recording": RECORDING}
    (rl_dir / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n")


def read_run_info(rl_dir: Path) -> RunInfo:
    path = rl_dir / RUN_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {rl_dir} is not the directory of a recorded RL run "
                                "(rl/<mode> of a run directory, written with learner.record_batches on)")
    try:
        raw = json.loads(path.read_text())
        return RunInfo(rl_dir / raw["config"], (rl_dir / raw["model_dir"]).resolve(), rl_dir / raw["recording"])
    except (ValueError, KeyError, TypeError) as e:
        raise RecordingError(f"{path}: not a recording description ({e})") from None


def _payload(batch: Batch) -> bytes:
    """The batch's frames behind their count and sizes, in one buffer (a batch has thousands of
    frames: more than one writev takes)."""
    frames = encode(batch)
    sizes = [memoryview(f).nbytes for f in frames]
    return b"".join([struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes), *frames])


def _batch_from(payload: memoryview, where: str) -> Batch:
    """The batch of one checksummed payload; RecordingError (naming `where`) if it is not one."""
    if len(payload) < _COUNT.size:
        raise RecordingError(f"{where}: payload of {len(payload)} bytes holds no frame count")
    (n,) = _COUNT.unpack_from(payload, 0)
    at = _COUNT.size + _SIZE.size * n
    if n == 0 or at > len(payload):
        raise RecordingError(f"{where}: {n} frames announced in a payload of {len(payload)} bytes")
    sizes = struct.unpack_from(f"<{n}Q", payload, _COUNT.size)
    if at + sum(sizes) != len(payload):
        raise RecordingError(f"{where}: frames of {sum(sizes)} bytes in a payload holding {len(payload) - at}")
    frames = []
    for size in sizes:
        frames.append(payload[at:at + size])
        at += size
    try:
        msg = decode(frames, Limits(max_bytes=len(payload), max_header_bytes=len(payload), max_frames=n,
                                    accept=frozenset({Batch})))
    except ProtocolError as e:
        raise RecordingError(f"{where}: not a batch ({e})") from None
    assert isinstance(msg, Batch)
    return msg


def _records(path: Path) -> Iterator[tuple[int, memoryview]]:
    """(offset, payload) of each record, checked, in order, read as asked for; RecordingError at the
    first damage."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise RecordingError(f"{path}: not a batch recording (no {MAGIC!r} at byte 0)")
        offset = len(MAGIC)
        while offset < size:
            head = f.read(_RECORD.size)
            if len(head) < _RECORD.size:
                raise RecordingError(f"{path}: record header at byte {offset} cut short ({len(head)} bytes)")
            length, crc = _RECORD.unpack(head)
            body = offset + _RECORD.size
            if length > size - body:
                raise RecordingError(f"{path}: record at byte {offset} cut short ({length} bytes announced, "
                                     f"{size - body} left)")
            payload = f.read(length)
            if zlib.crc32(payload) != crc:
                raise RecordingError(f"{path}: record at byte {offset} fails its checksum")
            yield offset, memoryview(payload)
            offset = body + length


def read_batches(path: Path) -> Iterator[tuple[int, Batch]]:
    """(byte offset, batch) of each record in order. Records are read as they are asked for: a rerun
    that stops before a damaged record never meets it, and only the record in hand is in memory."""
    for offset, payload in _records(path):
        yield offset, _batch_from(payload, f"{path}: record at byte {offset}")


def _end_of_records(path: Path, keep: int) -> int | None:
    """The byte offset after the first `keep` records (None: the file holds fewer, or is damaged
    before their end)."""
    try:
        for i, (offset, payload) in enumerate(_records(path)):
            if i + 1 == keep:
                return offset + _RECORD.size + len(payload)
    except RecordingError as e:
        log.warning("%s", e)
    return None


class BatchRecorder:
    """Appends each step's batch to the recording. `keep`: records to keep from an earlier process of
    the same run (a resumed run keeps the steps before its checkpoint, as metrics.jsonl does; the
    steps after it are trained again and recorded again)."""

    def __init__(self, path: Path, keep: int = 0) -> None:
        self.path = path
        end = _end_of_records(path, keep) if keep and path.is_file() else None
        if end is not None:
            os.truncate(path, end)
        else:
            if keep:
                # The steps before the checkpoint are not all on record (recording was off, or the
                # file is damaged): it starts anew here, and a rerun starts from this checkpoint.
                log.warning("%s: the %d steps before the checkpoint are not on record; recording from "
                            "version %d on", path, keep, keep)
            path.write_bytes(MAGIC)
        self._file = path.open("ab", buffering=0)

    def append(self, batch: Batch) -> None:
        payload = _payload(batch)
        written = os.writev(self._file.fileno(), [_RECORD.pack(len(payload), zlib.crc32(payload)), payload])
        if written != _RECORD.size + len(payload):
            raise OSError(f"{self.path}: short write ({written} of {_RECORD.size + len(payload)} bytes)")

    def close(self) -> None:
        self._file.close()
