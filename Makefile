# Set-up and the two README commands. The venv gets the CPU build of torch
# (torch==2.13.0); with a GPU, pass another spec, e.g.
#   make demo TORCH_SPEC=torch        (PyPI's default Linux build, with CUDA)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup reproduce demo test test-slow wheel-check clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,tvm,experiments]"
	touch $@

reproduce: setup
	$(PY) -m experiments.reproduce_paper --quick --trace reproduce-out/trace.json --out reproduce-out

demo: setup
	$(PY) -m experiments.demo

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

# The wheel in a fresh virtualenv (with the experiments extra, without tvm): console scripts from outside the repo.
wheel-check:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash .ci/wheel-check

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache reproduce-out
