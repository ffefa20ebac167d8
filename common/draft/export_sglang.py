"""The SGLang export of the draft: config.json + model.safetensors that SGLang's
LlamaForCausalLMEagle3 (and vLLM's eagle3 loader) reads, with the exact key set checked both ways."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.draft.model import Eagle3DraftModel
from common.io import atomic_path, write_json


def export_shapes(cfg: dict) -> dict[str, tuple]:
    """The exact key set and shapes of the SGLang export (docs/design.md section 4)."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    ht = cfg.get("target_hidden_size", h)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        "fc.weight": (h, 3 * ht),
        "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * d),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        "d2t": (cfg["draft_vocab_size"],),
        "t2d": (cfg["vocab_size"],),
    }


def sglang_config(cfg: dict, capture_points: list[int], torch_dtype: str = "bfloat16") -> dict:
    """config.json of the export. SGLang's eagle_config ids mean OUTPUT of layer j (it adds +1), so
    ids = capture points - 1; vLLM's top-level ids mean INPUT of layer i: the points themselves."""
    points = sorted(int(p) for p in capture_points)
    out = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "intermediate_size": cfg["intermediate_size"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"], "max_position_embeddings": cfg["max_position_embeddings"],
        "num_hidden_layers": 1, "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["draft_vocab_size"], "tie_word_embeddings": False,
        "torch_dtype": torch_dtype, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [p - 1 for p in points],
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": points,
    }
    if cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    return out


def export_sglang(model: Eagle3DraftModel, out_dir, capture_points: list[int],
                  torch_dtype: str = "bfloat16", extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors that SGLang's LlamaForCausalLMEagle3 loads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, torch_dtype)
    tensors = {}
    for name, t in model.trainable_state_dict().items():
        t = t.detach().cpu()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    # SGLang silently skips unknown names and leaves missing ones random: insist on the exact set.
    want = export_shapes(model.config)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    assert got == want, f"export keys/shapes differ: {sorted(set(got) ^ set(want))} {got} {want}"
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", {**sglang_config(model.config, capture_points, torch_dtype),
                                         **(extra_config or {})})
    return out_dir


def load_sglang_export(export_dir, embed_weight: torch.Tensor) -> Eagle3DraftModel:
    """Rebuild the draft from an export (strict: the file must hold exactly the export key set)."""
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    model = Eagle3DraftModel(cfg)
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    want = export_shapes(model.config)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        raise ValueError(f"{export_dir}: keys/shapes differ from the EAGLE-3 export set: "
                         f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}, "
                         f"shape mismatches {sorted(k for k in want if k in got and got[k] != want[k])}")
    if tuple(embed_weight.shape) != (cfg["vocab_size"], cfg["hidden_size"]):
        raise ValueError(f"embedding {tuple(embed_weight.shape)} does not match the draft "
                         f"({cfg['vocab_size']}, {cfg['hidden_size']})")
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    state["embed_tokens.weight"] = embed_weight.float()
    model.load_state_dict(state, strict=True)
    return model.eval()
