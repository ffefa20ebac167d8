"""Capture of the target's hidden states for EAGLE-3: capture points, target dimensions, the HF backend.

Convention (REFERENCE section 1): a capture point i names h_i, the residual stream at the INPUT of
decoder layer i (h_0 = embeddings, h_i = output of layer i-1). The draft reads the concatenation
[h_low | h_mid | h_high] (ascending), width 3H, and the teacher's logits come from the target's final
post-norm hidden state (the lm_head input). Every backend returns exactly these two tensors, so a later
`capture_sglang` slots in beside `capture_hf` without touching the stages around it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.stage import StageError


def target_dims(config) -> dict:
    """num_hidden_layers, hidden_size, vocab_size of a target config object.

    Kimi-K2.5 is a multimodal wrapper whose language model config sits under `text_config` (a dict
    or a config object depending on how it was loaded: assets/kimi_k25/config.json); plain
    DeepseekV3 configs carry the fields at top level.
    """
    text = getattr(config, "text_config", None) or config
    get = text.get if isinstance(text, dict) else (lambda k: getattr(text, k, None))
    dims = {k: get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    missing = [k for k, v in dims.items() if not isinstance(v, int)]
    if missing:
        raise StageError(f"target config has no integer {', '.join(missing)} (looked at top level "
                         "and under text_config)")
    return dims


def load_target_config(model_dir: str | Path):
    """The target's config through transformers (its own code where it ships some, as Kimi does)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)


def default_capture_points(num_hidden_layers: int) -> list[int]:
    """SGLang's default `layers_to_capture` [2, N//2, N-3] (Kimi-K2.5, N=61: h_2, h_30, h_58)."""
    n = num_hidden_layers
    return [2, n // 2, n - 3]


def validate_capture_points(points: list[int], num_hidden_layers: int) -> list[int]:
    """Three strictly ascending h_i indices with 1 <= i <= N-1.

    h_0 (the embedding) and h_N (past the last layer) are excluded: HF's hidden_states[N] is the
    post-norm state, not a residual, and SGLang captures only before a layer runs.
    """
    points = [int(p) for p in points]
    n = num_hidden_layers
    if len(points) != 3:
        raise StageError(f"--capture-points needs exactly 3 indices (low mid high), got {points}")
    if any(not 1 <= p <= n - 1 for p in points):
        raise StageError(f"--capture-points {points}: each must lie in 1..{n - 1} (N={n} decoder layers)")
    if any(b <= a for a, b in zip(points, points[1:])):
        raise StageError(f"--capture-points {points} must be strictly ascending")
    return points


@torch.no_grad()
def capture_hf(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               capture_points: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an HF causal LM once; return (aux [B,T,3H], final [B,T,H]) in the model's dtype.

    aux = cat(h_i for i in capture_points) along features; final = the lm_head input.
    Padding must be on the right (positions of real tokens stay 0..T-1 and no real token attends a
    pad), so a padded row's real positions equal a one-sample forward; callers drop the pad rows.
    """
    n = target_dims(model.config)["num_hidden_layers"]
    # HF records hidden_states[0] = input of layer 0 and hidden_states[i] = output of layer i-1
    # = input of layer i, so index i is h_i for 1 <= i <= N-1; index N is replaced by the post-norm
    # last_hidden_state (= the lm_head input). Selecting the indices keeps only those tensors alive.
    # logits_to_keep=1: the logits are not needed here, and [B,T,V] would be the largest tensor.
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                output_hidden_states=[*capture_points, n], logits_to_keep=1)
    hs = out.hidden_states
    assert len(hs) == n + 1, f"expected {n + 1} hidden states, got {len(hs)}"
    aux = torch.cat([hs[i] for i in capture_points], dim=-1)  # [B, T, 3H]
    final = hs[n]  # [B, T, H]
    return aux, final
