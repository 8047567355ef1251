"""A process with vLLM imported that forks one child per script: the engine tests run in these
children (`run_child(..., zygote=engine_zygote)`, tests/conftest.py), so the suite pays vLLM's import
(about 7 CPU-s of an engine's 11) once, not once per test. An actor process is in the same state when
it builds its engine: vLLM imported by its __init__ (dph_async/runtime/actor_process.py), nothing run yet.

    python tests/engine_zygote.py

Prints `ready` once imported, then reads one JSON request per line on stdin ({"script", "args", "cwd",
"env", "log"}), forks a child that runs the script as `__main__` with its stdout and stderr in `log`,
and prints {"pid": ...} at once and {"rc": ...} when the child ends. EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dph_async.actors.engine  # noqa: F401  (vLLM, torch, transformers: what the children would import)


def child(request: dict) -> None:
    """Run the request's script in this forked process and exit with its status; never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)  # the zygote's stdout is its channel to the tests: never the child's
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["script"], *request["args"]]
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            child(json.loads(line))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
