"""SGLang for 05b: the launch command and its guarded flags, the info document and its checks, the
preflight, one streamed request to /generate, and SGLangEngine (engine.Engine in SGLang's terms).

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

Requests go to its native POST /generate with token ids (`input_ids`, `stream: true`) and
every sampling parameter set (request_params.pinned; the seed as `sampling_seed`):
the time to the first streamed chunk is the TTFT; the final chunk's `meta_info` carries
`completion_tokens` and, on a speculative server, `spec_verify_ct` (verify rounds), so per-request
tau = completion_tokens / spec_verify_ct (bonus token included; SGLang's definition, tokenizer_manager).
spec_verify_ct counts verify rounds whatever the sampling: a sampled request's tau is read the same way.
Chunks are SSE lines `data: {json}` ending with `data: [DONE]`; a failed request streams
`data: {"error": {"message", ...}}` before `[DONE]` (sglang 0.5.14 srt/entrypoints/http_server.py).
Each chunk's `output_ids` are the answer so far, or with --incremental-streaming-output only the chunk's
new ones (tokenizer_manager `_handle_batch_output`).
"""
from __future__ import annotations

import json
import shlex
import sys
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from common.draft import OURS
from common.draft.manifest import DraftManifest
from common.serving.drafts import (check_acceptance, check_draft_files, draft_files, folder_fingerprint, not_one_of,
                                   same_folder, served_draft)
from common.serving.engine import Engine, ServedDraft, check_simulated_tau, confirm_simulated, refuse_lossy
from common.serving.http import http_json, parse_answer, sse_request
from common.serving.request_params import pinned
from common.serving.settings import (ADAPTIVE, is_adaptive, is_block, parse_spec_setting,
                                     simulated as simulated_setting, simulated_length as simulated_length_of)
from common.stage import StageError
from common.target.manifests import HiddenStatesManifest

INFO_PATHS = ("/server_info", "/get_server_info")  # newer name first; older releases only the second
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
# The options under which SGLang silently turns --speculative-adaptive off (adaptive_unsupported_reason),
# refused with a `,adaptive` setting.
ADAPTIVE_OFF_WITH = ("--enable-dp-attention", "--enable-multi-layer-eagle", "--enable-pdmux")


# ---------------------------------------------------------------- command construction
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


# ---------------------------------------------------------------- lossy or simulated
# What makes an SGLang EAGLE server accept drafts that its verify would not accept as a sample of the target,
# or not verify at all: tau then rises without a better draft, and 05 would credit the draft (issue 34).
# sglang 0.5.14 (speculative/eagle_utils.py verify, spec_utils.py, server_args.py): at topk 1 the sgl-kernel
# chain walk accepts draft d iff `coin <= prob_acc / threshold_acc || target_prob_single >= threshold_single`
# (prob_acc = p(d)), and on rejection samples from the target with d taken out, so only threshold_acc = 1 and
# threshold_single >= 1 commit d with probability p(d): another threshold_acc commits it with p(d) /
# threshold_acc, a threshold_single below 1 also whenever p(d) reaches it. `--speculative-use-rejection-
# sampling` verifies by min(1, p/q) with the draft's sampled q: a rule the agreement check does not model (and
# 0.5.14 refuses a draft vocabulary smaller than the target's). SGLANG_SIMULATE_ACC_LEN (> 0) replaces the
# verify's result by a simulated acceptance length (generate_simulated_accept_index: every committed token
# becomes id 100), drawn as SGLANG_SIMULATE_ACC_METHOD says. The info document (asdict(server_args) and each
# rank's internal state) reports the flags; it holds no environment variable.
SIMULATION_ENV = ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_SIMULATE_ACC_METHOD")
THRESHOLD_SINGLE, THRESHOLD_ACC = "speculative_accept_threshold_single", "speculative_accept_threshold_acc"
REJECTION_SAMPLING = "speculative_use_rejection_sampling"
# Every --speculative-* option string of sglang 0.5.14 (server_args.py fields and aliases): argparse takes
# an unambiguous prefix of one of them as that option, so a prefix of a lossy one alone sets it.
SPECULATIVE_OPTIONS = tuple("--" + f.replace("_", "-") for f in (
    "speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_draft_load_format", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_dflash_block_size", THRESHOLD_SINGLE, THRESHOLD_ACC,
    REJECTION_SAMPLING, "speculative_token_map", "speculative_attention_mode",
    "speculative_draft_attention_backend", "speculative_draft_window_size", "speculative_moe_runner_backend",
    "speculative_moe_a2a_backend", "speculative_draft_model_quantization", "speculative_skip_dp_mlp_sync",
    "speculative_adaptive", "speculative_adaptive_config", "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type", "speculative_ngram_max_trie_depth",
    "speculative_ngram_capacity", "speculative_ngram_external_corpus_path", "speculative_ngram_external_sam_budget",
    "speculative_ngram_external_corpus_max_tokens", "speculative_draft_model", "speculative_dflash_draft_window_size"))


def speculative_option(token: str) -> str | None:
    """The --speculative-* option string argparse reads `token` (`--name` or `--name=value`) as: itself, or the
    one option it is an unambiguous prefix of; None otherwise."""
    name = token.split("=", 1)[0]
    if name in SPECULATIVE_OPTIONS or not name.startswith("--spec"):
        return name if name in SPECULATIVE_OPTIONS else None
    hits = [o for o in SPECULATIVE_OPTIONS if o.startswith(name)]
    return hits[0] if len(hits) == 1 else None


def threshold_fault(field: str, value) -> str | None:
    """Why an accept threshold as set makes the verify lossy, else None."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return f"{field} {value!r} is not a number"
    if field == THRESHOLD_ACC and x != 1.0:
        return (f"{field} {x:g}: a draft d is committed with probability p(d) / {x:g}, not p(d), so the answers are "
                "not samples of the target")
    if field == THRESHOLD_SINGLE and x < 1.0:
        return f"{field} {x:g}: every draft whose p(d) reaches {x:g} is accepted, whatever the coin says"
    return None


def lossy_or_simulated(argv=(), env=None, info: dict | None = None) -> list[str]:
    """Why an SGLang server launched with `argv` and environment `env`, or reporting the info document `info`,
    verifies drafts lossily or simulates acceptance (the comment above); [] when it does neither. One reason a
    setting, each naming where it was read. 05b refuses such a server in any measurement (engine.refuse_lossy),
    and confirms with it that a server it launched to simulate acceptance is simulated (engine.confirm_simulated:
    simulation_reasons are the simulated part)."""
    return launch_line_lossy(argv) + simulation_reasons(argv, env, info) + info_lossy(info)


def launch_line_lossy(argv=()) -> list[str]:
    """lossy_or_simulated's reasons read from a launch line (argparse's forms; the last value wins)."""
    why, argv, values = [], list(argv), {}
    for i, token in enumerate(argv):
        option = speculative_option(token)
        field = option[2:].replace("-", "_") if option else None
        if field == REJECTION_SAMPLING:
            values[field] = True
        elif field in (THRESHOLD_SINGLE, THRESHOLD_ACC):  # argparse keeps the last value given
            values[field] = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else None)
    for field, value in values.items():
        bad = (REJECTION_SAMPLING_WHY if field == REJECTION_SAMPLING else threshold_fault(field, value))
        if bad:
            why.append(f"the launch line sets {bad}")
    return why


def simulation_reasons(argv=(), env=None, info: dict | None = None) -> list[str]:
    """lossy_or_simulated's reasons that say the server simulates acceptance: SIMULATION_ENV in the environment
    (the info document holds no environment variable)."""
    return [f"the environment sets {name}={env[name]} (SGLang simulates acceptance instead of verifying drafts: "
            "speculative/spec_utils.py)" for name in SIMULATION_ENV if env is not None and name in env]


def info_lossy(info: dict | None) -> list[str]:
    """lossy_or_simulated's reasons read from an info document: the server args and each rank's internal state."""
    why = []
    docs = [("the info document", info or {})] + [(f"internal_states[{i}]", st) for i, st in
                                                  enumerate((info or {}).get("internal_states") or [])
                                                  if isinstance(st, dict)]
    for where, doc in docs:
        for field in (THRESHOLD_SINGLE, THRESHOLD_ACC):
            bad = threshold_fault(field, doc[field]) if doc.get(field) is not None else None
            if bad:
                why.append(f"{where} reports {bad}")
        if doc.get(REJECTION_SAMPLING):
            why.append(f"{where} reports {REJECTION_SAMPLING_WHY}")
    return why


# How 05b makes SGLang simulate acceptance (05b --simulate-accept-lengths): SGLANG_SIMULATE_ACC_LEN = L > 0 makes
# every verify round commit L tokens (accepted drafts + the bonus; spec_utils.py generate_simulated_accept_index,
# called from eagle_utils.py eagle_sample, which the overlap worker eagle_worker_v2.py runs too), drawn per batch
# as SGLANG_SIMULATE_ACC_METHOD says: "match-expected" (0.5.14's default, environ.py) takes floor(L) or floor(L) + 1
# with the weights that make the mean L, clipped to [1, steps + 1]; "multinomial" rounds a normal around L, whose
# mean is not L. Every committed verify token becomes id 100 (`predict.fill_(100)`), so a simulated answer is its
# prefill token, then id 100 to the budget.
SIMULATE_METHOD = "match-expected"
SIMULATED_TOKEN = 100


def simulated_length(argv=(), env=None, info: dict | None = None) -> float | None:
    """The accept length an SGLang environment makes the server simulate (None: none, or a method whose mean is
    not the length asked for)."""
    env = env or {}
    try:
        length = float(env.get("SGLANG_SIMULATE_ACC_LEN", -1))
    except ValueError:
        return None
    method = env.get("SGLANG_SIMULATE_ACC_METHOD", SIMULATE_METHOD)
    return length if length > 0 and method == SIMULATE_METHOD else None


def simulation_env(setting) -> dict[str, str]:
    """The environment of a simulated setting's server (settings.simulated), {} for any other."""
    length = simulated_length_of(setting)
    return {} if length is None else {"SGLANG_SIMULATE_ACC_LEN": f"{length:g}",
                                      "SGLANG_SIMULATE_ACC_METHOD": SIMULATE_METHOD}


def check_simulated_answers(url: str, answers: list[dict]) -> None:
    """A server that simulates acceptance commits id 100 at every verified position (the comment above): refuse
    one whose warm-up answers show a real verify instead (its launch asked for the simulation)."""
    real = [r for r in answers if any(t != SIMULATED_TOKEN for t in (r.get("output_ids") or [])[1:])]
    if real:
        raise StageError(f"the SGLang server {url} was launched with SGLANG_SIMULATE_ACC_LEN, but {len(real)} of its "
                         f"{len(answers)} warm-up answers hold other tokens than id {SIMULATED_TOKEN} after the "
                         "first: it verified drafts for real (a release that reads the variable elsewhere?)")


REJECTION_SAMPLING_WHY = (f"{REJECTION_SAMPLING}: drafts are verified by min(1, p/q) with the draft's sampled q, a "
                          "rule 05 does not model (SGLang 0.5.14 also refuses a draft vocabulary smaller than the "
                          "target's)")


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


# Attention backends by the attention they serve (sglang 0.5.14 speculative/draft_utils.py: the draft takes
# --speculative-draft-attention-backend, else --decode-attention-backend, else --attention-backend). An MLA draft
# (Eagle3DeepseekV2ForCausalLM, configs/model_config.py: AttentionArch.MLA) runs on triton, flashinfer (their MLA
# variants), fa3 and the MLA kernels; an MHA draft (LlamaForCausalLMEagle3) on none of the MLA-only ones.
MLA_ONLY_BACKENDS = ("trtllm_mla", "flashmla", "cutedsl_mla", "tokenspeed_mla", "dsa", "nsa", "dsv4")
MHA_ONLY_BACKENDS = ("trtllm_mha",)


def draft_backend(draft_backend_flag: str | None, extra_args: list[str]) -> tuple[str | None, str]:
    """The attention backend SGLang gives the draft, and which flag says so (None: SGLang picks)."""
    if draft_backend_flag:
        return draft_backend_flag, "--sglang-draft-attention-backend"
    for flag in ("--decode-attention-backend", "--attention-backend"):
        value = flag_value(list(extra_args), flag)
        if value:
            return value, f"{flag} in --server-extra-args (the draft inherits it)"
    return None, ""


def check_draft_backend(where: str, draft_config: dict, backend: str | None, source: str) -> None:
    """Refuse a draft whose attention form the backend cannot run, before anything launches: an MHA draft next
    to an MLA-only backend fails to start (sgl-project/sglang issue 23490), an MLA draft on an MHA-only one."""
    mla = "Eagle3DeepseekV2ForCausalLM" in (draft_config.get("architectures") or [])
    wrong = MHA_ONLY_BACKENDS if mla else MLA_ONLY_BACKENDS
    if backend in wrong:
        form, other = ("MLA", "MHA") if mla else ("MHA", "MLA")
        raise StageError(f"{where} is an {form} draft, and its attention backend {backend!r} ({source}) runs {other} "
                         f"attention only: give --sglang-draft-attention-backend triton (both forms; the one that "
                         f"runs on SM120, docs/sglang.md)")


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


# ---------------------------------------------------------------- what the server says
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


def server_accept_length(info: dict) -> float | None:
    """Server-wide tau: internal_states[0].avg_spec_accept_length (absent before any verify, and until
    the first --decode-log-interval decode iterations after a counter reset)."""
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return None if value is None else float(value)


# ---------------------------------------------------------------- preflight
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
    refuse_lossy(where, lossy_or_simulated(info=info))
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
    """05 times every server with prefix caching off (sweep.py): refuse one whose radix cache is on."""
    if info.get("disable_radix_cache") is not True:
        raise StageError(f"the SGLang server {url} reports disable_radix_cache {info.get('disable_radix_cache')!r}: "
                         "05 times every server with prefix caching off, so that repeated passes over the same "
                         "prompts are fresh prefills on every server alike; start it with --disable-radix-cache")


def preflight(base_url: str, export_dir: Path, m02b: HiddenStatesManifest, m04: DraftManifest, warmup_fn,
              min_accept_length: float, target_dir: Path | None = None, draft: tuple[str, Path] | None = None,
              simulated: float | None = None) -> dict:
    """Run every check against a live server; returns a record for metrics.json.

    warmup_fn(base_url) -> per-request tau over a few short requests (common/serving/sweep.warmup); with
    `simulated` L (a server launched to simulate accept length L) -> the warm-up answers, which must commit L
    tokens a round (engine.check_simulated_tau) and hold id 100 after their first token (check_simulated_answers).
    `draft`: (name, folder) of a declared --draft the server must serve instead of 04's export; its files
    were checked against the target before launch (common/draft/imported.py), the manifests describe 04's.
    """
    name, folder = draft or (OURS, Path(export_dir))
    info = get_server_info(base_url)
    check_server_info(info, {name: folder}, target_dir, base_url)
    if name == OURS:
        check_draft_files(export_dir, m02b, m04)
    reset_accept_counters(base_url)  # so the server's average below is the warm-up's alone
    if simulated is not None:
        answers = warmup_fn(base_url)
        tau_requests = check_simulated_tau(f"the SGLang server {base_url}", simulated, answers,
                                           int(info["speculative_num_steps"]))
        check_simulated_answers(base_url, answers)
        tau_server = None
    else:
        tau_requests = warmup_fn(base_url)
        check_acceptance(tau_requests, min_accept_length, f"{base_url} warm-up (per-request)")
        tau_server = server_accept_length(get_server_info(base_url))
    if tau_server is not None:
        check_acceptance(tau_server, min_accept_length, f"{base_url} avg_spec_accept_length")
    backends = {"target": info.get("attention_backend"), "draft": info.get("speculative_draft_attention_backend")}
    print(f"[05b] preflight ok: EAGLE3, draft {name + ' ' if draft else ''}{folder}, warm-up tau {tau_requests:.2f} "
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
            "version": info.get("version"), **({"simulated_accept_length": simulated} if simulated else {})}


# ---------------------------------------------------------------- requests: POST /generate
def sglang_sampling(sampling: dict | None, max_new_tokens: int) -> dict:
    """SGLang's `sampling_params` of one request: every parameter pinned (request_params), the seed under
    its SGLang name."""
    p = pinned(sampling)
    return {"max_new_tokens": int(max_new_tokens), **{k: v for k, v in p.items() if k != "seed"},
            "sampling_seed": p["seed"]}


def generate_stream(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float,
                    role: str = "SGLang", sampling: dict | None = None) -> dict:
    """One request to SGLang's /generate, greedy or sampled with `sampling` = {temperature, top_p, seed}
    (request_params.pinned fills in the rest); returns {ttft_s, latency_s, completion_tokens,
    spec_verify_ct, accept_length, output_ids, retries} (output_ids None when no chunk carried any).

    The whole request is retried on connection refused/reset, a cut stream and transient 5xx
    (http.sse_request), and timed on its successful attempt alone; an error chunk or an aborted
    request stops with the server's own message, and a final chunk without its counts with one line
    naming the field (http.parse_answer).
    """
    url = base_url.rstrip("/") + "/generate"
    what = f"{role} server {base_url}: POST /generate"
    payload = {"input_ids": input_ids, "stream": True, "sampling_params": sglang_sampling(sampling, max_new_tokens)}
    got = sse_request(url, payload, timeout, what)
    last = got["chunks"][-1] if got["chunks"] else None
    if last is not None and "error" in last:
        err = last["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        raise StageError(f"{url} answered a {len(input_ids)}-token prompt with an error: {message}")
    if last is None:
        raise StageError(f"{url} streamed no chunk for a {len(input_ids)}-token prompt")
    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise StageError(f"{url} aborted a {len(input_ids)}-token prompt: {finish.get('message', finish)}")
    parse_answer(last, what, counts=("meta_info.completion_tokens",), optional=("meta_info.spec_verify_ct",))
    return {"ttft_s": got["ttft_s"], "latency_s": got["latency_s"], **parse_meta(last["meta_info"]),
            "output_ids": answer_ids(got["chunks"]), "retries": got["retries"]}


def answer_ids(chunks: list[dict]) -> list[int] | None:
    """The answer's token ids as streamed: the last chunk's when each chunk's ids extend the previous
    chunk's (SGLang's default), else all chunks' joined (--incremental-streaming-output); None when no
    chunk carried any. 05 checks completion_tokens against them (sweep.answer_fault)."""
    seen = [c["output_ids"] for c in chunks if isinstance(c.get("output_ids"), list)]
    if not seen:
        return None
    cumulative = all(b[:len(a)] == a for a, b in zip(seen, seen[1:]))
    return list(seen[-1]) if cumulative else [t for ids in seen for t in ids]


def parse_meta(meta: dict) -> dict:
    """completion_tokens, spec_verify_ct (None on a non-speculative server) and per-request tau."""
    n = int(meta["completion_tokens"])
    ct = meta.get("spec_verify_ct")
    ct = None if ct is None else int(ct)
    return {"completion_tokens": n, "spec_verify_ct": ct,
            "accept_length": (n / ct) if ct else None}


# ---------------------------------------------------------------- the engine
@dataclass
class SGLangEngine(Engine):
    """engine.Engine over SGLang servers, built from this module's functions (a method named like one of them
    calls it); registry.ENGINES names it "sglang"."""
    target_dir: Path
    export_dir: Path
    m02b: HiddenStatesManifest
    m04: DraftManifest
    tp_size: int = 1
    mem_fraction: float = 0.85
    python: str = "python"
    extra_args: list[str] = field(default_factory=list)
    min_accept_length: float = 1.3
    draft_attention_backend: str | None = None
    foreign: list[ServedDraft] = field(default_factory=list)  # the declared --draft ones
    name = "sglang"
    label = "SGLang"
    server_tau_slop = 39  # its counters are folded in every 40 decode iterations (server_tau_note)
    server_tau_note = ("server tau = `internal_states[0].avg_spec_accept_length` after POST /set_internal_state reset "
                       "its lifetime counters right before this run. The reset does not clear SGLang's per-interval "
                       "counters, which it folds into the lifetime ones every 40 decode iterations "
                       "(--decode-log-interval): the number may include up to 39 decode iterations from before the run "
                       "and miss up to 39 of its last ones (sglang 0.5.14 and 0.5.23 scheduler metrics). Per-request tau "
                       "is exact. '-' = not available. CUDA-graph mode as the server reports it "
                       "(`cuda_graph_config.decode.backend`).")
    simulates = (f"the environment SGLANG_SIMULATE_ACC_LEN=L, SGLANG_SIMULATE_ACC_METHOD={SIMULATE_METHOD} "
                 "(speculative/spec_utils.py; every verified token becomes id 100)")
    # prefix caching off (repeated timed passes are fresh prefills; a deployment keeps its cache) and the test
    # box's host/port (a deployment picks its own)
    measurement_flags = {"--host": 1, "--port": 1, "--disable-radix-cache": 0}

    @classmethod
    def add_flags(cls, group):
        group.add_argument("--sglang-tp-size", type=int, default=1, help="SGLang tensor-parallel size (GPUs)")
        group.add_argument("--mem-fraction-static", type=float, default=0.85,
                           help="SGLang mem_fraction_static: share of GPU memory for weights + KV pool (0-1)")
        group.add_argument("--sglang-draft-attention-backend", default=None,
                           help="the draft's attention backend (--speculative-draft-attention-backend); unset, the "
                                "draft inherits the target's: an MHA draft fails next to an MLA-only one such as "
                                "trtllm_mla. A backend of the other attention form than the draft's is refused before "
                                "launching")
        group.add_argument("--sglang-python", default=sys.executable, help="python that has sglang installed")

    @classmethod
    def from_args(cls, args, export_dir, m02b, m04, target_dir, work_dir, foreign):
        return cls(target_dir, export_dir, m02b, m04, tp_size=args.sglang_tp_size,
                   mem_fraction=args.mem_fraction_static, python=args.sglang_python,
                   extra_args=list(args.server_extra_args), min_accept_length=args.min_accept_length,
                   draft_attention_backend=args.sglang_draft_attention_backend, foreign=list(foreign))

    @classmethod
    def target_server(cls, target, port, python, served_name, context_length, memory_share):
        extra = ["--served-model-name", served_name, "--context-length", str(context_length)]
        return server_command(target, port, 1, memory_share, True, python=python, extra_args=extra), {}

    def __post_init__(self):
        backend, source = draft_backend(self.draft_attention_backend, self.extra_args)
        if backend is None:
            return
        for where, folder in [("04's export", self.export_dir)] + [(f"--draft {d.name}", d.path) for d in self.foreign]:
            config = Path(folder or "") / "config.json"
            if folder is not None and config.is_file():
                check_draft_backend(f"{where} ({folder})", json.loads(config.read_text()), backend, source)

    @classmethod
    def refuse_unservable(cls, where, draft, points, default):
        """SGLang loads its own layouts only (`LlamaForCausalLMEagle3`, `Eagle3DeepseekV2ForCausalLM`) and reads
        the capture points from `eagle_config.eagle_aux_hidden_state_layer_ids` (`default` without them)."""
        if draft.layout != "sglang":
            raise StageError(f"{where} loads EAGLE-3 drafts in its own layouts (LlamaForCausalLMEagle3, "
                             f"Eagle3DeepseekV2ForCausalLM) only, this one is in the {draft.layout} layout: give "
                             "the draft's SGLang-layout folder")
        if draft.sglang_ids is None and list(points) != default:
            raise StageError(f"{where} would feed it h{default} (no eagle_config.eagle_aux_hidden_state_layer_ids: "
                             f"its default), but it reads h{list(points)}: add eagle_config's ids to its config.json")

    @staticmethod
    def lossy(argv=(), env=None, info=None):
        return lossy_or_simulated(argv, env, info)

    @staticmethod
    def simulation_reasons(argv=(), env=None, info=None):
        return simulation_reasons(argv, env, info)

    @staticmethod
    def simulated_length(argv=(), env=None, info=None):
        return simulated_length(argv, env, info)

    @staticmethod
    def setting_note(log):
        return adaptive_disabled_line(log)

    def parse_setting(self, text):
        setting = parse_spec_setting(text)
        if is_block(setting):
            raise StageError(f"--spec-settings {text!r}: block verification is vLLM's (rejection_sample_method "
                             "'block'); SGLang 0.5.14 verifies token by token")
        return setting

    @staticmethod
    def check_launch_line(argv):
        at = [j for j, a in enumerate(argv) if a == "--speculative-algorithm"]
        if len(at) != 1 or argv[at[0] + 1:at[0] + 2] != ["EAGLE3"]:
            raise ValueError(f"not an EAGLE3 launch line: {shlex.join(argv)}")

    def command(self, port, graph, setting, draft=None):
        folder = (draft or self.drafts[0]).path if setting else None
        cmd = server_command(self.target_dir, port, self.tp_size, self.mem_fraction, graph,
                             folder, setting, self.python, self.extra_args,
                             self.draft_attention_backend, target_quantization(self.target_dir) is not None,
                             prefix_cache=False)
        return cmd, simulation_env(setting)

    def context_length(self):
        # --context-length may come in --server-extra-args; without it SGLang derives it from the target's config
        given = flag_value(list(self.extra_args), "--context-length")
        if given is not None:
            return int(given), "--context-length in --server-extra-args"
        return (derived_context_length(self.target_dir),
                f"SGLang's default, derived from {Path(self.target_dir) / 'config.json'}; --server-extra-args "
                "'--context-length N' sets it")

    def check_baseline(self, url):
        info = get_server_info(url)
        check_baseline_info(info, self.target_dir, url)
        check_radix_cache_off(info, url)
        return cuda_graph_on(info)

    def check_eagle3(self, url, drafts=None, simulated=None):
        """`simulated` L: its info document holds no environment, so nothing says it simulates but the launch
        (confirmed before it started: sweep.refuse_lossy_launches) and its warm-up answers (preflight)."""
        drafts = drafts or self.drafts
        info = get_server_info(url)
        check_server_info(info, {d.name: d.path for d in drafts}, self.target_dir, url)
        check_radix_cache_off(info, url)
        setting = spec_settings_of(info, f"the EAGLE3 server {url}'s info document")
        return (cuda_graph_on(info), setting if simulated is None else simulated_setting(setting, simulated),
                self.identify(info.get("speculative_draft_model_path"), drafts))

    def preflight(self, url, log, warmup_fn, draft=None, simulated=None):
        other = None if draft is None or draft.ours else (draft.name, draft.path)
        return preflight(url, self.export_dir, self.m02b, self.m04, min_accept_length=self.min_accept_length,
                         target_dir=self.target_dir, warmup_fn=warmup_fn, draft=other, simulated=simulated)

    @property
    def draft_dir(self) -> Path:  # SGLang always loads 04's SGLang export
        return self.export_dir

    def request(self, url, ids, max_new_tokens, timeout, sampling=None, logprobs=None):
        return generate_stream(url, ids, max_new_tokens, timeout, sampling=sampling)   # engine_probabilities: none

    def sampling_defaults(self, url, log):
        # ServerArgs fields of newer releases (`--sampling-defaults`, `--preferred-sampling-params`), when present
        info = get_server_info(url)
        return {k: info[k] for k in ("sampling_defaults", "preferred_sampling_params") if k in info}

    def window_start(self, url):
        return reset_accept_counters(url)

    def window_end(self, url, start):
        return {"server_accept_length": server_accept_length(get_server_info(url)) if start else None}
