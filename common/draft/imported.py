"""Read an EAGLE-3 draft made elsewhere (or by 04) and check it against a target before any work.

Three layouts, told apart by config.json alone (never by the folder name):
  sglang       `LlamaForCausalLMEagle3` config + safetensors with `midlayer.*`, `fc`, `norm`, `lm_head`:
               04's export_sglang/, SpecForge's output and the public Kimi drafts
               (lightseekorg/kimi-k2.5-eagle3). `d2t`/`t2d` give a pruned draft vocab; without them
               the lm_head must cover the whole target vocab (draft id = target id).
  speculators  `Eagle3Speculator` config (`transformer_layer_config` nested) + `layers.0.*` weights:
               04's export_speculators/ and vLLM's speculators drafts.
An `embed_tokens.weight` in the file is dropped: SGLang's EAGLE-3 worker (set_embed) and vLLM both
feed the draft the target's embedding, and so do we.

The capture points a draft reads (h_i = the INPUT of decoder layer i, docs/design.md section 1) come from
its config in each engine's id convention: SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
through the target architecture's rule (common/target/capture.py; SpecForge's Kimi config says [2, 30,
58] and 04 writes [1, 29, 57]: both capture h_2, h_30, h_58 on DeepSeek-V3), vLLM's top-level
`eagle_aux_hidden_state_layer_ids` as the points themselves; without either, the engines' default
[2, N//2, N-3]. Every check raises StageError with one line: field, the draft's value, the expected one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from common.draft.export_sglang import export_shapes
from common.draft.model import Eagle3DraftModel
from common.stage import StageError

LAYOUTS = ("sglang", "speculators")
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ImportedDraft:
    """A draft as read from disk: our config keys, the weights under our names (d2t/t2d included,
    made for a full-vocab head), the capture points in each convention it declares, and its identity."""
    path: Path
    layout: str
    config: dict                      # Eagle3DraftModel config (CONFIG_KEYS)
    state: dict                       # name -> tensor, as stored (no embed_tokens)
    dtype: str                        # the weights' float dtype
    sglang_ids: list[int] | None      # eagle_config ids (SGLang convention), if declared
    vllm_points: list[int] | None     # top-level ids (vLLM convention = points), if declared
    full_vocab: bool                  # no d2t/t2d stored: lm_head rows are target ids
    sha256: str                       # of the weight files' bytes, in name order
    raw_config: dict = field(repr=False, default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def identity(self) -> dict:
        return {"path": str(self.path), "layout": self.layout, "sha256": self.sha256, "dtype": self.dtype,
                "draft_vocab_size": self.config["draft_vocab_size"], "full_vocab": self.full_vocab}


def refuse(path, what: str, value, expected) -> StageError:
    return StageError(f"draft {path}: {what} is {value}, expected {expected}")


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise refuse(path, "the weights file", "missing", "model.safetensors or model.safetensors.index.json "
                 "(a .bin draft: convert it to safetensors first)")


def _file_sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _layout(path: Path, cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs:
        return "speculators"
    if any("Eagle3" in a for a in archs):
        return "sglang"
    raise refuse(path, "config.json architectures", archs, "['LlamaForCausalLMEagle3'] (SGLang layout) or "
                 "['Eagle3Speculator'] (speculators)")


def _our_config(path: Path, layer: dict, top: dict) -> dict:
    """Our draft config from the (layer) config; defaults as the engines read a Llama config."""
    if layer.get("rope_scaling"):
        raise refuse(path, "rope_scaling", layer["rope_scaling"], "none (the draft's RoPE here is plain "
                     "rotate_half with rope_theta; a scaled one would be evaluated wrongly)")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
    except KeyError as e:
        raise refuse(path, f"config {e.args[0]}", "missing", "present") from None
    return {
        "hidden_size": hidden,
        "target_hidden_size": int(top.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or hidden // heads),
        "intermediate_size": int(layer["intermediate_size"]),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(layer.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 4096)),
        "vocab_size": vocab,
        "draft_vocab_size": int(top.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
    }


def read_draft(path: str | Path) -> ImportedDraft:
    """Read config and weights (names mapped to ours). Shapes, dtype and values are checked here;
    the fit to a target is check_draft's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise refuse(path, "config.json", "missing", "a draft folder (SGLang or speculators layout)")
    raw = json.loads((path / "config.json").read_text())
    layout = _layout(path, raw)
    layer = raw.get("transformer_layer_config", {}) if layout == "speculators" else raw
    if layout == "speculators" and raw.get("norm_before_residual", False):
        raise refuse(path, "norm_before_residual", True, "false (our draft's residual is the un-normed hidden)")
    cfg = _our_config(path, layer, raw)
    files = _weight_files(path)
    state, notes = {}, []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                ours = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
                if ours.startswith("model."):            # some writers nest under model.
                    ours = ours[len("model."):]
                if ours == "embed_tokens.weight":
                    notes.append("embed_tokens.weight dropped: the engines feed the target's embedding")
                    continue
                state[ours] = sf.get_tensor(name)
    full_vocab = "d2t" not in state and "t2d" not in state
    if full_vocab:
        if cfg["draft_vocab_size"] != cfg["vocab_size"]:
            raise refuse(path, "draft_vocab_size without d2t/t2d", cfg["draft_vocab_size"],
                         f"the target vocab {cfg['vocab_size']} (a pruned head needs d2t and t2d)")
        state["d2t"] = torch.zeros(cfg["vocab_size"], dtype=torch.int64)
        state["t2d"] = torch.ones(cfg["vocab_size"], dtype=torch.bool)
    want = export_shapes(cfg)
    for name in sorted(set(want) | set(state)):
        got = tuple(state[name].shape) if name in state else "missing"
        if got != want.get(name, "absent"):
            raise refuse(path, f"tensor {name}", got, want.get(name, "absent (not an EAGLE-3 draft tensor)"))
    floats = {n: t for n, t in state.items() if n not in ("d2t", "t2d")}
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in floats.values()})
    if len(dtypes) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise refuse(path, "weight dtype", dtypes, "one of bfloat16, float16, float32")
    declared = raw.get("torch_dtype") or raw.get("dtype") or layer.get("torch_dtype")
    if declared is not None and declared != dtypes[0]:
        raise refuse(path, "config torch_dtype", declared, f"{dtypes[0]} (the stored weights)")
    for name, t in floats.items():
        if not torch.isfinite(t).all():
            raise refuse(path, f"tensor {name}", f"{int((~torch.isfinite(t)).sum())} NaN/inf values", "finite")
    d2t, t2d = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    target_ids = torch.arange(len(d2t)) + d2t
    if int(t2d.sum()) != len(d2t) or target_ids.min() < 0 or target_ids.max() >= cfg["vocab_size"] \
            or not bool(t2d[target_ids].all()):
        raise refuse(path, "d2t/t2d", "inconsistent", "draft id + d2t = a target id marked in t2d, one per row")
    state["d2t"], state["t2d"] = d2t, t2d
    sglang_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm_points = raw.get("eagle_aux_hidden_state_layer_ids")
    return ImportedDraft(path, layout, cfg, state, dtypes[0],
                         None if sglang_ids is None else [int(i) for i in sglang_ids],
                         None if vllm_points is None else [int(i) for i in vllm_points],
                         full_vocab, _file_sha256(files), raw, notes)


def draft_capture_points(d: ImportedDraft, sglang_points, num_hidden_layers: int) -> list[int]:
    """The h_i the engines will feed this draft on this target; refuses when its declarations disagree.
    sglang_points: eagle_config ids -> the h_i SGLang captures on the target (its architecture's rule,
    common/target/capture.py sglang_points_reader)."""
    declared = {}
    if d.sglang_ids is not None:
        declared[f"eagle_config ids {d.sglang_ids} (SGLang)"] = sglang_points(d.sglang_ids)
    if d.vllm_points is not None:
        declared[f"top-level ids {d.vllm_points} (vLLM)"] = list(d.vllm_points)
    if not declared:
        n = num_hidden_layers
        return [2, n // 2, n - 3]
    (first, points), *rest = declared.items()
    for what, other in rest:
        if other != points:
            raise refuse(d.path, f"capture points by {what}", f"h{other}", f"h{points} as by {first}")
    if any(not 1 <= p <= num_hidden_layers - 1 for p in points) or points != sorted(set(points)):
        raise refuse(d.path, f"capture points by {first}", points,
                     f"ascending layers in 1..{num_hidden_layers - 1}")
    return points


def check_draft(d: ImportedDraft, target_cfg: dict, sglang_points,
                capture_points: list[int] | None = None) -> list[int]:
    """Check the draft against the target's text config (and the capture points the caller's features
    hold, when given). Returns the draft's capture points. sglang_points: see draft_capture_points."""
    c = d.config
    for what, value, expected in (("target_hidden_size", c["target_hidden_size"], target_cfg["hidden_size"]),
                                  ("hidden_size", c["hidden_size"], target_cfg["hidden_size"]),
                                  ("vocab_size", c["vocab_size"], target_cfg["vocab_size"])):
        if int(value) != int(expected):
            raise refuse(d.path, what, value, f"{expected} (the target's)")
    if c["num_attention_heads"] % c["num_key_value_heads"]:
        raise refuse(d.path, "num_key_value_heads", c["num_key_value_heads"],
                     f"a divisor of num_attention_heads {c['num_attention_heads']}")
    if c["head_dim"] % 2:
        raise refuse(d.path, "head_dim", c["head_dim"], "even (RoPE rotates pairs)")
    if not (c["rope_theta"] > 0 and 0 < c["rms_norm_eps"] < 1e-2):
        raise refuse(d.path, "rope_theta / rms_norm_eps", (c["rope_theta"], c["rms_norm_eps"]),
                     "rope_theta > 0 and 0 < rms_norm_eps < 1e-2")
    points = draft_capture_points(d, sglang_points, int(target_cfg["num_hidden_layers"]))
    if capture_points is not None and list(capture_points) != points:
        raise refuse(d.path, "capture points", f"h{points}", f"h{list(capture_points)} (the stored features')")
    return points


def build_model(d: ImportedDraft, embed_weight: torch.Tensor) -> Eagle3DraftModel:
    """The draft in float32 with the target's embedding (eval mode)."""
    model = Eagle3DraftModel(d.config)
    state = {n: t.float() if t.is_floating_point() else t for n, t in d.state.items()}
    state["embed_tokens.weight"] = embed_weight.float()
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_draft(path: str | Path, target_cfg: dict, sglang_points, embed_weight: torch.Tensor,
               capture_points: list[int] | None = None) -> tuple[Eagle3DraftModel, ImportedDraft, list[int]]:
    """read_draft + check_draft + build_model: (float32 model, the draft as read, its capture points)."""
    d = read_draft(path)
    points = check_draft(d, target_cfg, sglang_points, capture_points)
    return build_model(d, embed_weight), d, points
