"""The learner's recording (learner/recording.py) at its edges: a record that ends exactly at the end
of the file and one a byte short, a header cut anywhere, a payload whose frame table does not add up,
a checksummed message of another type, a resume that keeps exactly as many records as the file
holds, a short write, and where a run's description says its model is."""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from dph_async.config import RunConfig, dump_config
from dph_async.learner.recording import (
    LEARNER_CONFIG,
    MAGIC,
    RECORDING,
    RUN_INFO,
    BatchRecorder,
    RecordingError,
    read_batches,
    read_run_info,
    write_run_info,
)
from dph_async.protocol import Batch, Completion, RolloutGroup, SamplingInfo, encode
from dph_async.rewards.result import RewardResult


def rollout(seq: int) -> RolloutGroup:
    ids = np.arange(1, 2 + seq % 3, dtype=np.int32)
    comp = Completion(ids, -np.ones(len(ids), np.float32), np.zeros(len(ids), np.int32), RewardResult(1.0, True),
                      "stop")
    return RolloutGroup(0, seq, f"p{seq}", "digits", ids, [comp], SamplingInfo(1.0, 1.0, -1, 4), 0.0, 0.0)


def batch(version: int) -> Batch:
    return Batch(version, [rollout(2 * version), rollout(2 * version + 1)], [], {"stale": version})


def recorded(path: Path, n: int) -> list[int]:
    """A recording of n batches; the byte offset of each record."""
    recorder = BatchRecorder(path)
    for v in range(n):
        recorder.append(batch(v))
    recorder.close()
    return [o for o, _ in read_batches(path)]


def record(payload: bytes) -> bytes:
    return struct.pack("<QI", len(payload), zlib.crc32(payload)) + payload


def frames(*parts: bytes) -> bytes:
    """A payload: the frame count, each frame's size, the frames."""
    return struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)


def refusal(path: Path) -> str:
    with pytest.raises(RecordingError) as e:
        list(read_batches(path))
    return str(e.value)


def test_records_read_back_in_order_at_their_offsets(tmp_path):
    path = tmp_path / RECORDING
    offsets = recorded(path, 3)
    assert offsets[0] == len(MAGIC) and offsets == sorted(offsets)
    data = path.read_bytes()
    for at, end in zip(offsets, [*offsets[1:], len(data)], strict=True):
        (length,) = struct.unpack_from("<Q", data, at)
        assert at + 12 + length == end  # each record's header and payload, nothing between
    assert [(b.version, [g.seq for g in b.groups], b.drops) for _, b in read_batches(path)] == \
        [(v, [2 * v, 2 * v + 1], {"stale": v}) for v in range(3)]
    empty = tmp_path / "empty.rec"
    BatchRecorder(empty).close()
    assert empty.read_bytes() == MAGIC and list(read_batches(empty)) == []


def test_a_record_ending_exactly_at_the_end_is_read_and_one_byte_short_is_refused(tmp_path):
    path = tmp_path / RECORDING
    offsets = recorded(path, 2)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert refusal(path) == (f"{path}: record at byte {offsets[1]} cut short "
                             f"({len(data) - offsets[1] - 12} bytes announced, {len(data) - offsets[1] - 13} left)")
    path.write_bytes(data)
    assert len(list(read_batches(path))) == 2


@pytest.mark.parametrize("left", [1, 11])
def test_a_header_cut_short_is_refused_with_its_offset(tmp_path, left):
    path = tmp_path / RECORDING
    offsets = recorded(path, 2)
    path.write_bytes(path.read_bytes()[:offsets[1] + left])
    assert refusal(path) == f"{path}: record header at byte {offsets[1]} cut short ({left} bytes)"


def test_only_the_magic_at_byte_zero_opens_a_recording(tmp_path):
    path = tmp_path / RECORDING
    recorded(path, 1)
    data = bytearray(path.read_bytes())
    data[7] ^= 1  # the magic's last byte
    path.write_bytes(bytes(data))
    assert refusal(path) == f"{path}: not a batch recording (no {MAGIC!r} at byte 0)"


@pytest.mark.parametrize(("payload", "why"), [
    (b"\x01\x00\x00", "payload of 3 bytes holds no frame count"),
    (struct.pack("<I", 0), "0 frames announced in a payload of 4 bytes"),
    (struct.pack("<IQ", 2, 1) + b"x", "2 frames announced in a payload of 13 bytes"),
    (struct.pack("<IQ", 1, 4) + b"abc", "frames of 4 bytes in a payload holding 3"),
    (struct.pack("<IQ", 1, 2) + b"abc", "frames of 2 bytes in a payload holding 3"),
    # The table exactly filling the payload: one empty frame, no header in it, refused by the decoder.
    (struct.pack("<IQ", 1, 0), "not a batch (header is not a valid message envelope"),
])
def test_a_checksummed_payload_whose_frames_do_not_add_up_is_refused(tmp_path, payload, why):
    path = tmp_path / RECORDING
    path.write_bytes(MAGIC + record(payload))
    assert refusal(path).startswith(f"{path}: record at byte 8: {why}")


def test_a_checksummed_message_of_another_type_is_refused_as_no_batch(tmp_path):
    path = tmp_path / RECORDING
    good = frames(*(bytes(f) for f in encode(batch(0))))
    other = frames(*(bytes(f) for f in encode(rollout(0))))
    path.write_bytes(MAGIC + record(good) + record(other))
    with pytest.raises(RecordingError, match=rf"^{path}: record at byte {8 + 12 + len(good)}: not a batch \(") as e:
        list(read_batches(path))
    assert "RolloutGroup" in str(e.value)
    # Records are read as they are asked for: the batch before the damage comes out first.
    first = next(read_batches(path))
    assert first[0] == 8 and first[1].version == 0


def test_a_resume_keeps_exactly_the_records_asked_for(tmp_path, caplog):
    path = tmp_path / RECORDING
    offsets = recorded(path, 3)
    size = path.stat().st_size
    BatchRecorder(path, keep=3).close()  # all of them: nothing cut
    assert path.stat().st_size == size
    recorder = BatchRecorder(path, keep=1)
    assert path.stat().st_size == offsets[1]
    recorder.append(batch(7))  # appended after the kept record
    recorder.close()
    assert [b.version for _, b in read_batches(path)] == [0, 7]
    with caplog.at_level(logging.WARNING, logger="dph_async.learner.recording"):
        BatchRecorder(path, keep=3).close()  # more than the file holds: it starts anew
    assert path.read_bytes() == MAGIC
    assert caplog.messages == [f"{path}: the 3 steps before the checkpoint are not on record; recording from "
                               "version 3 on"]


def test_a_resume_over_a_damaged_recording_starts_anew_and_says_why(tmp_path, caplog):
    path = tmp_path / RECORDING
    offsets = recorded(path, 2)
    data = bytearray(path.read_bytes())
    data[offsets[0] + 20] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dph_async.learner.recording"):
        BatchRecorder(path, keep=1).close()
    assert path.read_bytes() == MAGIC
    assert caplog.messages[0] == f"{path}: record at byte {offsets[0]} fails its checksum"
    missing = tmp_path / "missing.rec"
    BatchRecorder(missing, keep=2).close()
    assert missing.read_bytes() == MAGIC


def test_a_short_write_is_an_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / RECORDING
    recorder = BatchRecorder(path)
    sizes: list[int] = []
    monkeypatch.setattr(os, "writev", lambda fd, bufs: sizes.append(sum(len(b) for b in bufs)) or sizes[0] - 1)
    with pytest.raises(OSError) as e:
        recorder.append(batch(0))
    assert str(e.value) == f"{path}: short write ({sizes[0] - 1} of {sizes[0]} bytes)"
    monkeypatch.setattr(os, "writev", lambda fd, bufs: sum(len(b) for b in bufs))
    recorder.append(batch(0))  # a whole write is no error
    recorder.close()


def test_a_runs_description_names_a_model_inside_the_run_relative_to_it(tmp_path):
    run = tmp_path / "run"
    rl_dir = run / "rl" / "grpo"
    rl_dir.mkdir(parents=True)
    (run / "base_model").mkdir()
    write_run_info(rl_dir, RunConfig(), run / "base_model")
    raw = json.loads((rl_dir / RUN_INFO).read_text())
    assert raw == {"config": LEARNER_CONFIG, "model_dir": "../../base_model", "recording": RECORDING}
    assert (rl_dir / LEARNER_CONFIG).read_text() == dump_config(RunConfig())
    # Moved elsewhere, the run still finds its model.
    moved = tmp_path / "moved"
    run.rename(moved)
    info = read_run_info(moved / "rl" / "grpo")
    assert info.model_dir == (moved / "base_model").resolve()
    assert (info.config, info.recording) == (moved / "rl" / "grpo" / LEARNER_CONFIG, moved / "rl" / "grpo" / RECORDING)
    # A model outside the run's tree is named as it is.
    outside = tmp_path / "models" / "pi0"
    outside.mkdir(parents=True)
    write_run_info(rl_dir := moved / "rl" / "grpo", RunConfig(), outside)
    assert json.loads((rl_dir / RUN_INFO).read_text())["model_dir"] == str(outside.resolve())
    assert read_run_info(rl_dir).model_dir == outside.resolve()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"config": "c.yaml", "model_dir": "m"}'])
def test_a_damaged_run_description_is_refused_naming_it(tmp_path, text):
    (tmp_path / RUN_INFO).write_text(text)
    with pytest.raises(RecordingError, match=rf"^{tmp_path / RUN_INFO}: not a recording description \("):
        read_run_info(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        read_run_info(tmp_path / "none")
    assert str(e.value) == (f"{tmp_path / 'none' / RUN_INFO} not found: {tmp_path / 'none'} is not the directory of "
                            "a recorded RL run (rl/<mode> of a run directory, written with learner.record_batches on)")
