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
    del tensors["d2t"], tensors["t2d"]
    tensors["embed_tokens.weight"] = torch.zeros(600, cfg["hidden_size"], dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "x" / "model.safetensors"))
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = POINTS
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["dtype"] = cfg.pop("torch_dtype")
    (tmp_path / "x" / "config.json").write_text(json.dumps(cfg))
    d = read_draft(tmp_path / "x")
    assert d.full_vocab and d.config["draft_vocab_size"] == 600 and "embed_tokens" in d.notes[0]
    assert torch.equal(d.state["d2t"], torch.zeros(600, dtype=torch.int64)) and bool(d.state["t2d"].all())
    assert check_draft(d, tcfg_of(micro_target), DEEPSEEK, POINTS) == POINTS   # [2,4,5] kept as is on DeepSeek
    with pytest.raises(StageError, match=r"capture points is h\[3, 5, 6\], expected h\[2, 4, 5\]"):
        check_draft(d, tcfg_of(micro_target), LLAMA, POINTS)                    # Llama adds 1 to every id
    embed = torch.randn(600, cfg["hidden_size"])
    m = build_model(d, embed)
    assert torch.equal(m.draft_to_target(torch.arange(600)), torch.arange(600))


def edit(src, dst, config=None, tensors=None):
    """A copy of the draft folder src with config keys and tensors changed (None deletes)."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
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
    "rope": ({"rope_scaling": {"type": "yarn", "factor": 4}}, None, r"rope_scaling is .*yarn.*, expected none"),
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
