"""SGLang servers for 05: launch commands, readiness, shutdown, the info document, and the preflight.

The preflight exists because of one failure: a server started with `--speculative-algorithm EAGLE`
(not EAGLE3) with an EAGLE-3 draft loads fine, skips aux capture, feeds the draft H-wide final states
and accepts at chance (REFERENCE section 5). Nothing errors; only tau shows it. So before any benchmark
or long job the server's own info document, the draft's files and the 02b/04 manifests must agree.

Sources (sgl-project/sglang): the info document is `{**dataclasses.asdict(server_args),
**scheduler_info, "internal_states": [scheduler.get_internal_state() per DP rank], "version"}`
(`srt/entrypoints/http_server.py` GET /get_server_info, newer also GET /server_info);
`internal_states[i]["avg_spec_accept_length"]` (`srt/managers/scheduler.py:get_internal_state`, present
once a speculative server has verified something). Flag names are `ServerArgs` fields with `-`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.stage import StageError

INFO_PATHS = ("/server_info", "/get_server_info")  # newer name first; older releases only the second
CHANCE_CAUSES = (
    "the server runs --speculative-algorithm EAGLE instead of EAGLE3 (no aux capture: the draft sees "
    "H-wide final states), the draft was trained on other capture points (eagle_config ids must be "
    "capture points - 1), the draft was trained for another target/tokenizer or chat template, the "
    "draft folder is not 04's export (an older or untrained checkpoint), or d2t is missing/zero so "
    "draft ids map to the wrong target ids")


# ---------------------------------------------------------------- command construction
def parse_spec_setting(text: str) -> tuple[int, int, int]:
    """'steps,topk,num_draft_tokens' -> ints, checked the way SGLang constrains them.

    topk 1 (a chain): SGLang forces num_draft_tokens = steps + 1, so anything else is refused here
    rather than silently changed. topk > 1 (a tree): at most 1 + topk + (steps-1)*topk^2 candidates.
    """
    try:
        steps, topk, ndt = (int(x) for x in str(text).split(","))
    except ValueError:
        raise StageError(f"--spec-settings entry {text!r}: expected 'steps,topk,num_draft_tokens', "
                         "e.g. 3,1,4") from None
    if steps < 1 or topk < 1 or ndt < 2:
        raise StageError(f"--spec-settings {text!r}: steps >= 1, topk >= 1, num_draft_tokens >= 2")
    if topk == 1 and ndt != steps + 1:
        raise StageError(f"--spec-settings {text!r}: with topk 1 SGLang uses num_draft_tokens = steps + 1 "
                         f"= {steps + 1}")
    if topk > 1 and ndt > 1 + topk + (steps - 1) * topk * topk:
        raise StageError(f"--spec-settings {text!r}: a tree of {steps} steps x topk {topk} has fewer "
                         f"than {ndt - 1} draft tokens")
    return steps, topk, ndt


def server_command(target: str | Path, port: int, tp_size: int, mem_fraction: float,
                   cuda_graph: bool, draft_dir: str | Path | None = None,
                   setting: tuple[int, int, int] | None = None, python: str = sys.executable,
                   extra_args: list[str] | None = None) -> list[str]:
    """argv of `python -m sglang.launch_server` for a baseline (no draft) or an EAGLE3 server.

    Prefix caching stays on (the benchmark sends distinct prompts); `--speculative-algorithm` is
    always EAGLE3 here, never EAGLE.
    """
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target), "--trust-remote-code",
           "--host", "127.0.0.1", "--port", str(int(port)), "--tp-size", str(int(tp_size)),
           "--mem-fraction-static", str(mem_fraction)]
    if not cuda_graph:
        cmd.append("--disable-cuda-graph")
    if draft_dir is not None:
        steps, topk, ndt = setting
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
                "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
                "--speculative-num-draft-tokens", str(ndt)]
    for bad in ("--enable-two-batch-overlap", "--speculative-algorithm", "--pp-size"):
        if bad in (extra_args or []):
            raise StageError(f"--server-extra-args may not set {bad}: two-batch overlap and pipeline "
                             "parallelism skip aux capture; the algorithm is fixed to EAGLE3")
    return cmd + list(extra_args or [])


# ---------------------------------------------------------------- process life cycle
def http_json(url: str, payload: dict | None = None, timeout: float = 30.0) -> dict:
    """GET (payload None) or POST JSON; returns the decoded document."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def get_server_info(base_url: str, timeout: float = 30.0) -> dict:
    """The server's info document (GET /server_info, else the older /get_server_info)."""
    last = None
    for path in INFO_PATHS:
        try:
            return http_json(base_url.rstrip("/") + path, timeout=timeout)
        except urllib.error.HTTPError as e:  # 404: this release has the other name
            last = e
    raise StageError(f"{base_url} answers neither {' nor '.join(INFO_PATHS)} ({last}): is it SGLang?")


def launch_server(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """Start a server in its own process group (so shutdown reaches its TP workers); log to a file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[05] launching: {' '.join(cmd)}\n[05]   log: {log_path}")
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout_s: float,
               poll_s: float = 2.0, log_path: Path | None = None) -> dict:
    """Poll /health until 200, then return the info document; stop early if the process died."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise StageError(f"the server exited with status {proc.returncode} before it was ready; "
                             f"see {log_path}")
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return get_server_info(base_url)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(poll_s)
    raise StageError(f"{base_url} was not ready after {timeout_s:.0f} s (--server-timeout); see {log_path}")


def stop_server(proc: subprocess.Popen | None, grace_s: float = 60.0) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL what is left."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# ---------------------------------------------------------------- preflight
def spec_settings_of(info: dict) -> tuple[int, int, int]:
    return (int(info["speculative_num_steps"]), int(info["speculative_eagle_topk"]),
            int(info["speculative_num_draft_tokens"]))


def check_server_info(info: dict, export_dir: Path, target_dir: Path | None = None) -> None:
    """Refuse unless the server runs EAGLE3 with exactly 04's export as its draft (and our target)."""
    algo = info.get("speculative_algorithm")
    if algo != "EAGLE3":
        raise StageError(
            f"the server reports speculative_algorithm={algo!r}, not 'EAGLE3'. With an EAGLE-3 draft, "
            "EAGLE skips aux hidden-state capture and acceptance falls to chance while nothing errors. "
            "Restart it with --speculative-algorithm EAGLE3 (see docs/sglang.md).")
    draft = info.get("speculative_draft_model_path")
    if not draft or Path(draft).resolve() != Path(export_dir).resolve():
        raise StageError(f"the server's draft is {draft!r}, not 04's export {Path(export_dir).resolve()}: "
                         "restart it with --speculative-draft-model-path pointing at that folder")
    if target_dir is not None and Path(info.get("model_path", "")).resolve() != Path(target_dir).resolve():
        raise StageError(f"the server serves {info.get('model_path')!r}, but the draft was trained for "
                         f"{Path(target_dir).resolve()}")


def check_draft_files(export_dir: Path, m02b: dict, m04: dict) -> dict:
    """The exported draft against the target (02b manifest) and 04's manifest. Returns its config."""
    from safetensors import safe_open

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    with safe_open(str(Path(export_dir) / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    points = [int(p) for p in m02b["capture_points"]]
    hidden, vocab = int(m02b["hidden_size"]), int(m02b["vocab_size"])
    dv = int(m04["draft_vocab_size"])
    problems = []
    if "fc.weight" not in shapes or shapes["fc.weight"][1] != 3 * hidden:
        problems.append(f"fc.weight {shapes.get('fc.weight')} must take 3 x target hidden = {3 * hidden}")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids != [p - 1 for p in points]:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} must be the 02b capture "
                        f"points - 1 = {[p - 1 for p in points]} (SGLang adds +1)")
    if [int(p) for p in m04.get("capture_points", [])] != points:
        problems.append(f"04 trained on capture points {m04.get('capture_points')}, 02b captured {points}")
    if cfg.get("vocab_size") != vocab:
        problems.append(f"vocab_size {cfg.get('vocab_size')} != target vocab {vocab}")
    if cfg.get("draft_vocab_size") != dv:
        problems.append(f"draft_vocab_size {cfg.get('draft_vocab_size')} != 04's {dv}")
    if shapes.get("d2t") != (dv,):
        problems.append(f"d2t {shapes.get('d2t')} must be present with shape ({dv},)")
    if shapes.get("lm_head.weight", (None,))[0] != dv:
        problems.append(f"lm_head.weight {shapes.get('lm_head.weight')} must have {dv} rows")
    if problems:
        raise StageError(f"draft {export_dir} does not fit the target/manifests:\n  - "
                         + "\n  - ".join(problems) + "\nRe-run `python 04_train.py --overwrite`.")
    return cfg


def server_accept_length(info: dict) -> float | None:
    """Server-wide tau: internal_states[0].avg_spec_accept_length (absent before any verify)."""
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return None if value is None else float(value)


def check_acceptance(tau: float, min_accept_length: float, where: str) -> None:
    """Refuse a tau at chance: 1.0 means only the bonus token is ever accepted."""
    if not tau >= min_accept_length:
        raise StageError(f"{where}: acceptance length {tau:.3f} is at chance (< {min_accept_length}). "
                         f"Usual causes: {CHANCE_CAUSES}.")


def preflight(base_url: str, export_dir: Path, m02b: dict, m04: dict, warmup_fn, min_accept_length: float,
              target_dir: Path | None = None) -> dict:
    """Run every check against a live server; returns a record for metrics.json.

    warmup_fn(base_url) -> per-request tau over a few short requests (common/sglang/bench.warmup).
    """
    info = get_server_info(base_url)
    check_server_info(info, export_dir, target_dir)
    check_draft_files(export_dir, m02b, m04)
    tau_requests = warmup_fn(base_url)
    check_acceptance(tau_requests, min_accept_length, f"{base_url} warm-up (per-request)")
    tau_server = server_accept_length(get_server_info(base_url))
    if tau_server is not None:
        check_acceptance(tau_server, min_accept_length, f"{base_url} avg_spec_accept_length")
    print(f"[05] preflight ok: EAGLE3, draft {export_dir}, warm-up tau {tau_requests:.2f} "
          f"(server {tau_server})")
    return {"speculative_algorithm": info["speculative_algorithm"], "draft": str(export_dir),
            "warmup_tau": tau_requests, "server_avg_spec_accept_length": tau_server,
            "version": info.get("version")}
