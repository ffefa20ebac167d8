"""What each compact feature format saves and costs, side by side on the real small target.

One row per 02b feature format (common/target/shards.py): bytes per sample token read from the files,
04 tokens/s, 04's held-out per-step accuracy, and tau at each k by replay on the held-out prompts,
paired against the bf16 row over the same prompts (relative difference with its 95% interval). Every
row trains on the same samples (--max-train-samples), seed, epochs and flags; only the format differs.

The format rows are written by 02b's own encoder (shards.write_shard) from the base run's bf16 shards,
not by capturing the target again: fp8 is encoded from bf16 states (02b encodes from the compute
dtype; the extra bf16 rounding is 2^-8 against fp8's 2^-4), and the top-k logits come from the stored
bf16 final state through the target's lm_head (computed once at the largest k; a smaller k is its
prefix, which is exactly the smaller top-k). tests/units/target/test_feature_formats.py runs the formats through
02b itself. Needs a base work dir with 01c, 02b (bf16 + final, no window) and 03 complete.
Writes: OUT/formats/<row>/{02b_hidden_states,04_draft}, OUT/results.json, OUT/table.md.
Run:    python benchmarks/bench_feature_formats.py --base runs/smollm2 --out runs/formats --max-train-samples 400
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rows as dr  # noqa: E402

from common.stage import EXTRACT, MERGE, VOCAB, stage_dir  # noqa: E402

ROWS = {  # name -> FeatureFormat fields
    "bf16": {},
    "fp8": {"aux": "fp8"},
    "topk32": {"teacher": "topk", "topk": 32},
    "fp8+topk32": {"aux": "fp8", "teacher": "topk", "topk": 32},
    "fp8+topk8": {"aux": "fp8", "teacher": "topk", "topk": 8},
    "fp8+topk32+W32": {"aux": "fp8", "teacher": "topk", "topk": 32, "window": 32},
    "fp8+topk32+W8": {"aux": "fp8", "teacher": "topk", "topk": 32, "window": 8},
}


def reencode(base: Path, rows: dict, out: Path) -> dict:
    """Write every format row's 02b folder from the base's bf16 shards; returns {row: seconds}."""
    import torch

    from common.target.shards import FeatureFormat, ShardReader, list_shards, topk_logits, write_shard
    from common.target.head import load_target_head
    from common.io import write_json
    from common.target.manifests import HiddenStatesManifest

    m02 = HiddenStatesManifest.read(stage_dir(base, EXTRACT))
    if m02.feature_format != FeatureFormat():
        raise SystemExit(f"the base's 02b must be bf16 + final without a window, not {m02.feature_format.as_dict()}")
    fmts = {name: FeatureFormat(**f) for name, f in rows.items()}
    todo = {n: f for n, f in fmts.items() if not (stage_dir(out / n, EXTRACT) / "manifest.json").is_file()}
    if not todo:
        return {}
    k_max = max([f.topk for f in todo.values() if f.topk] or [0])
    lm_head = load_target_head(m02.target["path"], dtype=torch.float32, with_head=True)[1] if k_max else None
    seconds = {n: 0.0 for n in todo}
    shards = list_shards(stage_dir(base, EXTRACT))
    for path in shards:
        if all((stage_dir(out / n, EXTRACT) / path.name).is_file() for n in todo):
            continue   # written by an earlier, interrupted run (shards are written atomically)
        r = ShardReader(path)
        samples = []
        for i in range(len(r)):
            s = r.sample(i)
            s["aux"], s["final"] = s["aux"].float(), s["final"].float()
            if k_max:
                s["topk_ids"], s["topk_logits"] = topk_logits(s["final"], lm_head, k_max)
            samples.append(s)
        for name, features in todo.items():
            t0 = time.time()
            write_shard(stage_dir(out / name, EXTRACT) / path.name, samples, torch.bfloat16, features)
            seconds[name] += time.time() - t0
    for name, features in todo.items():
        d = stage_dir(out / name, EXTRACT)
        rows_stored = sum(ShardReader(p).num_tokens for p in list_shards(d))
        num_bytes = sum(p.stat().st_size for p in list_shards(d))
        write_json(d / "manifest.json", {**m02.raw, "feature_format": features.as_dict(), "num_tokens": rows_stored,
                                         "num_bytes": num_bytes, "bytes_per_token": features.bytes_per_token(m02.hidden_size),
                                         "bytes_per_sample_token": round(num_bytes / m02.num_tokens, 1),
                                         "reencoded_from": str(stage_dir(base, EXTRACT))})
    return seconds


def main(argv=None):
    p = dr.parser(__doc__, "work dir with 01c, 02b (bf16), 03 complete")
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"formats to run, of: {', '.join(ROWS)}")
    p.add_argument("--max-train-samples", type=int, default=400, help="training samples of every row (count)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of every row")
    p.add_argument("--train-flags", nargs="*", default=[], metavar="FLAG=VALUE", help="extra 04 flags, every row")
    args = p.parse_args(argv)
    import torch

    from common.target.manifests import HiddenStatesManifest

    torch.set_num_threads(args.threads)
    rows = {name: ROWS[name] for name in args.rows}
    reencode(args.base, rows, args.out / "formats")
    held = None   # built on the first row that needs it: a table of finished rows needs no target
    out_json = args.out / "results.json"
    results = dr.load_results(out_json)
    flags = {"num-epochs": args.epochs, "max-train-samples": args.max_train_samples, "train-seed": args.seed,
             **dict(f.split("=", 1) for f in args.train_flags)}
    for name in rows:
        if name in results and results[name]["flags"] == flags:
            continue
        held = held or dr.HeldOut(args.base, args.config, args.threads)
        work = args.out / "formats" / name
        dr.link(args.base, work, (MERGE, VOCAB))
        run = dr.train(work, args.config, flags)
        m02 = HiddenStatesManifest.read(stage_dir(work, EXTRACT))
        results = dr.save_result(out_json, name, {"flags": flags, "format": m02.feature_format.as_dict(), **run,
                                                  "bytes_per_sample_token": m02.bytes_per_sample_token,
                                                  "replay": held.evaluate(run["export"], args.num_draft_tokens)})
        print(f"[formats] {name}: {m02.bytes_per_sample_token} B/token, "
              + ", ".join(f"k={k} tau {e['tau']:.3f}" for k, e in results[name]["replay"].items()), flush=True)

    results = dr.load_results(out_json)   # rows of other processes too
    ref = results["bf16"]
    lines = [f"# Feature formats on {dr.target_name(args.base)}", "",
             f"Same {args.max_train_samples} training samples x {args.epochs} epoch(s), seed {args.seed}, flags "
             f"`{' '.join(dr.argv_of(flags))}`; bytes per sample token from the shard files (stored rows only, "
             f"headers included); tau by replay on {dr.num_prompts(results)} held-out prompts [95% CI]; "
             "vs bf16: relative tau difference at k=5, paired over the same prompts [95% CI].", "",
             "| format | B/token | x smaller | 04 tok/s | eval acc0 | eval tau (sim) | "
             + " | ".join(f"tau k={k}" for k in args.num_draft_tokens) + " | k=5 vs bf16 |",
             "|---" * (7 + len(args.num_draft_tokens)) + "|"]
    for name, r in results.items():
        diff = dr.fmt_rel(dr.paired(r["replay"]["5"], ref["replay"]["5"])) if name != "bf16" else "-"
        lines.append(f"| {name} | {r['bytes_per_sample_token']:.0f} | "
                     f"{ref['bytes_per_sample_token'] / r['bytes_per_sample_token']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['eval_acc'][0]:.3f} | {r['eval_tau']:.2f} | "
                     + " | ".join(dr.fmt_tau(r["replay"][str(k)]) for k in args.num_draft_tokens) + f" | {diff} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
