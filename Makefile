# Two commands on a fresh machine with only Python 3.11:
#   make demo   set up, then train a small GPT under a budget smaller than its footprint
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch first and pinned: an unpinned torch would pull a CUDA build of several GB
TORCH  ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(VENV)/.done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.done

demo: setup
	$(PY) examples/demo.py --out demo-out

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m bench memory

clean:
	rm -rf $(VENV) demo-out .pytest_cache .hypothesis
