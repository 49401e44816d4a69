# The two commands of the quick start: `make bench` and `make test`.
# Both set up .venv first (idempotent; re-run when pyproject.toml or the script changes).
PY := .venv/bin/python
BENCH_ARGS ?=

.PHONY: setup bench test lint
setup: .venv/.setup-stamp

.venv/.setup-stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

bench: setup
	$(PY) -m hicache_l3.cli bench $(BENCH_ARGS)

lint: setup
	$(PY) -m ruff check hicache_l3 tests
	$(PY) -m mypy hicache_l3

test: lint
	$(PY) -m pytest -q -p no:randomly
