"""Which training recipe makes the best draft on the real small target: an ablation table.

Every row trains a draft with 04 on the SAME samples (--max-train-samples of them, nested by a seeded
hash of the sample id) for the same number of epochs, from the same 02b features and 03 vocabulary,
changing only the flags of that row; then its draft is replayed against the target's greedy answers
to the held-out prompts (benchmarks/draft_rows.py: features computed once for all rows). Reported:
tau at each k with a 95% bootstrap interval, the paired difference at k=5 to the reference row with
its interval, 04's held-out per-step accuracy (less noisy than tau) and 04's tokens/s. Rows:
  established   the established recipe (SpecForge): one sample per optimizer step, lr 1e-4, AdamW
                betas (0.9, 0.999), normal(0, 0.02) init, each step's loss divided by all positions
  preset        configs/smollm2.yaml as it stands
  one-factor rows around the preset, and `chosen` (the preset plus --chosen flags) when given.
Needs a work dir where 01c, 02b and 03 of configs/smollm2.yaml are complete (make bench-real).
Writes: OUT/rows/<row>/04_draft (each row's 04 run, resumable), OUT/results.json, OUT/table.md.
Run:    python benchmarks/ablate_recipe.py --base runs/smollm2 --out runs/ablation --max-train-samples 400
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rows as dr  # noqa: E402

from common.stage import EXTRACT, MERGE, VOCAB  # noqa: E402

ESTABLISHED = {"max-samples-per-batch": 1, "learning-rate": "1e-4", "adam-betas": ["0.9", "0.999"],
               "init-scheme": "normal", "init-std": "0.02", "loss-normalization": "batch"}
ROWS = {
    "established": ESTABLISHED,
    "preset": {},
    "lr 1e-4": {"learning-rate": "1e-4"},
    "lr 1e-3": {"learning-rate": "1e-3"},
    "1 sample/step": {"max-samples-per-batch": 1},
    "batch 8K tokens": {"batch-tokens": 8192},
    "betas 0.999": {"adam-betas": ["0.9", "0.999"]},
    "init normal": {"init-scheme": "normal"},
    "loss per batch": {"loss-normalization": "batch"},
    "warmup 0.1": {"warmup-ratio": "0.1"},
}


def main(argv=None):
    p = dr.parser(__doc__, "work dir with 01c, 02b, 03 complete")
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"rows to run, of: {', '.join(ROWS)}")
    p.add_argument("--chosen", nargs="*", default=None, metavar="FLAG=VALUE",
                   help="add a row: the preset with these 04 flags (lists comma-separated), named --chosen-name")
    p.add_argument("--chosen-name", default="chosen", help="name of the --chosen row (several candidates: run again)")
    p.add_argument("--reference-row", default="established", help="row the paired differences are taken to")
    p.add_argument("--max-train-samples", type=int, default=400, help="training samples of every row (count)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of every row")
    args = p.parse_args(argv)
    rows = {name: ROWS[name] for name in args.rows}
    if args.chosen is not None:
        rows[args.chosen_name] = {k: (v.split(",") if "," in v else v) for k, v in (f.split("=", 1) for f in args.chosen)}
    held = None   # built on the first row that needs it: a table of finished rows needs no target
    out_json = args.out / "results.json"
    results = dr.load_results(out_json)
    common = {"num-epochs": args.epochs, "max-train-samples": args.max_train_samples, "train-seed": args.seed}
    for name, flags in rows.items():
        if name in results and results[name]["flags"] == flags:
            print(f"[ablate] {name}: done before, kept")
            continue
        held = held or dr.HeldOut(args.base, args.config, args.threads)
        work = args.out / "rows" / name.replace(" ", "_").replace("/", "_").replace(",", "")
        dr.link(args.base, work, (MERGE, EXTRACT, VOCAB))
        run = dr.train(work, args.config, {**common, **flags})
        results = dr.save_result(out_json, name, {"flags": flags, **run,
                                                  "replay": held.evaluate(run["export"], args.num_draft_tokens)})
        print(f"[ablate] {name}: " + ", ".join(f"k={k} tau {e['tau']:.3f}" for k, e in results[name]["replay"].items())
              + f" | {run['seconds'] / 60:.1f} min", flush=True)

    results = {name: r for name, r in dr.load_results(out_json).items()}   # rows of other processes too
    ref = results.get(args.reference_row)
    lines = [f"# Recipe ablation on {dr.target_name(args.base)}", "",
             f"Same {args.max_train_samples} training samples x {args.epochs} epoch(s) per row, seed {args.seed}; "
             f"tau by replay on {dr.num_prompts(results)} held-out prompts [95% bootstrap CI over prompts]; "
             f"last column: tau at k=5 relative to `{args.reference_row}`, paired over the same prompts.", "",
             "| row | flags | steps | tok/s | eval acc0 | eval tau (sim) | "
             + " | ".join(f"tau k={k}" for k in args.num_draft_tokens) + " | k=5 vs ref |",
             "|---" * (7 + len(args.num_draft_tokens)) + "|"]
    for name, r in results.items():
        diff = dr.fmt_rel(dr.paired(r["replay"]["5"], ref["replay"]["5"])) if ref and name != args.reference_row else "-"
        acc0 = f"{r['eval_acc'][0]:.3f}" if r["eval_acc"] else "-"
        sim = f"{r['eval_tau']:.2f}" if r["eval_tau"] else "-"
        lines.append(f"| {name} | `{' '.join(dr.argv_of(r['flags'])) or '(preset)'}` | {r['steps']} | "
                     f"{r['tokens_per_s']:.0f} | {acc0} | {sim} | "
                     + " | ".join(dr.fmt_tau(r["replay"][str(k)]) for k in args.num_draft_tokens) + f" | {diff} |")
    scored = [r for r in results.values() if r["eval_tau"]]
    if len(scored) >= 3:
        lines += ["", "04's simulated tau against replay tau, rank correlation over the rows (Spearman): "
                  + ", ".join(f"k={k} {dr.spearman([r['eval_tau'] for r in scored], [r['replay'][str(k)]['tau'] for r in scored]):.2f}"
                              for k in args.num_draft_tokens)]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
