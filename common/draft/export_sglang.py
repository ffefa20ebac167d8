"""The SGLang export of the draft: config.json + model.safetensors that the engines' EAGLE-3 draft classes
read, with the exact key set checked both ways.

  mha: `LlamaForCausalLMEagle3` (SGLang llama_eagle3.py; vLLM reads the same folder), weights `midlayer.*`.
  mla: `Eagle3DeepseekV2ForCausalLM` (SGLang 0.5.14 kimi_k25_eagle3.py, vLLM 0.32 deepseek_eagle3.py: the
       same folder serves both), weights `layers.0.*` as the public MLA drafts name them (SGLang's
       load_weights maps `^layers.0.` to its midlayer; vLLM prefixes `model.`), `model_type: kimi_k2`
       as the public K2.5 MLA drafts say: both engines register it as DeepSeek-V3's config class, and
       vLLM rewrites `deepseek_v3` into its MTP model (speculative.py), so the export never says that.
  EAGLE-3.1 options, either form: `fc_norm.{0,1,2}.weight` with `fc_norm: true`, and `norm_output: true`.
  SGLang skips unknown names silently and leaves missing ones random: the key set is asserted exactly.
  A draft vocab that is the whole target vocab in target order (an imported full-vocab draft) is written
  without d2t/t2d (identity_vocab: vLLM cannot load a d2t there).
  An imported draft's fields (04 --init-from) come through `extra_config` (imported.export_config: its model
  type and the keys both engines ignore, as read); its RoPE, YaRN included, is in its config already.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.draft.model import MLA_KEYS, Eagle3DraftModel
from common.io import atomic_path, write_json


def layer_shapes(cfg: dict) -> dict[str, tuple]:
    """The draft layer's tensors (our `midlayer.` names) and shapes, for either attention form."""
    h, i, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    if cfg.get("attention", "mha") == "mla":
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        attn = {"q_a_proj.weight": (ql, 2 * h), "q_a_layernorm.weight": (ql,),
                "q_b_proj.weight": (nh * (nope + rope), ql),
                "kv_a_proj_with_mqa.weight": (kvl + rope, 2 * h), "kv_a_layernorm.weight": (kvl,),
                "kv_b_proj.weight": (nh * (nope + v), kvl), "o_proj.weight": (h, nh * v)}
    else:
        d, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
        attn = {"q_proj.weight": (nh * d, 2 * h), "k_proj.weight": (nkv * d, 2 * h),
                "v_proj.weight": (nkv * d, 2 * h), "o_proj.weight": (h, nh * d)}
    return {**{f"midlayer.self_attn.{k}": v for k, v in attn.items()},
            "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i), "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,)}


def export_shapes(cfg: dict) -> dict[str, tuple]:
    """The exact key set and shapes of the draft (our names; docs/design.md section 4)."""
    h = cfg["hidden_size"]
    ht = cfg.get("target_hidden_size") or h
    norms = {f"fc_norm.{j}.weight": (ht,) for j in range(3)} if cfg.get("fc_norm") else {}
    return {"fc.weight": (h, 3 * ht), **norms, **layer_shapes(cfg), "norm.weight": (h,),
            "lm_head.weight": (cfg["draft_vocab_size"], h), "d2t": (cfg["draft_vocab_size"],),
            "t2d": (cfg["vocab_size"],)}


def identity_vocab(cfg: dict, d2t: torch.Tensor) -> bool:
    """A draft vocab that is the whole target vocab in target order: the export stores no d2t/t2d (as the
    public full-vocab Kimi drafts do). vLLM 0.32 registers no draft_id_to_target_id when the draft vocab
    equals the target's and then fails on a stored d2t (llama_eagle3.py:339-345, deepseek_eagle3.py:308-314,
    its weight loader refuses unknown names); SGLang reads the lm_head rows as target ids without it."""
    return cfg["draft_vocab_size"] == cfg["vocab_size"] and not bool(d2t.any())


def export_name(name: str, cfg: dict) -> str:
    """Our tensor name -> the export's: `midlayer.` becomes `layers.0.` in the MLA form (its checkpoints'
    names); the MHA form keeps `midlayer.` (what SGLang's LlamaForCausalLMEagle3 was written for)."""
    if cfg.get("attention", "mha") == "mla" and name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    return name


def sglang_config(cfg: dict, capture_points: list[int], torch_dtype: str = "bfloat16") -> dict:
    """config.json of the export. SGLang's eagle_config ids mean OUTPUT of layer j (it adds +1), so
    ids = capture points - 1; vLLM's top-level ids mean INPUT of layer i: the points themselves."""
    points = sorted(int(p) for p in capture_points)
    mla = cfg.get("attention", "mha") == "mla"
    out = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM" if mla else "LlamaForCausalLMEagle3"],
        "model_type": "kimi_k2" if mla else "llama",
        "hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        **({k: cfg[k] for k in MLA_KEYS} if mla else {"head_dim": cfg["head_dim"]}),
        "intermediate_size": cfg["intermediate_size"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        **({} if cfg.get("max_position_embeddings") is None else
           {"max_position_embeddings": cfg["max_position_embeddings"]}),   # an imported draft may have none
        "num_hidden_layers": 1, "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["draft_vocab_size"], "tie_word_embeddings": False,
        "torch_dtype": torch_dtype, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [p - 1 for p in points],
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": points,
    }
    if cfg.get("rope_scaling"):
        out["rope_scaling"] = dict(cfg["rope_scaling"])
    for option in ("fc_norm", "norm_output"):   # EAGLE-3.1; both engines default them to false
        if cfg.get(option):
            out[option] = True
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
    if identity_vocab(model.config, tensors["d2t"]):
        del tensors["d2t"], tensors["t2d"]   # vLLM fails on a d2t next to a full draft vocab (module docstring)
    tensors = {export_name(k, model.config): v for k, v in tensors.items()}
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", merge_config(sglang_config(model.config, capture_points, torch_dtype),
                                                     extra_config or {}))
    return out_dir


def merge_config(ours: dict, extra: dict) -> dict:
    """The export's config with `extra` (an imported draft's fields, imported.export_config) added; inside
    eagle_config ours win (the capture ids), its other keys are kept."""
    out = {**ours, **{k: v for k, v in extra.items() if k != "eagle_config"}}
    if "eagle_config" in extra:
        out["eagle_config"] = {**extra["eagle_config"], **ours["eagle_config"]}
    return out


def our_name(name: str) -> str:
    """An export's tensor name -> ours (export_name's inverse)."""
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def load_sglang_export(export_dir, embed_weight: torch.Tensor) -> Eagle3DraftModel:
    """Rebuild the draft from an export (strict: the file must hold exactly the export key set)."""
    from common.draft.config import read_config   # the importer's reading of a config (its refusal table)

    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    model = Eagle3DraftModel(read_config(export_dir, cfg).config)
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        tensors = {our_name(k): f.get_tensor(k) for k in f.keys()}
    c = model.config
    if "d2t" not in tensors and "t2d" not in tensors and c["draft_vocab_size"] == c["vocab_size"]:
        tensors["d2t"] = torch.zeros(c["vocab_size"], dtype=torch.int64)      # a full draft vocab (identity_vocab)
        tensors["t2d"] = torch.ones(c["vocab_size"], dtype=torch.bool)
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
