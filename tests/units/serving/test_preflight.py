"""Preflight against a local HTTP server returning SGLang's real info document: EAGLE refused, EAGLE3 with
04's draft accepted, chance-level acceptance refused, draft config checked against the manifests."""
from __future__ import annotations

import json

import pytest

from common.draft.export_sglang import export_sglang

from common.draft.manifest import DraftManifest
from common.draft.model import Eagle3DraftModel, draft_config
from common.serving.drafts import check_draft_files
from common.serving.sglang import generate_stream, get_server_info, preflight
from common.serving.sweep import warmup
from common.stage import StageError
from common.target.manifests import HiddenStatesManifest
from tests.sglang_server_stub import StubServer, StubState

POINTS = [2, 4, 5]
TARGET = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 600}
M02B_DICT = {"capture_points": POINTS, "hidden_size": 32, "vocab_size": 600,
             "target_architecture": "DeepseekV3ForCausalLM"}
M04_DICT = {"capture_points": POINTS, "draft_vocab_size": 64}
M02B, M04 = HiddenStatesManifest.from_dict(M02B_DICT), DraftManifest.from_dict(M04_DICT)


def m02b(**fields) -> HiddenStatesManifest:
    return HiddenStatesManifest.from_dict({**M02B_DICT, **fields})


def m04(**fields) -> DraftManifest:
    return DraftManifest.from_dict({**M04_DICT, **fields})
PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    model = Eagle3DraftModel(draft_config(TARGET, draft_vocab_size=64))
    return export_sglang(model, tmp_path_factory.mktemp("d") / "export_sglang", POINTS, "float32")


def run_preflight(url, export, min_tau=1.3):
    return preflight(url, export, M02B, M04, lambda u: warmup(u, PROMPTS, 16, 30, generate_stream), min_tau)


def test_eagle_is_refused(export):
    with StubServer(StubState(algorithm="EAGLE", draft_path=str(export))) as url:
        with pytest.raises(StageError, match="speculative_algorithm='EAGLE', not 'EAGLE3'"):
            run_preflight(url, export)


def test_eagle3_with_our_draft_passes(export):
    state = StubState(algorithm="EAGLE3", draft_path=str(export), accept_length=3.0)
    with StubServer(state) as url:
        rec = run_preflight(url, export)
    assert rec["speculative_algorithm"] == "EAGLE3" and rec["warmup_tau"] == pytest.approx(16 / 6)
    assert rec["server_avg_spec_accept_length"] == pytest.approx(16 / 6)
    assert [r["input_ids"] for r in state.requests] == PROMPTS


def test_info_path_new_and_old(export):
    for new in (False, True):
        with StubServer(StubState(algorithm="EAGLE3", draft_path=str(export), new_info_path=new)) as url:
            info = get_server_info(url)
        assert info["speculative_algorithm"] == "EAGLE3" and "internal_states" in info


def test_other_draft_path_is_refused(export, tmp_path):
    with StubServer(StubState(algorithm="EAGLE3", draft_path=str(tmp_path))) as url:
        with pytest.raises(StageError, match="not 04's export"):
            run_preflight(url, export)


def test_chance_acceptance_is_refused(export):
    with StubServer(StubState(algorithm="EAGLE3", draft_path=str(export), accept_length=1.0)) as url:
        with pytest.raises(StageError, match="at chance.*EAGLE instead of EAGLE3"):
            run_preflight(url, export)


def test_draft_config_against_manifests(export, tmp_path):
    check_draft_files(export, M02B, M04)  # the right one passes
    llama = {"capture_points": [3, 5, 7], "target_architecture": "LlamaForCausalLM"}
    with pytest.raises(StageError, match=r"must be \[2, 4, 6\]: SGLang captures h\[3, 5, 7\]"):
        check_draft_files(export, m02b(**llama), m04(capture_points=[3, 5, 7]))
    # On a DeepSeek/Kimi target SGLang would read ids [2, 4, 6] as given (h2/h4/h6): refused outright
    with pytest.raises(StageError, match=r"would capture h\[2, 4, 6\] instead"):
        check_draft_files(export, m02b(**{**llama, "target_architecture": "KimiK25ForConditionalGeneration"}),
                          m04(capture_points=[3, 5, 7]))
    with pytest.raises(StageError, match="3 x target hidden = 192"):
        check_draft_files(export, m02b(hidden_size=64), M04)
    with pytest.raises(StageError, match="draft_vocab_size 64 != 04's 32"):
        check_draft_files(export, M02B, m04(draft_vocab_size=32))
    # a folder without d2t (the key SGLang needs to map draft ids) is refused
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    t = load_file(str(export / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((export / "config.json").read_text())
    with pytest.raises(StageError, match="d2t None must be present"):
        check_draft_files(bad, M02B, M04)
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


@pytest.mark.parametrize("arch, backend, via, refused", [
    ("LlamaForCausalLMEagle3", "trtllm_mla", "draft", True),          # sgl-project/sglang issue 23490
    ("LlamaForCausalLMEagle3", "flashmla", "target", True),           # inherited from the target's backend
    ("Eagle3DeepseekV2ForCausalLM", "trtllm_mha", "draft", True),
    ("Eagle3DeepseekV2ForCausalLM", "triton", "draft", False),        # both forms (the SM120 choice)
    ("LlamaForCausalLMEagle3", "triton", "target", False),
    ("Eagle3DeepseekV2ForCausalLM", "flashmla", "target", False),     # an MLA draft may inherit an MLA kernel
])
def test_sglang_refuses_a_draft_backend_of_the_other_attention_form(tmp_path, arch, backend, via, refused):
    """The draft's attention form against the backend it will run on (its own flag, else inherited from the
    target's --attention-backend), for 04's export and every declared draft, before anything launches."""
    from common.serving.engine import ServedDraft
    from common.serving.sglang import SGLangEngine

    for name in ("ours", "public"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"architectures": [arch]}))
    kw = ({"draft_attention_backend": backend} if via == "draft"
          else {"extra_args": ["--attention-backend", backend]})
    for export, foreign in ((tmp_path / "ours", []), (None, [ServedDraft("public", tmp_path / "public")])):
        build = lambda: SGLangEngine(tmp_path, export, M02B, M04, foreign=foreign, **kw)  # noqa: E731
        if refused:
            with pytest.raises(StageError, match=f"attention backend '{backend}'.*triton"):
                build()
        else:
            build()
