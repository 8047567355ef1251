#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py; figures in docs/benchmarks.md, GPU). Needs python3 with torch
# and triton; the loss library also needs pydantic and omegaconf, installed from the wheels in
# $DPH_WHEELS (default .whl/) into a scratch folder where the image lacks them.
#   scripts/gpu_check.sh [--json FILE] [--seed N]     on a CUDA machine
#   scripts/gpu_check.sh --tiny                       on a CPU (Triton's interpreter, tiny shapes)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python
wheels="${DPH_WHEELS:-.whl}"
if ! "$py" -c 'import pydantic, omegaconf' 2>/dev/null; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "error: the loss library needs pydantic and omegaconf: none importable and no wheels in $wheels" >&2
    exit 2
  fi
  site="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
for arg in "$@"; do [ "$arg" = --tiny ] && export TRITON_INTERPRET=1; done
exec "$py" scripts/gpu_check.py "$@"
