#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): 04 at Kimi-K2.5's draft shape measured and every CUDA
# path checked against the CPU, in <= 8 min on one H200; OUT gets gpu_check.json and gpu_check.md.
#   bash scripts/gpu_check.sh OUT                         # a GPU machine (torch with CUDA, transformers)
#   bash scripts/gpu_check.sh --device cpu --tiny OUT     # tiny shapes on the CPU (tests/tools/test_gpu_check.py)
# PY picks the interpreter (default: .venv/bin/python when it exists, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" benchmarks/gpu_check.py "$@"
