"""05b, the serving benchmark: launch commands, --server-extra-args read as SGLang's argparse reads them,
spec-setting rules, meta_info parsing, the sweep against stub SGLang servers (attached, and launched as real
subprocesses with readiness polling and a shutdown that waits for the whole process group), the
baseline and EAGLE3 info documents checked before anything is measured, the graph mode from
cuda_graph_config, the server's tau windowed per run, draft identity by content, streamed errors,
retries, bad answers (counts refused against the ids, the verify-round bound and the server's own tau;
sign-in pages, cut JSON and missing counts ending in one line), and the Kimi preset against the plan's
server command."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

from common.draft.export_sglang import export_sglang
from common.draft.manifest import DraftManifest
from common.draft.model import Eagle3DraftModel, draft_config
from common.io import write_jsonl
from common.serving import drafts, http, process, settings
from common.serving import sglang as srv
from common.serving.sglang import SGLangEngine, generate_stream, parse_meta
from common.serving.sweep import run_prompts, summarize
from common.serving.vllm import VllmEngine
from common.stage import (BENCH, EXTRACT, MERGE, SERVE_BENCH, StageError, TRAIN, stage_dir, stage_script,
                          target_identity, tokenizer_identity, write_manifest)
from common.target.manifests import HiddenStatesManifest
from tests.sglang_server_stub import StubServer, StubState
from tests.paths import REPO

NO_MANIFESTS = (HiddenStatesManifest.from_dict({}), DraftManifest.from_dict({}))  # 02b, 04: none read
POINTS = [2, 4, 5]


def test_commands():
    base = srv.server_command("/m/K", 30010, 8, 0.8, True, python="py")
    assert base == ["py", "-m", "sglang.launch_server", "--model-path", "/m/K", "--trust-remote-code",
                    "--host", "127.0.0.1", "--port", "30010", "--tp-size", "8", "--mem-fraction-static", "0.8"]
    spec = srv.server_command("/m/K", 30020, 8, 0.8, False, "/w/04_draft/export_sglang", (5, 1, 6), "py")
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    # graphs off with the non-deprecated per-phase flags (--disable-cuda-graph is a deprecated alias)
    assert "--disable-cuda-graph" not in spec
    assert spec[spec.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert spec[spec.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert spec[-8:] == ["--speculative-draft-model-path", "/w/04_draft/export_sglang",
                         "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", "6"]


def test_extra_args_parsed_like_sglang_argparse():
    """argparse splits `--opt=value`, accepts aliases and unambiguous prefixes: all refused the same."""
    for bad in (["--enable-two-batch-overlap"], ["--speculative-algorithm", "EAGLE"], ["--pp-size", "2"],
                ["--pp-size=2"], ["--pipeline-parallel-size", "2"], ["--pipeline=2"], ["--speculative-algo", "EAGLE"],
                ["--speculative-algorithm=EAGLE"], ["--enable-two"], ["--config", "x.yaml"],
                ["--speculative-draft-model", "/other"], ["--speculative-draft-model-path=/other"],
                ["--disable-cuda-graph"], ["--cuda-graph-backend-decode=full"], ["--tensor-parallel-size", "4"],
                ["--tp", "4"], ["--model", "/other"], ["--mem", "0.5"],
                # the draft's quantization and attention backend are 05's (a quantized draft
                # that 04 did not make is refused; the backend has its own flag)
                ["--speculative-draft-model-quantization", "fp8"], ["--speculative-draft-attention-backend=fa3"]):
        with pytest.raises(StageError, match="may not contain"):
            srv.server_command("/m", 1, 1, 0.8, True, extra_args=bad)
    ok = ["--attention-backend", "triton", "--context-length", "4096", "--enable-metrics"]
    assert srv.server_command("/m", 1, 1, 0.8, True, extra_args=ok, python="py")[-len(ok):] == ok
    assert srv.guarded_option("--speculative-algo=EAGLE") == "speculative_algorithm"
    assert srv.guarded_option("--served-model-name") is None


def test_cuda_graph_mode_from_cuda_graph_config():
    assert srv.cuda_graph_on({"cuda_graph_config": {"decode": {"backend": "full"}}, "disable_cuda_graph": False})
    # started with --cuda-graph-backend-decode disabled: the deprecated field still says False
    assert not srv.cuda_graph_on({"cuda_graph_config": {"decode": {"backend": "disabled"}},
                                  "disable_cuda_graph": False})
    assert not srv.cuda_graph_on({"disable_cuda_graph": True})  # a release without cuda_graph_config


def test_spec_settings():
    assert settings.parse_spec_setting("3,1,4") == (3, 1, 4)
    assert settings.parse_spec_setting("5,4,8") == (5, 4, 8)
    assert settings.parse_spec_setting("3,1,4,adaptive") == (3, 1, 4, "adaptive")
    for bad in ("3,1,5", "1,4,9", "3,1", "0,1,1", "3,1,4,5", "3,1,4,adaptiv",
                "5,1,6,adaptive",  # 5 is not one of 0.5.14's candidate steps: SGLang refuses the start
                "3,2,7,adaptive"):  # adaptive drafts chains only: SGLang would silently turn it off
        with pytest.raises(StageError):
            settings.parse_spec_setting(bad)


def test_adaptive_setting_launched_checked_and_kept_out_of_the_cost_model(tmp_path):
    """--speculative-adaptive: set by 05 only, refused next to the options under which SGLang only warns
    and turns it off, read back from the info document, and never fitted as a fixed chain."""
    from common.serving import deploy
    setting = settings.parse_spec_setting("3,1,4,adaptive")
    cmd = srv.server_command("/m", 1, 1, 0.8, True, "/d", setting, "py")
    assert cmd[-1] == "--speculative-adaptive" and cmd[cmd.index("--speculative-num-steps") + 1] == "3"
    assert "--speculative-adaptive" not in srv.server_command("/m", 1, 1, 0.8, True, "/d", (3, 1, 4), "py")
    with pytest.raises(StageError, match="turns --speculative-adaptive off"):
        srv.server_command("/m", 1, 1, 0.8, True, "/d", setting, "py", extra_args=["--enable-dp-attention"])
    for bad in (["--speculative-adaptive"], ["--speculative-adaptive-config", "x.json"]):
        with pytest.raises(StageError, match="may not contain"):
            srv.server_command("/m", 1, 1, 0.8, True, "/d", (3, 1, 4), "py", extra_args=bad)
    info = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    assert srv.spec_settings_of({**info, "speculative_adaptive": True}) == setting
    assert srv.spec_settings_of({**info, "speculative_adaptive": False}) == (3, 1, 4)
    assert srv.spec_settings_of(info) == (3, 1, 4)  # a release without the field
    with pytest.raises(StageError, match="05 does not launch"):
        VllmEngine(Path("t"), Path("e"), Path("d"), *NO_MANIFESTS).parse_setting("3,1,4,adaptive")
    req = [{"latency_s": 1.0, "ttft_s": 0.1, "completion_tokens": 40, "spec_verify_ct": 20}]
    run = lambda s, t: {"cuda_graph": True, "setting": s, "by_concurrency": {"1": {  # noqa: E731
        "requests": req, "accept_length_pooled": t, "output_tokens_per_s": 40.0}}}
    metrics = {"runs": {"3-1-4-adaptive/graph": run(list(setting), 2.0)}}
    assert deploy.cost_models(metrics, None) == []  # no fixed chain: nothing to fit
    log = tmp_path / "adaptive.log"
    log.write_text("WARNING speculative_adaptive disabled: enable_dp_attention=True is not supported. Falling back\n")
    assert srv.adaptive_disabled_line(log).startswith("WARNING speculative_adaptive disabled: enable_dp")
    assert srv.adaptive_disabled_line(tmp_path / "none.log") is None


def test_a_launched_server_that_dropped_adaptive_is_refused(tmp_path):
    """SGLang turns --speculative-adaptive off with a warning (topk, DP attention, ...): a launched
    server whose info document says another setting than 05 asked for is refused, quoting its log."""
    from common.serving.sweep import run_server_benchmark, sweep_plan

    class StubEngine(SGLangEngine):
        def command(self, port, graph, setting, draft=None):
            code = ("import sys; sys.path.insert(0, %r); from tests.sglang_server_stub import *; "
                    "import http.server as h; print('WARNING speculative_adaptive disabled: enable_pdmux=True "
                    "is not supported', flush=True); s = StubState(algorithm=%r, draft_path='/d', adaptive=False); "
                    "h.ThreadingHTTPServer(('127.0.0.1', %d), make_handler(s)).serve_forever()"
                    % (str(REPO), "EAGLE3" if setting else None, port))
            return [sys.executable, "-c", code], {}

        def check_baseline(self, url):
            return srv.cuda_graph_on(srv.get_server_info(url))

        def check_eagle3(self, url, drafts=None):
            info = srv.get_server_info(url)
            return srv.cuda_graph_on(info), srv.spec_settings_of(info), self.drafts[0]

    import socket
    ports = []
    for _ in range(2):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(sk.getsockname()[1])
    plan = sweep_plan(load_05b().build_parser().parse_args([
        "--work-dir", str(tmp_path), "--cuda-graph", "on", "--spec-settings", "3,1,4,adaptive", "--warmup-requests", "1",
        "--benchmark-max-new-tokens", "4", "--request-timeout", "10", "--baseline-port", str(ports[0]),
        "--eagle3-port", str(ports[1]), "--server-timeout", "60", "--bench-repeats", "1", "--bench-concurrency", "1"]))
    engine = StubEngine(Path("t"), Path("e"), *NO_MANIFESTS)
    with pytest.raises(StageError, match=r"runs setting 3-1-4/graph, but 05 launched 3-1-4-adaptive/graph "
                                         r"\(its log: WARNING speculative_adaptive disabled: enable_pdmux"):
        run_server_benchmark(plan, tmp_path, engine, [[1, 2, 3]], warm=[[4, 5]])


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
        s = run_prompts(url, [[1, 2], [3], [4, 5, 6]], 32, 2, 30, generate_stream)
    assert s["num_requests"] == 3 and s["completion_tokens"] == 96 and s["accept_length_pooled"] == 4.0
    with StubServer(StubState()) as url:  # baseline: no spec_verify_ct in meta_info
        s = run_prompts(url, [[1, 2]], 8, 1, 30, generate_stream)
    assert s["accept_length_pooled"] is None and s["completion_tokens"] == 8


def load_05b():
    return importlib.import_module(SERVE_BENCH)


def make_work(work: Path, target: Path) -> Path:
    """Just the manifests and files 05b reads: 01c prompts, 02b manifest, 04 export."""
    ns, ident = argparse.Namespace(), {"tokenizer": tokenizer_identity(target), "target": target_identity(target)}
    write_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl",
                [{"id": f"p{k}", "source": "t", "prompt": "x", "prompt_ids": [k + 1, k + 2]} for k in range(3)])
    write_manifest(stage_dir(work, MERGE), MERGE, ns, **ident)
    write_manifest(stage_dir(work, EXTRACT), EXTRACT, ns, capture_points=POINTS,
                   hidden_size=32, vocab_size=600, target_architecture="DeepseekV3ForCausalLM",
                   sglang_layer_ids=[p - 1 for p in POINTS], **ident)
    cfg = json.loads((target / "config.json").read_text())
    model = Eagle3DraftModel(draft_config(cfg, draft_vocab_size=64))
    export = export_sglang(model, stage_dir(work, TRAIN) / "export_sglang", POINTS, "float32")
    write_manifest(stage_dir(work, TRAIN), TRAIN, ns, capture_points=POINTS, draft_vocab_size=64, **ident)
    return export


def test_05b_attached(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    base = StubState(model_path=str(micro_target))
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=3.0)
    with StubServer(base) as b, StubServer(spec) as e:
        load_05b().main(["--work-dir", str(tmp_path), "--baseline-url", b, "--eagle3-url", e,
                         "--bench-concurrency", "2", "--benchmark-max-new-tokens", "24", "--warmup-requests", "1"])
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/graph", "3-1-4/graph"} and m["concurrency"] == [1, 2]
    run = m["runs"]["3-1-4/graph"]["by_temperature"]["0"]
    assert run["by_concurrency"]["1"]["accept_length_pooled"] == 3.0
    # The server's lifetime average would mix the warm-up (64 tokens / 22 rounds) into every run;
    # counters reset before each pass leave this pass's 2 requests x 24 tokens / 8 rounds each.
    for c in ("1", "2"):
        assert run["by_concurrency"][c]["server_accept_length"] == pytest.approx(3.0)
        assert [p["server_accept_length"] for p in run["by_concurrency"][c]["passes"]] == [pytest.approx(3.0)] * 2
    assert m["preflight"]["server_avg_spec_accept_length"] == pytest.approx(64 / 22)  # the warm-up alone
    assert spec.resets == 5  # before the warm-up and before each of the 2 x 2 passes; never the baseline
    base_run = m["runs"]["baseline/graph"]["by_temperature"]["0"]["by_concurrency"]["1"]
    assert base.resets == 0 and base_run["server_accept_length"] is None
    assert run["by_concurrency"]["2"]["speed_ratio"] is not None
    assert m["preflight"]["warmup_tau"] == pytest.approx(64 / 22)
    for f in ("report.md", "tokens_per_s.png", "accept_length.png", "manifest.json"):
        assert (out / f).is_file(), f
    assert "3-1-4/graph" in (out / "report.md").read_text()


def run_05b(work, *extra):
    load_05b().main(["--work-dir", str(work), "--bench-concurrency", "1",
                    "--benchmark-max-new-tokens", "8", "--warmup-requests", "1", *extra])


def test_graph_mode_read_from_cuda_graph_config(tmp_path, micro_target):
    """An attached server started with --cuda-graph-backend-decode disabled reports disable_cuda_graph
    False: its runs are labelled nograph from cuda_graph_config."""
    export = make_work(tmp_path, micro_target)
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target),
                     decode_graph="disabled")
    assert spec.server_args["disable_cuda_graph"] is False
    with StubServer(spec) as e:
        run_05b(tmp_path, "--eagle3-url", e)
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert set(m["runs"]) == {"3-1-4/nograph"} and m["runs"]["3-1-4/nograph"]["cuda_graph"] is False


def test_baseline_url_is_checked_before_anything_runs(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    good_spec = dict(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target))
    # an EAGLE server with a foreign draft given as the "baseline"
    fake_base = StubState(algorithm="EAGLE", draft_path="/elsewhere/draft", model_path=str(micro_target))
    spec = StubState(**good_spec)
    with StubServer(fake_base) as b, StubServer(spec) as e:
        with pytest.raises(StageError, match=f"baseline server {b} runs speculative_algorithm='EAGLE'"):
            run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e)
    assert fake_base.requests == [] and spec.requests == []
    # a baseline serving another model
    other = StubState(model_path=str(tmp_path / "another-model"))
    with StubServer(other) as b, StubServer(StubState(**good_spec)) as e:
        with pytest.raises(StageError, match=f"baseline server {b} serves .*another-model"):
            run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e)
    # a good baseline is not measured before a bad EAGLE3 server is found
    base = StubState(model_path=str(micro_target))
    with StubServer(base) as b, StubServer(StubState(**{**good_spec, "algorithm": "EAGLE"})) as e:
        with pytest.raises(StageError, match=f"EAGLE3 server {e} reports .*not 'EAGLE3'"):
            run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e)
    assert base.requests == []


def test_draft_identified_by_content(tmp_path, micro_target):
    """A byte-identical copy of 04's export (another mount) is the same draft; a changed copy is not."""
    import shutil
    export = make_work(tmp_path, micro_target)
    copy = tmp_path / "mnt" / "draft"
    shutil.copytree(export, copy)
    with StubServer(StubState(algorithm="EAGLE3", draft_path=str(copy), model_path=str(micro_target))) as e:
        run_05b(tmp_path, "--eagle3-url", e)
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert m["preflight"]["draft_sha256"] == drafts.folder_fingerprint(export, drafts.DRAFT_FILES)
    assert m["preflight"]["server_draft_path"] == str(copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    with StubServer(StubState(algorithm="EAGLE3", draft_path=str(copy), model_path=str(micro_target))) as e:
        with pytest.raises(StageError, match="neither the same folder nor a byte-identical copy"):
            run_05b(tmp_path, "--eagle3-url", e, "--overwrite")


def test_streamed_error_raises_the_server_message():
    from common.serving.sglang import generate_stream
    msg = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
    with StubServer(StubState(algorithm="EAGLE3", draft_path="/d", error_message=msg)) as url:
        with pytest.raises(StageError, match=r"with an error: The input \(9000 tokens\)"):
            generate_stream(url, [1, 2, 3], 8, 30)


def test_transient_failures_retried_then_one_clear_line(monkeypatch):
    from common.serving.sglang import generate_stream
    monkeypatch.setattr(http, "RETRY_FIRST_WAIT_S", 0.01)
    state = StubState(algorithm="EAGLE3", draft_path="/d", fail_first=2)
    with StubServer(state) as url:
        r = generate_stream(url, [1, 2], 8, 30)  # two 503s, then the answer
    assert r["completion_tokens"] == 8 and len(state.requests) == 1
    with StubServer(StubState(fail_first=100)) as url:
        with pytest.raises(StageError, match=r"HTTP 503 .*6 tries"):
            generate_stream(url, [1, 2], 8, 30)
    import socket
    with socket.socket() as sk:  # a port nobody listens on: connection refused
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with pytest.raises(StageError, match=r"GET http://127.0.0.1:\d+/server_info: .*refused.*6 tries"):
        srv.get_server_info(f"http://127.0.0.1:{port}")


def test_05b_refuses_eagle(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    with StubServer(StubState(algorithm="EAGLE", draft_path=str(export), model_path=str(micro_target))) as e:
        with pytest.raises(StageError, match=f"EAGLE3 server {e} reports .*not 'EAGLE3'"):
            load_05b().main(["--work-dir", str(tmp_path), "--eagle3-url", e, "--warmup-requests", "1"])
    assert not (stage_dir(tmp_path, SERVE_BENCH) / "manifest.json").exists()


def test_launch_ready_stop(tmp_path):
    """A real subprocess: readiness polling on /health, info document, SIGTERM of the process group."""
    code = ("import sys, time; sys.path.insert(0, %r); from tests.sglang_server_stub import *; "
            "import http.server as h; s = StubState(algorithm='EAGLE3', draft_path='/d'); "
            "h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), make_handler(s)).serve_forever()" % str(REPO))
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = process.launch_server([sys.executable, "-c", code, str(port)], tmp_path / "log.txt")
    try:
        process.wait_ready(f"http://127.0.0.1:{port}", proc, 60, poll_s=0.2)
        info = srv.get_server_info(f"http://127.0.0.1:{port}")
        assert info["speculative_algorithm"] == "EAGLE3" and srv.spec_settings_of(info) == (3, 1, 4)
    finally:
        process.stop_server(proc, grace_s=10)
    assert proc.returncode is not None and process.group_members(proc.pid) == []
    dead = process.launch_server([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log2.txt")
    with pytest.raises(StageError, match="exited with status 3"):
        process.wait_ready("http://127.0.0.1:9", dead, 30, poll_s=0.2)


def test_docs_show_the_commands_05_builds():
    """docs/sglang.md and the plan show exactly what 05 launches for Kimi-K2.5 (its INT4 target, the preset's
    draft attention backend, the adaptive setting)."""
    from common.config import load_config
    doc = (REPO / "docs" / "sglang.md").read_text()
    base = srv.server_command("/models/Kimi-K2.5", 30010, 8, 0.85, True, python="python", prefix_cache=False)
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")  # Kimi-K2.5's INT4 target, the preset's backend
    kimi = dict(python="python", quantized_target=True, draft_attention_backend=cfg["sglang-draft-attention-backend"],
                prefix_cache=False)  # as SGLangEngine.command builds them
    spec = srv.server_command("/models/Kimi-K2.5", 30020, 8, 0.85, True, "/data/eagle3/04_draft/export_sglang",
                              (3, 1, 4), **kimi)
    adaptive = srv.server_command("/models/Kimi-K2.5", 30020, 8, 0.85, True, "/data/eagle3/04_draft/export_sglang",
                                  settings.parse_spec_setting("3,1,4,adaptive"), **kimi)
    plan = (REPO / "train_plan_v4.md").read_text()
    for cmd in (base, spec, adaptive):
        assert " ".join(cmd) + "\n" in doc, " ".join(cmd)
    for cmd in (base, spec):
        assert " ".join(cmd) + "\n" in plan, " ".join(cmd)
    assert "3,1,4,adaptive" in cfg["spec-settings"]


def test_stop_server_waits_for_the_whole_process_group(tmp_path):
    """Like SGLang's TP workers, a child outlives the launcher's SIGTERM by a moment: stop_server returns
    only once it has gone too (a new server would otherwise find the GPU memory still held)."""
    child = ("import signal, sys, time; open(sys.argv[1], 'w').write('up'); "
             "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0))); time.sleep(60)")
    ready = tmp_path / "child_up"
    parent = ("import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(ready)!r}]); time.sleep(60)")
    proc = process.launch_server([sys.executable, "-c", parent], tmp_path / "log.txt")
    import time
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    members = process.group_members(proc.pid)
    assert len(members) == 2, members
    process.stop_server(proc, grace_s=20)
    assert process.group_members(proc.pid) == []


def test_stop_server_kills_what_ignores_sigterm(tmp_path):
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1], 'w').write('up'); time.sleep(60)")
    ready = tmp_path / "up"
    proc = process.launch_server([sys.executable, "-c", code, str(ready)], tmp_path / "log.txt")
    import time
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    process.stop_server(proc, grace_s=0.5)
    assert proc.returncode == -9 and process.group_members(proc.pid) == []


def test_kimi_preset_matches_the_plans_server_and_draft_heads():
    """The Kimi preset, the server command of train_plan_v4.md step 1 and 01b's checks must agree, and
    the draft gets head_dim 128 (SpecForge's DeepSeek-V3 draft: 56 heads / 8 KV heads)."""
    import re

    from common.config import load_config
    from common.target.capture import target_dims
    from common.draft.model import draft_config
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    plan = (REPO / "train_plan_v4.md").read_text()
    block = re.search(r"\*\*Step 1: serve K2\.5\*\*.*?```\n(.*?)```", plan, re.S).group(1)
    argv = block.replace("\\\n", " ").split()
    assert argv[argv.index("--served-model-name") + 1] == cfg["served-model-name"]
    assert int(argv[argv.index("--context-length") + 1]) >= int(cfg["long-context"])
    assert argv[argv.index("--model-path") + 1] == cfg["target-path"]
    assert argv[argv.index("--tp-size") + 1] == str(cfg["sglang-tp-size"])
    kimi = json.loads((REPO / "assets" / "kimi_k25" / "config.json").read_text())["text_config"]
    # the preset's form: MLA at Kimi's heads and MLA dims (the public K2.5 MLA draft's shape)
    draft = draft_config({**kimi, **target_dims(kimi)}, 32000, cfg.get("draft-num-attention-heads"),
                         cfg.get("draft-num-key-value-heads"), attention=cfg["draft-attention"])
    assert (draft["attention"], draft["num_attention_heads"]) == ("mla", 64)
    assert [draft[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                               "v_head_dim")] == [1536, 512, 128, 64, 128]
    # the MHA form the plan names instead: 56 x 128 = 7168 (Kimi's 64 heads would give head_dim 112)
    flags = re.search(r"`--draft-attention mha --draft-num-attention-heads (\d+) --draft-num-key-value-heads (\d+)`",
                      plan)
    mha = draft_config({**kimi, **target_dims(kimi)}, 32000, int(flags[1]), int(flags[2]))
    assert (mha["num_attention_heads"], mha["num_key_value_heads"], mha["head_dim"]) == (56, 8, 128)


class CutOnce:
    """A raw HTTP server whose first answer to POST /generate is cut inside an SSE line; later ones are
    whole. `hang=True`: it takes the connection and never answers."""

    def __init__(self, hang: bool = False):
        import http.server
        import threading

        self.posts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts += 1
                if hang:
                    import time
                    time.sleep(5)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                done = {"meta_info": {"completion_tokens": 4, "spec_verify_ct": 2}, "output_ids": [5, 6, 7, 8]}
                if outer.posts == 1:
                    self.wfile.write(b'data: {"meta_info": {"completion_tok')  # cut mid-line
                else:
                    self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_network_failures_end_in_one_line_naming_the_server(monkeypatch):
    """An unresolvable host and a server that never answers stop at once with one line naming the server;
    a stream cut inside an event is retried, and the request is timed on its good attempt alone."""
    from common.serving.sglang import generate_stream
    monkeypatch.setattr(http, "RETRY_FIRST_WAIT_S", 0.2)
    with pytest.raises(StageError, match=r"SGLang server http://sglang-box.invalid:30000: POST /generate: .*"
                                         r"is the address right"):
        generate_stream("http://sglang-box.invalid:30000", [1, 2], 8, 30)
    hang = CutOnce(hang=True)
    try:
        with pytest.raises(StageError, match=rf"SGLang server {hang.url}: POST /generate: no answer before the timeout"):
            generate_stream(hang.url, [1, 2], 8, 0.5)
    finally:
        hang.close()
    cut = CutOnce()
    try:
        r = generate_stream(cut.url, [1, 2], 8, 30)
    finally:
        cut.close()
    assert cut.posts == 2 and r["retries"] == 1 and r["completion_tokens"] == 4 and r["accept_length"] == 2.0
    assert r["latency_s"] < 0.2  # the backoff wait (0.2 s) is no part of the request's latency


def test_a_ratio_taken_under_retries_is_refused():
    from common.serving.sweep import add_ratios, summarize
    good = {"completion_tokens": 10, "spec_verify_ct": None, "accept_length": None, "ttft_s": 0.1, "latency_s": 1.0}
    base = summarize([dict(good) for _ in range(4)], 4.0, 1)
    spec = summarize([dict(good), dict(good, retries=2), dict(good), dict(good)], 2.0, 1)
    assert (spec["num_retries"], spec["retried_requests"], base["num_retries"]) == (2, 1, 0)
    level = lambda s: {"0": {"by_concurrency": {"1": s}}}  # noqa: E731
    metrics = {"runs": {"baseline/graph": {"cuda_graph": True, "by_temperature": level(base)},
                        "3-1-4/graph": {"cuda_graph": True, "by_temperature": level(spec)}}}
    add_ratios(metrics, max_retried=0)
    assert spec["speed_ratio"] is None and "under faults" in spec["ratio_refused"]
    add_ratios(metrics, max_retried=1)
    assert spec["speed_ratio"] == pytest.approx(2.0)


def test_quantized_target_keeps_its_quantization_off_the_draft(tmp_path):
    """Kimi-K2.5's INT4 checkpoint (compressed-tensors in text_config): the draft is loaded unquant, the
    draft's own attention backend is set when asked, and a server that quantizes the draft is refused."""
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}}))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert srv.target_quantization(kimi) == "compressed-tensors" and srv.target_quantization(plain) is None
    spec = srv.server_command(kimi, 1, 8, 0.8, True, "/d", (3, 1, 4), "py", draft_attention_backend="triton",
                              quantized_target=True)
    assert spec[spec.index("--speculative-draft-model-quantization") + 1] == "unquant"
    assert spec[spec.index("--speculative-draft-attention-backend") + 1] == "triton"
    base = srv.server_command(kimi, 1, 8, 0.8, True, python="py", quantized_target=True)
    assert "--speculative-draft-model-quantization" not in base  # a baseline has no draft
    with pytest.raises(StageError, match="SGLang reads it as speculative_draft_model_quantization"):
        srv.check_extra_args(["--speculative-draft-model-quantization", "compressed-tensors"])
    draft = tmp_path / "draft"
    draft.mkdir()
    info = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft), "model_path": str(kimi),
            "speculative_draft_model_quantization": "compressed-tensors"}
    with pytest.raises(StageError, match="loads the draft quantized .*compressed-tensors"):
        srv.check_server_info(info, draft, kimi, "http://box:30020")
    srv.check_server_info({**info, "speculative_draft_model_quantization": None}, draft, kimi, "http://box:30020")


# ---------------------------------------------------------------- declared drafts (--draft NAME=PATH) served
def other_draft(work: Path, target: Path, name: str, seed: int) -> Path:
    """Another EAGLE-3 draft for the target (SGLang layout, 04's shape, other weights; draft ids = the first
    64 target ids)."""
    return random_draft(json.loads((target / "config.json").read_text()), work / name, seed)


def random_draft(target_cfg: dict, out: Path, seed: int) -> Path:
    import torch
    torch.manual_seed(seed)
    model = Eagle3DraftModel(draft_config(target_cfg, draft_vocab_size=64))
    t2d = torch.zeros(model.t2d.shape[0], dtype=torch.bool)
    t2d[:64] = True
    model.set_vocab_mapping(torch.zeros(64, dtype=torch.int64), t2d)
    return export_sglang(model, out, POINTS, "float32")


class FakeProc:
    def __init__(self, httpd):
        self.httpd = httpd

    def poll(self):
        return None


class FakeLaunches:
    """Stand-ins for process.launch_server / stop_server: each launched SGLang argv starts an in-process stub
    server on its --port serving what the argv asks for (target, draft, setting, graph mode), with
    `accept[draft path]` as its acceptance and `serve[draft path]` as the draft it reports instead (a server
    that loaded another folder); SGLANG_SIMULATE_ACC_LEN in its environment makes it simulate that accept length
    (unless `ignore_simulation`: a release that does not read it), `step_s` / `round_s` its costs (sglang_server_stub).
    Records every (argv, StubState)."""

    def __init__(self, accept=None, serve=None, step_s=0.0, round_s=0.0, ignore_simulation=False):
        self.accept, self.serve, self.launched = accept or {}, serve or {}, []
        self.step_s, self.round_s, self.ignore_simulation = step_s, round_s, ignore_simulation

    def launch(self, cmd, log_path, env=None):
        import threading
        from http.server import ThreadingHTTPServer
        from tests.sglang_server_stub import make_handler

        def arg(flag):
            return cmd[cmd.index(flag) + 1] if flag in cmd else None
        draft = arg("--speculative-draft-model-path")
        setting = tuple(int(arg(f"--speculative-{f}")) for f in ("num-steps", "eagle-topk", "num-draft-tokens")) \
            if draft else (3, 1, 4)
        state = StubState(algorithm="EAGLE3" if draft else None, draft_path=self.serve.get(draft, draft),
                          model_path=arg("--model-path"), setting=setting, accept_length=self.accept.get(draft, 3.0),
                          decode_graph="disabled" if arg("--cuda-graph-backend-decode") == "disabled" else "full",
                          disable_radix_cache="--disable-radix-cache" in cmd, step_s=self.step_s, round_s=self.round_s,
                          simulate=None if self.ignore_simulation else float((env or {}).get("SGLANG_SIMULATE_ACC_LEN", 0)))
        httpd = ThreadingHTTPServer(("127.0.0.1", int(arg("--port"))), make_handler(state))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        state.env = dict(env or {})
        self.launched.append((cmd, state))
        return FakeProc(httpd)

    def stop(self, proc, *a, **k):
        proc.httpd.shutdown()
        proc.httpd.server_close()


def free_ports(n: int) -> list[str]:
    import socket
    ports = []
    for _ in range(n):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(str(sk.getsockname()[1]))
    return ports


@pytest.fixture
def fake_launches(monkeypatch):
    def make(**kw):
        fake = FakeLaunches(**kw)
        monkeypatch.setattr(process, "launch_server", fake.launch)
        monkeypatch.setattr(process, "stop_server", fake.stop)
        return fake
    return make


def sweep_05b(work, *extra):
    base, spec = free_ports(2)
    run_05b(work, "--baseline-port", base, "--eagle3-port", spec, "--spec-settings", "3,1,4", "5,1,6",
           "--cuda-graph", "on", "off", *extra)


def test_a_declared_draft_is_served_at_every_setting_like_04s(tmp_path, micro_target, fake_launches):
    """05b --draft public=PATH: one EAGLE-3 server per (draft, setting, graph mode) next to the one
    baseline per graph mode, launched with the same command but the draft path, asked the same requests; the
    report and metrics say which draft each run served, every ratio against the same baseline."""
    export = make_work(tmp_path, micro_target)
    public = other_draft(tmp_path, micro_target, "public", seed=1)
    fake = fake_launches()
    sweep_05b(tmp_path, "--draft", f"public={public}")
    served = [(s.server_args["speculative_draft_model_path"], s.server_args["speculative_num_steps"],
               s.server_args["cuda_graph_config"]["decode"]["backend"]) for _, s in fake.launched]
    assert served == [(None, None, "full"), (str(export), 3, "full"), (str(export), 5, "full"),
                      (str(public), 3, "full"), (str(public), 5, "full"),
                      (None, None, "disabled"), (str(export), 3, "disabled"), (str(export), 5, "disabled"),
                      (str(public), 3, "disabled"), (str(public), 5, "disabled")]
    by_draft = {}
    for cmd, state in fake.launched:
        draft = state.server_args["speculative_draft_model_path"]
        if draft is not None:  # the same argv but the draft path; the same requests in the same order
            argv = [str(export) if a == draft else a for a in cmd]
            by_draft.setdefault(draft, []).append((argv, [json.dumps(r, sort_keys=True) for r in state.requests]))
    assert by_draft[str(export)] == by_draft[str(public)] and len(by_draft[str(public)]) == 4
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert list(m["runs"]) == ["baseline/graph", "3-1-4/graph", "5-1-6/graph", "public/3-1-4/graph",
                               "public/5-1-6/graph", "baseline/nograph", "3-1-4/nograph", "5-1-6/nograph",
                               "public/3-1-4/nograph", "public/5-1-6/nograph"]
    run = m["runs"]["public/5-1-6/nograph"]
    assert run["draft"] == "public" and run["preflight"]["draft_name"] == "public"
    assert run["preflight"]["draft_sha256"] == drafts.folder_fingerprint(public, drafts.DRAFT_FILES)
    assert run["by_temperature"]["0"]["by_concurrency"]["1"]["speed_ratio"] is not None
    assert m["runs"]["3-1-4/graph"]["draft"] == "04"
    assert m["preflight"]["draft"] == str(export) and m["drafts"] == {"04": str(export), "public": str(public)}
    cmd = json.loads((out / "commands.json").read_text())["public/3-1-4/graph"]
    assert cmd[cmd.index("--speculative-draft-model-path") + 1] == str(public)
    report = (out / "report.md").read_text()
    assert "| draft | setting | T | concurrency |" in report and "| public | 5-1-6/nograph | 0 | 1 |" in report
    assert "| 04 | 3-1-4/graph | 0 | 1 |" in report and "| - | baseline/graph | 0 | 1 |" in report
    assert f"drafts 04 `{export}`, public `{public}`" in report
    man = json.loads((out / "manifest.json").read_text())
    assert man["drafts"]["public"]["path"] == str(public) and "public/3-1-4/graph" in man["runs"]


def test_the_warmup_floor_and_the_launched_draft_hold_for_a_declared_draft(tmp_path, micro_target, fake_launches):
    make_work(tmp_path, micro_target)
    public = other_draft(tmp_path, micro_target, "public", seed=1)
    fake_launches(accept={str(public): 1.0})  # the declared draft's server accepts at chance
    with pytest.raises(StageError, match=r"warm-up \(per-request\): acceptance length 1.000 is at chance"):
        sweep_05b(tmp_path, "--draft", f"public={public}")
    undeclared = other_draft(tmp_path, micro_target, "undeclared", seed=2)
    fake_launches(serve={str(public): str(undeclared)})  # launched with public, serving another folder
    with pytest.raises(StageError, match=rf"draft is '{undeclared}', not the draft public {public} \(neither"):
        sweep_05b(tmp_path, "--draft", f"public={public}", "--overwrite")


def test_an_attached_server_serves_04s_or_a_declared_draft_by_content(tmp_path, micro_target):
    """The preflight identifies an attached server's draft among 04's and the declared ones by content,
    the report names it, and a server whose draft is none of them is refused naming every candidate."""
    import shutil
    export = make_work(tmp_path, micro_target)
    public = other_draft(tmp_path, micro_target, "public", seed=1)
    copy = tmp_path / "mnt" / "public"
    shutil.copytree(public, copy)
    with StubServer(StubState(algorithm="EAGLE3", draft_path=str(copy), model_path=str(micro_target))) as e:
        run_05b(tmp_path, "--eagle3-url", e, "--draft", f"public={public}")
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert list(m["runs"]) == ["public/3-1-4/graph"] and m["runs"]["public/3-1-4/graph"]["draft"] == "public"
    assert m["preflight"]["server_draft_path"] == str(copy) and m["preflight"]["draft_name"] == "public"
    undeclared = other_draft(tmp_path, micro_target, "undeclared", seed=2)
    state = StubState(algorithm="EAGLE3", draft_path=str(undeclared), model_path=str(micro_target))
    with StubServer(state) as e:
        with pytest.raises(StageError, match=rf"draft is '{undeclared}', none of 05's drafts \(04 {export}, "
                                             rf"public {public}\)"):
            run_05b(tmp_path, "--eagle3-url", e, "--draft", f"public={public}", "--overwrite")
    assert state.requests == []


def test_a_draft_an_engine_cannot_serve_is_refused_before_any_launch(tmp_path, micro_target, other_micro_target,
                                                                     fake_launches):
    """Checked against the target (common/draft/imported.py) and against the engine's reading of its layout
    and capture points, with one line, before anything launches or is written."""
    from common.benchmark import compare as cmp
    from common.serving.registry import check_servable
    from common.draft.export_speculators import export_speculators
    make_work(tmp_path, micro_target)
    public = other_draft(tmp_path, micro_target, "public", seed=1)
    wrong = random_draft(json.loads((other_micro_target / "config.json").read_text()), tmp_path / "wrong", 3)
    spec = export_speculators(public, tmp_path / "spec", POINTS, micro_target, ["DeepseekV3ForCausalLM"])
    fake = fake_launches()
    for bad, message in ((wrong, r"vocab_size is 700, expected 600 \(the target's\)"),
                         (spec, r"SGLang loads EAGLE-3 drafts in its own layouts .* the speculators layout")):
        with pytest.raises(StageError, match=message) as e:
            sweep_05b(tmp_path, "--draft", f"public={public}", f"bad={bad}")
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    assert fake.launched == [] and not stage_dir(tmp_path, BENCH).parent.exists()
    # vLLM reads eagle_config's ids as the points without the top-level ones: [1, 3, 4] are h[2, 4, 5] to
    # SGLang on DeepSeek (first id 1: +1), so vLLM would feed other layers; SGLang serves it as is
    cfg = json.loads((public / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (public / "config.json").write_text(json.dumps(cfg))
    checked = cmp.check_drafts({"public": public}, micro_target)
    assert [d.points for d in check_servable("sglang", checked, micro_target)] == [tuple(POINTS)]
    with pytest.raises(StageError, match=r"--draft public .*: vLLM would feed it h\[1, 3, 4\] .* but it reads "
                                         r"h\[2, 4, 5\]: add top-level eagle_aux_hidden_state_layer_ids \[2, 4, 5\]"):
        check_servable("vllm", checked, micro_target)


# ---------------------------------------------------------------- bad answers: refused, never believed
def test_doubled_completion_tokens_refuse_the_run_by_name_with_the_tau_bound(tmp_path, micro_target, capsys):
    """A server that reports twice the tokens it streamed: 05 used to report tau 6.40 for a 3-1-4 chain and
    recommend it. The run is refused in one line naming the server, the setting, the field, the value and
    the bound; none of its numbers is kept, "what to deploy" says nothing valid was measured, and 05 exits 1
    without a manifest (its report kept), so a re-run measures again."""
    export = make_work(tmp_path, micro_target)
    base = StubState(model_path=str(micro_target))
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=3.0,
                     count_scale=2, honest_first=1)   # its one warm-up answer is true: the preflight passes
    with StubServer(base) as b, StubServer(spec) as e, pytest.raises(StageError, match="nothing valid was measured"):
        run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e)
    out = stage_dir(tmp_path, SERVE_BENCH)
    assert not (out / "manifest.json").exists()
    m = json.loads((out / "metrics.json").read_text())
    run = m["runs"]["3-1-4/graph"]["by_temperature"]["0"]["by_concurrency"]["1"]
    # 8 tokens in ceil(8 / 3) = 3 rounds, reported as 16: tau 5.33 > (4 x 3 + 1) / 3 = 4.33
    why = (f"{e}: request 1 of 2: completion_tokens 16 over spec_verify_ct 3 is tau 5.33, above "
           "the bound 4.33 (4 tokens a verify round: 3 drafts and the bonus token; and the prefill token)")
    assert run["refused"] == f"pass 1 of 2: {why}" and run["passes"][1]["refused"] == why
    assert run["output_tokens_per_s"] is None and run["accept_length_pooled"] is None and run["speed_ratio"] is None
    assert run["output_tokens_per_s_passes"] is None
    assert run["requests"][0]["completion_tokens"] == 16  # the server's claim, kept for a person to look at
    assert "3-1-4/graph T=0 c=1 pass 1/2: REFUSED, its counts are not believed: " + why in capsys.readouterr().out
    best = m["deploy"]["best"]["1"]
    assert best["best"] is None and best["launch"] is None and best["nothing_valid"]
    report = (out / "report.md").read_text()
    assert "| 04 | 3-1-4/graph | 0 | 1 | - | refused* |" in report
    assert f"this run was refused: {run['refused']}" in report
    deploy_section = report.split("## What to deploy")[1]
    assert "nothing valid was measured" in deploy_section and "Run without speculation" not in deploy_section
    assert "5.33" not in report.split("## What to deploy")[0].replace(run["refused"], "")  # no tau shown as measured


def test_counts_are_held_against_the_ids_received_and_the_servers_own_tau():
    """Within the bound, a count is still checked against the token ids that came back (or, without ids,
    the chunks that carried tokens) and against the server's own tau when the run is long enough for its
    window; an adaptive setting may reach SGLang's deepest candidate chain."""
    from common.serving.sweep import answer_fault, round_bound, server_tau_fault
    with StubServer(StubState(algorithm="EAGLE3", draft_path="/d", accept_length=2.0, count_scale=2)) as url:
        s = run_prompts(url, [[1, 2], [3]], 24, 1, 30, generate_stream, bound=4)  # 48 in 12 rounds: under the bound
    assert s["refused"] == f"{url}: request 1 of 2: completion_tokens 48, but 24 token ids came back"
    assert s["completion_tokens"] is None and s["output_tokens_per_s"] is None
    with StubServer(StubState(algorithm="EAGLE3", draft_path="/d", accept_length=2.0)) as url:
        assert "refused" not in run_prompts(url, [[1, 2], [3]], 24, 1, 30, generate_stream, bound=4)
    assert answer_fault({"completion_tokens": 3, "output_ids": None, "token_chunks": 5, "spec_verify_ct": None},
                        None) == "completion_tokens 3, but 5 streamed chunks carried tokens"
    assert round_bound((3, 1, 4)) == 4 and round_bound((3, 4, 8)) == 4 and round_bound((3, 1, 4, "adaptive")) == 8
    reqs = [{"completion_tokens": 301, "spec_verify_ct": 100}] * 4   # tau 3.00 without the prefill token
    summ = {"requests": reqs, "server_accept_length": 2.0}
    assert server_tau_fault(summ, 1, 0) == ("tau 3.00 (completion_tokens without the prefill token, over "
                                            "spec_verify_ct) is more than 25% above the server's own 2.00 "
                                            "(server_accept_length)")
    assert server_tau_fault({**summ, "server_accept_length": 2.5}, 1, 0) is None   # within 25%
    assert server_tau_fault(summ, 1, 39) is not None        # 400 rounds at c=1: long enough for SGLang's window
    assert server_tau_fault(summ, 2, 39) is None            # 200 iterations or fewer: its window is not this run's


def test_a_refused_baseline_refuses_every_ratio_against_it():
    from common.serving import deploy
    from common.serving.sweep import add_ratios, refuse
    good = {"completion_tokens": 10, "spec_verify_ct": None, "accept_length": None, "ttft_s": 0.1, "latency_s": 1.0}
    base, spec = summarize([dict(good)] * 4, 4.0, 1), summarize([dict(good)] * 4, 2.0, 1)
    refuse(base, "http://b: request 1 of 4: completion_tokens 10, but 5 token ids came back")
    level = lambda s: {"0": {"by_concurrency": {"1": s}}}  # noqa: E731
    metrics = {"runs": {"baseline/graph": {"cuda_graph": True, "setting": None, "by_temperature": level(base)},
                        "3-1-4/graph": {"cuda_graph": True, "setting": [3, 1, 4], "by_temperature": level(spec)}}}
    add_ratios(metrics)
    assert spec["speed_ratio"] is None and spec["ratio_refused"].startswith("the baseline run was refused: http://b")
    assert base["ratio_refused"] == f"this run was refused: {base['refused']}"
    best = deploy.best_settings(deploy.at_temperature(metrics, "0"))["1"]
    assert best["best"] is None and best["nothing_valid"] == [f"baseline/graph: {base['refused']}"]


class SSEOnce:
    """A raw HTTP server answering every POST with 200 and `body` (an event stream of one's own making);
    the JSON bodies it was sent are kept (`bodies`)."""

    def __init__(self, body: bytes, kind: str = "text/event-stream"):
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def events(*chunks) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("fault, message", [
    ("html", r"POST /generate: the answer is an HTML page \('<!DOCTYPE html>'\), not an event stream"),
    ("truncated", r"POST /generate: the answer is '\{.*, not the JSON 05 reads \(cut short\)"),
    ("no_count", r"POST /generate: the answer has no meta_info.completion_tokens$"),
], ids=["html", "truncated", "no_count"])
def test_a_bad_generate_answer_ends_05_in_one_line_naming_server_and_field(tmp_path, micro_target, monkeypatch,
                                                                          fault, message):
    """A 200 from /generate that is a sign-in page, half a JSON event or a final chunk without its count:
    one line naming the server and what is wrong, at once (never retried: the server answered)."""
    monkeypatch.setattr(http, "RETRY_FIRST_WAIT_S", 0.01)
    export = make_work(tmp_path, micro_target)
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), bad_answer=fault)
    with StubServer(spec) as e:
        with pytest.raises(StageError, match=rf"^SGLang server {e}: {message}") as got:
            run_05b(tmp_path, "--eagle3-url", e)
    assert isinstance(got.value, SystemExit) and "\n" not in str(got.value)
    assert len(spec.requests) == (0 if fault == "html" else 1)  # the first answer ends it: no retry
    assert not (stage_dir(tmp_path, SERVE_BENCH) / "manifest.json").exists()


@pytest.mark.parametrize("fault, message", [
    ("html", r"the answer is an HTML page \('<!DOCTYPE html> <html><head><title>Sign in - Cluster Gateway"),
    ("truncated", r"the answer is '\{\"model_path\": .*, not the JSON 05 reads \(cut short\): "),
], ids=["html", "truncated"])
def test_a_bad_info_document_ends_05_in_one_line_naming_the_server(tmp_path, micro_target, fault, message):
    make_work(tmp_path, micro_target)
    with StubServer(StubState(model_path=str(micro_target), bad_info=fault)) as b:
        with pytest.raises(StageError, match=rf"^GET {b}/get_server_info: {message}") as got:
            run_05b(tmp_path, "--baseline-url", b)
    assert "\n" not in str(got.value)


def test_the_html_page_is_one_line_on_stderr_without_a_traceback(tmp_path, micro_target):
    """What a person sees: 05 exits 1 with `error: ...` on one line and no traceback."""
    import subprocess
    make_work(tmp_path, micro_target)
    with StubServer(StubState(model_path=str(micro_target), bad_info="html")) as b:
        done = subprocess.run([sys.executable, str(REPO / stage_script(SERVE_BENCH)), "--work-dir", str(tmp_path),
                               "--baseline-url", b, "--warmup-requests", "1"], capture_output=True,
                              text=True, cwd=REPO, timeout=300,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: GET {b}/get_server_info: the answer is an HTML page ('<!DOCTYPE html> <html><head><title>Sign in - "
        "Cluster Gateway'...), not the JSON 05 reads: Expecting value at character 0"]


def test_vllm_stream_answers_are_parsed_by_name():
    """vLLM's streamed completion: a usage chunk without completion_tokens is one line naming the field; the
    ids it streams are kept (None when it sends none, with the chunks that carried text counted instead)."""
    from common.serving.vllm import complete_stream
    text = {"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": None}]}
    with SSEOnce(events(text, {"choices": [], "usage": {"prompt_tokens": 2}})) as url:
        with pytest.raises(StageError, match=rf"^vLLM server {url}: POST /v1/completions: the answer has no "
                                             r"usage.completion_tokens$"):
            complete_stream(url, "m", [1, 2], 8, 30)
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    with SSEOnce(events(text, usage)) as url:
        r = complete_stream(url, "m", [1, 2], 8, 30)
    assert r["output_ids"] == [5, 6] and r["token_chunks"] == 1 and r["completion_tokens"] == 2
    with SSEOnce(events({"choices": [{"text": "ab"}]}, {"choices": [{"text": "c"}]}, usage)) as url:
        r = complete_stream(url, "m", [1, 2], 8, 30)
    assert r["output_ids"] is None and r["token_chunks"] == 2
    with SSEOnce(b"{\"choices\": []}\n", kind="application/json") as url:  # stream ignored: a plain JSON body
        with pytest.raises(StageError, match=r"POST /v1/completions: the answer is '\{\"choices\": \[\]\}', not an "
                                             r"event stream"):
            complete_stream(url, "m", [1, 2], 8, 30)


def test_agreement_refuses_answers_without_ids_in_one_line():
    """The agreement check replays the engine's own tokens: an answer without ids stops it by name."""
    from common.serving.agreement import with_ids
    from common.stage import StageError

    ok = [{"output_ids": [1, 2]}]
    assert with_ids("http://x", ok) is ok
    with pytest.raises(StageError, match="http://x sent answers without token ids"):
        with_ids("http://x", ok + [{"output_ids": None}])


# ---------------------------------------------------------------- a fair comparison: warm-up, prompts, cache, passes
def timed_and_warm(state: StubState, budget: int) -> tuple[list, list]:
    """(timed requests, warm-up requests) a stub received: the timed ones ask for the sweep's budget, the
    preflight's warm-up for 64 tokens."""
    return ([r for r in state.requests if r["sampling_params"]["max_new_tokens"] == budget],
            [r for r in state.requests if r["sampling_params"]["max_new_tokens"] == 64])


def attached_pair(tmp_path, micro_target, *extra) -> tuple[StubState, StubState, dict]:
    """05 against an attached baseline and EAGLE-3 stub (8-token answers, 1 warm-up request)."""
    export = make_work(tmp_path, micro_target)
    base = StubState(model_path=str(micro_target))
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=3.0)
    with StubServer(base) as b, StubServer(spec) as e:
        run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e, *extra)
    return base, spec, json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())


def test_the_baseline_gets_the_same_warm_up_as_every_eagle3_server(tmp_path, micro_target, fake_launches):
    """Only EAGLE-3 servers used to be warmed up (the preflight's requests): the baseline met its first timed
    request cold. Now every server answers the same warm-up requests, in the same order, before any timed one:
    attached, and launched."""
    base, spec, _ = attached_pair(tmp_path, micro_target)
    first = [json.dumps(r, sort_keys=True) for r in spec.requests[:1]]
    assert timed_and_warm(spec, 8)[1] == spec.requests[:1]      # the warm-up comes first
    assert [json.dumps(r, sort_keys=True) for r in base.requests[:1]] == first
    fake = fake_launches()
    sweep_05b(tmp_path, "--overwrite")
    warmups = [[json.dumps(r, sort_keys=True) for r in timed_and_warm(state, 8)[1]] for _, state in fake.launched]
    assert all(w == warmups[0] and w for w in warmups) and len(warmups) == 6
    for _, state in fake.launched:  # before the first timed request
        assert all(r["sampling_params"]["max_new_tokens"] == 64 for r in state.requests[:len(warmups[0])])


def test_agreement_requests_go_to_every_server_the_check_does_not_judge():
    """mirror_agreement sends what agreement.AgreementCheck sends (each prompt alone at its budget, greedy, then
    at each sampled temperature with prompt_seed(--seed, ids, T/top-p, "engine") % 2**31)."""
    from common.benchmark import sampled as smp
    from common.benchmark import spec_decode as sd
    from common.serving.sweep import mirror_agreement

    check = argparse.Namespace(prompts=[[1, 2], [3]], max_new_tokens=16, timeout=5, seed=7,
                               sampling=(sd.SamplingParams(1.0, 0.95),))
    sent = []
    mirror_agreement("u", check, lambda url, ids, n, t, sampling=None: sent.append((ids, n, sampling)))
    seed = lambda ids: smp.prompt_seed(7, ids, check.sampling[0], "engine") % 2 ** 31  # noqa: E731 (agreement.py)
    assert sent == [([1, 2], 16, None), ([3], 16, None),
                    ([1, 2], 16, {"temperature": 1.0, "top_p": 0.95, "seed": seed([1, 2])}),
                    ([3], 16, {"temperature": 1.0, "top_p": 0.95, "seed": seed([3])})]


def test_no_warm_up_or_agreement_prompt_is_ever_timed(tmp_path, micro_target):
    """The warm-up used to be the first timed prompts (prompts[:n]) with prefix caching on, so at c=1 the
    EAGLE-3 server met a prompt it had cached. The held-out prompts are split once: the warm-up's never timed."""
    base, spec, m = attached_pair(tmp_path, micro_target)
    for state in (base, spec):
        timed, warm = timed_and_warm(state, 8)
        assert warm and timed and not {tuple(r["input_ids"]) for r in warm} & {tuple(r["input_ids"]) for r in timed}
    split = m["prompt_split"]
    assert split == {"timed": ["p0", "p1"], "warmup": ["p2"]} and m["num_warmup_prompts"] == 1
    with pytest.raises(StageError, match=r"holds 3 held-out prompts; 05b needs --num-prompts 3 timed and 1 "
                                         r"more, never timed"):
        run_05b(tmp_path, "--num-prompts", "3", "--overwrite")


def test_prefix_caching_is_off_on_every_server_alike(tmp_path, micro_target, fake_launches):
    """Timed passes answer the same prompts again, so prefix caching is off on every server: launched with
    the engine's flag (SGLang --disable-radix-cache, vLLM --no-enable-prefix-caching), an attached one refused
    unless its info document says off; the launch line to deploy leaves the flag out."""
    from common.serving import vllm
    make_work(tmp_path, micro_target)
    fake = fake_launches()
    sweep_05b(tmp_path)
    assert len(fake.launched) == 6 and all("--disable-radix-cache" in cmd for cmd, _ in fake.launched)
    commands = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "commands.json").read_text())
    assert all("--disable-radix-cache" in cmd for cmd in commands.values())
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert all("--disable-radix-cache" not in (rec.get("launch") or "") for rec in m["deploy"]["best"].values())
    with StubServer(StubState(model_path=str(micro_target), disable_radix_cache=False)) as b:
        with pytest.raises(StageError, match=rf"SGLang server {b} reports disable_radix_cache False: .*start it with "
                                             r"--disable-radix-cache"):
            run_05b(tmp_path, "--baseline-url", b, "--overwrite")
    engine = VllmEngine(Path("t"), Path("e"), Path("d"), *NO_MANIFESTS)
    assert all("--no-enable-prefix-caching" in engine.command(1, False, s)[0] for s in (None, (3, 1, 4)))
    vllm.check_prefix_caching_off({"cache_config": {"enable_prefix_caching": False}}, "u")
    for info in ({"cache_config": {"enable_prefix_caching": True}}, {}):
        with pytest.raises(StageError, match="start it with --no-enable-prefix-caching"):
            vllm.check_prefix_caching_off(info, "u")


def test_timed_passes_alternate_and_repeat_with_an_interval_on_each_ratio(tmp_path, micro_target, fake_launches):
    """Each setting was timed once, so no interval held the timing noise. Now every (setting, T, c) is timed
    --bench-repeats times: attached servers in turn (baseline, EAGLE-3, baseline, ...), a launched server's
    repeats as separate passes interleaved across concurrency levels; each ratio has its interval."""
    base, spec, m = attached_pair(tmp_path, micro_target, "--bench-repeats", "3", "--bench-concurrency", "1", "2")
    arrivals = sorted([(a, "base") for a, r in zip(base.arrivals, base.requests)
                       if r["sampling_params"]["max_new_tokens"] == 8]
                      + [(a, "spec") for a, r in zip(spec.arrivals, spec.requests)
                         if r["sampling_params"]["max_new_tokens"] == 8])
    blocks = [who for i, (_, who) in enumerate(arrivals) if i == 0 or arrivals[i - 1][1] != who]
    assert blocks == ["base", "spec"] * 3
    assert [(p["run"], p["pass"], p["concurrency"]) for p in m["pass_order"]] == [
        (key, r, c) for r in range(3) for key in ("baseline/graph", "3-1-4/graph") for c in (1, 2)]
    for c in ("1", "2"):
        cell = m["runs"]["3-1-4/graph"]["by_temperature"]["0"]["by_concurrency"][c]
        assert cell["num_passes"] == 3 and len(cell["output_tokens_per_s_passes"]) == 3
        lo, hi = cell["speed_ratio_ci95"]
        assert lo <= cell["speed_ratio"] <= hi and {r["pass"] for r in cell["requests"]} == {0, 1, 2}
    fake_launches()
    sweep_05b(tmp_path, "--bench-concurrency", "1", "2", "--overwrite")
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert [(p["pass"], p["concurrency"]) for p in m["pass_order"] if p["run"] == "5-1-6/nograph"] == \
        [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert m["repeats"] == 2 and "2 timed passes of each (setting, T, concurrency)" in \
        (stage_dir(tmp_path, SERVE_BENCH) / "report.md").read_text()


PINNED = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "sampling_seed"}


def test_sampled_requests_pin_every_parameter_and_a_rerun_sends_the_same_seeds(tmp_path, micro_target):
    """Every timed request used to be greedy with only its temperature set. Now every setting, the baseline
    included, is timed greedily and at each serving temperature of the preset, every request pinning every
    sampling parameter (the model's defaults never apply) with a seed derived from the prompt: the same on every
    server, every pass and every rerun. SGLang's per-request tau under sampling is read as greedy's."""
    sampled = ["--acceptance-temperatures", "0", "1.0", "--acceptance-top-p", "0.95"]
    seeds = []
    for run in range(2):
        base, spec, m = attached_pair(tmp_path, micro_target, *sampled, *(["--overwrite"] if run else []))
        got = {}
        for state in (base, spec):
            for r in timed_and_warm(state, 8)[0]:
                sp = r["sampling_params"]
                assert set(sp) == PINNED and (sp["top_k"], sp["min_p"], sp["repetition_penalty"]) == (-1, 0.0, 1.0)
                assert (sp["temperature"], sp["top_p"]) in ((0.0, 1.0), (1.0, 0.95))
                got.setdefault((tuple(r["input_ids"]), sp["temperature"]), set()).add(sp["sampling_seed"])
        assert all(len(v) == 1 for v in got.values())   # one seed per prompt and temperature, on both servers
        from common.serving.request_params import request_seed
        assert got[((1, 2), 1.0)] == {request_seed(0, [1, 2], 1.0, 0.95)}
        seeds.append(got)
    assert seeds[0] == seeds[1]
    assert m["temperatures"] == ["0", "1"] and m["deploy"]["serving_temperature"] == "1"
    hot = m["runs"]["3-1-4/graph"]["by_temperature"]["1"]["by_concurrency"]["1"]
    assert hot["accept_length_pooled"] == pytest.approx(8 / 3) and hot["speed_ratio"] is not None
    assert {r["temperature"] for r in hot["requests"]} == {1.0}


def test_pinned_parameters_in_both_engines_and_the_instant_temperature():
    """vLLM's completion carries every parameter too, greedy and sampled; a thinking-off prompt is sampled at
    the preset's instant-mode temperature when it gives one."""
    from common.serving.request_params import timed_sampling
    from common.serving.vllm import complete_stream
    done = {"choices": [{"text": "ab", "token_ids": [5, 6]}], "usage": {"completion_tokens": 2}}
    server = SSEOnce(events(done))
    with server as url:
        complete_stream(url, "m", [1, 2], 8, 30)
        complete_stream(url, "m", [1, 2], 8, 30, sampling={"temperature": 1.0, "top_p": 0.95, "seed": 7})
    pinned = [{k: b[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")}
              for b in server.bodies]
    assert pinned == [{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 0},
                      {"temperature": 1.0, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                       "seed": 7}]
    tags = [{"thinking": False}, {"thinking": True}, None]
    assert [x["temperature"] for x in timed_sampling([[1], [2], [3]], tags, 1.0, 0.95, 0.6, 0)] == [0.6, 1.0, 1.0]
    assert [x["temperature"] for x in timed_sampling([[1], [2], [3]], tags, 0.0, 0.95, 0.6, 0)] == [0.0] * 3
    assert [x["temperature"] for x in timed_sampling([[1], [2], [3]], tags, 1.0, 0.95, None, 0)] == [1.0] * 3


def test_an_impossible_warm_up_tau_stops_the_preflight(tmp_path, micro_target):
    """The preflight printed "preflight ok" at a warm-up tau of 6.42 on a 3-1-4 chain (at most 4 tokens a round)
    while the server said 3.20: its warm-up answers are checked as a timed run's are, against the setting's bound
    (a tree's: its depth + 1) and the ids that came back, and 05b stops in one line before anything is timed."""
    export = make_work(tmp_path, micro_target)
    for setting, accept, scale, why in (
            ((3, 1, 4), 3.0, 2, r"completion_tokens 128 over spec_verify_ct 22 is tau 5.82, above the bound 4.05 "
                                r"\(4 tokens a verify round"),
            # a tree of depth 2 that streams 4 tokens a round: more than 2 drafts and the bonus token
            ((2, 4, 8), 4.0, 1, r"completion_tokens 64 over spec_verify_ct 16 is tau 4.00, above the bound 3.06 "
                                r"\(3 tokens a verify round")):
        spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=accept,
                         count_scale=scale, setting=setting)
        with StubServer(spec) as e:
            with pytest.raises(StageError, match=rf"^{e}: warm-up request 1 of 1: {why}.*not believed, so neither "
                                                 r"is its acceptance$"):
                run_05b(tmp_path, "--eagle3-url", e)
        assert all(r["sampling_params"]["max_new_tokens"] == 64 for r in spec.requests)   # nothing timed


def test_every_run_refused_without_a_baseline_exits_1_in_one_line(tmp_path, micro_target):
    """An attached EAGLE-3 server alone (no baseline to compare with) whose every timed run is refused: 05b used
    to exit 0 with an empty recommendation. It stops in one line, writes no manifest, keeps its report."""
    export = make_work(tmp_path, micro_target)
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), count_scale=2,
                     honest_first=1)   # the warm-up answer is true, every timed one doubled
    with StubServer(spec) as e:
        with pytest.raises(StageError) as err:
            run_05b(tmp_path, "--eagle3-url", e)
    assert str(err.value).startswith("every timed run was refused, so nothing valid was measured") and \
        "\n" not in str(err.value)
    out = stage_dir(tmp_path, SERVE_BENCH)
    assert not (out / "manifest.json").exists() and (out / "report.md").is_file()
