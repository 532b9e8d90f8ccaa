# Two commands for a fresh clone: `make demo` (train a tiny K3 and evaluate it) and `make test`.
# Both find or bootstrap Python >= 3.12, keep a venv with the pinned JAX stack in a cache outside
# the repo, and do nothing more when nothing changed.

SHELL := /bin/bash
K3JAX_CACHE ?= $(HOME)/.cache/k3jax
export K3JAX_CACHE
VENV := $(K3JAX_CACHE)/venv
PY := $(VENV)/bin/python
REFVENV := $(K3JAX_CACHE)/refvenv
PYTEST_ARGS ?=

.PHONY: demo test venv refvenv test-gpu clean-venv

demo: venv
	$(PY) -m k3jax.train.demo

# --dist loadscope: a module's tests stay on one worker, so a module-scoped fixture (an 8-device worker
# process, a compiled model) runs once, not once per worker that xdist's default spreading reaches.
test: venv refvenv
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=15 $(PYTEST_ARGS)

test-gpu: venv
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

venv: $(VENV)/.k3jax-stamp

# The README's commands need the `experiments` extra (matplotlib for the balancing plot) too.
$(VENV)/.k3jax-stamp: setup.cfg pyproject.toml scripts/find_python.sh Makefile
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  python=$$(bash scripts/find_python.sh); \
	  echo "k3jax: creating $(VENV) with $$python"; \
	  "$$python" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e '.[test,tpu,experiments]'
	@touch $@

# The PyTorch side of the golden tests: Python 3.11 (the local CPU torch wheel is cp311).
refvenv: $(REFVENV)/.k3jax-stamp

$(REFVENV)/.k3jax-stamp: tests/reference/requirements.txt
	@set -e; \
	py311=$$(command -v python3.11 || true); \
	if [ -z "$$py311" ]; then for c in python3 $$HOME/.pyenv/versions/3.11*/bin/python3.11; do \
	  if "$$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then py311=$$c; break; fi; done; fi; \
	if [ -z "$$py311" ]; then echo "k3jax: no Python 3.11 here; the PyTorch golden tests will be skipped"; exit 0; fi; \
	[ -x $(REFVENV)/bin/python ] || "$$py311" -m venv $(REFVENV); \
	$(REFVENV)/bin/python -m pip install -q -r tests/reference/requirements.txt; \
	touch $@

clean-venv:
	rm -rf $(VENV) $(REFVENV)
