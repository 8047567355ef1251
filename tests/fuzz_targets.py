"""Coverage-guided fuzz targets (atheris, libFuzzer) for the decoders of what arrives from a socket or a file.

    python tests/fuzz_targets.py TARGET [libFuzzer flags] [CORPUS_DIR ...]   fuzz TARGET
    python tests/fuzz_targets.py --seeds                                     rewrite tests/data/fuzz/

Each target takes bytes and must either decode them or raise its module's own error; anything else
(another exception, a crash, a hang) is a finding, written by libFuzzer as crash-* under -artifact_prefix.
    protocol  dph_async.protocol.decode: frames as u32 count, then per frame u32 length and its bytes
    state     replay.state.decode_state (and so replay/records.py's groups_from): an Arrow IPC file
    wal       the write-ahead log's reader: the first byte picks the file the rest becomes in a log
              directory (0: the live segment, 1: wal.json, 2: wal.ack), then every record is read
tests/test_fuzz.py runs each for a few seconds from the seeds in tests/data/fuzz/TARGET.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris
import msgspec  # noqa: F401  (imported before instrumentation: only this project's code is instrumented)
import numpy  # noqa: F401
import pyarrow as pa

with atheris.instrument_imports(include=["dph_async.protocol", "replay"]):
    from dph_async import protocol as P
    from dph_async.replay import state, wal

SEEDS = Path(__file__).parent / "data" / "fuzz"
_FRAMES = struct.Struct("<I")
_LOG = Path()  # the log directory fuzz_wal rebuilds, made by main()


def split_frames(data: bytes) -> list[bytes]:
    """Frames from the fuzzer's bytes: u32 count, then per frame u32 length and its bytes (cut short
    where the data ends)."""
    frames, at = [], _FRAMES.size
    count = _FRAMES.unpack_from(data)[0] if len(data) >= at else 0
    for _ in range(min(count, 64)):
        size = _FRAMES.unpack_from(data, at)[0] if len(data) >= at + _FRAMES.size else 0
        at += _FRAMES.size
        frames.append(data[at : at + size])
        at += size
    return frames


def join_frames(frames: list) -> bytes:
    return _FRAMES.pack(len(frames)) + b"".join(_FRAMES.pack(len(bytes(f))) + bytes(f) for f in frames)


def fuzz_protocol(data: bytes) -> None:
    with contextlib.suppress(P.ProtocolError):
        P.decode(split_frames(data))


def fuzz_state(data: bytes) -> None:
    with contextlib.suppress(state.ReplayStateError):
        state.decode_state(pa.py_buffer(data), "fuzzed")


WAL_FILES = ["seg-00000000.wal", wal.MANIFEST, wal.ACK]


def read_log(directory: Path, data: bytes) -> list[wal.Record]:
    """Every record of a new log in `directory` (of one live segment, nothing acknowledged yet) with one
    of its files, picked by data[0], replaced by data[1:]."""
    shutil.rmtree(directory, ignore_errors=True)
    log = wal.WriteAheadLog(directory)
    log.open()
    log.close()
    (directory / WAL_FILES[data[0] % len(WAL_FILES)]).write_bytes(data[1:])
    return list(wal.WriteAheadLog(directory).records(repair=True))


def fuzz_wal(data: bytes) -> None:
    if not data:
        return
    with contextlib.suppress(wal.WalFormatError):
        read_log(_LOG, data)


TARGETS: dict[str, Callable[[bytes], None]] = {"protocol": fuzz_protocol, "state": fuzz_state, "wal": fuzz_wal}


def seeds() -> dict[str, dict[str, bytes]]:
    """Small valid inputs of each target, the fuzzer's start."""
    from dph_async.tools.bench.transport import synthetic_group

    groups = [synthetic_group(1, i, n=2, tokens=3, prompt_tokens=4) for i in range(2)]
    batch = P.Batch(3, groups[:1], [], {"stale": 1}, 9)
    messages = [groups[0], batch, P.Ack([(0, 1)], "ok"), P.BatchRequest(4, 16, 1.0, 77, b"token")]
    out: dict[str, dict[str, bytes]] = {"protocol": {}, "state": {}, "wal": {}}
    for m in messages:
        out["protocol"][type(m).__name__] = join_frames(P.encode(m))
    with tempfile.TemporaryDirectory() as tmp:
        path = state.write_state(Path(tmp) / "s.arrow", state.ReplayState(3, groups, [0, 1]))
        buf = pa.memory_map(str(path)).read_buffer()
        out["state"]["two-groups"] = state._arrow_bytes(path, buf).to_pybytes()
        log = wal.WriteAheadLog(Path(tmp) / "log")
        log.open()
        log.append(wal.IngestRecord(groups))
        log.append(wal.ServeRecord(7, 2, [(1, 0)], ["r"], [((1, 1), "stale")]))
        log.close()
        for i, name in enumerate(WAL_FILES):
            out["wal"][name] = bytes([i]) + (Path(tmp) / "log" / name).read_bytes()
        out["wal"][wal.ACK] = bytes([2]) + wal.Ack(0, -1, 0, bytes(16), False).pack() * 2  # of a new log
    return out


def main() -> None:
    if sys.argv[1:] == ["--seeds"]:
        for target, files in seeds().items():
            shutil.rmtree(SEEDS / target, ignore_errors=True)
            (SEEDS / target).mkdir(parents=True)
            for name, data in files.items():
                (SEEDS / target / name).write_bytes(data)
        return
    global _LOG
    logging.disable(logging.CRITICAL)  # recovery logs what it repairs: thousands of inputs a second would flood
    target = TARGETS[sys.argv.pop(1)]
    with tempfile.TemporaryDirectory(prefix="fuzz-wal-", dir=os.environ.get("FUZZ_SCRATCH")) as scratch:
        _LOG = Path(scratch) / "log"  # libFuzzer ends the process itself: FUZZ_SCRATCH is where to leave it
        atheris.Setup(sys.argv, target)
        atheris.Fuzz()


if __name__ == "__main__":
    main()
