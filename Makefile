# Two commands a fresh machine needs: `make demo` and `make test`. Each builds .venv first.
#
# torch is installed on its own first, pinned to the CPU wheel this project is developed on
# (TORCH=...), so that the `torch>=2.4` range in pyproject.toml finds it satisfied instead of
# pulling a multi-GB CUDA build. Override it for your platform: `make test TORCH="torch==2.5.1"`.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits.py

lint: $(STAMP)
	$(PY) -m ruff check engine tests benchmarks examples conftest.py
	$(PY) -m ruff format --check engine tests benchmarks examples conftest.py
	$(PY) -m mypy engine

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.step --json

clean:
	rm -rf $(VENV) *.egg-info
