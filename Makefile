# The two commands of the README. Both set up .venv first (idempotent, see scripts/setup.sh).
.PHONY: setup run test lint

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/dph-async run --compare grpo@d_exp,js_low_var,reverse_kl:0.1

test: setup
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check .
