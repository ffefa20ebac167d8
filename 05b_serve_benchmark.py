"""Serve the exported EAGLE-3 draft: tok/s against a baseline server, what to deploy, agreement with replay.

Reads:  <work-dir>/04_draft/export_sglang/ (vLLM, --draft-format speculators: export_speculators/)
        (+ 04_draft/manifest.json), <work-dir>/01c_merged/benchmark_prompts.jsonl (+ manifest.json),
        <work-dir>/02b_hidden_states/manifest.json, the target from the manifests; every --draft NAME=PATH
        (an EAGLE-3 folder the engine loads); optional: <work-dir>/05_benchmark/reference/{metrics.json,
        manifest.json} when 05 measured this draft
Writes: <work-dir>/05_benchmark/server/{metrics.json,report.md,tokens_per_s.png,accept_length.png,
        commands.json,server_logs/,agreement/,manifest.json} (+ breakeven_map.png, breakeven_curves.png with
        --simulate-accept-lengths)
        Without 04 (no 04_draft/manifest.json) and with --draft: 01c alone, the declared drafts served alone (the
        break-even map before training, train_plan_v4.md step 2b)
Real:   python 05b_serve_benchmark.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3
Tiny:   python 05b_serve_benchmark.py --config configs/smollm2.yaml --work-dir runs/smollm2
            (vLLM's CPU build serves SmolLM2 here: `make engine`, then `make bench-serve`)

A baseline and, per draft (04's, every --draft) and --spec-settings, an EAGLE-3 server of --engine (SGLang,
vLLM; docs/sglang.md, docs/serving.md), preflighted (EAGLE3 / eagle3, its draft, target, aux layers,
warm-up tau), 04's checked against replay (--agreement-prompts), all warmed up alike on never-timed
prompts, prefix caching off; tok/s, TTFT, tau and the ratio to the baseline (interval over --bench-repeats
passes) per draft, temperature, prompt length and concurrency; what to deploy (common/serving/deploy.py),
its cost model fed 05's per-depth tau when 05 measured this draft (recorded in the manifest's inputs). With
--simulate-accept-lengths, the break-even map: each engine made to commit chosen accept lengths a verify round with
a draft of the right shape, the break-even tau per engine, setting and cell (common/serving/breakeven.py), its runs
kept out of every measured number.
"""
from __future__ import annotations

import sys
from pathlib import Path

from common.benchmark.inputs import (Repeated, add_benchmark_flags, check_shared_flags, drafts_identity, given_mode,
                                     load_inputs, load_inputs_without_04, target_and_drafts)
from common.draft.manifest import DraftManifest
from common.config import base_parser, parse_args
from common.io import read_json
from common.serving.context import parse_buckets
from common.serving import deploy, registry, report
from common.serving.registry import check_servable
from common.serving.breakeven import check_lengths
from common.serving.sweep import every_run_refused, same_draft_reference, server_main, sweep_plan, warm_count
from common.stage import (EXTRACT, MERGE, SERVE_BENCH, StageError, TRAIN, input_manifests, is_complete, stage_dir,
                          start_stage, write_manifest)
from common.target.manifests import HiddenStatesManifest

STAGE = SERVE_BENCH


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("benchmark")
    add_benchmark_flags(
        g, draft="another EAGLE-3 draft folder (a public Kimi draft, SpecForge output, an earlier 04 export) served "
                 "at every setting next to 04's, against the same baseline (SGLang loads the SGLang layout only); "
                 "repeatable; a preset gives a list of NAME=PATH strings",
        num_prompts="timed held-out prompts, taken in turn from each source (default: all but the warm-up ones)",
        bench_seed="seed of every sampled request (per prompt: common/serving/request_params.py) and of the "
                   "sampled agreement check's replay",
        acceptance_temperatures="the serving temperatures: every run is timed greedily and at each T > 0 of these, "
                                "with --acceptance-top-p (docs/design.md section 11); vllm: the agreement check "
                                "also sends sampled requests at each T > 0. Not 01b's --temperature, which is the "
                                "generation temperature")
    s = p.add_argument_group("servers (SGLang or vLLM; docs/sglang.md, docs/serving.md)")
    s.add_argument("--engine", choices=registry.ENGINES, default="sglang",
                   help="serving engine: sglang (the GPU box) or vllm (its CPU build serves the CPU worlds)")
    s.add_argument("--agreement-prompts", type=int, default=0,
                   help="the first N warm-up prompts answered one at a time on every EAGLE-3 server of 04's draft "
                        "(fixed chains), greedy and at each T > 0, and their rounds compared with replay of the same "
                        "draft on the same tokens: vLLM's per-round counts, SGLang's verify counts against the "
                        "rounds its answers give (0: off; the target is loaded in float32 on this machine, refused "
                        "before any launch when it cannot be; --draft ones are not checked)")
    s.add_argument("--agreement-tolerance", type=float, default=0.0,
                   help="largest relative tau difference the agreement check allows, greedy and sampled, and the "
                        "relative band on p(d) its probability gate allows (0: every round equal, as float32 "
                        "gives; a bf16 engine needs a few percent)")
    s.add_argument("--spec-settings", nargs="+", default=["3,1,4", "5,1,6", "7,1,8"],
                   help="EAGLE3 settings 'steps,topk,num_draft_tokens' to sweep (topk > 1 = tree); "
                        "'steps,1,steps+1,adaptive' = SGLang's --speculative-adaptive from that chain")
    s.add_argument("--bench-concurrency", type=int, nargs="+", default=[1, 8],
                   help="concurrent requests per run (batch 1 is always included)")
    s.add_argument("--bench-context", nargs="+", default=["short"], metavar="short|TOKENS",
                   help="prompt-length buckets every (setting, T, concurrency) is timed on: short = the held-out "
                        "prompts as they are; a length L = held-out prompts of about L tokens (0.9 L to L): the "
                        "split's longest as they stand, else padded with earlier held-out conversations as prior "
                        "turns in the target's chat format (common/serving/context.py); short is always timed")
    s.add_argument("--bench-context-prompts", type=int, default=None,
                   help="timed prompts of each --bench-context length bucket (default: as many as the short "
                        "bucket's, --num-prompts)")
    s.add_argument("--bench-repeats", type=int, default=2,
                   help="timed passes of every (setting, temperature, concurrency): the ratio to the baseline gets "
                        "a 95%% interval over the paired passes (2: a wide one; 1: none, nothing decided)")
    s.add_argument("--instant-temperature", type=float, default=None,
                   help="the temperature thinking-off prompts are sampled at, at every serving temperature "
                        "above 0 (a model's own instant-mode temperature; unset: the level's)")
    s.add_argument("--cuda-graph", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="CUDA-graph modes to run every server in")
    s.add_argument("--baseline-url", default=None,
                   help="attach to this running baseline server instead (alone: the EAGLE-3 settings are "
                        "launched next to it, in its graph mode)")
    s.add_argument("--eagle3-url", default=None, help="attach to this running EAGLE3 server instead")
    s.add_argument("--baseline-port", type=int, default=30010, help="port of launched baseline servers")
    s.add_argument("--eagle3-port", type=int, default=30020, help="port of launched EAGLE3 servers")
    s.add_argument("--server-extra-args", default="", help="extra launch_server arguments (one string)")
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
    registry.add_engine_flags(p)   # each engine declares its own (Engine.add_flags), in its own group
    add_map_flags(p)
    return p


def add_map_flags(p) -> None:
    """The break-even map's flags (common/serving/breakeven.py)."""
    b = p.add_argument_group("the break-even map (simulated acceptance; common/serving/breakeven.py, docs/serving.md)")
    b.add_argument("--simulate-accept-lengths", type=float, nargs="+", default=[], metavar="L",
                   help="tokens a verify round commits (the bonus included), e.g. 1.5 2 2.5 3 3.5: one simulated "
                        "server per length and --simulate-settings chain, timed at the serving temperature on every "
                        "prompt bucket and concurrency against the baseline; the report gives the break-even tau per "
                        "cell (x1.0, x1.2, x1.5) with intervals, breakeven_map.png; never a draft's measurement")
    b.add_argument("--simulate-settings", nargs="+", default=None, metavar="STEPS,1,STEPS+1",
                   help="the chains the map simulates (default: the chains of --spec-settings)")
    b.add_argument("--simulate-draft", default=None, metavar="NAME",
                   help="the draft whose shape the simulated servers serve: 04 (default when 04 ran) or a --draft NAME")
    b.add_argument("--map-engines", nargs="+", choices=registry.ENGINES, default=[],
                   help="more engines to draw the map on (their own baseline and simulated servers, the same plan), "
                        "for the best engine per cell: e.g. --engine sglang --map-engines vllm on the box")
    b.add_argument("--known-tau", nargs="+", action=Repeated, default=[], metavar="NAME=TAU",
                   help="a draft's tau per verify round from elsewhere (NAME=TAU, or NAME@K=TAU for one k), marked on "
                        "the map: e.g. public@3=2.69 (a model card's)")


def refuse_mode(argv: list[str]) -> None:
    """An old `05_benchmark.py --mode server` line given this script's name: say what to drop."""
    if given_mode(argv) is not None:
        raise StageError("--mode: 05b_serve_benchmark.py is the serving benchmark (05's old --mode server); drop "
                         "--mode")


def check_flags(args) -> None:
    """05b's own flags, a preset's YAML scalar made a list, checked before anything is read."""
    check_shared_flags(args)
    if args.bench_repeats < 1 or (args.instant_temperature is not None and args.instant_temperature <= 0):
        raise StageError("--bench-repeats must be >= 1 and --instant-temperature > 0")
    if not isinstance(args.bench_context, list):  # a YAML scalar instead of a list
        args.bench_context = [args.bench_context]
    parse_buckets(args.bench_context)  # a bucket that is neither short nor a length stops 05b before it writes
    if args.bench_context_prompts is not None and args.bench_context_prompts < 1:
        raise StageError("--bench-context-prompts must be >= 1")
    check_lengths(args.simulate_accept_lengths)
    if args.simulate_accept_lengths and args.eagle3_url:
        raise StageError("--simulate-accept-lengths launches its simulated servers itself: drop --eagle3-url (an "
                         "attached server cannot be confirmed to simulate what 05b asks)")
    if (args.map_engines or args.simulate_settings or args.simulate_draft or args.known_tau) \
            and not args.simulate_accept_lengths:
        raise StageError("--map-engines, --simulate-settings, --simulate-draft and --known-tau draw the break-even map: "
                         "give --simulate-accept-lengths too")
    args.map_engines = [e for e in dict.fromkeys(args.map_engines) if e != args.engine]


def main(argv=None):
    refuse_mode(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(build_parser(), argv)
    check_flags(args)
    plan = sweep_plan(args)
    out = stage_dir(args.work_dir, STAGE)
    trained = is_complete(stage_dir(args.work_dir, TRAIN)) or not args.draft   # without 04: the declared drafts
    inputs = (load_inputs if trained else load_inputs_without_04)(args.work_dir, args.num_prompts, warm_count(plan))
    hidden = stage_dir(args.work_dir, EXTRACT)
    m02b = HiddenStatesManifest.require(hidden) if trained else HiddenStatesManifest.from_dict({})
    target_dir, checked = target_and_drafts(args, inputs.m04, inputs.m01c)
    # a draft the engine cannot serve as checked stops 05b before any server launches
    served = check_servable(args.engine, checked, target_dir, inputs.export_dir)
    map_served = {name: check_servable(name, checked, target_dir, inputs.export_dir) for name in args.map_engines}
    reference = same_draft_reference(args.work_dir) if trained else None
    if not trained:
        print(f"[05b] no 04 in {args.work_dir}: serving the declared drafts alone ({', '.join(checked)}), "
              f"target {target_dir}")
    if not start_stage(out, args.overwrite, STAGE):
        return
    metrics = server_main(args, plan, out, inputs, m02b, target_dir, served,
                          read_json(reference / "metrics.json") if reference else None, map_served)
    report.write_report(out, metrics)
    report.plot(out, metrics)
    if deploy.nothing_measured(metrics["deploy"]) or every_run_refused(metrics):
        raise StageError(f"every timed run was refused, so nothing valid was measured (why: {out / 'report.md'}); "
                         "no manifest written: fix the server and run 05b again")
    write_05b_manifest(args, out, inputs, metrics, checked, reference, trained)
    print(f"[05b] wrote {out}")


def write_05b_manifest(args, out: Path, inputs, metrics: dict, checked: dict, reference, trained: bool) -> None:
    """05b's manifest: its inputs (04, 01c, 02b and 05's when they were read), counts, the preflight, the measured
    runs, the agreement, and the break-even map's runs and verdicts, each marked simulated."""
    upstream = ([stage_dir(args.work_dir, TRAIN), stage_dir(args.work_dir, MERGE), stage_dir(args.work_dir, EXTRACT)]
                if trained else [stage_dir(args.work_dir, MERGE)])
    ident = inputs.m04 if trained else DraftManifest.from_dict(inputs.m01c)
    write_manifest(out, STAGE, args, tokenizer=ident.tokenizer, target=ident.target,
                   inputs=input_manifests(args.work_dir, *upstream, *([reference] if reference else [])),
                   counts={"num_prompts": len(inputs.rows), "num_warmup_prompts": len(inputs.warm),
                           **{f"num_prompts_context_{b}": rec["num_prompts"]
                              for b, rec in metrics["context_buckets"].items() if b != "short"}},
                   preflight=metrics["preflight"],
                   runs=list(metrics["runs"]), engine=args.engine,
                   **({"drafts": drafts_identity(checked)} if checked else {}),
                   **({"map": map_record(metrics["map"])} if "map" in metrics else {}),
                   agreement={key: {"exact": a["exact"], "engine_tau": a["engine"]["tau"],
                                    "replay_tau": a["replay"]["tau"]} if a.get("judged", True) else
                              {"judged": False, "why": a["why"]} for key, a in metrics["agreement"].items()})


def map_record(m: dict) -> dict:
    """The manifest's record of the break-even map: simulated, by engine its runs, and each cell's break-even tau."""
    return {"simulated": True, "lengths": m["lengths"], "temperature": m["temperature"],
            "runs": {name: list(b["runs"]) for name, b in m["engines"].items()},
            "break_even": [{k: row[k] for k in ("engine", "cuda_graph", "setting", "context", "concurrency", "verdict")}
                           | {"tau": (row["fit"] or {}).get("break_even")} for row in m["breakeven"]["rows"]]}


if __name__ == "__main__":
    main()
