"""05b's sweep (common/serving/sweep.py): meta_info parsing and the run summary, the sweep against stub SGLang
servers (attached, and launched in-process by `fake_launches` or as a real subprocess), the baseline and EAGLE3
info documents checked before anything is measured, the server's tau windowed per run, draft identity by content,
declared drafts served like 04's, bad answers (counts refused against the ids, the verify-round bound and the
server's own tau; sign-in pages, cut JSON and missing counts ending in one line), and a fair comparison (the same
warm-up, prompts never timed, prefix caching off, passes that alternate and repeat, pinned sampling). The helpers
other serving tests share (make_work, run_05b, fake_launches, free_ports) live here. SGLang's own commands and
stream: test_sglang_engine.py; server processes: test_process.py; report.md: test_report.py."""
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
from common.serving import drafts, http, process
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

    engine = StubEngine(Path("t"), Path("e"), *NO_MANIFESTS)
    with StubServer(StubState()) as base:   # attached (graph mode on): the EAGLE-3 server alone is launched
        plan = sweep_plan(load_05b().build_parser().parse_args([
            "--work-dir", str(tmp_path), "--spec-settings", "3,1,4,adaptive", "--warmup-requests", "1",
            "--benchmark-max-new-tokens", "4", "--request-timeout", "10", "--baseline-url", base,
            "--eagle3-port", free_ports(1)[0], "--server-timeout", "60", "--bench-repeats", "1",
            "--bench-concurrency", "1"]))
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


def test_05b_refuses_eagle(tmp_path, micro_target):
    export = make_work(tmp_path, micro_target)
    with StubServer(StubState(algorithm="EAGLE", draft_path=str(export), model_path=str(micro_target))) as e:
        with pytest.raises(StageError, match=f"EAGLE3 server {e} reports .*not 'EAGLE3'"):
            load_05b().main(["--work-dir", str(tmp_path), "--eagle3-url", e, "--warmup-requests", "1"])
    assert not (stage_dir(tmp_path, SERVE_BENCH) / "manifest.json").exists()


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
        # stop() waits for serve_forever's next poll: 0.5 s by default, for each of a sweep's servers
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
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
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

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
