"""Benchmark the exported EAGLE-3 draft: acceptance length (tau), speed, and losslessness.

Mode `reference`: real greedy speculative decoding in transformers (common/draft/spec_decode.py) with the
HF target and the draft loaded from the SGLang export exactly as an engine does (the draft gets the
target's embedding; d2t maps draft ids to target ids; aux states come from the capture points in the
export config). For each k in --num-draft-tokens, on the held-out prompts, it measures tau (accepted
drafts + 1 bonus per verify round, SGLang's definition), per-position acceptance, the histogram of
accepted lengths, speculative vs target-only tokens/s (interleaved per prompt, same run), and the tau
of an untrained draft of the same shape (seeded) for contrast. Every speculative output must equal
target-only greedy decoding; otherwise the differences go to mismatches.json and the run raises.
Float32 throughout: a reference measures acceptance, not engine speed.
Mode `server` (common/sglang/bench.py, docs/sglang.md): launches (or attaches to) a baseline and EAGLE3
SGLang servers per --spec-settings and --cuda-graph mode, preflights each EAGLE3 server (EAGLE3, 04's
draft, draft config vs manifests, warm-up tau above chance), then reports output tok/s, TTFT, tau and
the ratio to the baseline at each --bench-concurrency.

Reads:  <work-dir>/04_draft/export_sglang/{config.json,model.safetensors} (+ 04_draft/manifest.json),
        <work-dir>/01c_merged/benchmark_prompts.jsonl (+ manifest.json), the target from the manifests
Writes: <work-dir>/05_benchmark/reference/{metrics.json,report.md,acceptance.png,manifest.json}
        <work-dir>/05_benchmark/server/{metrics.json,report.md,tokens_per_s.png,accept_length.png,
        commands.json,server_logs/,manifest.json} (server mode; also reads 02b_hidden_states/manifest.json)
Real:   python 05_benchmark.py --config configs/kimi-k2.5.yaml --work-dir /data/eagle3
Tiny:   python 05_benchmark.py --config configs/tiny.yaml --work-dir runs/tiny
"""
from __future__ import annotations

import sys
from pathlib import Path

from common.config import base_parser, parse_args
from common.io import iter_jsonl, read_json, write_json
from common.stage import (StageError, check_same_tokenizer, manifest_sha256, require_complete,
                          resolve_target, stage_dir, start_stage, write_manifest)

STAGE = "05_benchmark"
MODES = ("reference", "server")


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("benchmark")
    g.add_argument("--mode", choices=MODES, default="reference",
                   help="reference = HF target + exported draft in transformers; server = SGLang servers")
    g.add_argument("--num-draft-tokens", type=int, nargs="+", default=[5],
                   help="tokens k the draft proposes per verify round (several values = a sweep); "
                        "SGLang topk 1: --speculative-num-steps k, --speculative-num-draft-tokens k+1")
    g.add_argument("--benchmark-max-new-tokens", type=int, default=256,
                   help="generation cap per benchmark response (tokens)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="use only the first N held-out prompts (default: all)")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; read from the 04 manifest, and when given it must match")
    g.add_argument("--seed", type=int, default=0, help="seed of the untrained contrast draft's init")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where target and draft run (default: cuda if available)")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads on CPU (threads); batch-1 decoding of a small model is "
                        "latency-bound and extra threads mostly add synchronisation")
    s = p.add_argument_group("server mode (SGLang; docs/sglang.md)")
    s.add_argument("--spec-settings", nargs="+", default=["3,1,4", "5,1,6", "7,1,8"],
                   help="EAGLE3 settings 'steps,topk,num_draft_tokens' to sweep (topk > 1 = tree)")
    s.add_argument("--bench-concurrency", type=int, nargs="+", default=[1, 8],
                   help="concurrent requests per run (batch 1 is always included)")
    s.add_argument("--cuda-graph", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="CUDA-graph modes to run every server in")
    s.add_argument("--baseline-url", default=None, help="attach to this running baseline server instead")
    s.add_argument("--eagle3-url", default=None, help="attach to this running EAGLE3 server instead")
    s.add_argument("--baseline-port", type=int, default=30010, help="port of launched baseline servers")
    s.add_argument("--eagle3-port", type=int, default=30020, help="port of launched EAGLE3 servers")
    s.add_argument("--sglang-tp-size", type=int, default=1, help="SGLang tensor-parallel size (GPUs)")
    s.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="SGLang mem_fraction_static: share of GPU memory for weights + KV pool (0-1)")
    s.add_argument("--server-extra-args", default="", help="extra launch_server arguments (one string)")
    s.add_argument("--sglang-python", default=sys.executable, help="python that has sglang installed")
    s.add_argument("--server-timeout", type=float, default=3600, help="seconds to wait for readiness")
    s.add_argument("--request-timeout", type=float, default=1800, help="seconds for one request")
    s.add_argument("--warmup-requests", type=int, default=4, help="preflight warm-up requests (64 tokens each)")
    s.add_argument("--min-accept-length", type=float, default=1.3,
                   help="preflight refuses a warm-up tau below this (1.0 = chance: only the bonus token)")
    return p




def load_inputs(args):
    """Check the upstream folders; return (export dir, 04 manifest, prompt rows)."""
    draft_dir = stage_dir(args.work_dir, "04_train")
    m04 = require_complete(draft_dir, "04_train")
    export_dir = draft_dir / "export_sglang"
    if not (export_dir / "config.json").is_file() or not (export_dir / "model.safetensors").is_file():
        raise StageError(f"{export_dir} lacks config.json/model.safetensors: re-run `python 04_train.py "
                         "--overwrite`")
    merged = stage_dir(args.work_dir, "01c_merge_datasets")
    m01c = require_complete(merged, "01c_merge_datasets")
    check_same_tokenizer(m01c["tokenizer"], m04["tokenizer"], merged, "01c_merge_datasets")
    rows = list(iter_jsonl(merged / "benchmark_prompts.jsonl"))
    if args.num_prompts is not None:
        rows = rows[:args.num_prompts]
    if not rows:
        raise StageError(f"{merged / 'benchmark_prompts.jsonl'} holds no prompts: re-run 01c with "
                         "--benchmark-size > 0")
    return export_dir, m04, rows


def read_capture_points(export_cfg: dict, m04: dict, num_hidden_layers: int) -> list[int]:
    """Capture points (h_i indices) from the export config, cross-checked against SGLang's ids."""
    from common.draft.capture import validate_capture_points

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
    import torch
    from transformers import AutoModelForCausalLM

    from common.draft.model import Eagle3DraftModel, load_sglang_export

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


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(target, ids: list[int]) -> float:
    """Target logit gap top1 - top2 after `ids` (full forward): ~0 means a genuine argmax near-tie."""
    import torch

    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids], device=target.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def run_reference(args, target, drafts: dict, rows: list[dict], points: list[int], eos: set[int]):
    """Interleave per prompt: target-only greedy, then every (draft, k). Returns (metrics, mismatches)."""
    from tqdm import tqdm

    from common.draft import spec_decode as sd

    ks = sorted(set(args.num_draft_tokens))
    results = {(name, k): [] for name in drafts for k in ks}
    base_tokens = base_seconds = 0.0
    mismatches = []
    # Warm-up (allocator, kernels, lazy init) so the first timed call is not penalised.
    sd.greedy_decode(target, rows[0]["prompt_ids"], 4, eos)
    sd.speculative_decode(target, drafts["trained"], rows[0]["prompt_ids"], ks[0], 4, eos, points)
    for row in tqdm(rows, desc="[05] prompts", unit="prompt"):
        ids = row["prompt_ids"]
        ref, secs = sd.greedy_decode(target, ids, args.benchmark_max_new_tokens, eos)
        base_tokens += len(ref)
        base_seconds += secs
        for (name, k), bucket in results.items():
            res = sd.speculative_decode(target, drafts[name], ids, k, args.benchmark_max_new_tokens, eos, points)
            bucket.append(res)
            at = first_difference(ref, res.tokens)
            if at is not None:
                mismatches.append({
                    "id": row["id"], "draft": name, "num_draft_tokens": k, "first_difference": at,
                    "target_only": ref[at:at + 16], "speculative": res.tokens[at:at + 16],
                    "target_top2_logit_margin": top2_margin(target, ids + ref[:at])})
    base_tps = base_tokens / base_seconds
    per_k = {}
    for k in ks:
        entry = {}
        for name in drafts:
            stats = sd.acceptance_stats(results[(name, k)], k)
            stats["tokens_per_s"] = stats["num_generated_tokens"] / stats["seconds"]
            stats["speed_ratio"] = stats["tokens_per_s"] / base_tps
            stats["lossless"] = not any(m["draft"] == name and m["num_draft_tokens"] == k
                                        for m in mismatches)
            entry[name] = stats
        t, u = entry["trained"], entry["untrained"]
        per_k[str(k)] = {"tau": t["tau"], "untrained_tau": u["tau"],
                         "per_position_acceptance": t["per_position_acceptance"],
                         "accept_length_histogram": t["accept_length_histogram"],
                         "tokens_per_s_speculative": t["tokens_per_s"],
                         "tokens_per_s_target_only": base_tps, "speed_ratio": t["speed_ratio"],
                         "lossless": t["lossless"] and u["lossless"], **entry}
    metrics = {
        "mode": "reference", "device": str(target.device), "dtype": "float32",
        "num_prompts": len(rows), "max_new_tokens": args.benchmark_max_new_tokens, "capture_points": points,
        "num_draft_tokens": ks, "lossless": not mismatches, "num_mismatches": len(mismatches),
        "target_only": {"num_generated_tokens": int(base_tokens), "seconds": base_seconds,
                        "tokens_per_s": base_tps},
        "by_num_draft_tokens": per_k,
    }
    return metrics, mismatches


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_report(out: Path, metrics: dict, draft_info: dict) -> None:
    from common.io import atomic_path

    lines = [
        "# EAGLE-3 draft benchmark (reference mode)", "",
        f"Target `{draft_info['target']}`, draft `{draft_info['export']}` (draft vocab "
        f"{draft_info['draft_vocab_size']}, capture points {metrics['capture_points']}).",
        f"{metrics['num_prompts']} held-out prompts, greedy, up to {metrics['max_new_tokens']} new tokens, "
        f"float32 on {metrics['device']}. Target-only: {metrics['target_only']['num_generated_tokens']} "
        f"tokens at {metrics['target_only']['tokens_per_s']:.1f} tok/s.", "",
        "**Lossless: " + ("yes** - every speculative output equals target-only greedy decoding."
                          if metrics["lossless"] else
                          f"NO** - {metrics['num_mismatches']} outputs differ (see mismatches.json)."), "",
        "tau = tokens committed per verify round (accepted drafts + 1 bonus/correction; SGLang's "
        "accept length). Untrained = same shape, random init: the chance level.", "",
        "| k | tau | untrained tau | spec tok/s | target tok/s | speed ratio | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, e in metrics["by_num_draft_tokens"].items():
        lines.append(f"| {k} | {fmt(e['tau'])} | {fmt(e['untrained_tau'])} | "
                     f"{fmt(e['tokens_per_s_speculative'], 1)} | {fmt(e['tokens_per_s_target_only'], 1)} | "
                     f"{fmt(e['speed_ratio'])} | {'yes' if e['lossless'] else 'NO'} |")
    lines += ["", "Per-position acceptance P(draft j accepted | drafts 1..j-1 accepted), trained draft; "
              "histogram of accepted drafts per round (0..k):", ""]
    for k, e in metrics["by_num_draft_tokens"].items():
        pos = ", ".join(fmt(p) for p in e["per_position_acceptance"])
        lines.append(f"- k={k}: per position [{pos}]; histogram {e['accept_length_histogram']} "
                     f"over {e['trained']['num_rounds']} rounds")
    lines += ["", "Speed in reference mode is transformers eager on "
              f"{metrics['device']}: the draft costs a Python-level forward per token, so the ratio "
              "understates an engine's. tau is the portable number.", ""]
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines))


def plot_acceptance(out: Path, metrics: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.io import atomic_path

    fig, ax = plt.subplots(figsize=(6, 4))
    for c, (k, e) in enumerate(metrics["by_num_draft_tokens"].items()):
        for name, style in (("trained", "-o"), ("untrained", "--x")):  # one colour per k
            acc = [float("nan") if p is None else p for p in e[name]["per_position_acceptance"]]
            ax.plot(range(1, len(acc) + 1), acc, style, color=f"C{c}",
                    label=f"{name} k={k} (tau {fmt(e[name]['tau'])})")
    k_max = max(metrics["num_draft_tokens"])
    ax.set_xticks(range(1, k_max + 1))
    ax.set_xlim(0.5, k_max + 0.5)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("EAGLE-3 per-position acceptance (greedy, reference)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "acceptance.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if isinstance(args.num_draft_tokens, int):  # a YAML scalar instead of a list
        args.num_draft_tokens = [args.num_draft_tokens]
    if any(k < 1 for k in args.num_draft_tokens) or args.benchmark_max_new_tokens < 1:
        raise StageError("--num-draft-tokens and --benchmark-max-new-tokens must be >= 1")
    out = stage_dir(args.work_dir, STAGE) / args.mode
    export_dir, m04, rows = load_inputs(args)
    target_dir = resolve_target(args.target_path, m04, stage_dir(args.work_dir, "04_train"), "04_train")
    if not start_stage(out, args.overwrite, "05"):
        return
    if args.mode == "server":
        from common.sglang.bench import server_main
        metrics = server_main(args, out, export_dir, m04, rows, target_dir, args.work_dir)
        write_manifest(out, STAGE, args, tokenizer=m04["tokenizer"], target=m04["target"],
                       inputs={"04_draft": manifest_sha256(stage_dir(args.work_dir, "04_train"))},
                       counts={"num_prompts": len(rows)}, preflight=metrics["preflight"],
                       runs=list(metrics["runs"]))
        print(f"[05] wrote {out}")
        return
    import torch

    from common.draft.capture import load_target_config, target_dims
    from common.draft.spec_decode import LosslessError, eos_ids_of

    dims = target_dims(load_target_config(target_dir))
    export_cfg = read_json(export_dir / "config.json")
    points = read_capture_points(export_cfg, m04, dims["num_hidden_layers"])
    bad = [r["id"] for r in rows if not r["prompt_ids"] or max(r["prompt_ids"]) >= dims["vocab_size"]]
    if bad:
        raise StageError(f"benchmark prompts {bad[:3]} are empty or hold ids outside the target vocab")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # Measured on the 2-core dev box under load, tiny target (H 128, 8 layers): 12 ms/token with
        # 1 thread vs 180 ms/token with 2 (spin-waiting threads fight the other processes).
        torch.set_num_threads(args.cpu_threads)
    print(f"[05] target {target_dir}: N={dims['num_hidden_layers']}, H={dims['hidden_size']}, vocab "
          f"{dims['vocab_size']}; draft {export_dir} (draft vocab {export_cfg['draft_vocab_size']}); "
          f"capture points {points}; {len(rows)} prompts; k {args.num_draft_tokens}; "
          f"max {args.benchmark_max_new_tokens} new tokens; {device}")
    target, trained, untrained = load_models(target_dir, export_dir, device, args.seed)
    eos = eos_ids_of(target.config)
    metrics, mismatches = run_reference(args, target, {"trained": trained, "untrained": untrained},
                                        rows, points, eos)
    write_json(out / "metrics.json", metrics)
    write_report(out, metrics, {"target": target_dir, "export": export_dir,
                                "draft_vocab_size": export_cfg["draft_vocab_size"]})
    plot_acceptance(out, metrics)
    for k, e in metrics["by_num_draft_tokens"].items():
        print(f"[05] k={k}: tau {fmt(e['tau'])} (untrained {fmt(e['untrained_tau'])}), "
              f"{fmt(e['tokens_per_s_speculative'], 1)} vs {fmt(e['tokens_per_s_target_only'], 1)} tok/s "
              f"(x{fmt(e['speed_ratio'])}), lossless {e['lossless']}")
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
                   untrained_tau={k: e["untrained_tau"] for k, e in metrics["by_num_draft_tokens"].items()})
    print(f"[05] wrote {out}")


if __name__ == "__main__":
    main()
