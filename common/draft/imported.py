"""Read an EAGLE-3 draft made elsewhere (or by 04) and check it against a target before any work.

Three layouts, told apart by config.json alone (never by the folder name); the config is read by
common/draft/config.py (the refusal table: every key read, known to be unused by both engines, or
refused by name):
  sglang       `LlamaForCausalLMEagle3` (MHA) or `Eagle3DeepseekV2ForCausalLM` (MLA) config + safetensors:
               04's export_sglang/, SpecForge's and TorchSpec's output, the public Kimi drafts
               (lightseekorg/kimi-k2.5-eagle3, -eagle3-mla). `d2t`/`t2d` give a pruned draft vocab; without
               them the lm_head must cover the whole target vocab (draft id = target id).
  speculators  `Eagle3Speculator` config (`transformer_layer_config` nested) + `layers.0.*` weights:
               04's export_speculators/ and vLLM's speculators drafts (MHA only).
Tensor names: `layers.0.*` and `midlayer.*` (both engines map one to the other), and `model.*` /
`model.layers.0.*` (read here; only SGLang's Llama class loads them: SGLang's MLA class prefixes `model.`
again and skips them, kimi_k25_eagle3.py:433-435, 479, and vLLM's loaders prefix `model.` again and fail,
llama_eagle3.py:443, deepseek_eagle3.py:381: such a folder is marked unservable there). Any other name is
refused.
A shipped `embed_tokens.weight` is kept aside (ImportedDraft.embed), never fed to the draft: SGLang's
EAGLE-3 worker always replaces the draft's embedding by the target's (eagle_worker_v2.py:329 set_embed,
llama.py:793, kimi_k25_eagle3.py:389; only a draft whose target_hidden_size differs keeps its own, which
check_draft refuses). vLLM keeps a shipped embedding that differs from the target's
(v1/spec_decode/llm_base_proposer.py:1436-1466: shared only when absent or equal). So the draft is taken as
SGLang serves it, and `serving_differences` refuses a draft whose shipped embedding differs from the
target's for vLLM. 04's export never writes it (both engines then feed the target's embedding).

The capture points a draft reads (h_i = the INPUT of decoder layer i, docs/design.md section 1) come from
its config in each engine's id convention: SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
through the target architecture's rule (common/target/capture.py; SpecForge's Kimi config says [2, 30,
58] and 04 writes [1, 29, 57]: both capture h_2, h_30, h_58 on DeepSeek-V3), vLLM's top-level
`eagle_aux_hidden_state_layer_ids` as the points themselves; without either, the engines' default
[2, N//2, N-3]. Every check raises StageError with one line: field, the draft's value, the expected one;
an unreadable file (config.json, index, a missing shard, a truncated or bad safetensors) is one line
naming the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from common.draft.config import refuse, read_config
from common.draft.export_sglang import export_shapes
from common.draft.model import Eagle3DraftModel
from common.stage import StageError

LAYOUTS = ("sglang", "speculators")
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ShippedEmbed:
    """Where a draft's own embed_tokens.weight lies; loaded only to compare it with the target's (a Kimi-size
    one is 2.3 GB)."""
    file: Path
    name: str
    shape: tuple

    def load(self) -> torch.Tensor:
        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.name)


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
    sha256: str                       # of config.json, the index (if any) and the weight files, in that order
    raw_config: dict = field(repr=False, default_factory=dict)
    notes: list[str] = field(default_factory=list)
    model_type: str = "llama"         # as the engines' config class sees it
    carried: dict = field(default_factory=dict)    # config keys both engines ignore, as read (04 writes them back)
    embed: ShippedEmbed | None = None             # a shipped embed_tokens.weight (read only when compared)
    unservable: dict = field(default_factory=dict)  # engine -> why it would serve another network than this one

    def identity(self) -> dict:
        return {"path": str(self.path), "layout": self.layout, "sha256": self.sha256, "dtype": self.dtype,
                "attention": self.config["attention"], "model_type": self.model_type,
                "draft_vocab_size": self.config["draft_vocab_size"], "full_vocab": self.full_vocab}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StageError(f"draft {path.parent}: {what} {path.name} is unreadable ({_one_line(e)}), expected "
                         "a JSON file") from None
    if not isinstance(value, dict):
        raise refuse(path.parent, f"{what} {path.name}", type(value).__name__, "a JSON object")
    return value


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wmap = _read_json(index, "the weight index").get("weight_map")
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
            raise refuse(path, "the weight index's weight_map", repr(wmap)[:80], "{tensor name: shard file}")
        files = [path / n for n in sorted(set(wmap.values()))]
        for f in files:
            if not f.is_file():
                raise refuse(path, f"shard {f.name} named by {index.name}", "missing", "a file in the draft folder")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise refuse(path, "the weights file", "missing", "model.safetensors or model.safetensors.index.json "
                 "(a .bin draft: convert it to safetensors first)")


def _identity_sha256(files: list[Path]) -> str:
    """sha256 over each file's name and bytes: config.json first, so a changed config changes it."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def our_tensor_name(name: str) -> tuple[str, bool]:
    """A stored tensor name -> (our name, whether it came with SGLang-Llama-only `model.` nesting)."""
    nested = name.startswith("model.") and not name.startswith("model.lm_head") and \
        name[len("model."):] not in ("d2t", "t2d")
    if nested:
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name, nested


def _read_weights(path: Path, files: list[Path]) -> tuple[dict, ShippedEmbed | None, bool]:
    """(our name -> tensor, the shipped embed_tokens or None, whether any name was `model.`-nested)."""
    state, embed, nested_any = {}, None, False
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    ours, nested = our_tensor_name(name)
                    nested_any |= nested
                    if ours in state or (ours == "embed_tokens.weight" and embed is not None):
                        raise refuse(path, f"tensor {ours}", "stored twice (under two names)", "once")
                    if ours == "embed_tokens.weight":
                        embed = ShippedEmbed(f, name, tuple(sf.get_slice(name).get_shape()))
                        continue
                    state[ours] = sf.get_tensor(name)
        except StageError:
            raise
        except Exception as e:   # safetensors' SafetensorError, OSError, a truncated file's read
            raise StageError(f"draft {path}: weights file {f.name} is unreadable ({_one_line(e)}), expected a "
                             "complete safetensors file") from None
    return state, embed, nested_any


def read_draft(path: str | Path) -> ImportedDraft:
    """Read config and weights (names mapped to ours). Shapes, dtype and values are checked here;
    the fit to a target is check_draft's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise refuse(path, "config.json", "missing", "a draft folder (SGLang or speculators layout)")
    raw = _read_json(path / "config.json", "the config")
    dc = read_config(path, raw)
    cfg, notes, unservable = dc.config, list(dc.notes), {k: list(v) for k, v in dc.unservable.items()}
    files = _weight_files(path)
    index = path / "model.safetensors.index.json"
    state, embed, nested = _read_weights(path, files)
    if nested:
        why = ("its tensor names are nested under model.: SGLang's kimi_k25_eagle3.py load_weights prefixes model. "
               "again and skips them (random weights)" if cfg["attention"] == "mla" else None)
        if why:
            unservable.setdefault("sglang", []).append(why)
        unservable.setdefault("vllm", []).append(
            "its tensor names are nested under model.: vLLM's load_weights prefixes model. again and fails")
    if embed is not None:
        if embed.shape != (cfg["vocab_size"], cfg["hidden_size"]):
            raise refuse(path, "tensor embed_tokens.weight", embed.shape,
                         f"({cfg['vocab_size']}, {cfg['hidden_size']}) or absent")
        notes.append("embed_tokens.weight kept aside: SGLang feeds the target's embedding (set_embed); vLLM "
                     "serves it only if it differs from the target's, which 05b checks")
    full_vocab = "d2t" not in state and "t2d" not in state
    if not full_vocab and cfg["draft_vocab_size"] == cfg["vocab_size"]:
        unservable.setdefault("vllm", []).append(
            "it stores d2t with a full draft vocab: vLLM 0.32 then registers no draft_id_to_target_id and fails "
            "to load it (llama_eagle3.py:339-345, deepseek_eagle3.py:308-314)")
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
    if dc.declared_dtype is not None and dc.declared_dtype != dtypes[0]:
        raise refuse(path, "config torch_dtype", dc.declared_dtype, f"{dtypes[0]} (the stored weights)")
    for name, t in floats.items():
        if not torch.isfinite(t).all():
            raise refuse(path, f"tensor {name}", f"{int((~torch.isfinite(t)).sum())} NaN/inf values", "finite")
    d2t, t2d = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    target_ids = torch.arange(len(d2t)) + d2t
    if int(t2d.sum()) != len(d2t) or target_ids.min() < 0 or target_ids.max() >= cfg["vocab_size"] \
            or not bool(t2d[target_ids].all()):
        raise refuse(path, "d2t/t2d", "inconsistent", "draft id + d2t = a target id marked in t2d, one per row")
    state["d2t"], state["t2d"] = d2t, t2d
    identity_files = [path / "config.json", *([index] if index.is_file() else []), *files]
    return ImportedDraft(path, dc.layout, cfg, state, dtypes[0], dc.sglang_ids, dc.vllm_points, full_vocab,
                         _identity_sha256(identity_files), raw, notes, dc.model_type, dc.carried, embed, unservable)


def serving_differences(d: ImportedDraft, engine: str, target_embed=None) -> list[str]:
    """Why `engine` would serve another network than the one imported (and replayed by 05), or []:
    the config's (config.py), the tensor names', and for vLLM a shipped embed_tokens that differs from the
    target's (`target_embed`: a callable returning the target's input embedding, called only then)."""
    reasons = list(d.unservable.get(engine, []))
    if engine == "vllm" and d.embed is not None and target_embed is not None and embed_differs(d, target_embed()):
        reasons.append("it ships an embed_tokens.weight that differs from the target's: vLLM keeps the draft's "
                       "own (llm_base_proposer.py:1436-1466), SGLang and the replay feed the target's")
    return reasons


def embed_differs(d: ImportedDraft, target_embed: torch.Tensor) -> bool:
    """A shipped embedding unequal to the target's, compared in float32 (vLLM compares the loaded tensors;
    NaN never equals)."""
    if d.embed is None:
        return False
    return d.embed.shape != tuple(target_embed.shape) or \
        not torch.equal(d.embed.load().float(), target_embed.detach().float().cpu())


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
    if c["attention"] == "mla":
        if c["qk_rope_head_dim"] % 2:
            raise refuse(d.path, "qk_rope_head_dim", c["qk_rope_head_dim"], "even (RoPE rotates pairs)")
    else:
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
    """The draft in float32 with the target's embedding (eval mode), as SGLang serves it (a shipped
    embed_tokens is not used: module docstring)."""
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


def export_config(d: ImportedDraft) -> dict:
    """What an export of `d` (04 --init-from) writes besides our config (export_sglang.sglang_config, which
    writes every field the engines act on from d.config): its model type as read (the MLA form's kimi_k2 or
    deepseek_v2) and the keys both engines ignore, as read (config.py IGNORED, eagle_config's extras)."""
    out = {k: v for k, v in d.carried.items()}
    if d.config["attention"] == "mla":
        out["model_type"] = d.model_type
    return out
