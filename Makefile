# Riptide: `make demo` runs the local stack for a few training steps; `make test` runs the
# test suite. Both set everything up first (venv in .venv, CPU torch, system packages).

VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin torch; a GPU node installs its own CUDA build before `pip install -e .`.
TORCH_SPEC ?= torch==2.13.0
DEMO_STEPS ?= 3
PYTEST_ARGS ?=

RUNTIME_DEPS := redis-server:redis-server bwrap:bubblewrap git:git
TEST_DEPS := $(RUNTIME_DEPS) docker-compose:docker-compose slurmctld:slurm-wlm munged:munge

.PHONY: setup system-deps test-deps demo test lint typecheck compose-check protos bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,daytona]"
	touch $@

setup: $(VENV)/.installed system-deps

system-deps:
	@scripts/system_deps.sh $(RUNTIME_DEPS)

test-deps:
	@scripts/system_deps.sh $(TEST_DEPS)

demo: setup
	$(VENV)/bin/riptide up --steps $(DEMO_STEPS)

test: $(VENV)/.installed test-deps lint typecheck compose-check
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check services tests bench scripts
	$(VENV)/bin/lint-imports
	$(PY) scripts/gen_protos.py --check

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy services

compose-check:
	RIPTIDE_ADMIN_TOKEN=compose-check-token docker-compose config -q

protos: $(VENV)/.installed
	$(PY) scripts/gen_protos.py

bench: $(VENV)/.installed system-deps
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .riptide .pytest_cache .mypy_cache .ruff_cache
