"""Coverage-guided fuzzing (tests/fuzz_targets.py, atheris) of the decoders of what arrives from a socket or
a file, a few seconds each from the seeds in tests/data/fuzz: any exception but the module's own error,
a crash or a hang fails the test with the input's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SECONDS = 3


@pytest.mark.parametrize("target", ["protocol", "state", "wal"])
def test_fuzzing_finds_no_exception_but_the_decoders_own(tmp_path, memory_path, target):
    pytest.importorskip("atheris")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
           "FUZZ_SCRATCH": str(memory_path)}  # the wal target's log, rebuilt for each input: in memory where it can be
    found = subprocess.run(
        [sys.executable, str(TESTS / "fuzz_targets.py"), target, f"-max_total_time={SECONDS}", "-timeout=10",
         "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}/", str(tmp_path), str(TESTS / "data" / "fuzz" / target)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert found.returncode == 0 and "Done" in found.stderr, found.stderr[-4000:]


@pytest.mark.parametrize("target", ["protocol", "state", "wal"])
def test_every_seed_is_an_input_the_decoder_reads(tmp_path, target):
    """The seeds start the fuzzer from inside each format, not from its first check."""
    pytest.importorskip("atheris")  # fuzz_targets instruments what it imports
    sys.path.insert(0, str(TESTS))
    try:
        import fuzz_targets
    finally:
        sys.path.remove(str(TESTS))
    seeds = {p.name: p.read_bytes() for p in (TESTS / "data" / "fuzz" / target).iterdir()}
    if target == "protocol":
        decoded = [fuzz_targets.P.decode(fuzz_targets.split_frames(d)) for d in seeds.values()]
        assert {type(m).__name__ for m in decoded} == set(seeds)
    elif target == "state":
        assert [len(fuzz_targets.state.decode_state(fuzz_targets.pa.py_buffer(d), n).groups)
                for n, d in seeds.items()] == [2]
    else:
        assert set(seeds) == set(fuzz_targets.WAL_FILES)
        kinds = [[type(r).__name__ for r in fuzz_targets.read_log(tmp_path / n, d)] for n, d in seeds.items()]
        assert sorted(kinds) == [[], [], ["IngestRecord", "ServeRecord"]]


def test_an_arrow_file_whose_offsets_overrun_its_values_is_refused_not_read():
    """Found by fuzzing replay/records.py's groups_from: list offsets past the values array, read without
    Arrow's full validation, crashed the process (SIGSEGV). In a subprocess, so a regression fails this
    test rather than the whole run."""
    found = TESTS / "data" / "fuzz-found" / "state-list-offsets-overrun.arrow"
    code = ("import sys, pyarrow as pa; from dph_async.replay.state import decode_state, ReplayStateError\n"
            "try: decode_state(pa.py_buffer(open(sys.argv[1], 'rb').read()), sys.argv[1])\n"
            "except ReplayStateError as e: print(e)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(found)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "list offsets" in out.stdout and "larger than values array" in out.stdout, out
