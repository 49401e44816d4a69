# The two commands of the quick start: `make bench` and `make test`.
# Both set up .venv first (idempotent; re-run when pyproject.toml or the script changes).
PY := .venv/bin/python
BENCH_ARGS ?=

.PHONY: setup setup-sglang bench test test-containers lint
setup: .venv/.setup-stamp

.venv/.setup-stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# Real SGLang 0.5.23 in its own venv, for tests/integration/test_sglang.py (the script stamps it).
setup-sglang: .venv-sglang/.setup-stamp

.venv-sglang/.setup-stamp: scripts/setup-sglang.sh
	bash scripts/setup-sglang.sh

bench: setup
	$(PY) -m hicache_l3.cli bench $(BENCH_ARGS)

lint: setup
	$(PY) -m ruff check hicache_l3 tests benchmarks
	$(PY) -m mypy hicache_l3 benchmarks

# The loopback shim (README "Security") preloaded into the test run: Mooncake's transfer
# engine in the test process then listens on loopback too (empty when it was not built).
SHIM = $$($(PY) -c 'from hicache_l3.engines.loopback import SHIM; print(SHIM or "")')

# The suite with local engines, then again with engines as containers (docker/README.md).
# CI=1: tests that would skip where they cannot run (the security tests, not root) fail.
test: lint setup-sglang
	CI=1 LD_PRELOAD="$(SHIM)" $(PY) -m pytest -q -p no:randomly -rs --durations=25 --ignore=tests/containers
	CI=1 bash scripts/test-containers.sh

# The container part of `make test` alone.
test-containers: setup
	bash scripts/test-containers.sh
