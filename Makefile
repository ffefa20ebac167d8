# make demo: the whole chain on the tiny Kimi-shaped world (CPU). make test: the test suite.
PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORK ?= runs/tiny
CONFIG ?= configs/tiny.yaml

.PHONY: demo test setup clean-demo

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on CPU machines this is a local CPU wheel; nothing may pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

demo: $(STAMP)
	WORK=$(WORK) CONFIG=$(CONFIG) PY=$(PY) bash scripts/demo.sh

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

clean-demo:
	rm -rf $(WORK)
