"""An EAGLE-3 draft's config.json read as the pinned engines read it: the importer's one refusal table.

The engines (SGLang 0.5.14 on transformers 5.8, vLLM 0.32 on transformers 5.19) build a draft from its
config through transformers' config class, then `getattr` whatever field their draft class wants. So a
field the importer skipped could change the served network without a word. Here every key of the config
is one of three things, and anything else is refused by name:
  READ     it sets our draft config (common/draft/model.py CONFIG_KEYS) or its identity (layout, model
           type, capture points, dtype) - or it is refused for a value we do not implement;
  IGNORED  neither engine's draft class reads it (the reason is in IGNORED); such keys are kept as read
           (`carried`) and written back by 04's export;
  refused  everything else: "config key K is V, expected absent".
Each refusal is one StageError line naming the field, the value and what is implemented.

Architectures (SGLang models/llama_eagle3.py, models/kimi_k25_eagle3.py; vLLM models/registry.py:662,672):
  LlamaForCausalLMEagle3       the MHA form, SGLang layout (vLLM loads it too); model_type "llama".
  Eagle3DeepseekV2ForCausalLM  the MLA form, SGLang layout (both engines); model_type "kimi_k2" (both engines
                               register it as DeepSeek-V3's config class: SGLang utils/hf_transformers/
                               common.py:135, vLLM transformers_utils/config.py:100) or "deepseek_v2".
                               "deepseek_v3" is refused: vLLM's speculative.py:679-684 rewrites it into its MTP
                               model ("Eagle3DeepSeekMTPModel ... not supported").
  Eagle3Speculator             vLLM's speculators layout (transformers_utils/configs/speculators/): the layer
                               config nested as `transformer_layer_config` (model_type llama only: its
                               eagle3_arch_map, algos.py:39-46, maps qwen3 to a class we do not implement),
                               the EAGLE-3 fields at the top level (algos.py:30-50 overwrites the layer's).

RoPE (rope.py says how each form computes it). transformers 5 merges `rope_scaling` into `rope_parameters`
(rope_scaling wins, modeling_rope_utils.py convert_rope_params_to_dict) and both engines read the merged
dict (SGLang models/llama.py:266-272, kimi_k25_eagle3.py:78-86; vLLM models/llama.py:246,
deepseek_v2.py:1115-1127): the two keys are read alike and refused when they disagree. rope_theta comes
from the dict, else the top level (transformers' setdefault; both given and different is refused), else
10000 (transformers' default_theta); null is refused (the engines would take None as the base). Kinds:
"default" and "yarn" (as DeepSeek YaRN for MLA, Llama YaRN for MHA); any other kind is refused by name -
for MLA it matters doubly, as SGLang turns any non-default kind into deepseek_yarn (deepseek_v2.py:1539).
YaRN fields the engines read differently or not at all are refused by name (YARN_REFUSED); an MHA YaRN on
which vLLM computes another magnitude than SGLang (mscale/mscale_all_dim: rope.engine_rope_differences)
is read as SGLang serves it, and vLLM is marked unable to serve it (`unservable`, checked by 05b).

EAGLE-3 fields: `fc_norm` (or SGLang's legacy `use_aux_norm`, llama_eagle3.py:162, kimi_k25_eagle3.py:218;
vLLM reads fc_norm only, llama_eagle3.py:231, deepseek_eagle3.py:211: a use_aux_norm-only draft is
marked unservable on vLLM) and `norm_output` (all four classes) are read; `norm_before_residual` true
(vLLM llama_eagle3.py:101, deepseek_eagle3.py:101; speculators default true, algos.py:33) and
`norm_before_fc` true (vLLM llama_eagle3.py:184) are refused; `draft_vocab_size` null or missing is
refused (null: SGLang loads the target's lm_head, llama_eagle3.py:278, kimi_k25_eagle3.py:340; missing:
SGLang's LlamaForCausalLMEagle3 fails on the attribute); `eagle_config.use_aux_hidden_state` false (no
fc in vLLM, llama_eagle3.py:180) and a number of captured states other than 3 are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.draft.model import MLA_KEYS
from common.draft.rope import engine_rope_differences
from common.stage import StageError

MHA_ARCH, MLA_ARCH, SPECULATORS_ARCH = "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "Eagle3Speculator"
ARCHITECTURES = {MHA_ARCH: "mha", MLA_ARCH: "mla"}
MLA_MODEL_TYPES = ("kimi_k2", "deepseek_v2")
DEFAULT_THETA = 10000.0        # transformers' RotaryEmbeddingConfigMixin.default_theta; both engines' get_rope

# Keys of a draft config that neither engine's draft class reads, and why (read-and-ignored; kept and
# written back by 04's export as read).
IGNORED = {
    "_name_or_path": "where the writer loaded the config from",
    "transformers_version": "the writer's library version",
    "use_cache": "transformers' generate() cache switch; the engines keep their own KV cache",
    "initializer_range": "the init of training; the weights are given",
    "attention_dropout": "dropout is off at inference; neither Eagle3 class reads it",
    "bos_token_id": "generation ids of a standalone model; a draft never starts or ends a sequence",
    "eos_token_id": "generation ids of a standalone model; a draft never starts or ends a sequence",
    "pad_token_id": "generation ids of a standalone model (SGLang's LlamaModel reads padding_idx, which "
                    "its Eagle3 LlamaModel does not build)",
    "pretraining_tp": "transformers' slow Llama tensor-parallel path; no engine reads it",
    "max_window_layers": "Qwen2's sliding-window field; neither engine's Llama/DeepSeek Eagle3 class reads it "
                         "(vLLM's llama.py looks at layer_types only, which is read here)",
    "sliding_window": "read by vLLM only through layer_types (refused unless full attention); SGLang's draft "
                      "window comes from --speculative-draft-window-size",
    "use_sliding_window": "Qwen2's switch; no Llama/DeepSeek Eagle3 class reads it",
    "original_max_position_embeddings": "read with a YaRN rope (merged into it, as SGLang's llama.py:273 and "
                                        "transformers do); without a scaling nothing reads it",
}
# DeepSeek-V3 MoE/MTP fields a kimi_k2 draft config may copy from its target: both MLA draft classes build
# one dense MLP and no MTP layer (SGLang kimi_k25_eagle3.py:135, vLLM deepseek_eagle3.py:85-92).
MOE_IGNORED = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
               "topk_group", "topk_method", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
               "moe_layer_freq", "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits",
               "num_nextn_predict_layers", "num_mtp_layers")
# eagle_config keys neither engine reads (NVIDIA Model-Optimizer's export fields; the served network is
# what the engines build, whatever the trainer meant by them).
EAGLE_CONFIG_IGNORED = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm",
                        "next_layer_regular", "parallel_draft_step", "parallel_draft_heads_num_layers")
# The speculators layout's own top-level bookkeeping (vLLM builds the draft from transformer_layer_config and
# the EAGLE-3 fields, speculators/base.py extract_transformers_pre_trained_config, algos.py update_eagle3).
SPECULATORS_IGNORED = {
    "architectures": "vLLM sets the draft class from the layer's model_type (algos.py:43-46)",
    "speculators_config": "proposal methods and verifier: 05/05b choose k and the target themselves",
    "speculators_version": "the writer's library version", "has_no_defaults_at_init": "speculators bookkeeping",
    "embed_requires_grad": "training only", "transformers_version": "the writer's library version",
    "model_type": "vLLM's SpeculatorsConfig skips it (base.py: a class variable)",
}
# YaRN fields: implemented (read), and refused where the engines read them differently or one ignores them.
YARN_READ = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
YARN_REFUSED = {
    "attention_factor": ("absent", "vLLM reads it (MHA: the magnitude, yarn_scaling_rope.py; MLA: =1 switches to "
                                   "deepseek_llama_scaling, deepseek_v2.py:1116), SGLang does not"),
    "attn_factor": (1, "SGLang's YaRN reads it, vLLM's does not"),
    "extrapolation_factor": (1, "SGLang's YaRN reads it, vLLM's does not"),
    "partial_rotary_factor": (1, "a partial rotation is not implemented"),
    "rope_dim": ("absent", "vLLM's get_rope reads it, SGLang does not"),
    "apply_yarn_scaling": (True, "SGLang's MLA softmax scale reads it, vLLM does not"),
    "apply_scale": (True, "SGLang's MLA softmax scale reads it, vLLM does not"),
}


def refuse(path, what: str, value, expected) -> StageError:
    return StageError(f"draft {path}: {what} is {value}, expected {expected}")


@dataclass
class DraftConfig:
    """A draft's config.json as read: our draft config and everything else 04 and 05b need of it."""
    layout: str                         # sglang | speculators
    model_type: str                     # as the engines' config class sees it ("llama" for speculators)
    config: dict                        # Eagle3DraftModel config (model.CONFIG_KEYS)
    sglang_ids: list[int] | None        # eagle_config ids (SGLang convention), if declared
    vllm_points: list[int] | None       # top-level ids (vLLM convention = the points), if declared
    declared_dtype: str | None          # torch_dtype / dtype
    carried: dict = field(default_factory=dict)       # IGNORED keys as read (written back by 04's export)
    notes: list[str] = field(default_factory=list)
    unservable: dict[str, list[str]] = field(default_factory=dict)   # engine -> why it would serve another network


class _Keys:
    """One dict of the config being read: every key taken must be taken through here, and what is left
    at the end is refused by name (`rest`)."""

    def __init__(self, path, d: dict, where: str = ""):
        self.path, self.d, self.where, self.taken = path, d, where, set()

    def name(self, key: str) -> str:
        return f"{self.where}{key}"

    def has(self, key: str) -> bool:
        return key in self.d

    def get(self, key: str, default=None):
        self.taken.add(key)
        return self.d.get(key, default)

    def integer(self, key: str, default=None, required: bool = True) -> int | None:
        v = self.get(key, default)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise refuse(self.path, self.name(key), "missing" if key not in self.d else repr(v), "a positive integer")
        return v

    def number(self, key: str, default=None) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise refuse(self.path, self.name(key), "missing" if key not in self.d else repr(v), "a positive number")
        return float(v)

    def flag(self, key: str, allowed: bool | None, why: str, default: bool = False) -> bool:
        """A boolean (null or missing = `default`); `allowed` (if not None) is the only value implemented."""
        v = self.get(key)
        if v is not None and not isinstance(v, bool):
            raise refuse(self.path, self.name(key), repr(v), "true, false or absent")
        v = default if v is None else v
        if allowed is not None and v != allowed:
            raise refuse(self.path, self.name(key), v, f"{str(allowed).lower()} ({why})")
        return v

    def rest(self, ignored) -> dict:
        """The keys not taken: the ignored ones (returned as read), anything else refused by name."""
        out = {}
        for key in sorted(set(self.d) - self.taken):
            if key in ignored:
                out[key] = self.d[key]
            else:
                raise refuse(self.path, f"config key {self.name(key)}", repr(self.d[key]),
                             "absent (neither read by the importer nor known to be unused by SGLang 0.5.14 and vLLM "
                             "0.32: common/draft/config.py)")
        return out


def _rope_dict(path, value, what: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise refuse(path, what, repr(value), "a JSON object or null")
    out = dict(value)
    if "type" in out:
        kind = out.pop("type")
        if out.setdefault("rope_type", kind) != kind:
            raise refuse(path, f"{what} type/rope_type", (kind, out["rope_type"]), "one kind")
    return out


def read_rope(path, layer: _Keys, attention: str, notes: list[str]) -> tuple[float, dict | None]:
    """(rope_theta, YaRN dict or None) as the engines read it, or a refusal (module docstring)."""
    scaling = _rope_dict(path, layer.get("rope_scaling"), layer.name("rope_scaling"))
    params = _rope_dict(path, layer.get("rope_parameters"), layer.name("rope_parameters"))
    if scaling and params and {k: v for k, v in scaling.items() if k != "rope_theta"} != \
            {k: v for k, v in params.items() if k != "rope_theta"}:
        raise refuse(path, layer.name("rope_scaling"), scaling, f"equal to rope_parameters {params} or absent "
                     "(transformers 5 takes rope_scaling, a reader of rope_parameters would take the other)")
    rope = dict(scaling or params or {})
    thetas = {}
    for what, source in ((layer.name("rope_theta"), layer.d), (layer.name("rope_scaling.rope_theta"), scaling or {}),
                         (layer.name("rope_parameters.rope_theta"), params or {})):
        if "rope_theta" in source:
            v = source["rope_theta"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise refuse(path, what, repr(v), "a positive number (the RoPE base; null would reach the "
                             "engines' get_rope as None)")
            thetas[what] = float(v)
    layer.get("rope_theta")
    if len(set(thetas.values())) > 1:
        raise refuse(path, "rope_theta", thetas, "one value (transformers 5 takes the rope dict's, older readers "
                     "the top level's)")
    theta = next(iter(thetas.values()), None)
    if theta is None:
        theta = DEFAULT_THETA
        notes.append(f"rope_theta absent: read as {DEFAULT_THETA:g} (transformers' default_theta, the engines' "
                     "get_rope default)")
    rope.pop("rope_theta", None)
    kind = rope.pop("rope_type", "default")
    top_partial = layer.get("partial_rotary_factor")
    if top_partial is not None and top_partial != 1:
        raise refuse(path, layer.name("partial_rotary_factor"), top_partial, "1 (a partial rotation is not implemented)")
    if kind == "default":
        for key, v in rope.items():
            if not (key == "partial_rotary_factor" and v == 1):
                raise refuse(path, f"rope {key}", repr(v), "absent for rope_type default (only rope_theta is read)")
        return theta, None
    if kind != "yarn":
        raise refuse(path, "rope_type", repr(kind), "'default' or 'yarn' (the kinds implemented; SGLang serves any "
                     "other kind of an MLA draft as deepseek_yarn, deepseek_v2.py:1539)")
    out = {"rope_type": "yarn"}
    for key, v in rope.items():
        if key in YARN_REFUSED:
            ok, why = YARN_REFUSED[key]
            if ok == "absent" or v != ok:
                raise refuse(path, f"rope {key}", repr(v), f"{'absent' if ok == 'absent' else ok} ({why})")
            continue                      # the implemented value: nothing to keep
        if key == "truncate":
            if v is not True and attention == "mha":
                raise refuse(path, "rope truncate", repr(v), "true (both engines' Llama YaRN floor/ceil the "
                             "correction range when true, the default; false is not implemented)")
            out[key] = v                  # MLA: DeepSeek YaRN reads no truncate (kept as read)
            continue
        if key not in YARN_READ:
            raise refuse(path, f"rope {key}", repr(v), f"one of the YaRN fields read ({', '.join(YARN_READ)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (v < 0 if key.startswith("mscale") else v <= 0):
            raise refuse(path, f"rope {key}", repr(v), "a number")
        out[key] = v
    top_omax = layer.get("original_max_position_embeddings")
    if top_omax is not None:    # a top-level value overrides the dict's (SGLang llama.py:273, transformers)
        if "original_max_position_embeddings" in out and out["original_max_position_embeddings"] != top_omax:
            raise refuse(path, "original_max_position_embeddings", (top_omax, out["original_max_position_embeddings"]),
                         "one value at the top level and in the rope dict")
        out["original_max_position_embeddings"] = top_omax
    for key in ("factor", "original_max_position_embeddings"):
        if key not in out:
            raise refuse(path, f"rope {key}", "missing", "given for YaRN (transformers would take it from "
                         "max_position_embeddings or default it, which the engines do differently)")
    if out["factor"] < 1:
        raise refuse(path, "rope factor", out["factor"], ">= 1")
    return theta, out


def _declared_dtype(path, keys: _Keys) -> str | None:
    given = {k: keys.get(k) for k in ("torch_dtype", "dtype") if keys.has(k)}
    values = {v for v in given.values() if v is not None}
    if len(values) > 1:
        raise refuse(path, f"{keys.name('torch_dtype')}/dtype", given, "one dtype")
    return next(iter(values), None)


def read_config(path, raw: dict) -> DraftConfig:
    """The refusal table (module docstring): raw config.json dict -> DraftConfig, or one StageError line."""
    path = Path(path)
    if not isinstance(raw, dict):
        raise refuse(path, "config.json", type(raw).__name__, "a JSON object")
    top = _Keys(path, raw)
    notes, unservable = [], {}
    if top.has("speculators_model_type"):
        layout = "speculators"
        kind = top.get("speculators_model_type")
        if kind != "eagle3":
            raise refuse(path, "speculators_model_type", repr(kind), "'eagle3'")
        sub = top.get("transformer_layer_config")
        if not isinstance(sub, dict):
            raise refuse(path, "transformer_layer_config", repr(sub), "a JSON object (the draft layer's config)")
        layer = _Keys(path, sub, "transformer_layer_config.")
        attention, model_type = "mha", layer.get("model_type", "llama")
        if model_type != "llama":
            raise refuse(path, "transformer_layer_config.model_type", repr(model_type), "'llama' (vLLM 0.32's "
                         "speculators eagle3_arch_map, algos.py:39-46: qwen3 maps to Eagle3Qwen3ForCausalLM, not "
                         "implemented here)")
        layer.get("architectures")     # overwritten by vLLM (algos.py:46)
    else:
        layout, layer = "sglang", top
        archs = top.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise refuse(path, "config.json architectures", archs, "['LlamaForCausalLMEagle3'] (MHA) or "
                         "['Eagle3DeepseekV2ForCausalLM'] (MLA), SGLang layout; or a speculators config "
                         "(speculators_model_type eagle3)")
        attention = ARCHITECTURES[archs[0]]
        model_type = top.get("model_type")
        if attention == "mha" and model_type != "llama":
            raise refuse(path, "model_type", repr(model_type), "'llama' for LlamaForCausalLMEagle3 (its config class "
                         "decides what the engines read)")
        if attention == "mla" and model_type not in MLA_MODEL_TYPES:
            why = (" (vLLM 0.32 rewrites deepseek_v3 into its MTP model, config/speculative.py:679-684)"
                   if model_type == "deepseek_v3" else "")
            raise refuse(path, "model_type", repr(model_type), f"one of {list(MLA_MODEL_TYPES)} for "
                         f"Eagle3DeepseekV2ForCausalLM{why}")

    # the layer: shape, norms, activation, biases, RoPE
    layers = layer.get("num_hidden_layers")
    if layers != 1:
        raise refuse(path, layer.name("num_hidden_layers"), "missing" if layers is None else repr(layers),
                     "1 (SGLang's MLA class refuses others, kimi_k25_eagle3.py:231; the config classes' defaults "
                     "are 32 and 61)")
    hidden = layer.integer("hidden_size")
    heads = layer.integer("num_attention_heads")
    cfg = {"attention": attention, "hidden_size": hidden, "num_attention_heads": heads,
           "intermediate_size": layer.integer("intermediate_size"), "vocab_size": layer.integer("vocab_size"),
           "rms_norm_eps": layer.number("rms_norm_eps", 1e-6)}
    if attention == "mla":
        for key in MLA_KEYS:   # all five given: the config classes' defaults are Kimi's and DeepSeek-V2's
            cfg[key] = layer.integer(key)
        layer.get("num_key_value_heads")   # MLA shares one latent: no engine reads KV heads for it
        layer.get("head_dim")              # DeepseekV3Config sets head_dim = qk_rope_head_dim itself
        cfg["num_key_value_heads"], cfg["head_dim"] = heads, hidden // heads
        interleave = layer.get("rope_interleave")
        if interleave is not None and interleave is not True:
            raise refuse(path, "rope_interleave", repr(interleave), "true (vLLM's DeepSeek MLA hard-codes "
                         "interleaved pairs, deepseek_v2.py:1126; SGLang reads it, deepseek_v2.py:1634)")
        layer.get("rope_is_neox_style")    # a Llama field: the DeepSeek classes read rope_interleave
    else:
        cfg["num_key_value_heads"] = layer.integer("num_key_value_heads", heads)
        cfg["head_dim"] = layer.integer("head_dim", required=False) or hidden // heads
        neox = layer.get("rope_is_neox_style")
        if neox is not None and neox is not True:
            raise refuse(path, "rope_is_neox_style", repr(neox), "true (vLLM's Llama hard-codes it, llama.py:241; "
                         "SGLang reads it, llama.py:279)")
        layer.get("rope_interleave")       # a DeepSeek field: the Llama classes never read it
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(path, layer.name("hidden_act"), repr(act), "'silu' (both engines' MLPs refuse others)")
    for key, why in (("tie_word_embeddings", "SGLang would use the embedding as lm_head, vLLM its own head"),
                     ("attention_bias", "biases are not implemented (SGLang: o_proj bias; vLLM: q/k/v and o_proj)"),
                     ("bias", "biases are not implemented (SGLang: fc and o_proj bias; vLLM: o_proj only)"),
                     ("mlp_bias", "vLLM's Llama MLP would add biases, llama.py:305; SGLang's never"),
                     ("qkv_bias", "vLLM's Llama would add q/k/v biases, llama.py:272-273")):
        layer.flag(key, False, why)
    causal = layer.get("is_causal")
    if causal is not None and causal is not True:
        raise refuse(path, "is_causal", repr(causal), "true (vLLM would attend both ways, llama.py:280)")
    kinds = layer.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or any(k != "full_attention" for k in kinds)):
        raise refuse(path, "layer_types", repr(kinds), "full_attention only (vLLM slides the window of others, "
                     "llama.py:186-199)")
    for key, ok in (("logit_scale", 1), ("final_logit_softcapping", None)):
        v = layer.get(key, ok)
        if v != ok:
            raise refuse(path, key, repr(v), f"{ok} (vLLM's LogitsProcessor scales by logit_scale, SGLang's caps "
                         "logits by final_logit_softcapping)")
    for key in ("quantization_config", "index_topk", "index_n_heads", "index_head_dim"):
        if layer.has(key) or top.has(key):
            raise refuse(path, key, "present", "absent (a quantized or sparse-attention draft is not implemented)")
    cfg["max_position_embeddings"] = layer.integer("max_position_embeddings", required=False)
    cfg["rope_theta"], cfg["rope_scaling"] = read_rope(path, layer, attention, notes)
    if attention == "mha" and (diff := engine_rope_differences("mha", cfg["rope_scaling"])):
        unservable.setdefault("vllm", []).append(diff)
        notes.append(f"RoPE read as SGLang serves it; {diff}")

    # the EAGLE-3 fields: the top level (SGLang layout: the same dict; speculators: algos.py sets the layer's)
    eagle = top.get("eagle_config") if layout == "sglang" else None
    if eagle is not None and not isinstance(eagle, dict):
        raise refuse(path, "eagle_config", repr(eagle), "a JSON object")
    ek = _Keys(path, eagle or {}, "eagle_config.")
    ids = ek.get("eagle_aux_hidden_state_layer_ids")
    points = top.get("eagle_aux_hidden_state_layer_ids")
    if layout == "speculators" and not points:   # algos.py:47 sets them only when given: the layer's stay
        points = layer.get("eagle_aux_hidden_state_layer_ids")
    for what, v in (("eagle_config.eagle_aux_hidden_state_layer_ids", ids),
                    ("eagle_aux_hidden_state_layer_ids", points)):
        if v is not None and (not isinstance(v, list) or len(v) != 3 or
                              any(isinstance(i, bool) or not isinstance(i, int) for i in v)):
            raise refuse(path, what, repr(v), "three layer ids (the fc takes 3 captured states)")
    num_aux = layer.get("num_aux_hidden_states")
    if num_aux is not None and num_aux != 3:
        raise refuse(path, "num_aux_hidden_states", repr(num_aux), "3 (the fc takes 3 captured states)")
    ek.flag("use_aux_hidden_state", True, "without it vLLM builds no fc and feeds the final state, "
            "llama_eagle3.py:180", default=True)
    norm_before_fc = ek.get("norm_before_fc") or top.get("norm_before_fc")
    if norm_before_fc is not None and norm_before_fc is not False:
        raise refuse(path, "norm_before_fc", repr(norm_before_fc), "false or absent (vLLM's Llama class would norm "
                     "the concatenated states, llama_eagle3.py:184; SGLang never does)")
    ek.rest(set(EAGLE_CONFIG_IGNORED))
    carried_eagle = {k: eagle[k] for k in EAGLE_CONFIG_IGNORED if eagle and k in eagle}
    nbr = top.get("norm_before_residual")
    if nbr is None and layout == "speculators":
        nbr = "missing (vLLM reads true, algos.py:33)"
    if nbr is not None and nbr is not False:
        raise refuse(path, "norm_before_residual", nbr, "false (our draft's residual is the un-normed hidden; vLLM "
                     "would norm it first, llama_eagle3.py:101, deepseek_eagle3.py:101)")
    fc_norm = top.flag("fc_norm", None, "")
    use_aux_norm = top.flag("use_aux_norm", None, "") if layout == "sglang" else False
    if use_aux_norm and not fc_norm:
        unservable.setdefault("vllm", []).append(
            "use_aux_norm true without fc_norm: vLLM reads fc_norm only (llama_eagle3.py:231, deepseek_eagle3.py:211) "
            "and would build no fc_norm")
    cfg["fc_norm"] = fc_norm or use_aux_norm
    cfg["norm_output"] = top.flag("norm_output", None, "")
    dv = top.get("draft_vocab_size")
    if isinstance(dv, bool) or not isinstance(dv, int) or dv <= 0:
        raise refuse(path, "draft_vocab_size", "missing" if not top.has("draft_vocab_size") else repr(dv),
                     "a positive integer (null: SGLang takes the target's lm_head, vLLM the draft's, "
                     "llama_eagle3.py:278, kimi_k25_eagle3.py:340; missing: the same on the MLA class, and "
                     "SGLang's LlamaForCausalLMEagle3 fails to load)")
    cfg["draft_vocab_size"] = dv
    th = top.get("target_hidden_size")
    if layout == "speculators" and th is None:   # algos.py:31 sets it only when not null: the layer's stays
        th = layer.get("target_hidden_size")
    elif th is None and top.has("target_hidden_size"):
        raise refuse(path, "target_hidden_size", None, "an integer or absent (SGLang's Llama class would size "
                     "its fc from None, llama_eagle3.py:143)")
    if th is not None and (isinstance(th, bool) or not isinstance(th, int) or th <= 0):
        raise refuse(path, "target_hidden_size", repr(th), "a positive integer")
    cfg["target_hidden_size"] = th or hidden
    declared = _declared_dtype(path, top)
    if layout == "speculators":
        effective = {"fc_norm": cfg["fc_norm"], "norm_output": cfg["norm_output"], "norm_before_residual": False,
                     "norm_before_fc": False, "draft_vocab_size": dv}
        for key, want in effective.items():   # algos.py overwrites the layer's own copies
            if layer.has(key) and (bool(layer.d[key]) != want if isinstance(want, bool) else layer.d[key] != want):
                raise refuse(path, f"transformer_layer_config.{key}", repr(layer.d[key]),
                             f"absent or the top level's {want!r} (vLLM's algos.py overwrites it)")
            layer.get(key)
        declared_layer = _declared_dtype(path, layer)
        declared = declared or declared_layer
        top.flag("tie_word_embeddings", False, "the lm_head is the draft's own")
        top.rest(SPECULATORS_IGNORED)
        carried = layer.rest({**IGNORED, **{k: None for k in MOE_IGNORED}})
    else:
        carried = top.rest({**IGNORED, **({k: None for k in MOE_IGNORED} if attention == "mla" else {})})
    if carried_eagle:
        carried["eagle_config"] = carried_eagle
    return DraftConfig(layout, model_type, cfg, None if ids is None else list(ids),
                       None if points is None else list(points), declared, carried, notes, unservable)
