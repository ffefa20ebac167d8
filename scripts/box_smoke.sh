#!/usr/bin/env bash
# The smoke run: the first thing to run on any CUDA GPU box (with requirements-gpu.txt installed), before
# the multi-day Kimi run. The whole SGLang path on SmolLM2-135M in minutes; stops at the first layer of the
# stack that disagrees with transformers, and runs 05b's agreement check against SGLang greedy and sampled
# (T 1.0 / top-p 0.95: its probability gate is where SGLang's sampled verify is proven). What it runs and
# checks: scripts/box_smoke.py, docs/sglang.md.
#   bash scripts/box_smoke.sh --dry-run      # print every command, run nothing
#   TARGET=/models/smollm2 WORK=/data/smoke bash scripts/box_smoke.sh
# Environment: TARGET (HF target folder, default build/smollm2/target, built when missing), DATA (its
# train_code.jsonl + heldout.jsonl as 00_build_smollm2_world.py writes them, default $TARGET/../data),
# WORK (default runs/box_smoke; the transformers capture goes to ${WORK}_hf), PY (default .venv/bin/python),
# SGLANG_PY (the python with sglang, default PY), PORT (01b's server; 05 uses PORT+10 and PORT+20). Both
# work dirs are recreated.
set -euo pipefail
cd "$(dirname "$0")/.."
export PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1
exec "$PY" scripts/box_smoke.py "$@"
