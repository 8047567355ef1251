"""Work the slow tests wait for, started when the session starts, on the core the fast tests leave idle.

Most of the suite's time is processes starting and what they build (docs/testing.md, Time budget).
What does not need a test's own process starts with the session instead, in processes of its own:
DeepSpeed's CPU communication op (the first learner would build it: about 27 s) and a zygote with
vLLM imported for the engine tests (tests/engine_zygote.py). The fast tests run first (tests/conftest.py
orders them) and mostly keep one core of two busy meanwhile; a test asks for a head start by its
fixture and waits for it where it would have done the work itself.

Only single-threaded work, at the lowest priority: a fast test running torch on both cores waits at
every parallel region for its slower thread, so a head start that takes a share of either core
slows it far more than its own CPU time (a warm start of 800 steps on two threads as a head start
made one such test take 64 s instead of 1.1 s, and the suite 70 s longer, not shorter).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from dph_async.paths import torch_extensions_dir

ROOT = Path(__file__).resolve().parent.parent
BUILD_DEEPSPEED_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


# Starts argv in a session of its own and exits at once, so that init adopts it: tests that sample
# this process's descendants (CPU by component, peak memory, processes left behind) never see a head
# start. Its pid goes to the file named first.
DETACH = ("import subprocess, sys; "
          "open(sys.argv[1], 'w').write(str(subprocess.Popen(sys.argv[2:], start_new_session=True).pid))")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


def _detach(argv: list[str], pid_file: Path, **popen) -> tuple[subprocess.Popen, int]:
    """argv started outside this process's tree (DETACH) with Popen's `popen` streams: the launcher
    (its pipes stay connected to the process it started) and that process's pid, its session's id."""
    launcher = subprocess.Popen([sys.executable, "-c", DETACH, str(pid_file), *argv], cwd=ROOT, **popen)
    assert launcher.wait(timeout=60) == 0, "could not start a head start"
    return launcher, int(pid_file.read_text())


def _kill(session: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session, signal.SIGKILL)


class Job:
    """`python -c CODE` at the lowest priority, one compiler at a time (MAX_JOBS, read by torch's
    extension builds), detached (_detach), in a session of its own: a Ctrl-C of the suite does not
    cut a build short (torch's extension builds leave a lock behind that every later build waits on).
    Nothing waits for it but `close`: a learner that needs the op meanwhile waits on that lock."""

    def __init__(self, code: str, log: Path) -> None:
        self.status = log.with_suffix(".status")  # its exit status, written when it ends
        # Where the learners look (their cwd is ROOT too), so that the op built here is the one they load.
        env = {**_env(), "TORCH_EXTENSIONS_DIR": torch_extensions_dir(), "MAX_JOBS": "1"}
        with log.open("w") as sink:
            _detach(["sh", "-c", 'nice -n 19 "$@"; echo $? > "$0"', str(self.status), sys.executable, "-c", code],
                    log.with_suffix(".pid"), env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)

    def close(self, timeout: float = 1200) -> None:
        deadline = time.monotonic() + timeout
        while not (self.status.is_file() and self.status.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.2)


class Zygote:
    """tests/engine_zygote.py, detached (_detach), and its channel: `run` forks a child with vLLM
    already imported per script."""

    def __init__(self, log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.proc, self.session = _detach([sys.executable, str(ROOT / "tests" / "engine_zygote.py")],
                                              log.with_suffix(".pid"), env=_env(), stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=sink, bufsize=0)
        self.buffer = b""
        self.ready = False
        self.broken = False  # a child's status left unread: every later status would be off by one

    def _line(self, timeout: float) -> str:
        """The zygote's next line, read unbuffered so that a line already read is never waited for."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the engine zygote ended:\n{_tail(self.log)}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def run(self, script: Path, args: list[str], log: Path, timeout: float) -> int:
        """Run `script` with `args` in a forked child (stdout and stderr into `log`); its exit status.
        A child still running after `timeout` seconds is killed and fails the test; one whose wait is
        interrupted (a test's time limit, Ctrl-C) is killed too, and its status read, so that the next
        script's status is its own."""
        assert not self.broken, f"the engine zygote lost track of a child before:\n{_tail(self.log)}"
        if not self.ready:
            assert self._line(600) == "ready", _tail(self.log)
            self.ready = True
        request = {"script": str(script), "args": args, "cwd": str(ROOT), "env": _env(), "log": str(log)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = json.loads(self._line(60))["pid"]
        try:
            return json.loads(self._line(timeout))["rc"]
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            try:
                self._line(60)
            except BaseException:
                self.broken = True
                raise
            if isinstance(e, TimeoutError):
                raise AssertionError(f"{script} ran over {timeout} s:\n{_tail(log)}") from None
            raise

    def close(self) -> None:
        _kill(self.session)  # between scripts it holds nothing; run() has waited for every child
        self.proc.stdin.close()
        self.proc.stdout.close()
