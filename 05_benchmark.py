"""Benchmark the exported EAGLE-3 draft: acceptance length (tau), speed, and losslessness.

Reads:  <work-dir>/04_draft/export_sglang/{config.json,model.safetensors} (+ 04_draft/manifest.json),
        <work-dir>/01c_merged/benchmark_prompts.jsonl (+ manifest.json), the target from the manifests;
        every --draft NAME=PATH (an EAGLE-3 folder, SGLang or speculators layout)
Writes: <work-dir>/05_benchmark/reference/{metrics.json,report.md,acceptance.png,tau_by_position.png,
        manifest.json}
Real:   python 05_benchmark.py --config configs/smollm2.yaml --work-dir runs/smollm2
            (Kimi-K2.5 does not fit one device in float32: it is measured served, by 05b_serve_benchmark.py)
Tiny:   python 05_benchmark.py --config configs/tiny.yaml --work-dir runs/tiny

The HF target and the draft loaded from the SGLang export as an engine does (common/benchmark/reference.py);
tau by replay against the target's greedy continuation (exact), and under sampling at
--acceptance-temperatures (common/benchmark/sampled.py; the target's sampled answers drawn in batches of
--sample-batch-size), with 95% bootstrap intervals, split by segment,
output position and source (common/benchmark/segments.py); real speculative decoding on --loop-prompts
prompts must equal target-only decoding and its statistics the replay's. Float32; a target too large for
this machine is refused. Each --draft is checked against the target before anything is written and
replayed next to 04's on the same prompts: tau per k and temperature with paired intervals (compare.py).
The serving benchmark (engines, the sweep, what to deploy) is 05b_serve_benchmark.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.benchmark import compare as cmp
from common.benchmark import reference as rb
from common.benchmark import sampled as smp
from common.benchmark.formatting import fmt, fmt_ci
from common.benchmark.inputs import (add_benchmark_flags, check_shared_flags, drafts_identity, given_mode,
                                     load_inputs, target_and_drafts)
from common.benchmark.segments import plot_tau_by_position
from common.benchmark.spec_decode import LosslessError
from common.config import base_parser, parse_args
from common.draft.export_sglang import load_sglang_export
from common.draft.manifest import DraftManifest
from common.draft.model import Eagle3DraftModel
from common.generation.hf_engine import hf_generator
from common.generation.response_cache import ResponseCache, cache_identity
from common.io import read_json, write_json
from common.stage import BENCH, MERGE, StageError, TRAIN, input_manifests, stage_dir, start_stage, write_manifest
from common.target import head as target_head
from common.target.capture import load_target_config, target_dims, validate_capture_points
from common.text.target_format import load_target_format
from common.text.tokenizer import load_tokenizer

STAGE = BENCH


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("benchmark")
    g.add_argument("--num-draft-tokens", type=int, nargs="+", default=[5],
                   help="tokens k the draft proposes per verify round (several values = a sweep); "
                        "SGLang topk 1: --speculative-num-steps k, --speculative-num-draft-tokens k+1")
    add_benchmark_flags(
        g, draft="another EAGLE-3 draft folder (SGLang or speculators layout: a public Kimi draft, SpecForge output, "
                 "an earlier 04 export) replayed next to 04's on the same prompts; repeatable; a preset gives a list "
                 "of NAME=PATH strings (05b_serve_benchmark.py serves them instead)",
        num_prompts="use N held-out prompts, taken in turn from each source (default: all)",
        bench_seed="seed of the untrained contrast draft's init, the bootstrap intervals and the sampled "
                   "continuations / loops (per prompt: common/benchmark/sampled.py prompt_seed)",
        acceptance_temperatures="sampling temperatures tau is measured at, side by side (0 = greedy, the exact "
                                "replay; T > 0: the target samples at T and --acceptance-top-p, docs/design.md "
                                "section 11). Not 01b's --temperature, which is the generation temperature")
    g.add_argument("--acceptance-rule", choices=("engine", "textbook"), default="engine",
                   help="T > 0: engine = the draft proposes its argmax, accepted w.p. p(d) (vLLM 0.32, SGLang "
                        "0.5.14 defaults); textbook = the draft samples from q at T, accepted w.p. min(1, p/q)")
    g.add_argument("--sample-batch-size", type=int, default=smp.DEFAULT_SAMPLE_BATCH_SIZE,
                   help="T > 0: prompts whose sampled target answers are drawn together in one left-padded batch "
                        "(each with its own seeded generator, so the answers do not depend on it; the speed "
                        "does: benchmarks/bench_batch_sampling.py, README)")
    g.add_argument("--acceptance-loop-prompts", type=int, default=None,
                   help="T > 0: prompts (the first N) that run the real sampled loop, compared with the sampled "
                        "replay (default: --loop-prompts; 0: replay only)")
    g.add_argument("--loop-prompts", type=int, default=None,
                   help="prompts (the first N) that also run the step-by-step loop for the lossless check and the "
                        "speed ratio (default: all; 0: replay only)")
    g.add_argument("--loop-untrained", action="store_true",
                   help="run the untrained draft through the loop too (it costs a target-only decode per prompt "
                        "and k; its tau comes from replay anyway)")
    g.add_argument("--replay-cache-dir", type=Path, default=Path("build/replay_cache"),
                   help="where the target's greedy answers are cached (keyed by its weights)")
    g.add_argument("--response-cache", type=Path, default=None,
                   help="a response cache file (01b --response-cache) whose greedy answers to the benchmark "
                        "prompts, when it has them for this target, stand in for generating them")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where target and draft run (default: cuda if available)")
    g.add_argument("--benchmark-workers", type=int, default=1,
                   help="CPU: processes of one thread each for the per-prompt work (the target features, the "
                        "sampled answers by batch, the sampled replay and the sampled loop; common/parallel.py); the "
                        "greedy loop that times speed stays in one. The numbers equal one process's at "
                        "--cpu-threads 1")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads on CPU (threads); batch-1 decoding of a small model is "
                        "latency-bound and extra threads mostly add synchronisation")
    return p


def read_capture_points(export_cfg: dict, m04: DraftManifest, num_hidden_layers: int) -> list[int]:
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
    if m04.capture_points is not None and list(m04.capture_points) != points:
        raise StageError(f"04 manifest trained on capture points {list(m04.capture_points)} but the export "
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
    untrained = Eagle3DraftModel(trained.config)   # the same form (MHA or MLA, EAGLE-3.1 options) and shape
    untrained.embed_tokens.weight.data.copy_(embed.cpu())
    untrained.set_vocab_mapping(trained.d2t.cpu(), trained.t2d.cpu())
    return target, trained, untrained.to(device).eval()


def check_fits(target_dir: Path, device: str) -> None:
    """Refuse a target whose float32 weights cannot fit this machine (Kimi-K2.5: ~1T parameters):
    05 loads the whole model with transformers; SGLang serves it (05b_serve_benchmark.py)."""
    need = 4 * target_head.estimate_num_parameters(target_head.read_target_text_config(target_dir))
    if device == "cuda":
        have, where = torch.cuda.get_device_properties(0).total_memory, "GPU 0"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    if need > 0.9 * have:
        raise StageError(f"05 loads the target in float32 on one device: ~{need / 2**30:,.0f} GiB for "
                         f"{target_dir}, more than {where} ({have / 2**30:,.0f} GiB). Measure this target "
                         "with 05b_serve_benchmark.py (SGLang), which serves it sharded and quantized as in production")


def known_answers(args, target_dir: Path, tok, text_format):
    """row -> the target's greedy answer ids from --response-cache, or None (a miss); None without one."""
    if args.response_cache is None:
        return None
    # 05 decodes in float32 like 01b's hf engine on CPU: the same greedy answers.
    identity = cache_identity(target_dir, text_format, hf_generator("cpu"))
    cache = ResponseCache.load(args.response_cache, identity, tok)
    if cache.mismatch:
        print(f"[05] --response-cache {args.response_cache} was made for another target ({', '.join(cache.mismatch)} "
              "differ): the greedy answers are generated")

    def lookup(row):
        hit = cache.lookup(row["prompt"], args.benchmark_max_new_tokens) if "prompt" in row else None
        return None if hit is None else list(hit["completion_ids"])
    return lookup


def refuse_mode(argv: list[str]) -> None:
    """05 had a --mode until its serving half became 05b: an old command line stops with the script to run
    instead of argparse's "unrecognized arguments"."""
    mode = given_mode(argv)
    if mode == "server":
        raise StageError("--mode server: the serving benchmark is now its own stage, `python 05b_serve_benchmark.py` "
                         "(the same flags without --mode; it writes 05_benchmark/server/ as before)")
    if mode is not None:
        raise StageError(f"--mode {mode}: 05_benchmark.py is the reference benchmark alone now; drop --mode "
                         "(the serving benchmark is 05b_serve_benchmark.py)")


def main(argv=None):
    refuse_mode(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(build_parser(), argv)
    if isinstance(args.num_draft_tokens, int):  # a YAML scalar instead of a list
        args.num_draft_tokens = [args.num_draft_tokens]
    if any(k < 1 for k in args.num_draft_tokens):
        raise StageError("--num-draft-tokens must be >= 1")
    if args.sample_batch_size < 1 or args.benchmark_workers < 1:
        raise StageError("--sample-batch-size and --benchmark-workers must be >= 1")
    check_shared_flags(args)
    out = stage_dir(args.work_dir, STAGE)
    export_dir, m04, rows, _, _, _ = load_inputs(args.work_dir, args.num_prompts)
    target_dir, checked = target_and_drafts(args, m04)
    if not start_stage(out, args.overwrite, STAGE):
        return
    dims = target_dims(load_target_config(target_dir))
    export_cfg = read_json(export_dir / "config.json")
    points = read_capture_points(export_cfg, m04, dims["num_hidden_layers"])
    bad = [r["id"] for r in rows if not r["prompt_ids"] or max(r["prompt_ids"]) >= dims["vocab_size"]]
    if bad:
        raise StageError(f"benchmark prompts {bad[:3]} are empty or hold ids outside the target vocab")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_fits(target_dir, device)
    if args.benchmark_workers > 1 and device != "cpu":
        raise StageError("--benchmark-workers forks CPU processes (CUDA does not survive a fork): drop it on a "
                         "GPU")
    if device == "cpu":
        # Measured on the 2-core dev box under load, tiny target (H 128, 8 layers): 12 ms/token with
        # 1 thread vs 180 ms/token with 2 (spin-waiting threads fight the other processes).
        torch.set_num_threads(args.cpu_threads)
    print(f"[05] target {target_dir}: N={dims['num_hidden_layers']}, H={dims['hidden_size']}, vocab "
          f"{dims['vocab_size']}; draft {export_dir} (draft vocab {export_cfg['draft_vocab_size']}); "
          f"capture points {points}; {len(rows)} prompts (loop on {'all' if args.loop_prompts is None else args.loop_prompts}); "
          f"k {args.num_draft_tokens}; max {args.benchmark_max_new_tokens} new tokens; {device}")
    target, trained, untrained = load_models(target_dir, export_dir, device, args.bench_seed)
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
    write_manifest(out, STAGE, args, tokenizer=m04.tokenizer, target=m04.target,
                   inputs=input_manifests(args.work_dir, stage_dir(args.work_dir, TRAIN),
                                          stage_dir(args.work_dir, MERGE)),
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
