"""SGLang's side of 05b (common/serving/sglang.py): the launch commands and the --server-extra-args refused as
SGLang's own argparse would read them, the spec-setting grammar and SGLang's adaptive steps, the graph mode from
cuda_graph_config, a quantized target's unquantized draft, streamed errors, retries and network failures ending in
one line naming the server, and the Kimi preset against the plan's and the docs' server commands."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.serving import http, settings
from common.serving import sglang as srv
from common.serving.vllm import VllmEngine
from common.stage import StageError
from tests.paths import REPO
from tests.sglang_server_stub import StubServer, StubState
from tests.units.serving.test_sweep import NO_MANIFESTS


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
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

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
