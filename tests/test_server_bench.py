"""05 server mode: launch commands, spec-setting rules, meta_info parsing, the sweep against stub SGLang
servers (attached, and launched as real subprocesses with readiness polling and clean shutdown)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from common.sglang import server as srv
from common.draft.model import Eagle3DraftModel, draft_config, export_sglang
from common.io import write_jsonl
from common.sglang.bench import parse_meta, run_prompts, summarize
from common.stage import StageError, target_identity, tokenizer_identity, write_manifest
from tests.sglang_server_stub import StubServer, StubState

REPO = Path(__file__).resolve().parent.parent
POINTS = [2, 4, 5]


def test_commands():
    base = srv.server_command("/m/K", 30010, 8, 0.8, True, python="py")
    assert base == ["py", "-m", "sglang.launch_server", "--model-path", "/m/K", "--trust-remote-code",
                    "--host", "127.0.0.1", "--port", "30010", "--tp-size", "8", "--mem-fraction-static", "0.8"]
    spec = srv.server_command("/m/K", 30020, 8, 0.8, False, "/w/04_draft/export_sglang", (5, 1, 6), "py")
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3" and "--disable-cuda-graph" in spec
    assert spec[-8:] == ["--speculative-draft-model-path", "/w/04_draft/export_sglang",
                         "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", "6"]
    for bad in (["--enable-two-batch-overlap"], ["--speculative-algorithm", "EAGLE"], ["--pp-size", "2"]):
        with pytest.raises(StageError):
            srv.server_command("/m", 1, 1, 0.8, True, extra_args=bad)


def test_spec_settings():
    assert srv.parse_spec_setting("3,1,4") == (3, 1, 4)
    assert srv.parse_spec_setting("5,4,8") == (5, 4, 8)
    for bad in ("3,1,5", "1,4,9", "3,1", "0,1,1"):
        with pytest.raises(StageError):
            srv.parse_spec_setting(bad)


def test_parse_meta_and_summary():
    assert parse_meta({"completion_tokens": 12, "spec_verify_ct": 4}) == \
        {"completion_tokens": 12, "spec_verify_ct": 4, "accept_length": 3.0}
    assert parse_meta({"completion_tokens": 12})["accept_length"] is None
    rs = [{"completion_tokens": 10, "spec_verify_ct": 5, "accept_length": 2.0, "ttft_s": 0.1, "latency_s": 1.0},
          {"completion_tokens": 30, "spec_verify_ct": 10, "accept_length": 3.0, "ttft_s": 0.3, "latency_s": 2.0}]
    s = summarize(rs, 2.0, 2)
    assert s["output_tokens_per_s"] == 20 and s["accept_length_mean"] == 2.5
    assert s["accept_length_pooled"] == pytest.approx(40 / 15) and s["ttft_mean_s"] == pytest.approx(0.2)


def test_run_prompts_against_stub():
    with StubServer(StubState(algorithm="EAGLE3", draft_path="/d", accept_length=4.0)) as url:
        s = run_prompts(url, [[1, 2], [3], [4, 5, 6]], 32, 2, 30)
    assert s["num_requests"] == 3 and s["completion_tokens"] == 96 and s["accept_length_pooled"] == 4.0
    with StubServer(StubState()) as url:  # baseline: no spec_verify_ct in meta_info
        s = run_prompts(url, [[1, 2]], 8, 1, 30)
    assert s["accept_length_pooled"] is None and s["completion_tokens"] == 8


def load_05():
    spec = importlib.util.spec_from_file_location("_t_05s", REPO / "05_benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_work(work: Path, target: Path) -> Path:
    """Just the manifests and files 05 server mode reads: 01c prompts, 02b manifest, 04 export."""
    ns, ident = argparse.Namespace(), {"tokenizer": tokenizer_identity(target), "target": target_identity(target)}
    write_jsonl(work / "01c_merged" / "benchmark_prompts.jsonl",
                [{"id": f"p{k}", "source": "t", "prompt": "x", "prompt_ids": [k + 1, k + 2]} for k in range(3)])
    write_manifest(work / "01c_merged", "01c_merge_datasets", ns, **ident)
    write_manifest(work / "02b_hidden_states", "02b_extract_hidden_states_sglang", ns, capture_points=POINTS,
                   hidden_size=32, vocab_size=600, **ident)
    cfg = json.loads((target / "config.json").read_text())
    model = Eagle3DraftModel(draft_config(cfg, draft_vocab_size=64))
    export = export_sglang(model, work / "04_draft" / "export_sglang", POINTS, "float32")
    write_manifest(work / "04_draft", "04_train", ns, capture_points=POINTS, draft_vocab_size=64, **ident)
    return export


def test_05_server_mode_attached(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    base = StubState(model_path=str(micro_target))
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=3.0)
    with StubServer(base) as b, StubServer(spec) as e:
        load_05().main(["--work-dir", str(tmp_path), "--mode", "server", "--baseline-url", b, "--eagle3-url", e,
                        "--bench-concurrency", "2", "--benchmark-max-new-tokens", "24", "--warmup-requests", "1"])
    out = tmp_path / "05_benchmark" / "server"
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/graph", "3-1-4/graph"} and m["concurrency"] == [1, 2]
    run = m["runs"]["3-1-4/graph"]
    assert run["by_concurrency"]["1"]["accept_length_pooled"] == 3.0
    # server-wide average is cumulative: warm-up 64 tokens / 22 rounds + 6 requests x 24 tokens / 8 rounds
    assert run["server_accept_length"] == pytest.approx((64 + 6 * 24) / (22 + 6 * 8))
    assert run["by_concurrency"]["2"]["speed_ratio"] is not None and m["preflight"]["warmup_tau"] == pytest.approx(64 / 22)
    for f in ("report.md", "tokens_per_s.png", "accept_length.png", "manifest.json"):
        assert (out / f).is_file(), f
    assert "3-1-4/graph" in (out / "report.md").read_text()


def test_05_server_mode_refuses_eagle(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    with StubServer(StubState(algorithm="EAGLE", draft_path=str(export), model_path=str(micro_target))) as e:
        with pytest.raises(StageError, match="not 'EAGLE3'"):
            load_05().main(["--work-dir", str(tmp_path), "--mode", "server", "--eagle3-url", e])
    assert not (tmp_path / "05_benchmark" / "server" / "manifest.json").exists()


def test_launch_ready_stop(tmp_path):
    """A real subprocess: readiness polling on /health, info document, SIGTERM of the process group."""
    code = ("import sys, time; sys.path.insert(0, %r); from tests.sglang_server_stub import *; "
            "import http.server as h; s = StubState(algorithm='EAGLE3', draft_path='/d'); "
            "h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), make_handler(s)).serve_forever()" % str(REPO))
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = srv.launch_server([sys.executable, "-c", code, str(port)], tmp_path / "log.txt")
    try:
        info = srv.wait_ready(f"http://127.0.0.1:{port}", proc, 60, poll_s=0.2)
        assert info["speculative_algorithm"] == "EAGLE3" and srv.spec_settings_of(info) == (3, 1, 4)
    finally:
        srv.stop_server(proc, grace_s=10)
    assert proc.returncode is not None
    dead = srv.launch_server([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log2.txt")
    with pytest.raises(StageError, match="exited with status 3"):
        srv.wait_ready("http://127.0.0.1:9", dead, 30, poll_s=0.2)


def test_docs_show_the_commands_05_builds():
    doc = (REPO / "docs" / "sglang.md").read_text()
    base = srv.server_command("/models/Kimi-K2.5", 30010, 8, 0.85, True, python="python")
    spec = srv.server_command("/models/Kimi-K2.5", 30020, 8, 0.85, True, "/data/eagle3/04_draft/export_sglang",
                              (3, 1, 4), python="python")
    assert " ".join(base) + "\n" in doc and " ".join(spec) + "\n" in doc
