"""Work the slow tests wait for, started when the session starts, on the core the fast tests leave idle.

Most of the suite's time is processes starting and what they build (docs/testing.md, Time budget).
What does not need a test's own process starts with the session instead, in processes of its own:
DeepSpeed's CPU communication op (the first learner would build it: about 27 s), a zygote with vLLM
imported for the engine tests (tests/engine_zygote.py) and the critic test's warm start. The fast
tests run first (tests/conftest.py orders them) and keep about one core of two busy meanwhile; a test
asks for a head start by its fixture and waits for it where it would have done the work itself.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the learner's processes see (dph_async/app/learner_trainer.py sets the same default when
# imported), so that the op built here is the one they load.
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(os.environ.get("DPH_CACHE_DIR", ".cache"))
                                                          / "torch_extensions")
BUILD_DEEPSPEED_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


class Job:
    """`python -c CODE OUT` at low priority, in a session of its own (a Ctrl-C of the suite does not
    cut a build short: torch's extension builds leave a lock behind that every later build waits on).
    `wait()` returns OUT once the job has succeeded."""

    def __init__(self, code: str, out: Path, log: Path, killable: bool) -> None:
        self.code, self.out, self.log, self.killable = code, out, log, killable
        with log.open("w") as sink:
            self.proc = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", code, str(out)], cwd=ROOT,
                                         env={**_env(), "TORCH_EXTENSIONS_DIR": EXTENSIONS}, stdin=subprocess.DEVNULL,
                                         stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 1200) -> Path:
        code = self.proc.wait(timeout=timeout)
        if code != 0:
            raise RuntimeError(f"head start `{self.code}` exited {code}:\n{_tail(self.log)}")
        return self.out

    def close(self) -> None:
        if self.killable:
            self.proc.kill()
        self.proc.wait(timeout=1200)


class Zygote:
    """tests/engine_zygote.py and its channel: `run` forks a child with vLLM already imported per script."""

    def __init__(self, log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "engine_zygote.py")], cwd=ROOT,
                                         env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
                                         bufsize=0)
        self.buffer = b""
        self.ready = False

    def _line(self, timeout: float) -> str:
        """The zygote's next line, read unbuffered so that a line already read is never waited for."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the engine zygote ended (exit {self.proc.wait()}):\n{_tail(self.log)}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def run(self, script: Path, args: list[str], log: Path, timeout: float) -> int:
        """Run `script` with `args` in a forked child (stdout and stderr into `log`); its exit status.
        A child still running after `timeout` seconds is killed and fails the test."""
        if not self.ready:
            assert self._line(600) == "ready", _tail(self.log)
            self.ready = True
        request = {"script": str(script), "args": args, "cwd": str(ROOT), "env": _env(), "log": str(log)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = json.loads(self._line(60))["pid"]
        try:
            return json.loads(self._line(timeout))["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._line(60)
            raise AssertionError(f"{script} ran over {timeout} s:\n{_tail(log)}") from None

    def close(self) -> None:
        self.proc.kill()  # between scripts it holds nothing; run() has waited for every child
        self.proc.wait(timeout=60)
        self.proc.stdin.close()
        self.proc.stdout.close()
