# The two commands of the README. Both set up .venv first (idempotent, see scripts/setup.sh).
.PHONY: setup run test lint mutate docs

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/dph-async run --compare grpo@d_exp,js_low_var:200,reverse_kl:0.1 replay.reference_ratio=0.333

test: setup
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check .

# Mutation testing of the boundary modules against their fast tests (docs/testing.md): not part of
# `make test`. MODULE=learner/guard.py for one (comma-separated for several), BUDGET seconds per module.
mutate: setup
	.venv/bin/python scripts/mutate.py $(if $(MODULE),--module $(MODULE)) $(if $(BUDGET),--budget $(BUDGET))

# The docs' tables and figures rendered from docs/data/ (dph_async/tools/rendered_docs.py): CHECK=1 only
# compares and names every stale block (the test suite does the same).
docs: setup
	.venv/bin/python -m dph_async.tools.rendered_docs $(if $(CHECK),--check)
