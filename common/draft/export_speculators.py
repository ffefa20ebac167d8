"""Convert 04's SGLang export into the speculators/vLLM folder format.

speculators (vllm-project/speculators `src/speculators/models/eagle3/config.py`, `convert/eagle/
eagle3_converter.py`; docs/design.md section 4): `architectures ["Eagle3Speculator"]`,
`speculators_model_type "eagle3"`, the draft layer's Llama config nested as `transformer_layer_config`,
`speculators_config` (algorithm, greedy proposal with K speculative tokens, verifier), top-level
`eagle_aux_hidden_state_layer_ids` in the vLLM convention = the capture points themselves (INPUT of
layer i, no +1), and `norm_before_residual: false` written explicitly because vLLM's speculators
ingestion defaults it to True when the key is missing (our draft's residual is the un-normed hidden).
EAGLE-3.1's `fc_norm` and `norm_output` go at the top level too: vLLM 0.32's update_eagle3
(transformers_utils/configs/speculators/algos.py:37-38) reads them there and overwrites the layer's.
The layer config carries the RoPE as read (`rope_theta`, `rope_scaling`).
Weights: `midlayer.*` -> `layers.0.*`; everything else keeps its name; no embed_tokens.
Only the MHA form has a speculators form: algos.py's eagle3_arch_map (llama, qwen3) has no MLA class, so
an MLA draft is refused here (04 writes no export_speculators/ for it; vLLM loads export_sglang/ directly).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from common.io import atomic_path, write_json

LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act",
              "tie_word_embeddings", "torch_dtype")
EAGLE31_KEYS = ("fc_norm", "norm_output")   # top level: algos.py update_eagle3 reads them there


def to_speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def speculators_config(sglang_cfg: dict, capture_points: list[int], verifier: dict,
                       speculative_tokens: int = 3) -> dict:
    """config.json of the speculators folder from the SGLang export's config.json."""
    points = sorted(int(p) for p in capture_points)
    layer = {k: sglang_cfg[k] for k in LAYER_KEYS if k in sglang_cfg}
    layer.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1})
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": sglang_cfg["draft_vocab_size"],
        "target_hidden_size": sglang_cfg.get("target_hidden_size", sglang_cfg["hidden_size"]),
        "norm_before_residual": False,
        **{k: True for k in EAGLE31_KEYS if sglang_cfg.get(k)},
        "eagle_aux_hidden_state_layer_ids": points,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "torch_dtype": sglang_cfg.get("torch_dtype", "bfloat16"),
    }


def export_speculators(sglang_dir: str | Path, out_dir: str | Path, capture_points: list[int],
                       verifier_path: str | Path, verifier_architectures: list[str],
                       speculative_tokens: int = 3) -> Path:
    """Write out_dir/{config.json, model.safetensors} from an SGLang export (weights renamed only)."""
    sglang_dir, out_dir = Path(sglang_dir), Path(out_dir)
    cfg = json.loads((sglang_dir / "config.json").read_text())
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise ValueError(f"{sglang_dir}: {cfg.get('architectures')} has no speculators form in vLLM 0.32 (algos.py "
                         "eagle3_arch_map: llama and qwen3 only); vLLM loads the SGLang-layout folder itself")
    sg_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    points = sorted(int(p) for p in capture_points)
    # SGLang ids mean OUTPUT of layer j = points - 1; refuse a folder that disagrees with the points.
    assert sg_ids == [p - 1 for p in points], f"{sglang_dir}: eagle_config ids {sg_ids} != points-1"
    with safe_open(str(sglang_dir / "model.safetensors"), framework="pt") as f:
        tensors = {to_speculators_name(k): f.get_tensor(k) for k in f.keys()}
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    verifier = {"name_or_path": str(verifier_path), "architectures": list(verifier_architectures)}
    write_json(out_dir / "config.json", speculators_config(cfg, points, verifier, speculative_tokens))
    return out_dir
