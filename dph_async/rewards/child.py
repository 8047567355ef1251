"""A killable child process: a fresh interpreter running one of our modules, over a socket pair.

    child = Child("dph_async.rewards.worker", memory_limit_mb=1024, hello=b"<config json>", startup_timeout_s=10)
    child.conn.send_bytes(...); child.conn.recv_bytes()
    child.kill()                        # SIGKILL, at once

The child is `python -m <module> <socket fd> <memory limit MB>`, not a fork: it inherits none of the
caller's threads (vLLM, torch, an event loop) and never re-imports the caller's main module, as
multiprocessing's spawn and forkserver children do. It runs in its own process group, so a Ctrl-C
meant for the caller does not reach it. It reads `hello` (its settings), limits its own resources
(`limit_resources`) and answers b"ready" (or b"error: " and why not); the caller stops it by closing the pipe.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import resource
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import dph_async


def _package_parent() -> str | None:
    """What a child needs on its path to find this package: nothing where the project is installed (the
    install finds it, and the checkout's root would also offer the design card's directories under
    their bare names, `kernels` among them); the source tree's root where it is not."""
    try:
        importlib.metadata.distribution("dph-async")
    except importlib.metadata.PackageNotFoundError:
        return str(Path(dph_async.__file__).resolve().parent.parent)
    return None


_PACKAGE_PARENT = _package_parent()


class Child:
    """One child process and the parent's end of its socket."""

    def __init__(self, module: str, memory_limit_mb: int, hello: bytes, startup_timeout_s: float) -> None:
        """Start it and wait up to `startup_timeout_s` for it to be ready; RuntimeError if it is not."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        with ours, theirs:
            fd = theirs.fileno()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", module, str(fd), str(memory_limit_mb)],
                    pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as e:  # out of processes or file descriptors
                raise RuntimeError(f"{module} could not be started: {e}") from e
            self.conn = Connection(os.dup(ours.fileno()))
        try:
            self.conn.send_bytes(hello)
            answer = self.recv() if self.conn.poll(max(0.0, startup_timeout_s)) else None
        except OSError:
            answer = None
        if answer != b"ready":
            self.kill()
            code = self.proc.poll()
            why = f"exit code {code}" if code is not None else f"not ready within {startup_timeout_s:.3g} s"
            if answer and answer.startswith(b"error: "):  # the child's own account (a reward plugin failed)
                why = answer[7:].decode(errors="replace")
            raise RuntimeError(f"{module} did not start ({why})")

    def recv(self) -> bytes | None:
        """The next message, or None if the child has gone."""
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def stop(self) -> None:
        """Ask it to exit (closing its input); kill it if it has not within 2 s."""
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def limit_resources(memory_limit_mb: int) -> None:
    """In the child: cap its address space (a memory bomb ends in MemoryError, not in the machine
    swapping), the size of any file it could write (0 bytes) and core dumps."""
    cap = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A write past RLIMIT_FSIZE should fail with an error, not kill the child with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.dont_write_bytecode = True
