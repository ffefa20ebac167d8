"""Is the draft data-limited? tau on the held-out prompts at growing shares of the training samples.

The seed run's central claim was "the draft is data-limited": this measures the slope on the real
small target. Each point trains 04 with the preset (same seed, same epochs, same flags) on a nested
share of the training samples (--max-train-samples: the first N of one seeded hash order, so 25% is
inside 50% is inside 100%) and replays its draft on the held-out prompts (benchmarks/draft_rows.py).
Writes: OUT/rows/<share>/04_draft, OUT/results.json, OUT/table.md, OUT/data_scaling.png (tau at each
k against training samples, with 95% bootstrap intervals over prompts).
Run:    python benchmarks/data_scaling.py --base runs/smollm2 --out runs/scaling --shares 0.25 0.5 1
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rows as dr  # noqa: E402

from common.stage import EXTRACT, MERGE, TRAIN, VOCAB, stage_dir  # noqa: E402


def plot(results: dict, ks: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(results.values(), key=lambda r: r["num_train_samples"])
    n = [r["num_train_samples"] for r in pts]
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, k in enumerate(ks):
        tau = [r["replay"][str(k)]["tau"] for r in pts]
        lo = [t - r["replay"][str(k)]["tau_ci95"][0] for t, r in zip(tau, pts)]
        hi = [r["replay"][str(k)]["tau_ci95"][1] - t for t, r in zip(tau, pts)]
        ax.errorbar(n, tau, yerr=[lo, hi], fmt="-o", color=f"C{c}", capsize=3, label=f"k={k}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("training samples")
    ax.set_ylabel("tau (held-out, replay)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = dr.parser(__doc__, "work dir with 01c, 02b, 03 complete")
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="shares of the training samples")
    p.add_argument("--epochs", type=int, default=None, help="epochs of every point (default: the preset's)")
    p.add_argument("--train-flags", nargs="*", default=[], metavar="FLAG=VALUE", help="extra 04 flags, every point")
    args = p.parse_args(argv)
    from common.target.manifests import HiddenStatesManifest

    m02 = HiddenStatesManifest.read(stage_dir(args.base, EXTRACT))
    held = None   # built on the first point that needs it: a table of finished points needs no target
    out_json = args.out / "results.json"
    results = dr.load_results(out_json)
    flags = {"train-seed": args.seed, **dict(f.split("=", 1) for f in args.train_flags)}
    if args.epochs is not None:
        flags["num-epochs"] = args.epochs
    total = None
    for share in sorted(args.shares):
        name = f"{share:g}"
        work = args.out / "rows" / name
        dr.link(args.base, work, (MERGE, EXTRACT, VOCAB))
        if total is None:  # training samples available: all samples minus 04's eval split (by id hash)
            from argparse import Namespace
            stage = __import__("importlib").import_module(TRAIN)
            defaults = vars(stage.parse_args(stage.build_parser(), ["--config", str(args.config), "--work-dir", str(work)]))
            total = stage.plan_data(Namespace(**{**defaults, "max_train_samples": None}), stage_dir(work, EXTRACT),
                                    False).num_train
        row_flags = {**flags, "max-train-samples": max(1, round(share * total))}
        if name in results and results[name]["flags"] == row_flags:
            continue
        held = held or dr.HeldOut(args.base, args.config, args.threads)
        run = dr.train(work, args.config, row_flags)
        results = dr.save_result(out_json, name, {"flags": row_flags, **run,
                                                  "replay": held.evaluate(run["export"], args.num_draft_tokens)})
        print(f"[scaling] {name} ({run['num_train_samples']} samples): "
              + ", ".join(f"k={k} tau {e['tau']:.3f}" for k, e in results[name]["replay"].items()), flush=True)
    results = dr.load_results(out_json)   # points of other processes too
    pts = sorted(results.items(), key=lambda kv: kv[1]["num_train_samples"])
    lines = [f"# Data scaling on {dr.target_name(args.base)}", "",
             f"Preset {args.config.name}, flags `{' '.join(dr.argv_of(flags))}`; nested subsets of {total} training "
             f"samples; tau by replay on {dr.num_prompts(results)} held-out prompts [95% CI]; last column: tau at k=5 "
             "relative to the previous point, paired over the same prompts.", "",
             "| share | samples | steps | 04 s | eval acc0 | " + " | ".join(f"tau k={k}" for k in args.num_draft_tokens)
             + " | k=5 vs previous |", "|---" * (6 + len(args.num_draft_tokens)) + "|"]
    prev = None
    for name, r in pts:
        diff = dr.fmt_rel(dr.paired(r["replay"]["5"], prev["replay"]["5"])) if prev else "-"
        acc0 = f"{r['eval_acc'][0]:.3f}" if r["eval_acc"] else "-"
        lines.append(f"| {name} | {r['num_train_samples']} | {r['steps']} | {r['seconds']:.0f} | {acc0} | "
                     + " | ".join(dr.fmt_tau(r["replay"][str(k)]) for k in args.num_draft_tokens) + f" | {diff} |")
        prev = r
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    plot(results, args.num_draft_tokens, args.out / "data_scaling.png",
         f"{dr.target_name(args.base)}: tau vs training samples ({m02.num_samples} captured)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
