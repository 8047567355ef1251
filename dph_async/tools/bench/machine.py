"""What a benchmark's figures were measured on, recorded beside them (docs/benchmarks.md asks for it)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the processor's architecture where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine() -> dict:
    """CPU model and count, load average, and the versions of Python and the libraries measured; torch's
    and the GPU's when torch is loaded (a benchmark that does not use it does not pay its import)."""
    info: dict = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    if (torch := sys.modules.get("torch")) is not None:
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return info


def commit() -> str | None:
    """The checkout's commit (short hash, "+dirty" when tracked files differ from it), or None outside a
    git checkout: results are re-derivable only from the code that made them."""
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():  # an installed copy: the repository around it (if any) is another's
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def provenance() -> dict:
    """Date, commit, command line and machine of a result, as the docs record every figure."""
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit(),
            "command": "dph-async " + " ".join(sys.argv[1:]), "machine": machine()}
