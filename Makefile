# The two commands of the README. Both set up .venv first (idempotent, see scripts/setup.sh).
.PHONY: setup run test lint

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/dph-async run --compare grpo@d_exp,js_low_var:200,reverse_kl:0.1 replay.reference_ratio=0.333

test: setup
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check .
