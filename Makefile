# Two commands a fresh machine needs: `make demo` and `make test`. Each builds .venv first,
# with only what it needs: `make demo` the package and the demo's extra (scikit-learn),
# `make test` the package and the test extra (ruff, mypy, pytest, Lightning...). Each has its
# own stamp, so `make test` after `make demo` still installs the test extra.
#
# torch is installed on its own first, pinned to the CPU wheel this project is developed on
# (TORCH=...), so that the `torch>=2.13` range in pyproject.toml finds it satisfied instead of
# pulling a multi-GB CUDA build. Override it for your platform: `make test TORCH="torch==2.14.1"`
# (2.13 or newer: `import engine` refuses an older torch, see engine/_torch_check.py).
# Where plain `pip install torch` brings a CUDA build, take torch from PyTorch's CPU index:
# `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu` (its --index-url, for torch
# alone). PIP_ARGS is passed to every pip install (`PIP_ARGS="--no-index --find-links wheels/"`).
# The stamps record what was installed: after changing TORCH, `make clean` first.

PYTHON      ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
PIP_ARGS    ?=
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip install --quiet $(PIP_ARGS)
TORCH_STAMP := $(VENV)/.torch-installed
STAMP       := $(VENV)/.installed
DEMO_STAMP  := $(VENV)/.demo-installed

.PHONY: demo test check lint bench docs clean

$(TORCH_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	touch $@

$(STAMP): $(TORCH_STAMP) pyproject.toml Makefile
	$(PIP) -e ".[test]"
	touch $@

$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml Makefile
	$(PIP) -e ".[demo]"
	touch $@

demo: $(DEMO_STAMP)
	$(PY) examples/digits.py

lint: $(STAMP)
	$(PY) -m ruff check engine tests benchmarks examples conftest.py
	$(PY) -m ruff format --check engine tests benchmarks examples conftest.py
	$(PY) -m mypy engine

test: lint
	$(PY) -m pytest -q

# The tier for every change: lint, the type check and every test not marked slow (no rank
# launch, nothing over about 2 s); `make test` runs them all.
check: lint
	$(PY) -m pytest -q -m "not slow"

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

bench: $(STAMP)
	$(PY) -m benchmarks.step --json

clean:
	rm -rf $(VENV) *.egg-info site
