"""01b at the serving temperature or greedy: which regenerated data makes the better draft, judged by
greedy and by sampled tau? And how many answers loop?

SmolLM2-135M stands in for Kimi-K2.5. The base work dir (`make bench-real`'s runs/smollm2) holds the
target's greedy answers (01b at T 0, the shipped response cache). This script regenerates the same 01
prompts at --temperature / --top-p (default Kimi-K2.5's serving setting, T 1.0 / top-p 0.95) with 01b's
in-process engine, runs 01c -> 02b -> 03 -> 04 on them, and trains the greedy row on the base's own
01c/02b/03 (with --sources, both rows on a subset of the base's datasets, each through 01 -> 04) with the
same 04 flags (the preset's recipe, --share of the training samples, a candidate per
epoch). 05 (the reference benchmark) then measures both drafts side by side on the base's held-out prompts, greedy
and at the preset's serving temperatures, k = 3, 5, 7, with paired 95% intervals. 01c's repetition-loop
counts (common/text/repetition.py) and 01b's length-cap share of both data sets go in the table.

Each part is a work dir under --out that is skipped when complete (`--only data` or its halves
`data_greedy` / `data_sampled`, `--only rows`, `--only eval`). Costs on a 2-core Intel Xeon (AVX-512 bf16),
one thread: 01b's sampled answers ~3 s a prompt (~67 tok/s; ~80 min for all 1,600, ~50 min for the 1,010
of --sources smollm2_code), 02b ~450 tok/s, 04 ~0.5 s a step with bf16 autocast.

  python benchmarks/regen_temperature.py --base runs/smollm2 --out runs/regen_temperature --sources smollm2_code
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import draft_rows as dr  # noqa: E402
from common.stage import EXTRACT, GENERATE, MERGE, PREPARE, TRAIN, VOCAB, stage_dir  # noqa: E402

UPSTREAM = (MERGE, EXTRACT, VOCAB)
RESPONSES = REPO / "assets" / "smollm2" / "responses.jsonl.gz"   # the base's greedy answers (05's too)


def sampled_preset(config: Path, out: Path) -> Path:
    """The preset without its response cache: the cache holds greedy answers, which 01b refuses at T > 0."""
    cfg = yaml.safe_load(config.read_text())
    cfg.pop("response-cache", None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "preset_sampled.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def build_data(work: Path, base: Path, preset: Path, args, sample: bool) -> None:
    """01 (the base's, linked; with --sources a run of 01 on those datasets only, benchmark-only ones kept),
    01b greedy or at the serving temperature, then 01c, 02b and 03."""
    common = ["--config", str(preset), "--work-dir", str(work)]
    if args.sources:
        datasets = json.loads((stage_dir(base, PREPARE) / "manifest.json").read_text())["config"]["datasets"]
        keep = [d for d in datasets if d["name"] in args.sources or d.get("benchmark-only")]
        if {d["name"] for d in keep} < set(args.sources):
            raise SystemExit(f"--sources: the base's 01 has {[d['name'] for d in datasets]}")
        dr.stage(PREPARE).main([*common, "--datasets", json.dumps(keep)])
    else:
        dr.link(base, work, (PREPARE,))
    sampling = ["--temperature", str(args.temperature), "--top-p", str(args.top_p), "--generation-seed", str(args.seed)]
    dr.stage(GENERATE).main([*common, "--generation-engine", "hf", "--device", "cpu",
                             "--hf-batch-size", str(args.hf_batch_size), *(sampling if sample else [])])
    dr.stage(MERGE).main(common)
    dr.stage(EXTRACT).main([*common, "--capture-engine", "hf", "--device", "cpu"])
    dr.stage(VOCAB).main(common)


def row_flags(num_samples: int, args) -> dict:
    """The 04 flags of both rows: the preset's recipe, the same sample count, a candidate per epoch."""
    return {"train-seed": args.seed, "candidates-per-epoch": 1, "max-train-samples": num_samples,
            **dict(f.split("=", 1) for f in args.train_flags)}


def check_row(work: Path, base: Path, flags: dict) -> None:
    """Refuse a --greedy-row that is unfinished, trained on other data or with other 04 flags."""
    from common.stage import input_manifests, is_complete

    d = stage_dir(work, TRAIN)
    if not is_complete(d):
        raise SystemExit(f"--greedy-row {work}: its 04 is not complete")
    m = json.loads((d / "manifest.json").read_text())
    upstream = input_manifests(base, *(stage_dir(base, u) for u in UPSTREAM[1:]))   # 02b and 03, as 04 records them
    if any(m["inputs"].get(k) != v for k, v in upstream.items()):
        raise SystemExit(f"--greedy-row {work}: trained on other 02b/03 outputs than {base}'s")
    differ = {k: (m["config"].get(k.replace("-", "_")), v) for k, v in flags.items()
              if str(m["config"].get(k.replace("-", "_"))) != str(v)}
    if differ:
        raise SystemExit(f"--greedy-row {work}: 04 flags differ (theirs, ours): {differ}")


def data_summary(work: Path) -> dict:
    """Answer tokens, repetition loops (01c) and the share of answers cut at the token cap (01b) of a work dir."""
    totals = json.loads((stage_dir(work, MERGE) / "stats.json").read_text())["totals"]
    m01b = json.loads((stage_dir(work, GENERATE) / "manifest.json").read_text())["counts"]
    reasons: dict[str, int] = {}
    for c in m01b.values():
        if not c.get("benchmark_only"):
            for r, n in c["finish_reasons"].items():
                reasons[r] = reasons.get(r, 0) + n
    n = totals["num_samples"]
    return {"num_samples": n, "num_response_tokens": totals["num_response_tokens"],
            "repetition_loops": totals["repetition_loops"], "loop_share": totals["repetition_loops"] / n,
            "length_share": reasons.get("length", 0) / max(1, sum(reasons.values()))}


def report(results: dict, args) -> str:
    """table.md: the data of both rows, tau at each temperature and k, and sampled_data - greedy_data."""
    from common.benchmark.compare import difference

    ev = results["eval"]
    lines = [f"# 01b at T {args.temperature:g} / top-p {args.top_p:g} vs greedy (SmolLM2-135M, CPU)", "",
             "| data | samples | answer tokens | repetition loops | cut at the token cap |", "|---|---|---|---|---|"]
    for name, d in results["data"].items():
        lines.append(f"| {name} | {d['num_samples']} | {d['num_response_tokens']} | {d['repetition_loops']} "
                     f"({100 * d['loop_share']:.1f}%) | {100 * d['length_share']:.1f}% |")
    ks = [str(k) for k in args.num_draft_tokens]
    lines += ["", f"tau by replay on {ev['num_prompts']} held-out prompts [95% CI]; `04` = the draft trained on the "
              "greedy answers, `sampled_data` = on the sampled ones; same recipe and sample count.", "",
              "| T | draft | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    for t in sorted(ev["drafts"]["04"]["tau"], key=float):
        for name in ("04", "sampled_data"):
            cells = [ev["drafts"][name]["tau"][t][k] for k in ks]
            lines.append(f"| {t} | {name} | " + " | ".join(dr.fmt_tau(c, 2) for c in cells) + " |")
        diffs = [difference(ev["pairs"], "sampled_data", "04", t, k) for k in ks]
        lines.append(f"| {t} | sampled - greedy | " + " | ".join(
            f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" for d in diffs) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = dr.parser(__doc__, "in-domain work dir with 01-03 complete on greedy answers (make bench-real's runs/smollm2)")
    p.add_argument("--temperature", type=float, default=1.0, help="01b's sampling temperature of the new data")
    p.add_argument("--top-p", type=float, default=0.95, help="01b's nucleus mass of the new data")
    p.add_argument("--hf-batch-size", type=int, default=32, help="01b's prompts per generate() call")
    p.add_argument("--share", type=float, default=1.0, help="share of the training samples both rows train on")
    p.add_argument("--sources", nargs="+", default=None, metavar="NAME",
                   help="train both rows on these 01 datasets only (each row then runs 01 -> 04 on them, the "
                        "greedy one from the response cache); default all of the base's")
    p.add_argument("--greedy-row", type=Path, default=None,
                   help="a finished 04 work dir on the base with the same flags (e.g. warm_start_study's "
                        "rows/scratch_1): used as the greedy row, after checking its manifest")
    p.add_argument("--train-flags", nargs="*", default=[], metavar="FLAG=VALUE", help="extra 04 flags, both rows")
    p.add_argument("--temperatures", type=float, nargs="+", default=None,
                   help="05's --acceptance-temperatures (default the preset's: 0 and 1.0)")
    p.add_argument("--only", choices=("data", "data_greedy", "data_sampled", "rows", "eval"), default=None,
                   help="do one part and stop (the two data parts can run as two processes)")
    args = p.parse_args(argv)
    if args.sources and args.greedy_row:
        raise SystemExit("--greedy-row trains on all of the base's datasets; with --sources the greedy row is "
                         "this script's own (drop one of the two)")
    import torch

    torch.set_num_threads(args.threads)
    sampled, preset = args.out / "sampled", sampled_preset(args.config, args.out)
    # the greedy data: the base's own, or with --sources the same subset as the sampled data, greedily
    greedy_data = args.out / "greedy" if args.sources else args.base
    if args.sources and args.only in (None, "data", "data_greedy"):
        build_data(greedy_data, args.base, args.config, args, sample=False)
    if args.only in (None, "data", "data_sampled"):
        build_data(sampled, args.base, preset, args, sample=True)
    if args.only in ("data", "data_greedy", "data_sampled"):
        return
    num = max(1, round(args.share * dr.num_train(greedy_data, args.config)))
    greedy = greedy_data if args.sources else args.greedy_row or args.out / "rows" / "greedy"
    if args.only in (None, "rows"):
        if args.greedy_row:
            check_row(args.greedy_row, args.base, row_flags(num, args))
        else:
            if not args.sources:
                dr.link(args.base, greedy, UPSTREAM)
            dr.train(greedy, args.config, row_flags(num, args))
        dr.train(sampled, preset, row_flags(num, args))
    if args.only == "rows":
        return
    ev = dr.evaluate(args.out / "eval", args.base, stage_dir(greedy, TRAIN),
                     {"sampled_data": stage_dir(sampled, TRAIN) / "export_sglang"}, args, RESPONSES)
    results = {"data": {"greedy": data_summary(greedy_data), "sampled": data_summary(sampled)},
               "sources": args.sources,
               "rows": {"04": row_flags(num, args), "sampled_data": row_flags(num, args)},
               "eval": {k: ev[k] for k in ("num_prompts", "drafts", "pairs", "deploy")}}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = report(results, args)
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
