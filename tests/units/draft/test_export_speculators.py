"""Speculators/vLLM export: exact key set, config keys (ids = capture points, norm_before_residual false),
and the SGLang -> speculators -> SGLang round trip is lossless."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.draft.export_sglang import export_sglang, export_shapes, load_sglang_export
from common.draft.export_speculators import LAYER_KEYS, export_speculators
from common.draft.model import Eagle3DraftModel, draft_config

POINTS = [2, 4, 5]
TARGET = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 600,
          "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 512}


def to_sglang_name(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def speculators_to_sglang(spec_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The inverse of export_speculators, the round trip's other half: (SGLang config.json dict,
    SGLang-named tensors) from a speculators folder."""
    spec_dir = Path(spec_dir)
    cfg = json.loads((spec_dir / "config.json").read_text())
    if cfg.get("norm_before_residual", True):
        raise ValueError(f"{spec_dir}: norm_before_residual is not false; SGLang's Eagle3 Llama draft "
                         "has no such option")
    layer = cfg["transformer_layer_config"]
    points = [int(p) for p in cfg["eagle_aux_hidden_state_layer_ids"]]
    out = {k: layer[k] for k in LAYER_KEYS if k in layer}
    out.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "draft_vocab_size": cfg["draft_vocab_size"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [p - 1 for p in points],
                                 "use_aux_hidden_state": True},
                "eagle_aux_hidden_state_layer_ids": points})
    if cfg.get("target_hidden_size", layer["hidden_size"]) != layer["hidden_size"]:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    with safe_open(str(spec_dir / "model.safetensors"), framework="pt") as f:
        tensors = {to_sglang_name(k): f.get_tensor(k) for k in f.keys()}
    return out, tensors


@pytest.fixture()
def exported(tmp_path):
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(TARGET, draft_vocab_size=64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    d2t = torch.randint(0, 500, (64,))
    t2d = torch.zeros(600, dtype=torch.bool)
    t2d[torch.arange(64) + d2t] = True
    model.set_vocab_mapping(d2t, t2d)
    sg = export_sglang(model, tmp_path / "export_sglang", POINTS, torch_dtype="float32")
    spec = export_speculators(sg, tmp_path / "export_speculators", POINTS, "/models/Kimi-K2.5",
                              ["KimiK25ForConditionalGeneration"])
    return model, sg, spec


def test_key_set_and_shapes(exported):
    model, sg, spec = exported
    want = {(k.replace("midlayer.", "layers.0.", 1)): v for k, v in export_shapes(model.config).items()}
    with safe_open(str(spec / "model.safetensors"), framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert got == want
    assert not any(k.startswith("midlayer.") or k.startswith("embed_tokens") for k in got)
    assert "layers.0.hidden_norm.weight" in got and got["fc.weight"] == (32, 96)


def test_config_keys(exported):
    _, sg, spec = exported
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == POINTS          # vLLM: INPUT of layer i, no +1
    assert "norm_before_residual" in cfg and cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 32
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 600 and layer["hidden_size"] == 32
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"] == {"name_or_path": "/models/Kimi-K2.5",
                              "architectures": ["KimiK25ForConditionalGeneration"]}
    sgcfg = json.loads((sg / "config.json").read_text())
    assert sgcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: points - 1


def test_round_trip(exported, tmp_path):
    model, sg, spec = exported
    cfg, tensors = speculators_to_sglang(spec)
    orig = json.loads((sg / "config.json").read_text())
    for k, v in cfg.items():
        assert orig[k] == v, k
    with safe_open(str(sg / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), tensors[k]), k
    # and the rebuilt SGLang folder loads into the draft with the same outputs
    from safetensors.torch import save_file
    back = tmp_path / "back"
    back.mkdir()
    save_file(tensors, str(back / "model.safetensors"))
    (back / "config.json").write_text(json.dumps({**orig, **cfg}))
    emb = torch.randn(600, 32)
    a, b = load_sglang_export(sg, emb), load_sglang_export(back, emb)
    x, ids = torch.randn(1, 5, 32), torch.randint(0, 600, (1, 5))
    pos = torch.arange(5)[None]
    assert torch.equal(a.step(x, ids, pos)[0], b.step(x, ids, pos)[0])


def test_refuses_points_that_disagree(exported, tmp_path):
    _, sg, _ = exported
    with pytest.raises(AssertionError, match="points-1"):
        export_speculators(sg, tmp_path / "bad", [1, 3, 4], "/t", [])
    cfgp = tmp_path / "export_speculators" / "config.json"
    cfg = json.loads(cfgp.read_text())
    del cfg["norm_before_residual"]  # vLLM would default it to True
    cfgp.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_residual"):
        speculators_to_sglang(tmp_path / "export_speculators")


def test_the_layer_config_carries_the_rope_as_read(tmp_path):
    """An imported MHA draft's YaRN goes into transformer_layer_config (vLLM builds the layer from it)."""
    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    model = Eagle3DraftModel({**draft_config(TARGET, draft_vocab_size=64), "rope_scaling": yarn})
    d2t = torch.arange(64)
    t2d = torch.zeros(600, dtype=torch.bool)
    t2d[torch.arange(64) + d2t] = True
    model.set_vocab_mapping(d2t, t2d)
    sg = export_sglang(model, tmp_path / "sg", POINTS, torch_dtype="float32")
    spec = export_speculators(sg, tmp_path / "spec", POINTS, "/t", [])
    layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    assert layer["rope_scaling"] == yarn and layer["rope_theta"] == 50000.0
