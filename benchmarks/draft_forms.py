"""Which draft form makes the best draft on the real small target: MHA, MLA, and each with EAGLE-3.1.

Every row trains a draft with 04 on the SAME samples for the same epochs (the preset's recipe, --train-seed
--seed), from the base run's 02b features and 03 vocabulary, changing only the draft's form:
  mha        the Llama layer (LlamaForCausalLMEagle3): the preset as it stands
  mha+3.1    the same with --fc-norm --norm-output
  mla        --draft-attention mla (Eagle3DeepseekV2ForCausalLM; SmolLM2 is not MLA, so common/draft/model.py
             mla_dims gives the dims: Kimi's proportions to a head of H/heads)
  mla+3.1    mla with --fc-norm --norm-output
Then 05 (the reference benchmark) replays all four side by side (`--draft`) on the held-out prompts, greedy
and at the preset's serving temperature (T 1.0 / top-p 0.95), k = 3, 5, 7, with paired 95% intervals of
every difference. Reported per row: tau [95% CI] at each (T, k), the paired difference to `mha`, trainable
parameters, the draft KV cache per token (bf16, the engines' layout), 04's tokens/s and minutes.
Needs a work dir where 01c, 02b and 03 of configs/smollm2.yaml are complete (make bench-real up to 03).
Writes: OUT/rows/<row>/04_draft, OUT/eval/05_benchmark/reference (05's metrics.json, report.md), OUT/results.json,
OUT/table.md. Each row and the evaluation resume or are read back when complete.
Run:    python benchmarks/draft_forms.py --base runs/smollm2 --out runs/draft_forms
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rows as dr  # noqa: E402

from common.stage import EXTRACT, MERGE, VOCAB  # noqa: E402

ROWS = {
    "mha": {},
    "mha+3.1": {"fc-norm": True, "norm-output": True},
    "mla": {"draft-attention": "mla"},
    "mla+3.1": {"draft-attention": "mla", "fc-norm": True, "norm-output": True},
}
REFERENCE = "mha"


def draft_name(row: str) -> str:
    """The row's name among 05's drafts (--draft NAME: letters, digits, '_', '.', '-'); the reference is 04's."""
    return "04" if row == REFERENCE else row.replace("+", "_")


def draft_facts(export_dir: Path) -> dict:
    """Trainable parameters (the export's float tensors: no embedding, no d2t/t2d) and KV bytes per token."""
    from safetensors import safe_open

    from common.draft.model import full_config, kv_bytes_per_token

    cfg = json.loads((export_dir / "config.json").read_text())
    mla = "Eagle3DeepseekV2ForCausalLM" in cfg["architectures"]
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    full = full_config({**cfg, "attention": "mla" if mla else "mha"})
    return {"parameters": params, "kv_bytes_per_token": kv_bytes_per_token(full), "attention": full["attention"],
            "fc_norm": full["fc_norm"], "norm_output": full["norm_output"]}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def table(results: dict, metrics: dict, ks: list[int]) -> list[str]:
    """The markdown table: one line per row, tau at every (T, k) with its CI, the paired difference to mha."""
    from common.benchmark.compare import difference

    temps = list(next(iter(metrics["drafts"].values()))["tau"])
    lines = ["| form | parameters | KV bytes/token (bf16) | 04 tok/s | 04 min | "
             + " | ".join(f"tau T={t} k={k}" for t in temps for k in ks) + " |",
             "|---" * (5 + len(temps) * len(ks)) + "|"]
    shown = {n: draft_name(n) for n in results}
    for name, r in results.items():
        cells = []
        for t in temps:
            for k in ks:
                c = metrics["drafts"][shown[name]]["tau"][t][str(k)]
                cell = f"{c['tau']:.3f} [{c['tau_ci95'][0]:.3f}, {c['tau_ci95'][1]:.3f}]"
                if name != REFERENCE:
                    d = difference(metrics["pairs"], shown[name], "04", t, str(k))
                    cell += f"<br>{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
                cells.append(cell)
        lines.append(f"| {name} | {r['parameters']:,} | {r['kv_bytes_per_token']:,} | {r['tokens_per_s']:.0f} | "
                     f"{r['seconds'] / 60:.1f} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    p = dr.parser(__doc__, "work dir with 01c, 02b, 03 complete")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to train")
    p.add_argument("--temperatures", type=float, nargs="+", default=None,
                   help="05's acceptance temperatures (default: the preset's)")
    p.add_argument("--max-train-samples", type=int, default=None, help="training samples of every row (count; "
                   "default: all of the base's)")
    p.add_argument("--only", choices=("train", "eval"), default=None, help="one part only")
    args = p.parse_args(argv)
    out_json = args.out / "results.json"
    results = dr.load_results(out_json)
    common = {"train-seed": args.seed, **({"max-train-samples": args.max_train_samples}
                                          if args.max_train_samples else {})}
    if args.only != "eval":
        for name in args.rows:
            flags = ROWS[name]
            if name in results and results[name]["flags"] == flags:
                print(f"[forms] {name}: done before, kept")
                continue
            work = args.out / "rows" / name.replace("+", "_")
            dr.link(args.base, work, (MERGE, EXTRACT, VOCAB))
            run = dr.train(work, args.config, {**common, **flags})
            results = dr.save_result(out_json, name, {"flags": flags, **run, **draft_facts(Path(run["export"]))})
            print(f"[forms] {name}: {run['steps']} steps, {run['tokens_per_s']:.0f} tok/s, "
                  f"{run['seconds'] / 60:.1f} min", flush=True)
    if args.only == "train":
        return
    results = {n: results[n] for n in ROWS if n in results}
    if REFERENCE not in results:
        raise SystemExit(f"the reference row {REFERENCE} is not trained yet")
    ours = Path(results[REFERENCE]["export"]).parent
    others = {draft_name(n): Path(r["export"]) for n, r in results.items() if n != REFERENCE}
    response_cache = dr.REPO / "assets" / "smollm2" / "responses.jsonl.gz"
    metrics = dr.evaluate(args.out / "eval", args.base, ours, others, args, response_cache)
    lines = [f"# Draft forms on {dr.target_name(args.base)}", "",
             f"Same training samples and epochs per row ({results[REFERENCE]['num_train_samples']} samples, "
             f"seed {args.seed}); tau by 05's replay on the held-out prompts [95% bootstrap CI over prompts]; "
             f"under each non-reference cell the paired difference to `{REFERENCE}` [95% CI]. 05's report: "
             f"{dr.stage_dir(args.out / 'eval', dr.BENCH) / 'report.md'}.", ""]
    lines += table(results, metrics, sorted(set(args.num_draft_tokens)))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
