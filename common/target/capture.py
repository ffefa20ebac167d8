"""Capture of the target's hidden states for EAGLE-3: capture points, target dimensions, the HF engine.

Convention (docs/design.md section 1): a capture point i names h_i, the residual stream at the INPUT of
decoder layer i (h_0 = embeddings, h_i = output of layer i-1). The draft reads the concatenation
[h_low | h_mid | h_high] (ascending), width 3H, and the teacher's logits come from the target's final
post-norm hidden state (the lm_head input). Every capture engine returns exactly these two tensors
(`capture_hf` here, SGLang's in sglang_capture.py beside it). Which draft-config ids make SGLang capture
the same h_i depends on the target's model family: SGLANG_LAYER_ID_RULES below, the one place it is kept.
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


# ---- SGLang's draft-config layer ids ----------------------------------------------------------------
# A served EAGLE-3 draft names its capture points in `eagle_config.eagle_aux_hidden_state_layer_ids`;
# SGLang hands that list to the target's `set_eagle3_layers_to_capture(ids)` (model_runner.py
# init_aux_hidden_state_capture; SpecForge's offline capture calls the same hook), which sets
# `model.layers_to_capture`, and layer i in that list records its INPUT (`hidden_states + residual`
# before layer i runs) = h_i. How ids become layers differs by model file in sglang 0.5.14
# (https://github.com/sgl-project/sglang/tree/v0.5.14/python/sglang/srt/models):
#   "+1"          layers = [j + 1 for j in ids]                   llama.py, qwen2.py, qwen3.py, qwen2_moe.py,
#                                                                 qwen3_moe.py, qwen3_next.py, glm4_moe.py, ...
#   "+1 if ids[0] == 1"  layers = [j + 1 ...] when ids[0] == 1,  deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2,
#                        else ids unchanged                      Kimi-K2.5 through its language_model), glm4_moe_lite.py
# So ids = capture points - 1 names the right layers everywhere only when, for the DeepSeek family, the
# first capture point is 2 (Kimi: points [2, 30, 58], ids [1, 29, 57]). Keyed by the target's HF
# architecture name (config.json `architectures[0]`), which is also SGLang's model-class name.
SGLANG_PLUS_ONE = "+1"
SGLANG_PLUS_ONE_IF_FIRST_IS_ONE = "+1 if ids[0] == 1"
SGLANG_LAYER_ID_RULES = {
    **dict.fromkeys((
        "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
        "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM", "MiniMaxM2ForCausalLM",
    ), SGLANG_PLUS_ONE),
    **dict.fromkeys((
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration", "MistralLarge3ForCausalLM", "GlmMoeDsaForCausalLM",
        "Glm4MoeLiteForCausalLM",
    ), SGLANG_PLUS_ONE_IF_FIRST_IS_ONE),
}
SGLANG_VERSION_READ = "0.5.14"


def target_architecture(config) -> str:
    """The target's HF architecture name (`architectures[0]`), e.g. KimiK25ForConditionalGeneration."""
    archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    if not archs:
        raise StageError("the target config has no `architectures` entry: cannot tell which SGLang model "
                         "class (and layer-id rule) will serve it")
    return str(archs[0])


def sglang_captured_points(layer_ids: list[int], rule: str) -> list[int]:
    """The h_i SGLang records for draft-config `layer_ids` under `rule` (set_eagle3_layers_to_capture)."""
    if rule == SGLANG_PLUS_ONE or (rule == SGLANG_PLUS_ONE_IF_FIRST_IS_ONE and layer_ids[:1] == [1]):
        return [j + 1 for j in layer_ids]
    assert rule == SGLANG_PLUS_ONE_IF_FIRST_IS_ONE, rule
    return list(layer_ids)


def sglang_points_reader(architecture: str):
    """ids -> the h_i SGLang captures on this architecture from a draft config's eagle_config ids (for
    reading a draft made elsewhere); an architecture missing from the table is refused when called."""
    def read(layer_ids: list[int]) -> list[int]:
        rule = SGLANG_LAYER_ID_RULES.get(architecture)
        if rule is None:
            raise StageError(f"target architecture {architecture!r} is not in SGLANG_LAYER_ID_RULES "
                             "(common/target/capture.py): unknown how SGLang reads a draft's eagle_config ids")
        return sglang_captured_points(list(layer_ids), rule)
    return read


def sglang_layer_ids(points: list[int], architecture: str, allow_unknown: bool = False) -> list[int]:
    """The draft-config ids (points - 1) after checking SGLang captures exactly h_{points} from them.

    Refuses points SGLang would capture as other layers (DeepSeek family: a first point other than 2),
    and an architecture the table does not know unless `allow_unknown` (then the common +1 is assumed).
    """
    ids = [p - 1 for p in points]
    rule = SGLANG_LAYER_ID_RULES.get(architecture)
    if rule is None:
        if allow_unknown:
            return ids
        raise StageError(
            f"target architecture {architecture!r} is not in SGLANG_LAYER_ID_RULES (common/target/capture.py), "
            f"so it is unknown how SGLang {SGLANG_VERSION_READ} turns draft ids {ids} into captured layers. "
            "Read its set_eagle3_layers_to_capture in sglang/srt/models/, add it to the table, or pass "
            "--allow-unknown-architecture to assume SGLang adds 1 (ids = capture points - 1).")
    captured = sglang_captured_points(ids, rule)
    if captured != list(points):
        raise StageError(
            f"capture points {list(points)} cannot be served by SGLang {SGLANG_VERSION_READ} on {architecture}: "
            f"the draft config would say ids {ids}, and its set_eagle3_layers_to_capture ({rule}) would "
            f"capture h{captured} instead, while the shards, the hf engine, reference mode and the vLLM "
            "export use h" + str(list(points)) + ". Use capture points whose first entry is 2 "
            "(the default [2, N//2, N-3]).")
    return ids


@torch.no_grad()
def capture_hf(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               capture_points: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an HF causal LM once; return (aux [B,T,3H], final [B,T,H]) in the model's dtype.

    aux = cat(h_i for i in capture_points) along features, h_i = the input of decoder layer i (taken by
    a forward pre-hook on that layer: HF's hidden_states[i]); final = the decoder's post-norm
    last_hidden_state = the lm_head input. Only the decoder runs (no [B,T,V] logits), and only the
    captured tensors stay alive. Hooks, not `output_hidden_states=[...]`: a list there selects layers in
    transformers 5.24, and 5.19 returns another tuple for it (one state short, the last one unreplaced).
    Padding must be on the right (positions of real tokens stay 0..T-1 and no real token attends a
    pad), so a padded row's real positions equal a one-sample forward; callers drop the pad rows.
    """
    decoder = model.base_model
    layers = decoder.layers
    assert all(1 <= i < len(layers) for i in capture_points), (capture_points, len(layers))
    captured = {}

    def keep(i):
        def pre_hook(module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]
        return pre_hook

    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in capture_points]
    try:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([captured[i] for i in capture_points], dim=-1)  # [B, T, 3H]
    final = out.last_hidden_state  # [B, T, H]
    return aux, final
