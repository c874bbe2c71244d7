# Set-up and the two README commands. The venv gets the CPU build of torch
# (torch==2.13.0); with a GPU, pass another spec, e.g.
#   make demo TORCH_SPEC=torch        (PyPI's default Linux build, with CUDA)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# pip shows what it downloads and installs (a few minutes the first time); PIP_FLAGS=-q silences it.
PIP_FLAGS ?=

.PHONY: setup reproduce demo test test-slow docs wheel-check clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	@echo "== setup: a virtualenv in $(VENV) with torch, pipedp and its extras (a few minutes the first time)"
	$(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "== setup: $(TORCH_SPEC), the largest download"; \
		$(PY) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"; }
	@echo "== setup: pipedp (editable) with its dev, tvm and experiments extras"
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev,tvm,experiments,docs]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@
	@echo "== setup: done; the venv's programs (torchrun, tune-kernels, reproduce-paper) are in $(VENV)/bin"

reproduce: setup
	$(PY) -m experiments.reproduce_paper --quick --trace reproduce-out/trace.json --out reproduce-out

demo: setup
	$(PY) -m experiments.demo

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

# The documentation site (docs/ -> docs/_build/html), warnings as errors: a broken link or reference fails.
docs: setup
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

# The wheel in a fresh virtualenv (with the experiments extra, without tvm): console scripts from outside the repo.
wheel-check:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash .ci/wheel-check

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache reproduce-out
