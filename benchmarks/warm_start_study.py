"""Warm start from a public draft, on the CPU: does fine-tuning a draft trained on other, larger data beat
training from zero on the user's own, and what does it forget?

SmolLM2-135M stands in for Kimi-K2.5; a stand-in for the public draft is trained on general chat
(common/worlds/smollm2_general_prompts.py: 3,080 samples, twice the in-domain set, disjoint prompts, no
in-domain family; SmolLM2's answers shipped in assets/smollm2/general_responses.jsonl.gz). Then, at each
--shares of the in-domain coding set (the base work dir of `make bench-real`), three drafts are trained:
  scratch     04 from a random init (the preset's recipe)
  warm        04 --init-from the stand-in (vocab mapped onto the in-domain 03 vocab)
  warm_l2sp   the same with --l2sp-weight
each with --candidates-per-epoch 1 (the export is the selected candidate; for warm starts the stand-in
itself is candidate 0). The recipe rows run at the full size or --recipe-share: --epochs-curve N adds
scratch and warm for N epochs (a candidate per epoch: replay tau on 04's held-out split and the chosen
epoch; every candidate is also measured on the reported prompts), --warm-recipes adds warm rows
that change one flag of the fine-tune recipe (learning rate, warm-up, L2-SP weight).
Every draft, the stand-in included, is measured by 05 (the reference benchmark) side by side (`--draft`): on the
in-domain held-out prompts (four families never trained on) and on the stand-in's own held-out prompts
(forgetting), greedy and at T 1.0 / top-p 0.95, k = 3, 5, 7, with paired 95% intervals.

Each stage and row is a work dir under --out that is skipped when complete, so the study resumes after a
kill and can be spread over several sessions (`--only standin`, `--only rows`, `--only eval`). Costs on
a 2-core AVX2 CPU in fp32: 02b of the stand-in ~0.5 h, its 04 ~1.5 h at one sample per step, each row
~0.25-1 h; pass --train-flags max-samples-per-batch=8 batch-tokens=2048 to trade some tau for ~2x speed
(docs/results.md says which was used).

  python benchmarks/warm_start_study.py --base runs/smollm2 --out runs/warm_start_study
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import draft_rows as dr  # noqa: E402
from common.stage import EXTRACT, GENERATE, MERGE, PREPARE, TRAIN, VOCAB, stage_dir  # noqa: E402

WORLD_DATA = REPO / "build" / "smollm2" / "data"
GENERAL_RESPONSES = REPO / "assets" / "smollm2" / "general_responses.jsonl.gz"
GENERAL_HELDOUT = REPO / "assets" / "smollm2" / "general_heldout_responses.jsonl.gz"
VARIANTS = ("scratch", "warm", "warm_l2sp")
RECIPE_FLAGS = {"learning-rate": "lr", "warmup-ratio": "warmup", "l2sp-weight": "l2sp"}   # 04 flag: row name
RECIPE_ROW = re.compile(r"^warm_(%s)\d" % "|".join(RECIPE_FLAGS.values()))   # warm_lr0.0001_0.25, not warm_l2sp_1


def recipe(text: str) -> str:
    """A --warm-recipes item: FLAG=VALUE with a flag the recipe rows vary and a number."""
    flag, _, value = text.partition("=")
    if flag not in RECIPE_FLAGS:
        raise argparse.ArgumentTypeError(f"{flag!r}: the recipe rows vary {', '.join(RECIPE_FLAGS)}")
    try:
        float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not a number") from None
    return text
UPSTREAM = (MERGE, EXTRACT, VOCAB)


def build_standin_base(work: Path, config: Path) -> None:
    """01 -> 03 on the general set: its answers come from the shipped cache (01b's openai engine is never
    asked: every prompt is a cache hit), its held-out prompts are benchmark-only."""
    for name in ("general_train.jsonl", "general_heldout.jsonl"):
        if not (WORLD_DATA / name).is_file():
            raise SystemExit(f"{WORLD_DATA / name} is missing: rebuild the world with "
                             "`python 00_build_smollm2_world.py --config configs/smollm2.yaml --overwrite`")
    datasets = json.dumps([
        {"name": "general", "adapter": "messages", "path": str(WORLD_DATA / "general_train.jsonl")},
        {"name": "general_heldout", "adapter": "messages", "path": str(WORLD_DATA / "general_heldout.jsonl"),
         "benchmark-only": True}])
    common = ["--config", str(config), "--work-dir", str(work)]
    dr.stage(PREPARE).main([*common, "--datasets", datasets, "--max-new-tokens", "160"])
    dr.stage(GENERATE).main([*common, "--max-new-tokens", "160",
                             "--generation-engine", "openai", "--response-cache", str(GENERAL_RESPONSES),
                             "--server-url", "http://127.0.0.1:9/v1", "--served-model-name", "smollm2"])
    dr.stage(MERGE).main(common)
    dr.stage(EXTRACT).main([*common, "--capture-engine", "hf", "--device", "cpu"])
    dr.stage(VOCAB).main(common)


def row_flags(variant: str, share_samples: int | None, standin: Path, args) -> dict:
    flags = {"train-seed": args.seed, "candidates-per-epoch": 1, **dict(f.split("=", 1) for f in args.train_flags)}
    if share_samples is not None:
        flags["max-train-samples"] = share_samples
    if variant != "scratch":
        flags.update({"init-from": str(standin), "init-vocab": "map"})
    if variant == "warm_l2sp":
        flags["l2sp-weight"] = args.l2sp_weight
    return flags


def rows(args, standin: Path) -> dict[str, dict]:
    """{row name: 04 flags} of every in-domain row."""
    total = dr.num_train(args.base, args.config)
    out = {f"{v}_{share:g}": row_flags(v, max(1, round(share * total)), standin, args)
           for share in sorted(args.shares) for v in VARIANTS}
    share = max(args.shares) if args.recipe_share is None else args.recipe_share
    size = None if share == 1 else max(1, round(share * total))
    for flag, value in (v.split("=", 1) for v in args.warm_recipes):   # the fine-tune recipe
        out[f"warm_{RECIPE_FLAGS[flag]}{float(value):g}_{share:g}"] = {**row_flags("warm", size, standin, args),
                                                                        flag: float(value)}
    if args.epochs_curve:
        for v in ("scratch", "warm"):
            out[f"{v}{'' if share == 1 else f'_{share:g}'}_epochs{args.epochs_curve}"] = {
                **row_flags(v, size, standin, args), "num-epochs": args.epochs_curve}
    return out


def main(argv=None):
    p = dr.parser(__doc__, "in-domain work dir with 01c, 02b, 03 complete (make bench-real's runs/smollm2)")
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="in-domain shares")
    p.add_argument("--l2sp-weight", type=float, default=0.01, help="the warm_l2sp rows' --l2sp-weight")
    p.add_argument("--epochs-curve", type=int, default=6, help="epochs of the curve rows (0: none)")
    p.add_argument("--recipe-share", type=float, default=None,
                   help="in-domain share of the recipe rows, the epochs curve and --warm-recipes (default the "
                        "largest --shares; a smaller share costs less and over-trains sooner)")
    p.add_argument("--warm-recipes", nargs="*", default=[], metavar="FLAG=VALUE", type=recipe,
                   help="extra warm rows (at --recipe-share), each changing one 04 flag of the warm row: "
                        f"{', '.join(RECIPE_FLAGS)} (e.g. learning-rate=1e-4 warmup-ratio=0.2 l2sp-weight=1)")
    p.add_argument("--train-flags", nargs="*", default=[], metavar="FLAG=VALUE", help="extra 04 flags, every row")
    p.add_argument("--standin-samples", type=int, default=None,
                   help="train the stand-in on this many of the 3,080 general samples (default all; keep it >= 2x "
                        "the largest in-domain share's samples)")
    p.add_argument("--temperatures", type=float, nargs="+", default=None,
                   help="05's --acceptance-temperatures (default the preset's: 0 and 1.0; T > 0 samples the target's "
                        "continuations first, ~12 s per prompt on a 2-core CPU)")
    p.add_argument("--only", choices=("standin", "rows", "eval", "eval_in_domain", "eval_general"), default=None,
                   help="do one part and stop")
    p.add_argument("--tag", default="", help="suffix of the evaluation folders, results and table (a second "
                   "evaluation of some rows, e.g. at T 1.0, beside the first)")
    p.add_argument("--rows", nargs="*", default=None, metavar="NAME",
                   help="with --only rows: train just these rows (two processes, one core each, split the grid)")
    args = p.parse_args(argv)
    standin_work = args.out / "standin"
    if args.only in (None, "standin"):
        build_standin_base(standin_work, args.config)
        size = {"max-train-samples": args.standin_samples} if args.standin_samples else {}
        dr.train(standin_work, args.config, {"train-seed": args.seed, **size, **dict(f.split("=", 1) for f in args.train_flags)})
    standin = stage_dir(standin_work, TRAIN) / "export_sglang"
    todo = rows(args, standin)
    if args.only in (None, "rows"):
        unknown = set(args.rows or ()) - set(todo)
        if unknown:
            raise SystemExit(f"--rows: no such row {sorted(unknown)}; rows are {sorted(todo)}")
        for name, flags in todo.items():
            if args.rows is not None and name not in args.rows:
                continue
            work = args.out / "rows" / name
            dr.link(args.base, work, UPSTREAM)
            print(f"[study] row {name}: {' '.join(dr.argv_of(flags))}", flush=True)
            dr.train(work, args.config, flags)
    if args.only == "standin" or args.only == "rows":
        return
    exports = {n: stage_dir(args.out / "rows" / n, TRAIN) / "export_sglang" for n in todo}
    not_run = sorted(n for n, p in exports.items() if not (p / "config.json").is_file())
    if not_run:  # a grid spread over sessions: evaluate what is trained, say what is not
        print(f"[study] not trained yet, left out of this evaluation: {', '.join(not_run)}")
    todo = {n: f for n, f in todo.items() if n not in not_run}
    drafts = {"standin": standin, **{n: exports[n] for n in todo}}
    for n in todo:   # the curve rows' candidates, each measured on the reported prompts too
        if "epochs" in n:
            drafts.update(export_candidates(args.out / "rows" / n))
    ours = stage_dir(args.out / "rows" / f"scratch_{max(args.shares):g}", TRAIN)
    in_domain = general = None
    if args.only in (None, "eval", "eval_in_domain"):
        in_domain = dr.evaluate(args.out / f"eval_in_domain{args.tag}", args.base, ours, drafts, args,
                             REPO / "assets" / "smollm2" / "responses.jsonl.gz")
    if args.only in (None, "eval", "eval_general"):
        general = dr.evaluate(args.out / f"eval_general{args.tag}", standin_work, ours, drafts, args, GENERAL_HELDOUT)
    if in_domain is None or general is None:
        return
    results = {"rows": todo, "not_run": not_run, "in_domain": pick(in_domain), "general": pick(general),
               "selection": {n: selection(args.out / "rows" / n) for n in todo}}
    (args.out / f"results{args.tag}.json").write_text(json.dumps(results, indent=1))
    table = report(results, args)
    (args.out / f"table{args.tag}.md").write_text(table)
    print(table)


def export_candidates(row: Path) -> dict[str, Path]:
    """{ROW-stepN: folder}: every candidate a curve row's 04 kept (but step 0, the stand-in itself) as an SGLang
    export in row/candidate_exports (written once), so 05 measures each on the reported prompts: is the one
    chosen on 04's selection split within 1% of the best there?"""
    import torch

    from common.draft.export_sglang import export_sglang, load_sglang_export
    from common.draft.manifest import DraftManifest
    from common.target.head import load_target_head
    from common.training.selection import load_candidate

    d = stage_dir(row, TRAIN)
    m = DraftManifest.read(d)
    dtype = json.loads((d / "export_sglang" / "config.json").read_text())["torch_dtype"]
    embed = None
    out = {}
    for c in (m.selection or {}).get("candidates", []):
        if c["step"] == 0:
            continue
        dst = row / "candidate_exports" / f"step_{c['step']:06d}"
        if not (dst / "config.json").is_file():   # export_sglang writes config.json last
            if embed is None:
                embed, _ = load_target_head(m.target["path"], dtype=torch.float32, with_head=False)
            model = load_sglang_export(d / "export_sglang", embed)
            load_candidate(d / "candidates" / f"step_{c['step']:06d}", model)
            export_sglang(model, dst, list(m.capture_points), torch_dtype=dtype)
        out[f"{row.name}-step{c['step']}"] = dst
    return out


def pick(metrics: dict) -> dict:
    return {"num_prompts": metrics["num_prompts"], "drafts": metrics["drafts"], "pairs": metrics["pairs"],
            "deploy": metrics["deploy"]}


def selection(work: Path) -> dict:
    """The selection record of a row's 04 manifest (candidates with replay tau, the chosen step)."""
    from common.draft.manifest import DraftManifest

    return DraftManifest.read(stage_dir(work, TRAIN)).selection or {}


def cell(drafts: dict, name: str, t: str, k: str) -> str:
    return dr.fmt_tau(drafts[name]["tau"][t][k], 2)


def relative(part: dict, a: str, b: str, t: str, k: str) -> str:
    """(tau_a / tau_b - 1) in % with its paired interval, from the stored pair ("not run" without a row)."""
    from common.benchmark.compare import difference

    if a not in part["drafts"] or b not in part["drafts"]:
        return "not run"

    d = difference(part["pairs"], a, b, t, k)
    base = part["drafts"][b]["tau"][t][k]["tau"]
    return (f"{100 * d['difference'] / base:+.1f}% [{100 * d['ci'][0] / base:+.1f}, "
            f"{100 * d['ci'][1] / base:+.1f}]")


def curve(row: str, sel: dict, drafts: dict, t: str) -> list[str]:
    """A curve row's candidates: simulated and replay tau on 04's held-out split, 05's tau of each on the
    reported prompts (export_candidates; step 0 is the stand-in), the chosen one in bold, and how far the
    chosen one is from the best there."""
    k = str(sel["num_draft_tokens"])
    lines = [f"## Epochs: {row}, tau per candidate at k = {k}, T = {t} (chosen in bold)", "",
             "| step | simulated (04 held-out) | replay (04 selection split) | 05 reported prompts [95% CI] |",
             "|---|---|---|---|"]
    served = {}
    for c in sel["candidates"]:
        name = "standin" if c["step"] == 0 else f"{row}-step{c['step']}"
        got = drafts.get(name, {}).get("tau", {}).get(t, {}).get(k)
        if got:
            served[c["step"]] = got["tau"]
        cells = [str(c["step"]), f"{c['sim_tau']:.3f}" if "sim_tau" in c else "-", f"{c['replay_tau']:.3f}",
                 dr.fmt_tau(got, 2) if got else "not measured"]
        if c["step"] == sel["chosen_step"]:
            cells = [f"**{x}**" for x in cells]
        lines.append("| " + " | ".join(cells) + " |")
    if sel["chosen_step"] in served:
        best = max(served, key=served.get)
        gap = 100 * (served[sel["chosen_step"]] / served[best] - 1)
        lines += ["", f"Chosen step {sel['chosen_step']} on the reported prompts: {gap:+.1f}% against the best "
                      f"candidate there (step {best}); the target is within 1%."]
    return lines


def report(results: dict, args) -> str:
    """table.md: tau per row (in-domain, general) at each k and temperature; warm vs scratch and vs the
    stand-in, and forgetting (general tau vs the stand-in's), paired; the epochs curves."""
    ind, gen = results["in_domain"], results["general"]
    temps = sorted(ind["drafts"]["standin"]["tau"], key=float)
    names = ["standin"] + [n for n in results["rows"]]
    lines = ["# Warm start from a stand-in public draft (SmolLM2-135M, CPU)", "",
             f"tau by replay, {ind['num_prompts']} in-domain held-out prompts and {gen['num_prompts']} of the "
             "stand-in's own held-out prompts, [95% CI]; `04` = the scratch row at the full size.", ""]
    for t in temps:
        head = "| draft | " + " | ".join(f"in-domain k={k}" for k in args.num_draft_tokens) + " | " + \
               " | ".join(f"general k={k}" for k in args.num_draft_tokens) + " |"
        lines += [f"## T = {t}", "", head, "|---" * (1 + 2 * len(args.num_draft_tokens)) + "|"]
        for n in names:
            shown = "04" if n == f"scratch_{max(args.shares):g}" else n
            lines.append(f"| {n} | " + " | ".join(cell(ind["drafts"], shown, t, str(k)) for k in args.num_draft_tokens)
                         + " | " + " | ".join(cell(gen["drafts"], shown, t, str(k)) for k in args.num_draft_tokens) + " |")
        lines.append("")
    k = "5" if 5 in args.num_draft_tokens else str(args.num_draft_tokens[0])
    lines += [f"## Paired at k = {k}", "", "| share | T | warm vs scratch | warm_l2sp vs scratch | warm vs stand-in "
              "(in-domain) | forgetting: warm vs stand-in (general) | warm_l2sp vs stand-in (general) |",
              "|---|---|---|---|---|---|---|"]
    for share in sorted(args.shares):
        s = f"{share:g}"
        scratch = "04" if share == max(args.shares) else f"scratch_{s}"
        for t in temps:
            lines.append(f"| {s} | {t} | {relative(ind, f'warm_{s}', scratch, t, k)} | "
                         f"{relative(ind, f'warm_l2sp_{s}', scratch, t, k)} | {relative(ind, f'warm_{s}', 'standin', t, k)} | "
                         f"{relative(gen, f'warm_{s}', 'standin', t, k)} | {relative(gen, f'warm_l2sp_{s}', 'standin', t, k)} |")
    recipes = [n for n in results["rows"] if RECIPE_ROW.match(n)]
    if recipes:   # warm_{flag}{value}_{share} against warm_{share}, the preset's recipe
        lines += ["", f"## Fine-tune recipe at k = {k}, against the preset's (warm row of the same share)", "",
                  "| row | T | in-domain | general (forgetting) |", "|---|---|---|---|"]
        for n in recipes:
            ref = f"warm_{n.rsplit('_', 1)[1]}"
            lines += [f"| {n} vs {ref} | {t} | {relative(ind, n, ref, t, k)} | {relative(gen, n, ref, t, k)} |" for t in temps]
    curves = {n: v for n, v in results["selection"].items() if "epochs" in n and v}
    for n, sel in curves.items():
        lines += ["", *curve(n, sel, ind["drafts"], temps[0])]
    for n in (n for n in results["rows"] if n.startswith("warm") and "epochs" in n):
        scratch = "scratch" + n[len("warm"):]
        lines += ["", f"{n} vs {scratch} at k = {k}, in-domain / general: " + "; ".join(
            f"T {t}: {relative(ind, n, scratch, t, k)} / {relative(gen, n, scratch, t, k)}" for t in temps)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
