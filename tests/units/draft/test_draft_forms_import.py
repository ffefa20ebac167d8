"""Imported drafts of every form (MHA, MHA + EAGLE-3.1, MLA, MLA + EAGLE-3.1) and the public Kimi-K2.5 drafts'
configs synthesized at toy size: each is read (config.py's table), replayed by 05, round-tripped bit for bit
through 04 --init-from --max-steps 0, and checked by 05b for the engine that would serve it.

The public configs' field lists are copied here (tests never read outside the repository):
  TORCHSPEC_MLA  lightseekorg/TorchSpec @ 6f21829c configs/draft_models/kimi_k25_eagle3_mla.json (the
                 training config of lightseekorg/kimi-k2.5-eagle3-mla);
  KLL_MLA        k-l-lambda/Kimi-K2.5-Eagle3: the same fields (kimi_k2, lora ranks 1536/512, YaRN beta 1/1,
                 factor 64, mscale 1/1 over 4096 positions, eagle_config with Model-Optimizer's extra keys, no
                 max_position_embeddings, bos/eos/pad ids, the full 163840 draft vocab without d2t/t2d), and
                 the verifier's frozen embedding shipped in the file;
  TORCHSPEC_MHA  lightseekorg/TorchSpec @ 6f21829c configs/draft_models/kimi_k25_eagle3.json (the MHA
                 K2.5 draft's LlamaForCausalLMEagle3 config: head_dim 128 over 64 heads, YaRN beta 32/1 with
                 mscale 1/1, rope_theta 50000, Qwen2-style window fields), plus the draft_vocab_size a trained
                 checkpoint carries (the training config lacks it: refused, test below).
Toy size: hidden 32 as the micro target (tests/conftest.py), MLA dims the target's, 600-token vocab.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.benchmark import compare as cmp
from common.draft.export_sglang import export_sglang, load_sglang_export
from common.draft.export_speculators import export_speculators
from common.draft.imported import build_model, check_draft, embed_differs, read_draft, serving_differences
from common.draft.model import Eagle3DraftModel, draft_config, mla_dims
from common.serving.registry import check_servable
from common.stage import BENCH, StageError, TRAIN, stage_dir
from common.target.capture import sglang_points_reader
from common.target.head import load_target_head, read_target_text_config
from tests.spec_helpers import make_chain
from tests.units.serving.test_sweep import fake_launches, free_ports, make_work, run_05b  # noqa: F401 (fake_launches: a fixture)
from tests.train_helpers import FLAGS, POINTS, fresh_work, make_upstream

DEEPSEEK = sglang_points_reader("DeepseekV3ForCausalLM")
FORMS = {"mha": ("mha", False, False), "mha31": ("mha", True, True),
         "mla": ("mla", False, False), "mla31": ("mla", True, True)}
PUBLIC = ("torchspec_mla", "kll_mla", "torchspec_mha")
KIMI_YARN_MLA = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 4096, "type": "yarn"}
KIMI_YARN_MHA = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 4096, "type": "yarn"}


def perturbed(model: Eagle3DraftModel, seed: int) -> Eagle3DraftModel:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():   # norms away from 1, so a dropped or swapped tensor shows
        if p.requires_grad:
            p.data.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def form_model(micro_target, form: str, draft_vocab: int = 300, seed: int = 0) -> Eagle3DraftModel:
    attention, fc_norm, norm_output = FORMS[form]
    tcfg = read_target_text_config(micro_target)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(draft_config(tcfg, draft_vocab, attention=attention, fc_norm=fc_norm,
                                          norm_output=norm_output))
    used = torch.randperm(tcfg["vocab_size"], generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    t2d = torch.zeros(tcfg["vocab_size"], dtype=torch.bool)
    t2d[used] = True
    model.set_vocab_mapping(used - torch.arange(draft_vocab), t2d)
    return perturbed(model, seed)


def public_config(kind: str, tcfg: dict) -> tuple[dict, dict]:
    """(config.json, our draft config) of a public K2.5 draft at toy size (module docstring)."""
    v, h, heads = tcfg["vocab_size"], tcfg["hidden_size"], tcfg["num_attention_heads"]
    if kind in ("torchspec_mla", "kll_mla"):
        dims = mla_dims(tcfg, heads)            # full size: 1536, 512, 128, 64, 128
        raw = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
               "hidden_size": h, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
               "num_key_value_heads": heads, **dims, "hidden_act": "silu", "rms_norm_eps": 1e-05,
               "vocab_size": v, "draft_vocab_size": v, "torch_dtype": "bfloat16", "rope_theta": 50000.0,
               "rope_scaling": dict(KIMI_YARN_MLA),
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],   # full size: [1, 29, 57]
                                "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                                "use_last_layernorm": True, "use_mtp_layernorm": False},
               "bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 0}
        ours = {"attention": "mla", "hidden_size": h, "target_hidden_size": h, "num_attention_heads": heads,
                "num_key_value_heads": heads, "head_dim": h // heads, **dims, "intermediate_size": 64,
                "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
                "rope_scaling": {"rope_type": "yarn", **{k: x for k, x in KIMI_YARN_MLA.items() if k != "type"}},
                "max_position_embeddings": None, "vocab_size": v, "draft_vocab_size": v,
                "fc_norm": False, "norm_output": False}
        return raw, ours
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 3, "eos_token_id": 4, "head_dim": 16,             # full size: 128 over 64 heads of 7168
           "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02, "intermediate_size": 64,
           "max_position_embeddings": 262144, "max_window_layers": 36, "model_type": "llama",
           "num_attention_heads": heads, "num_hidden_layers": 1, "num_key_value_heads": heads, "rms_norm_eps": 1e-06,
           "rope_scaling": dict(KIMI_YARN_MHA), "rope_theta": 50000.0, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
           "use_cache": True, "use_sliding_window": False, "vocab_size": v,
           "draft_vocab_size": v}   # not in the training config: a trained checkpoint carries it
    ours = {"attention": "mha", "hidden_size": h, "target_hidden_size": h, "num_attention_heads": heads,
            "num_key_value_heads": heads, "head_dim": 16, "intermediate_size": 64, "rms_norm_eps": 1e-06,
            "rope_theta": 50000.0,
            "rope_scaling": {"rope_type": "yarn", **{k: x for k, x in KIMI_YARN_MHA.items() if k != "type"}},
            "max_position_embeddings": 262144, "vocab_size": v, "draft_vocab_size": v,
            "fc_norm": False, "norm_output": False}
    return raw, ours


def write_public(kind: str, micro_target, out: Path, seed: int = 5) -> tuple[Path, dict]:
    """A toy public draft: its config, random bf16 weights under its names (layers.0.* for MLA, midlayer.* for
    MHA), a full-vocab lm_head and no d2t/t2d; KLL_MLA also ships the target's embedding. Returns (folder,
    our draft config)."""
    tcfg = read_target_text_config(micro_target)
    raw, ours = public_config(kind, tcfg)
    torch.manual_seed(seed)
    model = perturbed(Eagle3DraftModel(ours), seed)
    tensors = {(("layers.0." + k[len("midlayer."):]) if ours["attention"] == "mla" and k.startswith("midlayer.") else k):
               v.to(torch.bfloat16).contiguous() for k, v in model.trainable_state_dict().items() if k not in ("d2t", "t2d")}
    if kind == "kll_mla":
        tensors["embed_tokens.weight"] = load_target_head(micro_target, with_head=False)[0].contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out, ours


@pytest.fixture(scope="module")
def drafts(micro_target, tmp_path_factory) -> dict[str, Path]:
    """{name: folder}: the four forms (04's export of a random draft, pruned vocab) and the three public ones."""
    root = tmp_path_factory.mktemp("forms")
    out = {form: export_sglang(form_model(micro_target, form, seed=i), root / form, POINTS)
           for i, form in enumerate(FORMS)}
    for kind in PUBLIC:
        out[kind] = write_public(kind, micro_target, root / kind)[0]
    return out


@pytest.fixture(scope="module")
def upstream(micro_target, tmp_path_factory):
    return make_upstream(micro_target, tmp_path_factory.mktemp("work"))


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """A draft folder's tensors under our names (the importer's mapping)."""
    from common.draft.imported import our_tensor_name
    return {our_tensor_name(k)[0]: t for k, t in load_file(str(folder / "model.safetensors")).items()}


def outputs(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = model.config["hidden_size"]
    x, ids = torch.randn(1, 6, h, generator=g), torch.randint(0, model.config["vocab_size"], (1, 6), generator=g)
    return model.step(x, ids, torch.arange(6)[None])


@pytest.mark.parametrize("form", FORMS)
def test_every_form_reads_back_as_exported(micro_target, drafts, form):
    """04's export of each form is read into the same config and tensors, and computes the same draft as the
    export's own loader; MLA exports name the layer layers.0.* and say kimi_k2."""
    model = form_model(micro_target, form, seed=list(FORMS).index(form))
    d = read_draft(drafts[form])
    assert d.layout == "sglang" and d.config == model.config and d.dtype == "bfloat16"
    assert d.model_type == ("kimi_k2" if form.startswith("mla") else "llama")
    assert d.unservable == {} and d.carried == {} and d.sglang_ids == [1, 3, 4] and d.vllm_points == POINTS
    names = set(load_file(str(drafts[form] / "model.safetensors")))
    assert any(n.startswith("layers.0." if form.startswith("mla") else "midlayer.") for n in names)
    assert ("fc_norm.0.weight" in names) == FORMS[form][1]
    assert check_draft(d, read_target_text_config(micro_target), DEEPSEEK, POINTS) == POINTS
    embed = torch.randn(d.config["vocab_size"], d.config["hidden_size"])
    a, b = build_model(d, embed), load_sglang_export(drafts[form], embed)
    for x, y in zip(outputs(a), outputs(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("naming", ["midlayer", "model.layers.0", "model.midlayer"])
def test_tensor_names_all_read_and_the_engines_that_cannot_load_them_are_named(drafts, tmp_path, naming):
    """layers.0.*, midlayer.* and model.-nested names read alike; model.* loads in SGLang's Llama class only."""
    for form in ("mha31", "mla31"):
        src = drafts[form]
        out = tmp_path / f"{form}-{naming}"
        out.mkdir()
        tensors = {}
        for k, t in stored(src).items():
            if k.startswith("midlayer."):
                k = naming + "." + k[len("midlayer."):]
            elif naming.startswith("model.") and k not in ("lm_head.weight", "d2t", "t2d"):
                k = "model." + k
            tensors[k] = t
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text((src / "config.json").read_text())
        a, b = read_draft(src), read_draft(out)
        assert a.config == b.config and set(a.state) == set(b.state)
        assert all(torch.equal(a.state[n], b.state[n]) for n in a.state)
        nested = naming.startswith("model.")
        assert bool(serving_differences(b, "vllm")) == nested
        assert bool(serving_differences(b, "sglang")) == (nested and form == "mla31")
    bad = tmp_path / "dup"
    bad.mkdir()
    t = stored(drafts["mha"])
    save_file({**t, "layers.0.mlp.up_proj.weight": t["midlayer.mlp.up_proj.weight"].clone()}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((drafts["mha"] / "config.json").read_text())
    with pytest.raises(StageError, match=r"tensor midlayer.mlp.up_proj.weight is stored twice"):
        read_draft(bad)


def test_speculators_export_carries_eagle31_at_the_top_and_mla_has_none(micro_target, drafts, tmp_path):
    spec = export_speculators(drafts["mha31"], tmp_path / "spec", POINTS, micro_target, ["DeepseekV3ForCausalLM"])
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True        # algos.py update_eagle3 reads them there
    assert "fc_norm" not in cfg["transformer_layer_config"]
    a, b = read_draft(drafts["mha31"]), read_draft(spec)
    assert b.layout == "speculators" and a.config == b.config
    assert all(torch.equal(a.state[n], b.state[n]) for n in a.state)
    plain = json.loads((export_speculators(drafts["mha"], tmp_path / "plain", POINTS, micro_target, []) /
                        "config.json").read_text())
    assert "fc_norm" not in plain and "norm_output" not in plain
    with pytest.raises(ValueError, match="no speculators form in vLLM 0.32"):
        export_speculators(drafts["mla"], tmp_path / "mla", POINTS, micro_target, [])


@pytest.mark.parametrize("kind", PUBLIC)
def test_public_k25_configs_import_as_the_engines_read_them(micro_target, drafts, kind):
    d = read_draft(drafts[kind])
    raw, ours = public_config(kind, read_target_text_config(micro_target))
    assert d.config == ours and d.full_vocab and d.dtype == "bfloat16"
    assert check_draft(d, read_target_text_config(micro_target), DEEPSEEK, POINTS) == POINTS
    target_embed = lambda: load_target_head(micro_target, with_head=False)[0]  # noqa: E731
    if kind == "torchspec_mha":
        # SGLang's Llama YaRN: magnitude 0.1 ln 64 + 1 = 1.416; vLLM's reads mscale / mscale_all_dim: 1.0
        assert d.carried == {k: raw[k] for k in ("attention_dropout", "bos_token_id", "eos_token_id",
                                                 "initializer_range", "max_window_layers", "sliding_window",
                                                 "transformers_version", "use_cache", "use_sliding_window")}
        assert d.sglang_ids is None and d.vllm_points is None     # the engines' default [2, N//2, N-3]
        (why,) = serving_differences(d, "vllm", target_embed)
        assert "YaRN magnitude 1.4159 in SGLang" in why and "1.0000 in vLLM" in why
        assert serving_differences(d, "sglang", target_embed) == []
    else:
        assert d.model_type == "kimi_k2" and d.sglang_ids == [1, 3, 4]
        assert d.carried == {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 0,
                             "eagle_config": {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                                              "use_mtp_layernorm": False}}
        assert (d.embed is not None) == (kind == "kll_mla")
        assert serving_differences(d, "vllm", target_embed) == [] == serving_differences(d, "sglang", target_embed)


def test_the_mha_training_config_without_draft_vocab_size_is_refused(micro_target, tmp_path):
    """TorchSpec's MHA training config as published has no draft_vocab_size: SGLang's LlamaForCausalLMEagle3
    cannot load it (a null one takes the target's lm_head)."""
    folder, _ = write_public("torchspec_mha", micro_target, tmp_path / "x")
    for value in ("missing", None):
        cfg = json.loads((folder / "config.json").read_text())
        if value == "missing":
            del cfg["draft_vocab_size"]
        else:
            cfg["draft_vocab_size"] = None
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(StageError, match=rf"draft_vocab_size is {value}, expected a positive integer \(null: "
                                             r"SGLang takes the target's lm_head"):
            read_draft(folder)


def test_a_shipped_embedding_that_differs_is_refused_for_vllm_only(micro_target, drafts, tmp_path):
    """SGLang always feeds the target's embedding (set_embed); vLLM keeps a shipped one that differs. The
    draft is read as SGLang serves it (the replay ignores the shipped tensor) and 05b refuses it on vLLM."""
    import shutil
    folder = tmp_path / "other_embed"
    shutil.copytree(drafts["kll_mla"], folder)
    t = load_file(str(folder / "model.safetensors"))
    t["embed_tokens.weight"] = t["embed_tokens.weight"] + 0.5
    save_file(t, str(folder / "model.safetensors"))
    target_embed = load_target_head(micro_target, with_head=False)[0]
    same, other = read_draft(drafts["kll_mla"]), read_draft(folder)
    assert not embed_differs(same, target_embed) and embed_differs(other, target_embed)
    for x, y in zip(outputs(build_model(same, target_embed)), outputs(build_model(other, target_embed))):
        assert torch.equal(x, y)                  # the replay feeds the target's embedding either way
    checked = cmp.check_drafts({"kll": folder}, micro_target)
    assert [s.name for s in check_servable("sglang", checked, micro_target)] == ["kll"]
    with pytest.raises(StageError, match=r"--draft kll .*: vLLM would serve another network than the one imported "
                                         r"and replayed: it ships an embed_tokens.weight that differs"):
        check_servable("vllm", checked, micro_target)


@pytest.mark.parametrize("name", [*FORMS, *PUBLIC])
def test_04_init_from_and_zero_steps_export_the_draft_bit_for_bit(upstream, micro_target, drafts, tmp_path, name):
    """04 --init-from D --max-steps 0: the export holds D's tensors bit for bit in D's dtype (a shipped
    embedding aside: 04 never writes one, both engines then feed the target's), and a config that reads back
    into the same draft config, model type, capture points and ignored fields; an MLA draft gets no
    export_speculators/ (none in vLLM 0.32) and the manifest says so."""
    src = drafts[name]
    work = fresh_work(upstream, tmp_path)
    importlib.import_module(TRAIN).main(["--work-dir", str(work), *FLAGS, "--save-every", "1000",
                                         "--init-from", str(src), "--max-steps", "0"])
    out = stage_dir(work, TRAIN)
    man = json.loads((out / "manifest.json").read_text())
    exported = out / "export_sglang"
    want = {k: v for k, v in stored(src).items() if k != "embed_tokens.weight"}
    got = stored(exported)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    a, b = read_draft(src), read_draft(exported)
    assert b.config == a.config and b.model_type == a.model_type and b.carried == a.carried
    assert b.unservable == a.unservable and b.embed is None
    assert check_draft(b, read_target_text_config(micro_target), DEEPSEEK, POINTS) == POINTS
    warm = man["init_from"]
    assert warm["sha256"] == a.sha256 and warm["attention"] == a.config["attention"]
    if a.config["attention"] == "mla":
        assert man["export_speculators_dir"] is None and not (out / "export_speculators").exists()
    else:
        spec = read_draft(out / "export_speculators")
        assert spec.config == a.config and man["export_speculators_dir"] == str(out / "export_speculators")


def test_05_replays_every_form_and_public_draft(micro_target, target, prompts, drafts, tmp_path):
    """05 --draft NAME=PATH for each: read, checked, replayed next to 04's (YaRN and MLA as SGLang computes
    them); each draft's tau is its own replay's."""
    from tests.stages.test_05_compare import argv, direct_tau
    work = tmp_path / "w"
    make_chain(work, micro_target, target, prompts)
    importlib.import_module(BENCH).main(argv(work, micro_target, "--draft", *(f"{n}={p}" for n, p in drafts.items())))
    m = json.loads((stage_dir(work, BENCH) / "metrics.json").read_text())
    assert list(m["drafts"]) == ["04", *drafts]
    for name in drafts:
        d = m["drafts"][name]
        assert d["attention"] == ("mla" if "mla" in name else "mha") and set(d["tau"]["0"]) == {"2", "4"}
    for name in ("torchspec_mha", "kll_mla", "mla31"):   # 05's tau is the draft's own replay
        assert {k: c["tau"] for k, c in m["drafts"][name]["tau"]["0"].items()} == direct_tau(
            micro_target, target, work, drafts[name], POINTS)


def test_05b_serves_every_form_and_refuses_the_engine_that_would_serve_another(micro_target, drafts, tmp_path,
                                                                               fake_launches):
    """05b --draft for every form: SGLang serves all (the sweep launches each folder); vLLM refuses the MHA
    YaRN draft it would rotate with another magnitude, before anything launches; 04's own export of that
    draft is held to the same."""
    make_work(tmp_path, micro_target)
    checked = cmp.check_drafts(dict(drafts), micro_target)
    assert [s.name for s in check_servable("sglang", checked, micro_target)] == list(drafts)
    forms = {n: checked[n] for n in FORMS}
    assert [s.name for s in check_servable("vllm", forms, micro_target)] == list(FORMS)
    with pytest.raises(StageError, match=r"--draft torchspec_mha .*: vLLM would serve another network .*YaRN "
                                         r"magnitude 1.4159 in SGLang"):
        check_servable("vllm", {"torchspec_mha": checked["torchspec_mha"]}, micro_target)
    for name in ("torchspec_mla", "kll_mla"):   # their eagle_config ids [1, 29, 57] would be read as the points
        with pytest.raises(StageError, match=rf"--draft {name} .*: vLLM would feed it h\[1, 3, 4\]"):
            check_servable("vllm", {name: checked[name]}, micro_target)
    with pytest.raises(StageError, match=r"04's export .*: vLLM would serve another network"):
        check_servable("vllm", {}, micro_target, drafts["torchspec_mha"])
    fake = fake_launches()
    base, spec = free_ports(2)
    run_05b(tmp_path, "--baseline-port", base, "--eagle3-port", spec, "--spec-settings", "3,1,4", "--cuda-graph", "on",
            "--draft", *(f"{n}={drafts[n]}" for n in FORMS))
    launched = {s.server_args["speculative_draft_model_path"] for _, s in fake.launched}
    assert {str(drafts[n]) for n in FORMS} <= launched


def test_vllm_serves_an_mla_export_from_export_sglang(tmp_path, capsys):
    """04 writes no export_speculators/ for an MLA draft (manifest: None); 05b's vLLM engine then serves
    export_sglang/, which vLLM loads itself, also under --draft-format speculators. An MHA draft keeps
    export_speculators/ there (a stale folder beside an MLA export is never picked)."""
    from common.config import parse_args
    from common.draft.manifest import DraftManifest
    from common.serving.vllm import VllmEngine
    args = parse_args(importlib.import_module("05b_serve_benchmark").build_parser(),
                      ["--work-dir", str(tmp_path), "--engine", "vllm", "--draft-format", "speculators"])
    export = stage_dir(tmp_path, TRAIN) / "export_sglang"
    for folder in (export, stage_dir(tmp_path, TRAIN) / "export_speculators"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    common = dict(capture_points=tuple(POINTS), draft_vocab_size=64, vocab_size=600, tokenizer={}, target={})
    mla = DraftManifest(draft_config={"attention": "mla"}, export_speculators_dir=None, **common)
    mha = DraftManifest(draft_config={"attention": "mha"},
                        export_speculators_dir=str(stage_dir(tmp_path, TRAIN) / "export_speculators"), **common)
    assert VllmEngine.from_args(args, export, None, mla, tmp_path, tmp_path, []).draft_dir == export
    assert "no speculators form (MLA)" in capsys.readouterr().out
    assert VllmEngine.from_args(args, export, None, mha, tmp_path, tmp_path, []).draft_dir.name == "export_speculators"
