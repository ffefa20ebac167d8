"""Importing a draft made elsewhere: the SGLang layout (pruned vocab with d2t/t2d, full vocab without
them, SpecForge's Kimi-style layer ids), the speculators layout, 04's own export, and every refusal
(one line naming the field, the draft's value and the expected one)."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.benchmark import replay as rp
from common.draft.export_sglang import export_sglang, load_sglang_export
from common.draft.export_speculators import export_speculators
from common.draft.imported import build_model, check_draft, read_draft
from common.draft.model import Eagle3DraftModel, draft_config
from common.stage import StageError
from common.target.capture import sglang_points_reader
from common.target.head import read_target_text_config

POINTS = [2, 4, 5]
DEEPSEEK = sglang_points_reader("DeepseekV3ForCausalLM")   # the micro target's architecture: +1 if ids[0] == 1
LLAMA = sglang_points_reader("LlamaForCausalLM")           # +1 always


def random_draft(micro_target, draft_vocab: int, seed: int = 0) -> Eagle3DraftModel:
    tcfg = read_target_text_config(micro_target)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(draft_config(tcfg, draft_vocab))
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(tcfg["vocab_size"], generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(tcfg["vocab_size"], dtype=torch.bool)
    t2d[used] = True
    model.set_vocab_mapping(used - torch.arange(draft_vocab), t2d)
    for p in model.parameters():   # norms away from 1, so a dropped or swapped tensor shows
        if p.requires_grad:
            p.data.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def exported(micro_target, tmp_path_factory):
    """(model, SGLang export dir, speculators dir) of a random pruned-vocab draft."""
    root = tmp_path_factory.mktemp("drafts")
    model = random_draft(micro_target, 300)
    sg = export_sglang(model, root / "sglang", POINTS)
    spec = export_speculators(sg, root / "spec", POINTS, micro_target, ["DeepseekV3ForCausalLM"])
    return model, sg, spec


def tcfg_of(micro_target):
    return read_target_text_config(micro_target)


def test_own_export_and_speculators_round_trip(exported, micro_target):
    model, sg, spec = exported
    a, b = read_draft(sg), read_draft(spec)
    assert (a.layout, b.layout) == ("sglang", "speculators") and not a.full_vocab and a.dtype == "bfloat16"
    assert a.sglang_ids == [1, 3, 4] and a.vllm_points == POINTS and b.vllm_points == POINTS
    assert a.config == b.config and set(a.state) == set(b.state)
    assert all(torch.equal(a.state[n], b.state[n]) for n in a.state)
    for d in (a, b):
        assert check_draft(d, tcfg_of(micro_target), DEEPSEEK, POINTS) == POINTS
    embed = torch.randn(a.config["vocab_size"], a.config["hidden_size"])
    ours, ref = build_model(a, embed), load_sglang_export(sg, embed)
    seq = torch.randint(0, a.config["vocab_size"], (40,)).tolist()
    aux = torch.randn(1, 40, 3 * a.config["hidden_size"])
    assert torch.equal(rp.draft_predictions(ours, aux, seq, 3), rp.draft_predictions(ref, aux, seq, 3))
    assert read_draft(sg).sha256 == a.sha256 and a.sha256 != read_draft(spec).sha256


def test_full_vocab_specforge_kimi_style(micro_target, tmp_path):
    """A public Kimi draft's shape of config: full-vocab lm_head, no d2t/t2d, `dtype` instead of
    `torch_dtype`, eagle_config ids = the points themselves (SpecForge's kimi-k25-eagle3.json says
    [2, 30, 58]), an embed_tokens tensor in the file."""
    model = random_draft(micro_target, 600)   # draft vocab = target vocab
    export_sglang(model, tmp_path / "x", POINTS)
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors   # a full vocab in target order: none stored (vLLM)
    tensors["embed_tokens.weight"] = torch.zeros(600, cfg["hidden_size"], dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "x" / "model.safetensors"))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = POINTS
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["dtype"] = cfg.pop("torch_dtype")
    (tmp_path / "x" / "config.json").write_text(json.dumps(cfg))
    d = read_draft(tmp_path / "x")
    assert d.full_vocab and d.config["draft_vocab_size"] == 600 and any("embed_tokens" in n for n in d.notes)
    assert torch.equal(d.state["d2t"], torch.zeros(600, dtype=torch.int64)) and bool(d.state["t2d"].all())
    assert check_draft(d, tcfg_of(micro_target), DEEPSEEK, POINTS) == POINTS   # [2,4,5] kept as is on DeepSeek
    with pytest.raises(StageError, match=r"capture points is h\[3, 5, 6\], expected h\[2, 4, 5\]"):
        check_draft(d, tcfg_of(micro_target), LLAMA, POINTS)                    # Llama adds 1 to every id
    embed = torch.randn(600, cfg["hidden_size"])
    m = build_model(d, embed)
    assert torch.equal(m.draft_to_target(torch.arange(600)), torch.arange(600))


NULL = object()   # edit(): set the key to JSON null (None deletes it)


def edit(src, dst, config=None, tensors=None):
    """A copy of the draft folder src with config keys and tensors changed (None deletes, NULL sets null;
    a key "a.b" edits key b of the dict a)."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            where, _, k = k.rpartition(".") if k.count(".") == 1 else ("", "", k)
            d = cfg.setdefault(where, {}) if where else cfg
            if v is None:
                d.pop(k, None)
            else:
                d[k] = None if v is NULL else v
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        for k, fn in tensors.items():
            if fn is None:
                del t[k]
            else:
                t[k] = fn(t[k])
        save_file(t, str(dst / "model.safetensors"))
    return dst


def nan_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


REFUSALS = {
    "heads": ({"num_attention_heads": 8}, None, r"tensor midlayer.self_attn.\w+.weight is \(\d+, \d+\), expected"),
    "rope": ({"rope_scaling": {"type": "linear", "factor": 4}}, None, r"rope_type is 'linear', expected 'default' "
             r"or 'yarn'"),
    "eps": ({"rms_norm_eps": 0.5}, None, r"rope_theta / rms_norm_eps is \(.*0.5\), expected"),
    "dtype": ({"torch_dtype": "float16"}, None, r"config torch_dtype is float16, expected bfloat16"),
    "nan": (None, {"fc.weight": nan_first}, r"tensor fc.weight is 1 NaN/inf values, expected finite"),
    "missing": (None, {"norm.weight": None}, r"tensor norm.weight is missing, expected \(32,\)"),
    "pruned_without_d2t": (None, {"d2t": None, "t2d": None},
                           r"draft_vocab_size without d2t/t2d is 300, expected the target vocab 600"),
    "ids_disagree": ({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, None,
                     r"capture points by top-level ids \[2, 4, 6\] \(vLLM\) is h\[2, 4, 6\], expected h\[2, 4, 5\]"),
    "vocab": ({"vocab_size": 700}, {"t2d": lambda t: torch.cat([t, torch.zeros(100, dtype=torch.bool)])},
              r"vocab_size is 700, expected 600 \(the target's\)"),
    "not_eagle3": ({"architectures": ["LlamaForCausalLM"]}, None, r"config.json architectures is \['LlamaForCausalLM'\]"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_field_value_and_expectation(exported, micro_target, tmp_path, case):
    config, tensors, message = REFUSALS[case]
    bad = edit(exported[1], tmp_path / case, config, tensors)
    with pytest.raises(StageError) as e:
        check_draft(read_draft(bad), tcfg_of(micro_target), DEEPSEEK, POINTS)
    text = str(e.value)
    assert "\n" not in text and str(bad) in text
    assert re.search(message, text), text


def test_refuses_other_hidden_size_and_other_capture_points(micro_target, exported, tmp_path):
    tcfg = tcfg_of(micro_target)
    with pytest.raises(StageError, match=r"target_hidden_size is 32, expected 48 \(the target's\)"):
        check_draft(read_draft(exported[1]), {**tcfg, "hidden_size": 48}, DEEPSEEK)
    with pytest.raises(StageError, match=r"capture points is h\[2, 4, 5\], expected h\[2, 4, 6\] \(the stored"):
        check_draft(read_draft(exported[1]), tcfg, DEEPSEEK, [2, 4, 6])
    with pytest.raises(StageError, match="architecture 'Unknown' is not in SGLANG_LAYER_ID_RULES"):
        check_draft(read_draft(exported[1]), tcfg, sglang_points_reader("Unknown"))


# ---------------------------------------------------------------- the refusal table (common/draft/config.py)
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
FIELD_REFUSALS = {   # case -> (config edits of the MHA draft, the one line's field, value, and expectation)
    "two_archs": ({"architectures": ["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"]},
                  r"architectures is \['LlamaForCausalLMEagle3', 'Eagle3DeepseekV2ForCausalLM'\], expected"),
    "vllm_alias": ({"architectures": ["Eagle3LlamaForCausalLM"]}, r"architectures is \['Eagle3LlamaForCausalLM'\]"),
    "mha_model_type": ({"model_type": "qwen3"}, r"model_type is 'qwen3', expected 'llama'"),
    "layers": ({"num_hidden_layers": 2}, r"num_hidden_layers is 2, expected 1"),
    "layers_missing": ({"num_hidden_layers": None}, r"num_hidden_layers is missing, expected 1"),
    "theta_null": ({"rope_theta": NULL}, r"rope_theta is None, expected a positive number"),
    "theta_disagree": ({"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
                       r"rope_theta is \{.*50000.0.*20000.0\}, expected one value"),
    "scaling_vs_parameters": ({"rope_scaling": YARN, "rope_parameters": {"rope_type": "default"}},
                              r"rope_scaling is .*yarn.*, expected equal to rope_parameters"),
    "kind": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"rope_type is 'llama3', expected 'default' "
                                                                           r"or 'yarn'"),
    "default_extra": ({"rope_scaling": {"rope_type": "default", "mrope_section": [1, 2]}},
                      r"rope mrope_section is \[1, 2\], expected absent for rope_type default"),
    "attention_factor": ({"rope_scaling": {**YARN, "attention_factor": 1.0}},
                         r"rope attention_factor is 1.0, expected absent \(vLLM reads it"),
    "attn_factor": ({"rope_scaling": {**YARN, "attn_factor": 2.0}}, r"rope attn_factor is 2.0, expected 1 "
                                                                     r"\(SGLang's YaRN reads it, vLLM's does not\)"),
    "extrapolation": ({"rope_scaling": {**YARN, "extrapolation_factor": 0.5}}, r"rope extrapolation_factor is 0.5"),
    "truncate": ({"rope_scaling": {**YARN, "truncate": False}}, r"rope truncate is False, expected true"),
    "partial": ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor is 0.5, expected 1"),
    "rope_dim": ({"rope_scaling": {**YARN, "rope_dim": 4}}, r"rope rope_dim is 4, expected absent"),
    "yarn_unknown": ({"rope_scaling": {**YARN, "low_freq_factor": 1.0}}, r"rope low_freq_factor is 1.0, expected one "
                                                                         r"of the YaRN fields read"),
    "yarn_no_factor": ({"rope_scaling": {k: v for k, v in YARN.items() if k != "factor"}},
                       r"rope factor is missing, expected given for YaRN"),
    "omax_disagree": ({"rope_scaling": YARN, "original_max_position_embeddings": 128},
                      r"original_max_position_embeddings is \(128, 64\), expected one value"),
    "neox": ({"rope_is_neox_style": False}, r"rope_is_neox_style is False, expected true"),
    "norm_before_fc": ({"eagle_config.norm_before_fc": True}, r"norm_before_fc is True, expected false or absent"),
    "norm_before_residual": ({"norm_before_residual": True}, r"norm_before_residual is True, expected false"),
    "bias": ({"bias": True}, r"bias is True, expected false \(biases are not implemented"),
    "attention_bias": ({"attention_bias": True}, r"attention_bias is True, expected false"),
    "mlp_bias": ({"mlp_bias": True}, r"mlp_bias is True, expected false \(vLLM's Llama MLP"),
    "qkv_bias": ({"qkv_bias": True}, r"qkv_bias is True, expected false"),
    "act": ({"hidden_act": "gelu"}, r"hidden_act is 'gelu', expected 'silu'"),
    "tied": ({"tie_word_embeddings": True}, r"tie_word_embeddings is True, expected false"),
    "draft_vocab_null": ({"draft_vocab_size": NULL}, r"draft_vocab_size is None, expected a positive integer \(null: "
                                                     r"SGLang takes the target's lm_head"),
    "draft_vocab_missing": ({"draft_vocab_size": None}, r"draft_vocab_size is missing, expected a positive integer"),
    "num_aux": ({"num_aux_hidden_states": 4}, r"num_aux_hidden_states is 4, expected 3"),
    "ids_count": ({"eagle_config.eagle_aux_hidden_state_layer_ids": [1, 3]},
                  r"eagle_config.eagle_aux_hidden_state_layer_ids is \[1, 3\], expected three layer ids"),
    "no_aux": ({"eagle_config.use_aux_hidden_state": False}, r"use_aux_hidden_state is False, expected true"),
    "eagle_unknown": ({"eagle_config.hidden_act": "relu"}, r"config key eagle_config.hidden_act is 'relu', expected "
                                                           r"absent"),
    "unknown_key": ({"some_new_field": 3}, r"config key some_new_field is 3, expected absent \(neither read by the "
                                           r"importer nor known to be unused"),
    "logit_scale": ({"logit_scale": 2.0}, r"logit_scale is 2.0, expected 1"),
    "softcap": ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping is 30.0, expected None"),
    "quantized": ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config is present, expected absent"),
    "sliding": ({"layer_types": ["sliding_attention"]}, r"layer_types is \['sliding_attention'\], expected "
                                                         r"full_attention only"),
    "target_hidden_null": ({"target_hidden_size": NULL}, r"target_hidden_size is None, expected an integer or absent"),
    "dtype_two": ({"dtype": "float16"}, r"torch_dtype/dtype is \{.*\}, expected one dtype"),
    "fc_norm_string": ({"fc_norm": "yes"}, r"fc_norm is 'yes', expected true, false or absent"),
}


@pytest.mark.parametrize("case", sorted(FIELD_REFUSALS))
def test_every_field_the_engines_act_on_is_read_or_refused_by_name(exported, tmp_path, case):
    config, message = FIELD_REFUSALS[case]
    bad = edit(exported[1], tmp_path / case, config)
    with pytest.raises(StageError) as e:
        read_draft(bad)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"draft {bad}: ") and re.search(message, text), text


@pytest.fixture(scope="module")
def exported_mla(micro_target, tmp_path_factory):
    tcfg = read_target_text_config(micro_target)
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(tcfg, 600, attention="mla"))
    return export_sglang(model, tmp_path_factory.mktemp("mla") / "mla", POINTS)


MLA_REFUSALS = {
    "deepseek_v3": ({"model_type": "deepseek_v3"}, r"model_type is 'deepseek_v3', expected one of \['kimi_k2', "
                                                   r"'deepseek_v2'\] .*rewrites deepseek_v3 into its MTP model"),
    "llama_type": ({"model_type": "llama"}, r"model_type is 'llama', expected one of"),
    "q_lora_null": ({"q_lora_rank": NULL}, r"q_lora_rank is None, expected a positive integer"),
    "q_lora_missing": ({"q_lora_rank": None}, r"q_lora_rank is missing, expected a positive integer"),
    "kv_lora_missing": ({"kv_lora_rank": None}, r"kv_lora_rank is missing"),
    "interleave": ({"rope_interleave": False}, r"rope_interleave is False, expected true"),
    "kind": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_type is 'linear', expected .*SGLang "
                                                                       r"serves any other kind of an MLA draft as "
                                                                       r"deepseek_yarn"),
    "apply_yarn": ({"rope_scaling": {**YARN, "apply_yarn_scaling": False}}, r"rope apply_yarn_scaling is False"),
    "sparse": ({"index_topk": 64}, r"index_topk is present, expected absent"),
    "moe_on_mha_is_unknown": ({}, None),
}


@pytest.mark.parametrize("case", sorted(MLA_REFUSALS))
def test_mla_fields_are_read_or_refused_by_name(exported_mla, exported, tmp_path, case):
    config, message = MLA_REFUSALS[case]
    if message is None:   # DeepSeek MoE fields are ignored on an MLA draft (dense MLP) but unknown on an MHA one
        d = read_draft(edit(exported_mla, tmp_path / "moe", {"n_routed_experts": 384, "scoring_func": "sigmoid"}))
        assert d.carried == {"n_routed_experts": 384, "scoring_func": "sigmoid"}
        with pytest.raises(StageError, match=r"config key n_routed_experts is 384, expected absent"):
            read_draft(edit(exported[1], tmp_path / "moe_mha", {"n_routed_experts": 384}))
        return
    bad = edit(exported_mla, tmp_path / case, config)
    with pytest.raises(StageError) as e:
        read_draft(bad)
    text = str(e.value)
    assert "\n" not in text and re.search(message, text), text


def test_rope_parameters_and_rope_scaling_are_read_alike(exported, exported_mla, tmp_path):
    """transformers 5 writes rope_parameters (theta inside); SGLang prefers it. Read with the base and the YaRN
    it gives, never as theta 10000 and plain RoPE; a missing theta reads as 10000 (transformers' default)."""
    base = read_draft(exported[1]).config
    a = read_draft(edit(exported[1], tmp_path / "a", {"rope_theta": None,
                                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}))
    assert a.config["rope_theta"] == 1e6 and a.config["rope_scaling"] is None
    b = read_draft(edit(exported[1], tmp_path / "b", {"rope_theta": None, "rope_parameters": {**YARN, "rope_theta": 1e6}}))
    legacy = {**{k: v for k, v in YARN.items() if k != "rope_type"}, "type": "yarn"}
    c = read_draft(edit(exported[1], tmp_path / "c", {"rope_theta": 1e6, "rope_scaling": legacy}))
    want = {k: v for k, v in YARN.items()}
    assert b.config["rope_scaling"] == want and b.config["rope_theta"] == 1e6
    assert {**c.config, "rope_scaling": want} == b.config       # "type" reads as "rope_type"
    d = read_draft(edit(exported[1], tmp_path / "d", {"rope_theta": None}))
    assert d.config == {**base, "rope_theta": 10000.0} and "rope_theta absent" in d.notes[0]
    mla = read_draft(edit(exported_mla, tmp_path / "m", {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}))
    assert mla.config["rope_scaling"] == {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0} and not mla.unservable
    # an MHA YaRN that vLLM rotates with another magnitude: read as SGLang serves it, vLLM marked
    mha = read_draft(edit(exported[1], tmp_path / "y", {"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}))
    assert list(mha.unservable) == ["vllm"] and "YaRN magnitude" in mha.unservable["vllm"][0]


def test_eagle31_fields_are_read(micro_target, exported, tmp_path):
    """norm_output read (both engines act on it); fc_norm, or SGLang's legacy use_aux_norm, which vLLM does not
    read: that draft is marked unservable on vLLM. A speculators config without norm_before_residual is what
    vLLM reads as true, and is refused like true."""
    d = read_draft(edit(exported[1], tmp_path / "no", {"norm_output": True}))
    assert d.config["norm_output"] is True and d.config["fc_norm"] is False
    tcfg = read_target_text_config(micro_target)
    model = Eagle3DraftModel(draft_config(tcfg, 600, fc_norm=True))
    src = export_sglang(model, tmp_path / "fc", POINTS)
    legacy = read_draft(edit(src, tmp_path / "legacy", {"fc_norm": None, "use_aux_norm": True}))
    assert legacy.config == read_draft(src).config and "vLLM reads fc_norm only" in legacy.unservable["vllm"][0]
    with pytest.raises(StageError, match=r"tensor fc_norm.0.weight is \(32,\), expected absent"):
        read_draft(edit(src, tmp_path / "off", {"fc_norm": False}))
    with pytest.raises(StageError, match=r"norm_before_residual is missing \(vLLM reads true, algos.py:33\), expected "
                                         r"false"):
        read_draft(edit(exported[2], tmp_path / "spec", {"norm_before_residual": None}))
    with pytest.raises(StageError, match=r"transformer_layer_config.fc_norm is True, expected absent or the top "
                                         r"level's False \(vLLM's algos.py overwrites it\)"):
        read_draft(edit(exported[2], tmp_path / "spec2", {"transformer_layer_config.fc_norm": True}))


def test_identity_covers_the_config(exported, tmp_path):
    """The sha256 04's resume compares covers config.json: the same weights under another config are another
    draft."""
    a = read_draft(exported[1])
    b = read_draft(edit(exported[1], tmp_path / "b", {"rms_norm_eps": 1e-5}))
    assert set(a.state) == set(b.state) and all(torch.equal(a.state[n], b.state[n]) for n in a.state)
    assert a.sha256 != b.sha256 and read_draft(exported[1]).sha256 == a.sha256


def _break(folder, how: str):
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "empty":
        weights.write_bytes(b"")
    elif how == "bad_header":
        weights.write_bytes(b"\xff" * 8 + b"not a header" + weights.read_bytes()[20:])
    elif how == "config_json":
        (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    elif how == "config_list":
        (folder / "config.json").write_text("[1, 2]")
    elif how in ("index_missing_shard", "index_json"):
        weights.rename(folder / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors",
                                "norm.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text("{oops" if how == "index_json" else json.dumps(index))
    return folder


UNREADABLE = {"truncated": r"weights file model.safetensors is unreadable \(.*\), expected a complete safetensors file",
              "empty": r"weights file model.safetensors is unreadable",
              "bad_header": r"weights file model.safetensors is unreadable",
              "config_json": r"the config config.json is unreadable \(JSONDecodeError: .*\), expected a JSON file",
              "config_list": r"the config config.json is list, expected a JSON object",
              "index_missing_shard": r"shard model-00002-of-00002.safetensors named by model.safetensors.index.json is "
                                     r"missing",
              "index_json": r"the weight index model.safetensors.index.json is unreadable"}


@pytest.mark.parametrize("how", sorted(UNREADABLE))
def test_an_unreadable_file_ends_in_one_line_naming_it(exported, micro_target, tmp_path, how):
    """04 --init-from, 05 --draft and 05b --draft all read through read_draft (05/05b via compare.check_drafts)."""
    from common.benchmark.compare import check_drafts
    bad = _break(edit(exported[1], tmp_path / how), how)
    for read in (lambda: read_draft(bad), lambda: check_drafts({"x": bad}, micro_target)):
        with pytest.raises(StageError) as e:
            read()
        text = str(e.value)
        assert "\n" not in text and str(bad) in text and re.search(UNREADABLE[how], text), text
