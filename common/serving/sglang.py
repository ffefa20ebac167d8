"""SGLang servers for 05: launch commands, readiness, shutdown, the info document, and the preflight.

The preflight exists because of one failure: a server started with `--speculative-algorithm EAGLE`
(not EAGLE3) with an EAGLE-3 draft loads fine, skips aux capture, feeds the draft H-wide final states
and accepts at chance (docs/design.md section 5). Nothing errors; only tau shows it. So before any benchmark
or long job the server's own info document, the draft's files and the 02b/04 manifests must agree.

Sources (sglang 0.5.14, https://github.com/sgl-project/sglang/tree/v0.5.14/python/sglang/srt): the info
document is `{**dataclasses.asdict(server_args), **scheduler_info, "internal_states": [per DP rank
scheduler.get_internal_state()], "version"}` (`entrypoints/http_server.py` GET /server_info; GET
/get_server_info is its deprecated alias). `internal_states[i]["avg_spec_accept_length"]` is
`spec_total_num_accept_tokens / spec_total_num_forward_ct` (`managers/scheduler.py`), lifetime
counters that `metrics_reporter.py` folds in every `--decode-log-interval` (40) decode iterations and
that only POST /set_internal_state resets. CUDA graphs: `cuda_graph_config.{decode,prefill}.backend`
(`model_executor/cuda_graph_config.py`); `disable_cuda_graph` is a deprecated flag that servers started
with the new `--cuda-graph-backend-decode disabled` still report as False. Flag names and aliases:
`server_args.py` (`ServerArgs` fields with `-`, `Arg(aliases=...)`, parsed by argparse with abbreviations).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.draft import OURS
from common.stage import StageError, sha256_file

INFO_PATHS = ("/server_info", "/get_server_info")  # newer name first; older releases only the second
# Connection refused/reset and these statuses are retried (a server restarting, a proxy in front of a
# busy one); anything else is an answer. Waits 1, 2, 4, 8, 16 s: about half a minute in all.
TRANSIENT_HTTP = {500, 502, 503, 504}
RETRY_ATTEMPTS = 6
RETRY_FIRST_WAIT_S = 1.0
# launch_server options 05 refuses in --server-extra-args, by ServerArgs field, with every option
# string sglang 0.5.14's parser accepts for it (server_args.py). Refused because they skip aux capture
# or fix the algorithm (pp_size, enable_two_batch_overlap, speculative_algorithm), could set anything
# (--config, a YAML of options), or are set by 05 itself and a later copy would silently win over what
# 05 records (model, draft, setting, ports, TP, memory, CUDA-graph mode).
GUARDED_OPTIONS = {
    "--pp-size": "pp_size", "--pipeline-parallel-size": "pp_size",
    "--enable-two-batch-overlap": "enable_two_batch_overlap",
    "--speculative-algorithm": "speculative_algorithm",
    "--config": "config",
    "--model-path": "model_path", "--model": "model_path",
    "--speculative-draft-model-path": "speculative_draft_model_path",
    "--speculative-draft-model": "speculative_draft_model_path",
    "--speculative-num-steps": "speculative_num_steps", "--speculative-eagle-topk": "speculative_eagle_topk",
    "--speculative-num-draft-tokens": "speculative_num_draft_tokens",
    "--tp-size": "tp_size", "--tensor-parallel-size": "tp_size", "--host": "host", "--port": "port",
    "--mem-fraction-static": "mem_fraction_static",
    "--disable-cuda-graph": "cuda_graph", "--cuda-graph-config": "cuda_graph",
    "--cuda-graph-backend-decode": "cuda_graph", "--cuda-graph-backend-prefill": "cuda_graph",
    "--disable-decode-cuda-graph": "cuda_graph", "--disable-prefill-cuda-graph": "cuda_graph",
    "--enable-breakable-cuda-graph": "cuda_graph", "--disable-piecewise-cuda-graph": "cuda_graph",
    "--enforce-piecewise-cuda-graph": "cuda_graph",
    "--speculative-draft-model-quantization": "speculative_draft_model_quantization",
    "--speculative-draft-attention-backend": "speculative_draft_attention_backend",
    "--speculative-adaptive": "speculative_adaptive", "--speculative-adaptive-config": "speculative_adaptive",
    "--disable-radix-cache": "disable_radix_cache",
}
# --speculative-adaptive (a `,adaptive` setting): the steps it may start from (the union of the default
# config's per-batch-size candidate steps, sglang 0.5.14 adaptive_spec_params.py, 0 = no drafting), and
# the options under which SGLang silently turns it off (adaptive_unsupported_reason), refused with it.
ADAPTIVE = "adaptive"
ADAPTIVE_STEPS = (1, 3, 7)
ADAPTIVE_OFF_WITH = ("--enable-dp-attention", "--enable-multi-layer-eagle", "--enable-pdmux")
CHANCE_CAUSES = (
    "the server runs --speculative-algorithm EAGLE instead of EAGLE3 (no aux capture: the draft sees "
    "H-wide final states), the draft was trained on other capture points (eagle_config ids must be "
    "capture points - 1), the draft was trained for another target/tokenizer or chat template, the "
    "draft folder is not 04's export (an older or untrained checkpoint), or d2t is missing/zero so "
    "draft ids map to the wrong target ids")


# ---------------------------------------------------------------- command construction
def parse_spec_setting(text: str) -> tuple:
    """'steps,topk,num_draft_tokens[,adaptive]' -> (steps, topk, ndt) or (steps, topk, ndt, "adaptive"),
    checked the way SGLang constrains them.

    topk 1 (a chain): SGLang forces num_draft_tokens = steps + 1, so anything else is refused here
    rather than silently changed. topk > 1 (a tree): at most 1 + topk + (steps-1)*topk^2 candidates.
    `adaptive` = `--speculative-adaptive` starting from that chain (SGLang then moves the steps between
    ADAPTIVE_STEPS by batch size and an EMA of accept length); its rules are checked here, not left to
    SGLang, which drops the flag with a warning when they fail (speculative_hook.py
    `_maybe_disable_adaptive`) or refuses the start.
    """
    parts = str(text).split(",")
    adaptive = len(parts) == 4 and parts[3].strip() == ADAPTIVE
    try:
        steps, topk, ndt = (int(x) for x in parts[:3] if len(parts) == 3 or adaptive)
    except ValueError:
        raise StageError(f"--spec-settings entry {text!r}: expected 'steps,topk,num_draft_tokens' or "
                         "'steps,1,steps+1,adaptive', e.g. 3,1,4") from None
    if adaptive and (topk != 1 or steps not in ADAPTIVE_STEPS):
        raise StageError(f"--spec-settings {text!r}: --speculative-adaptive runs chains only (topk 1) and "
                         f"starts from one of its candidate steps {list(ADAPTIVE_STEPS)} (sglang 0.5.14 "
                         "adaptive_spec_params.py DEFAULT_ADAPTIVE_CONFIG)")
    if steps < 1 or topk < 1 or ndt < 2:
        raise StageError(f"--spec-settings {text!r}: steps >= 1, topk >= 1, num_draft_tokens >= 2")
    if topk == 1 and ndt != steps + 1:
        raise StageError(f"--spec-settings {text!r}: with topk 1 SGLang uses num_draft_tokens = steps + 1 "
                         f"= {steps + 1}")
    if topk > 1 and ndt > 1 + topk + (steps - 1) * topk * topk:
        raise StageError(f"--spec-settings {text!r}: a tree of {steps} steps x topk {topk} has fewer "
                         f"than {ndt - 1} draft tokens")
    return (steps, topk, ndt, ADAPTIVE) if adaptive else (steps, topk, ndt)


def is_adaptive(setting) -> bool:
    return setting is not None and len(setting) == 4 and setting[3] == ADAPTIVE


def guarded_option(token: str) -> str | None:
    """The guarded ServerArgs field a launch_server argument sets, resolved the way argparse does.

    `--name=value` is split at `=`; an exact option string wins; otherwise argparse (allow_abbrev, the
    default) takes any unambiguous prefix (`--speculative-algo` = `--speculative-algorithm`) and stops
    on an ambiguous one, so any prefix of a guarded option is refused too. No other sglang 0.5.14 option
    string is a prefix of a guarded one, so nothing SGLang would read as another flag is caught.
    """
    if not token.startswith("--") or token == "--":
        return None
    name = token.split("=", 1)[0]
    if name in GUARDED_OPTIONS:
        return GUARDED_OPTIONS[name]
    hits = sorted({field for option, field in GUARDED_OPTIONS.items() if option.startswith(name)})
    return hits[0] if hits else None


def check_extra_args(extra_args: list[str]) -> None:
    """Refuse --server-extra-args that set a guarded launch_server option (GUARDED_OPTIONS)."""
    for token in extra_args:
        field = guarded_option(token)
        if field is None:
            continue
        why = {"pp_size": "pipeline parallelism skips aux capture on non-last ranks",
               "enable_two_batch_overlap": "two-batch overlap runs layers outside the capturing loop",
               "speculative_algorithm": "the algorithm is fixed to EAGLE3 (EAGLE would skip aux capture)",
               "config": "a config file could set any of the options 05 guards"}.get(
            field, "05 sets it itself (use 05's own flag: --target-path, --spec-settings, --cuda-graph, "
                   "--sglang-tp-size, --mem-fraction-static, --sglang-draft-attention-backend, "
                   "--baseline-port/--eagle3-port; the draft's quantization follows the target's)")
        raise StageError(f"--server-extra-args may not contain {token!r} (SGLang reads it as {field}): {why}")


def target_quantization(target_dir: str | Path) -> str | None:
    """The target checkpoint's quant_method (config.json, or its text_config as in Kimi-K2.5's
    compressed-tensors INT4 checkpoint), None for an unquantized one."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    for part in (cfg, cfg.get("text_config") or {}):
        quant = part.get("quantization_config")
        if isinstance(quant, dict) and quant.get("quant_method"):
            return str(quant["quant_method"])
    return None


# sglang 0.5.14 utils/hf_transformers/common.py: the keys get_context_length reads, first found wins
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value argparse keeps for `flag` in argv (`--flag V` or `--flag=V`; the last one wins), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def derived_context_length(target_dir: str | Path) -> int:
    """The context length SGLang derives for a target without --context-length (sglang 0.5.14
    `get_context_length` on the text config): the first of CONTEXT_LENGTH_KEYS, times the rope scaling factor
    unless the scaling names original_max_position_embeddings or is llama3's; 2048 without any key."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    scaling = text.get("rope_scaling") or {}
    factor = 1 if not scaling or "original_max_position_embeddings" in scaling or \
        scaling.get("rope_type") == "llama3" else scaling.get("factor", 1)
    value = next((text[k] for k in CONTEXT_LENGTH_KEYS if text.get(k) is not None), None)
    return 2048 if value is None else int(factor * value)


def server_command(target: str | Path, port: int, tp_size: int, mem_fraction: float,
                   cuda_graph: bool, draft_dir: str | Path | None = None,
                   setting: tuple[int, int, int] | None = None, python: str = sys.executable,
                   extra_args: list[str] | None = None, draft_attention_backend: str | None = None,
                   quantized_target: bool = False, prefix_cache: bool = True) -> list[str]:
    """argv of `python -m sglang.launch_server` for a baseline (no draft) or an EAGLE3 server.

    `prefix_cache` False = `--disable-radix-cache`: 05's sweep times repeated passes over the same prompts,
    which a radix cache would serve from memory (common/serving/sweep.py); `--speculative-algorithm`
    is always EAGLE3 here, never EAGLE. CUDA graphs off = both phases' backends `disabled` (the
    non-deprecated form of `--disable-cuda-graph`). Next to a quantized target (`quantized_target`:
target_quantization says) the draft is loaded
    `--speculative-draft-model-quantization unquant`: SGLang gives the draft the target's `--quantization`
    when that flag is typed (and an unquantized draft then fails to load: "Cannot find the config file"),
    sglang 0.5.14 server_args.py `_handle_missing_default_values`. `draft_attention_backend`: the draft's
    own backend (`--speculative-draft-attention-backend`); unset, an MHA draft inherits the target's, and
    next to an MLA target (`trtllm_mla`, `flashmla`) it fails ("trtllm_mla backend can only be used
    with MLA models", sgl-project/sglang issue 23490).
    """
    check_extra_args(list(extra_args or []))
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target), "--trust-remote-code",
           "--host", "127.0.0.1", "--port", str(int(port)), "--tp-size", str(int(tp_size)),
           "--mem-fraction-static", str(mem_fraction)]
    if not prefix_cache:
        cmd.append("--disable-radix-cache")
    if not cuda_graph:
        cmd += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if draft_dir is not None:
        steps, topk, ndt = setting[:3]
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
                "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
                "--speculative-num-draft-tokens", str(ndt)]
        if is_adaptive(setting):
            off = [a for a in extra_args or [] if a.split("=", 1)[0] in ADAPTIVE_OFF_WITH]
            if off:
                raise StageError(f"--server-extra-args {off[0]!r} turns --speculative-adaptive off (SGLang only "
                                 "warns): drop it or the ',adaptive' setting")
            cmd += ["--speculative-adaptive"]
        if quantized_target:
            cmd += ["--speculative-draft-model-quantization", "unquant"]
        if draft_attention_backend:
            cmd += ["--speculative-draft-attention-backend", draft_attention_backend]
    return cmd + list(extra_args or [])


# ---------------------------------------------------------------- process life cycle
class StreamCut(ConnectionError):
    """A response that ended early: half an SSE line, or no final chunk. Retried like a reset."""


class BadAnswer(StageError):
    """A 200 answer that is not what 05 reads: an HTML sign-in page of a proxy, half a JSON body, a document
    without a count 05 needs. The server answered, so asking again gives the same page: never retried, and
    one line naming the server and the field instead of a traceback from deep inside a parser."""


_MISSING = object()


def _field(doc, path: str):
    for name in path.split("."):
        doc = doc.get(name, _MISSING) if isinstance(doc, dict) else _MISSING
    return doc


def _head(text: str) -> str:
    """The start of an unexpected body, for the message (an HTML page is named as one)."""
    text = " ".join(text.split())
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    return f"an HTML page ({shown})" if text[:1] == "<" else shown


def parse_answer(body, where: str, counts: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                 obj: bool = True):
    """Every server answer 05 reads passes here: `body` (the bytes or text of a 200 answer, one streamed
    event's data, or a document already decoded) as JSON - an object unless `obj` is False - whose `counts`
    (dotted paths: "meta_info.completion_tokens") are whole numbers >= 0, as are `optional` ones that are
    present and not null. Returns the document; anything else is one BadAnswer line naming `where` (the
    server and its route) and what is wrong, never a KeyError or JSONDecodeError traceback."""
    doc = body
    if isinstance(body, (bytes, str)):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            doc = json.loads(text)
        except ValueError as e:
            # a body that ends inside a value or a string was cut short (half a body, a proxy's limit)
            cut = " (cut short)" if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated") else ""
            raise BadAnswer(f"{where}: the answer is {_head(text) if text.strip() else 'empty'}, not the JSON "
                            f"05 reads{cut}: {e.msg} at character {e.pos}") from None
    if obj and not isinstance(doc, dict):
        raise BadAnswer(f"{where}: the answer is {_head(json.dumps(doc))}, not a JSON object")
    for path in counts + optional:
        value = _field(doc, path)
        if path in optional and value in (_MISSING, None):
            continue
        if value is _MISSING:
            raise BadAnswer(f"{where}: the answer has no {path}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadAnswer(f"{where}: the answer's {path} is {value!r}, not a count (a whole number >= 0)")
    return doc


def with_retries(call, what: str, on_retry=None):
    """call(), retried on connection refused/reset, a cut response and transient 5xx with waits doubling
    from RETRY_FIRST_WAIT_S; after RETRY_ATTEMPTS tries one clear StageError instead of a traceback.

    Not retried, one line each: an unresolvable host or another network error (the address is wrong),
    and a timeout (the server took the connection and never answered: `what` names the server).
    `on_retry(reason)` is called before every retry, so callers can count them (a number measured
    under retries is marked as such). A non-transient HTTP status is raised as it is (callers read it).
    """
    import http.client
    import socket

    for attempt in range(RETRY_ATTEMPTS):
        try:
            return call()
        except urllib.error.HTTPError as e:  # an HTTP answer: only a transient status is retried
            if e.code not in TRANSIENT_HTTP:
                raise
            last = f"HTTP {e.code} {e.reason}"
        except urllib.error.URLError as e:  # no answer: retried when the connection was refused/reset
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise StageError(f"{what}: no answer before the timeout (the server accepted the connection "
                                 "and never answered)") from None
            if not isinstance(e.reason, ConnectionError):
                raise StageError(f"{what}: {e.reason} (is the address right?)") from None
            last = str(e.reason)
        except (TimeoutError, socket.timeout):
            raise StageError(f"{what}: no answer before the timeout (the server accepted the connection and "
                             "never answered)") from None
        except (ConnectionError, http.client.IncompleteRead) as e:  # reset, closed or cut mid-response
            last = str(e) or type(e).__name__
        if attempt + 1 < RETRY_ATTEMPTS:
            if on_retry is not None:
                on_retry(last)
            time.sleep(RETRY_FIRST_WAIT_S * 2 ** attempt)
    waited = RETRY_FIRST_WAIT_S * (2 ** (RETRY_ATTEMPTS - 1) - 1)
    raise StageError(f"{what}: {last} ({RETRY_ATTEMPTS} tries over {waited:.0f} s). Is the server running and "
                     "ready? For a launched server see its log under 05_benchmark/server/server_logs/.")


# The other lines an event stream may hold: a comment, or an event / id / retry field.
SSE_OTHER_LINE = re.compile(r"^(:|(event|id|retry)(:|$))")


def sse_request(url: str, payload: dict, timeout: float, what: str) -> dict:
    """POST `payload` and read its server-sent events (`data: {json}` lines up to `data: [DONE]`); the
    whole request is retried as with_retries says, a cut stream included. Returns {"chunks", "ttft_s",
    "latency_s", "retries"}: the times are those of the successful attempt alone (backoff waits are
    no part of a request's latency), and a chunk with "error" ends the stream for the caller to raise.
    A line the connection cut is a cut stream; a whole line that is no event, or an event that is not a
    JSON object, is the server's answer: BadAnswer (parse_answer), not retried."""
    retries = []

    def attempt() -> dict:
        t0 = time.perf_counter()
        ttft, chunks, done = None, [], False
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    if line and not SSE_OTHER_LINE.match(line):  # a page or a plain JSON body: no stream
                        raise BadAnswer(f"{what}: the answer is {_head(line)}, not an event stream "
                                        "(`data: {json}` lines)")
                    continue
                body = line[len("data:"):].strip()
                if body == "[DONE]":
                    done = True
                    break
                try:
                    chunk = parse_answer(body, what)
                except BadAnswer:
                    if raw.endswith(b"\n"):  # a whole event that is not JSON: the server's answer, not a cut
                        raise
                    raise StreamCut(f"the stream was cut inside an event ({body[:40]!r}...)") from None
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks.append(chunk)
                if "error" in chunk:
                    done = True
                    break
        if not done:
            raise StreamCut("the stream ended before `data: [DONE]`")
        return {"chunks": chunks, "ttft_s": ttft, "latency_s": time.perf_counter() - t0}

    out = with_retries(attempt, what, on_retry=retries.append)
    out["retries"] = len(retries)
    return out


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0, obj: bool = True):
    """GET (payload None) or POST JSON; returns the decoded document, a JSON object unless `obj` is False
    (transient failures retried; a 200 that is not JSON ends in parse_answer's one line)."""
    data = None if payload is None else json.dumps(payload).encode()
    what = f"{'POST' if payload is not None else 'GET'} {url}"

    def call():
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return parse_answer(r.read(), what, obj=obj)
    return with_retries(call, what)


def get_server_info(base_url: str, timeout: float = 30.0) -> dict:
    """The server's info document (GET /server_info, else the older /get_server_info)."""
    last = None
    for path in INFO_PATHS:
        try:
            return http_json(base_url.rstrip("/") + path, timeout=timeout)
        except urllib.error.HTTPError as e:  # 404: this release has the other name
            last = e
    raise StageError(f"{base_url} answers neither {' nor '.join(INFO_PATHS)} ({last}): is it SGLang?")


def reset_accept_counters(base_url: str) -> bool:
    """Zero the lifetime counters behind avg_spec_accept_length (POST /set_internal_state with no
    changes: scheduler.set_internal_state resets both). False when the server refuses (an admin API
    key, or a release without the endpoint): its average then cannot be windowed to one run."""
    try:
        http_json(base_url.rstrip("/") + "/set_internal_state", {"server_args": {}}, obj=False)  # a list per rank
    except urllib.error.HTTPError:
        return False
    return True


def launch_server(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a server in its own process group (so shutdown reaches its TP workers); log to a file.
    `env`: variables set for the server on top of this process's environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"[05] launching: {shown + ' ' if shown else ''}{' '.join(cmd)}\n[05]   log: {log_path}")
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout_s: float,
               poll_s: float = 2.0, log_path: Path | None = None, info: bool = True) -> dict | None:
    """Poll /health until 200, then return SGLang's info document (None with info=False: another
    engine); stop early if the process died."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise StageError(f"the server exited with status {proc.returncode} before it was ready; "
                             f"see {log_path}")
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return get_server_info(base_url) if info else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(poll_s)
    raise StageError(f"{base_url} was not ready after {timeout_s:.0f} s (--server-timeout); see {log_path}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc (Linux); elsewhere the group's
    existence (killpg signal 0) is all that can be asked."""
    proc_dir = Path("/proc")
    if not (proc_dir / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ')'
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # exited while being read
        if int(pgrp) == pgid and state not in ("Z", "X"):
            live.append(int(stat.parent.name))
    return live


def wait_group_exit(pgid: int, timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait until no live process is left in the group; returns the ones still alive at the timeout."""
    deadline = time.time() + timeout_s
    while (left := group_members(pgid)) and time.time() < deadline:
        time.sleep(poll_s)
    return left


def stop_server(proc: subprocess.Popen | None, grace_s: float = 60.0, kill_wait_s: float = 30.0) -> None:
    """SIGTERM the server's process group and wait until every member has exited (SGLang refuses to
    start while the previous server's TP workers still hold GPU memory); SIGKILL what is left after
    `grace_s`. The launcher alone exiting is not enough: its workers may outlive it."""
    if proc is None:
        return
    pgid = proc.pid  # launch_server starts a new session: the group id is the launcher's pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    try:
        proc.wait(timeout=grace_s)  # reap the launcher so it does not linger as a zombie
    except subprocess.TimeoutExpired:
        pass
    left = wait_group_exit(pgid, max(0.0, deadline - time.time()))
    if left:
        print(f"[05] server processes {left} still alive {grace_s:.0f} s after SIGTERM: SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=kill_wait_s)
        left = wait_group_exit(pgid, kill_wait_s)
    if left:
        raise StageError(f"server processes {left} (process group {pgid}) survived SIGKILL; they may still "
                         "hold GPU memory: end them before starting another server")


# ---------------------------------------------------------------- preflight
def spec_settings_of(info: dict, where: str = "the server's info document") -> tuple:
    """The setting a server runs, as parse_spec_setting writes it (`speculative_adaptive` as SGLang
    resolved it: False when it turned the flag off)."""
    fields = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    parse_answer(info, where, counts=fields)
    chain = tuple(int(info[f]) for f in fields)
    return (*chain, ADAPTIVE) if info.get("speculative_adaptive") else chain


def adaptive_disabled_line(log: Path | None) -> str | None:
    """SGLang's warning when it turned --speculative-adaptive off at start-up (speculative_hook.py
    `_maybe_disable_adaptive`), from the server's log; None when the log has none."""
    if log is None or not Path(log).is_file():
        return None
    lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines()
             if "speculative_adaptive disabled" in ln]
    return lines[-1] if lines else None


def cuda_graph_on(info: dict) -> bool:
    """Whether the server decodes with CUDA graphs: `cuda_graph_config.decode.backend` != disabled.

    Servers started with `--cuda-graph-backend-decode disabled` still report the deprecated
    `disable_cuda_graph` False; it is read only from releases without cuda_graph_config.
    """
    config = info.get("cuda_graph_config")
    if isinstance(config, dict) and isinstance(config.get("decode"), dict):
        return config["decode"].get("backend") != "disabled"
    return not info.get("disable_cuda_graph", False)


DRAFT_FILES = ("config.json", "model.safetensors")


def draft_files(folder: str | Path) -> tuple[str, ...]:
    """The files that identify a draft folder by content: config.json and its weights (model.safetensors,
    or a sharded checkpoint's index and shards, as a public draft may come)."""
    index = Path(folder) / "model.safetensors.index.json"
    if not index.is_file():
        return DRAFT_FILES
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ("config.json", index.name, *shards)


def folder_fingerprint(folder: str | Path, files: tuple[str, ...]) -> str | None:
    """sha256 over the named files' bytes (name + content hash each), or None when one is unreadable.
    Cached by path, size and mtime: a Kimi draft's weights are gigabytes and every preflight asks."""
    stats = []
    for name in files:
        path = Path(folder) / name
        if not path.is_file():
            return None
        st = path.stat()
        stats.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return _fingerprint(tuple(stats))


@functools.lru_cache(maxsize=16)
def _fingerprint(stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _size, _mtime in stats:
        h.update(Path(path).name.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()


def same_folder(reported: str | None, ours: Path, files: tuple[str, ...]) -> bool:
    """The server's folder is ours: the same resolved path, or byte-identical `files` (a copy on another
    mount). Read from this machine: a path that exists only on the server's host cannot be checked."""
    if not reported:
        return False
    if Path(reported).resolve() == Path(ours).resolve():
        return True
    theirs = folder_fingerprint(reported, files)
    return theirs is not None and theirs == folder_fingerprint(ours, files)


def candidates(drafts) -> dict[str, Path]:
    """{name: folder} of the drafts a server may serve; a bare folder is 04's export alone."""
    return {n: Path(f) for n, f in drafts.items()} if isinstance(drafts, dict) else {OURS: Path(drafts)}


def served_draft(reported: str | None, drafts) -> str | None:
    """The name of the first of `drafts` (candidates) that the server's folder is, by folder or content
    (same_folder over that draft's draft_files); None when it is none of them."""
    for name, folder in candidates(drafts).items():
        if same_folder(reported, folder, draft_files(folder)):
            return name
    return None


def not_one_of(drafts) -> str:
    """The refusal's middle: what the served draft is not, and how it was compared."""
    named = candidates(drafts)
    if len(named) == 1:
        (name, folder), = named.items()
        what = f"not 04's export {folder.resolve()}" if name == OURS else f"not the draft {name} {folder.resolve()}"
    else:
        what = "none of 05's drafts (" + ", ".join(f"{n} {f.resolve()}" for n, f in named.items()) + ")"
    return (f"{what} (neither the same folder nor a byte-identical copy of its config.json and weights, as read "
            "from this machine)")


def check_server_info(info: dict, drafts, target_dir: Path | None = None, url: str = "") -> None:
    """Refuse unless the server runs EAGLE3 with exactly one of `drafts` (04's export folder alone, or
    {name: folder}: 04's and the declared --draft ones) as its draft, and our target.

    A draft counts as one of them when its folder is that one or a byte-identical copy (config.json and
    its weights); the target when its folder is ours or has our config.json.
    """
    where = f"the EAGLE3 server {url}".rstrip() if url else "the server"
    algo = info.get("speculative_algorithm")
    if algo != "EAGLE3":
        raise StageError(
            f"{where} reports speculative_algorithm={algo!r}, not 'EAGLE3'. With an EAGLE-3 draft, "
            "EAGLE skips aux hidden-state capture and acceptance falls to chance while nothing errors. "
            "Restart it with --speculative-algorithm EAGLE3 (see docs/sglang.md).")
    draft = info.get("speculative_draft_model_path")
    if served_draft(draft, drafts) is None:
        raise StageError(f"{where}'s draft is {draft!r}, {not_one_of(drafts)}: restart it with "
                         "--speculative-draft-model-path pointing at that folder")
    quant = info.get("speculative_draft_model_quantization")
    if quant not in (None, "unquant"):
        raise StageError(f"{where} loads the draft quantized ({quant!r}: the target's --quantization, which "
                         "SGLang hands to the draft unless told otherwise), but 04 exported it unquantized. "
                         "Restart it with --speculative-draft-model-quantization unquant")
    check_model_path(info, target_dir, where)


def check_model_path(info: dict, target_dir: Path | None, where: str = "the server") -> None:
    if target_dir is not None and not same_folder(info.get("model_path"), target_dir, ("config.json",)):
        raise StageError(f"{where} serves {info.get('model_path')!r}, but the draft was trained for "
                         f"{Path(target_dir).resolve()} (another folder whose config.json differs)")


def check_baseline_info(info: dict, target_dir: Path | None, url: str = "") -> None:
    """A baseline runs no speculative algorithm and serves our target."""
    where = f"the baseline server {url}".rstrip()
    algo = info.get("speculative_algorithm")
    if algo:
        raise StageError(f"{where} runs speculative_algorithm={algo!r} (draft "
                         f"{info.get('speculative_draft_model_path')!r}): a baseline must run without "
                         "speculative decoding, or the speed ratio compares two speculative servers")
    check_model_path(info, target_dir, where)


def check_radix_cache_off(info: dict, url: str) -> None:
    """05 times every server with prefix caching off (server_bench): refuse one whose radix cache is on."""
    if info.get("disable_radix_cache") is not True:
        raise StageError(f"the SGLang server {url} reports disable_radix_cache {info.get('disable_radix_cache')!r}: "
                         "05 times every server with prefix caching off, so that repeated passes over the same "
                         "prompts are fresh prefills on every server alike; start it with --disable-radix-cache")


def check_draft_files(export_dir: Path, m02b: dict, m04: dict) -> dict:
    """The exported draft against the target (02b manifest) and 04's manifest. Returns its config."""
    from safetensors import safe_open

    from common.target.capture import sglang_layer_ids

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    with safe_open(str(Path(export_dir) / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    points = [int(p) for p in m02b["capture_points"]]
    hidden, vocab = int(m02b["hidden_size"]), int(m02b["vocab_size"])
    dv = int(m04["draft_vocab_size"])
    # The ids SGLang must read to capture exactly the 02b points on this target (its rule per model
    # family; 02b already refused points it cannot express, unless the architecture was accepted as
    # unknown there, in which case the common +1 applies).
    architecture = m02b.get("target_architecture")
    if architecture is None:
        raise StageError("the 02b manifest has no target_architecture (made by an older 02b): re-run "
                         "`python 02b_extract_hidden_states_sglang.py --overwrite`")
    expected = sglang_layer_ids(points, architecture, allow_unknown=True)
    problems = []
    if "fc.weight" not in shapes or shapes["fc.weight"][1] != 3 * hidden:
        problems.append(f"fc.weight {shapes.get('fc.weight')} must take 3 x target hidden = {3 * hidden}")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids != expected:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} must be {expected}: SGLang "
                        f"captures h{points} (the 02b capture points) from those ids on {architecture}")
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
    """Server-wide tau: internal_states[0].avg_spec_accept_length (absent before any verify, and until
    the first --decode-log-interval decode iterations after a counter reset)."""
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return None if value is None else float(value)


def check_acceptance(tau: float, min_accept_length: float, where: str) -> None:
    """Refuse a tau at chance: 1.0 means only the bonus token is ever accepted."""
    if not tau >= min_accept_length:
        raise StageError(f"{where}: acceptance length {tau:.3f} is at chance (< {min_accept_length}). "
                         f"Usual causes: {CHANCE_CAUSES}.")


def preflight(base_url: str, export_dir: Path, m02b: dict, m04: dict, warmup_fn, min_accept_length: float,
              target_dir: Path | None = None, draft: tuple[str, Path] | None = None) -> dict:
    """Run every check against a live server; returns a record for metrics.json.

    warmup_fn(base_url) -> per-request tau over a few short requests (common/benchmark/server_bench.warmup).
    `draft`: (name, folder) of a declared --draft the server must serve instead of 04's export; its files
    were checked against the target before launch (common/draft/imported.py), the manifests describe 04's.
    """
    name, folder = draft or (OURS, Path(export_dir))
    info = get_server_info(base_url)
    check_server_info(info, {name: folder}, target_dir, base_url)
    if name == OURS:
        check_draft_files(export_dir, m02b, m04)
    reset_accept_counters(base_url)  # so the server's average below is the warm-up's alone
    tau_requests = warmup_fn(base_url)
    check_acceptance(tau_requests, min_accept_length, f"{base_url} warm-up (per-request)")
    tau_server = server_accept_length(get_server_info(base_url))
    if tau_server is not None:
        check_acceptance(tau_server, min_accept_length, f"{base_url} avg_spec_accept_length")
    backends = {"target": info.get("attention_backend"), "draft": info.get("speculative_draft_attention_backend")}
    print(f"[05] preflight ok: EAGLE3, draft {name + ' ' if draft else ''}{folder}, warm-up tau {tau_requests:.2f} "
          f"(server {tau_server}); attention backends: target {backends['target']}, draft "
          f"{backends['draft'] or 'inherited from the target'}; draft quantization "
          f"{info.get('speculative_draft_model_quantization')}")
    return {"speculative_algorithm": info["speculative_algorithm"], "draft": str(folder),
            **({"draft_name": name} if draft else {}),
            "draft_sha256": folder_fingerprint(folder, draft_files(folder)),
            "server_draft_path": info.get("speculative_draft_model_path"),
            "warmup_tau": tau_requests, "server_avg_spec_accept_length": tau_server,
            "attention_backends": backends,
            "draft_quantization": info.get("speculative_draft_model_quantization"),
            "version": info.get("version")}
