"""05 `--draft NAME=PATH`: other EAGLE-3 drafts replayed next to 04's on the same prompts (05b serves them
next to 04's at every setting instead: common/serving/sweep.py, registry.check_servable).

A draft is any EAGLE-3 folder in the SGLang layout (public Kimi drafts, SpecForge output, 04's own
export) or the speculators layout, read and checked against the target by common/draft/imported.py
BEFORE 05 writes anything: a draft that does not fit stops 05 with the importer's one-line StageError.
A draft may read other capture points than 04's: the target's features are computed once per prompt at
the union of every draft's points and each draft is fed its own columns (replay.select_points), so
every draft sees exactly the features an engine would capture for it.

Every draft is replayed on the same held-out prompts at every k, greedy and at each sampled temperature
(reference.py, sampled.py), and split by segment (greedy). Every pair gets a paired 95% bootstrap
interval of the tau difference over the prompts (resampled together), per k and temperature. The draft
to deploy is the one with the highest tau at the serving setting: the smallest k (a chain of 3 is
SGLang's 3,1,4) at the largest --acceptance-temperatures value (greedy when that is 0); it is "clearly
better" only when its interval against every other draft lies above 0.
"""
from __future__ import annotations

import re
from pathlib import Path

from common.benchmark import replay as rp
from common.benchmark import segments as sg
from common.benchmark.formatting import fmt, fmt_ci
from common.draft import OURS  # how 04's draft ("trained" inside 05) is named in the comparison
from common.draft.imported import build_model, check_draft, read_draft
from common.io import read_json
from common.stage import StageError
from common.target.capture import sglang_points_reader, target_architecture
from common.target.head import read_target_text_config

RESERVED = (OURS, "trained", "untrained", "baseline")   # 05's own drafts, and 05b's baseline runs
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
GREEDY = "0"                     # the temperature key of greedy replay


def parse_specs(specs) -> dict[str, Path]:
    """--draft values "NAME=PATH" -> {name: path}; a malformed, reserved or repeated name is refused."""
    out = {}
    for spec in specs or []:
        name, sep, path = str(spec).partition("=")
        if not sep or not path or not NAME.fullmatch(name):
            raise StageError(f"--draft {spec!r}: expected NAME=PATH, NAME of letters, digits, '_', '.', '-'")
        if name in RESERVED or name in out:
            raise StageError(f"--draft {name}: the name is {'used twice' if name in out else 'reserved'} "
                             f"({', '.join(RESERVED)} name 05's own drafts and runs); pick another")
        out[name] = Path(path)
    return out


def check_drafts(specs: dict[str, Path], target_dir: Path) -> dict:
    """{name: (ImportedDraft, its capture points)}: each read and checked against the target (vocab,
    hidden size, capture points within its layers, in SGLang's id convention for its architecture)."""
    tcfg = read_target_text_config(target_dir)
    reader = sglang_points_reader(target_architecture(read_json(Path(target_dir) / "config.json")))
    checked = {}
    for name, path in specs.items():
        d = read_draft(path)
        checked[name] = (d, check_draft(d, tcfg, reader, capture_points=None))
    return checked


def build_drafts(checked: dict, embed, device) -> tuple[dict, dict]:
    """({name: float32 model on `device`}, {name: identity + capture_points}) of check_drafts' drafts;
    `embed` is the target's input embedding, which the engines feed every draft."""
    models = {n: build_model(d, embed).to(device) for n, (d, _) in checked.items()}
    return models, {n: {**d.identity(), "capture_points": pts} for n, (d, pts) in checked.items()}


def identity(path: Path, points: list[int]) -> dict:
    """A draft folder's identity as the importer reads it (04's own export, beside the --draft ones)."""
    return {**read_draft(path).identity(), "capture_points": list(points)}


def shown(name: str) -> str:
    return OURS if name == "trained" else name


def compare_drafts(args, replayed: dict, sampled_totals: dict, compared: dict, labels, rows: list[dict]) -> dict:
    """metrics.json's `drafts`, `pairs` and `deploy`. replayed[(name, k)]: greedy SpecResults per prompt;
    sampled_totals[T][name][k]: (per-prompt emitted, rounds) at T > 0 (sampled.run_sampled); compared:
    {name: identity} of the drafts to compare, 04's as "trained"; labels: segment labels (or None)."""
    ks = sorted(set(args.num_draft_tokens))
    totals = {GREEDY: {n: {k: rp.prompt_totals(replayed[(n, k)]) for k in ks} for n in compared}}
    totals.update(sampled_totals)
    drafts = {}
    for n, identity in compared.items():
        drafts[shown(n)] = {**identity, "tau": {t: {str(k): tau_cell(*totals[t][n][k], args.bench_seed) for k in ks}
                                                for t in totals}}
        if labels is not None:
            drafts[shown(n)]["by_segment"] = {str(k): segment_cells(replayed[(n, k)], labels, rows, k, args.bench_seed)
                                              for k in ks}
    names = list(compared)
    pairs = [{"a": shown(a), "b": shown(b),
              "by_temperature": {t: {str(k): rp.bootstrap_paired_difference(*totals[t][a][k], *totals[t][b][k],
                                                                            seed=args.bench_seed) for k in ks}
                                 for t in totals}}
             for i, b in enumerate(names) for a in names[i + 1:]]
    return {"drafts": drafts, "pairs": pairs, "deploy": deploy(drafts, pairs, max(totals, key=float), str(ks[0]))}


def tau_cell(num: list, den: list, seed: int) -> dict:
    return {"tau": sum(num) / sum(den) if sum(den) else None,
            "tau_ci95": list(rp.bootstrap_ratio(num, den, seed=seed))}


def segment_cells(results, labels, rows: list[dict], k: int, seed: int) -> dict:
    cells = sg.breakdown(results, labels, [r["source"] for r in rows], k, seed)["by_segment"]
    return {s: {"tau": c["tau"], "tau_ci95": c["tau_ci95"], "num_rounds": c["num_rounds"]} for s, c in cells.items()}


def difference(pairs: list[dict], a: str, b: str, t: str, k: str) -> dict:
    """tau_a - tau_b with its paired interval at (t, k), from whichever way round the pair was stored."""
    for p in pairs:
        d = p["by_temperature"][t][k]
        if (p["a"], p["b"]) == (a, b):
            return {"difference": d["difference"], "ci": d["ci"]}
        if (p["a"], p["b"]) == (b, a):
            return {"difference": 0.0 - d["difference"], "ci": [0.0 - d["ci"][1], 0.0 - d["ci"][0]]}  # no -0.0
    raise KeyError((a, b))


def deploy(drafts: dict, pairs: list[dict], t: str, k: str) -> dict:
    """The highest tau at temperature t and chain k (ties: the first listed, 04's), and whether its paired
    interval against every other draft lies above 0."""
    best = max(drafts, key=lambda n: drafts[n]["tau"][t][k]["tau"] or 0.0)
    against = {o: difference(pairs, best, o, t, k) for o in drafts if o != best}
    close = [o for o, d in against.items() if d["ci"][0] <= 0]
    cell = drafts[best]["tau"][t][k]
    setting = f"k={k}, {'greedy' if t == GREEDY else f'T={t}'}"

    def listed(names):
        return ", ".join(f"{o} ({fmt(against[o]['difference'], 3)} {fmt_ci(against[o]['ci'])})" for o in names)
    if not close:
        statement = (f"deploy {best}: tau {fmt(cell['tau'])} {fmt_ci(cell['tau_ci95'])} at {setting}, clearly "
                     f"better than every other draft (paired 95% interval of the difference above 0: "
                     f"{listed(against)})")
    else:
        pool = [best] + close
        cheapest = min(pool, key=lambda n: drafts[n]["draft_vocab_size"])
        statement = (f"{best} has the highest tau, {fmt(cell['tau'])} {fmt_ci(cell['tau_ci95'])} at {setting}, but "
                     f"is not distinguishable from {listed(close)}: the paired 95% interval holds 0, so these "
                     f"prompts do not separate them. Keep the cheaper or the public one ({cheapest} has the "
                     f"smallest draft vocab, {drafts[cheapest]['draft_vocab_size']}: the cheapest lm_head per "
                     "draft step; a public draft needs no training run of its own)")
        clear = [o for o in against if o not in close]
        if clear:
            statement += f"; clearly better than {listed(clear)}"
    return {"draft": best, "num_draft_tokens": int(k), "temperature": float(t), "tau": cell["tau"],
            "tau_ci95": cell["tau_ci95"], "clearly_better": not close, "not_distinguishable_from": close,
            "against": against, "statement": statement}


def report_lines(m: dict) -> list[str]:
    """report.md's section: the drafts, tau per draft x k x temperature, the pair differences, by segment,
    and the deploy line."""
    drafts, temps = m["drafts"], list(next(iter(m["drafts"].values()))["tau"])
    head = " | ".join(f"tau {temp_label(t)} | 95% CI" for t in temps)
    lines = ["## Drafts compared (04's and --draft)", "",
             f"Every draft replayed on the same {m['num_prompts']} held-out prompts, fed the target's features "
             f"at its own capture points; `{OURS}` is this work dir's 04 export. Pair intervals: paired "
             "bootstrap over prompts of tau_a - tau_b.", "",
             "| draft | layout | capture points | draft vocab | sha256 | path |", "|---|---|---|---|---|---|"]
    for n, d in drafts.items():
        lines.append(f"| {n} | {d['layout']} | h{d['capture_points']} | {d['draft_vocab_size']} | "
                     f"`{d['sha256'][:12]}` | `{d['path']}` |")
    lines += ["", f"| draft | k | {head} |", "|---|---|" + "---|---|" * len(temps)]
    for n, d in drafts.items():
        for k in d["tau"][temps[0]]:
            lines.append(f"| {n} | {k} | " + " | ".join(
                f"{fmt(d['tau'][t][k]['tau'])} | {fmt_ci(d['tau'][t][k]['tau_ci95'])}" for t in temps) + " |")
    lines += ["", "| a - b | k | T | difference | 95% CI | relative | 95% CI |", "|---|---|---|---|---|---|---|"]
    for p in m["pairs"]:
        for t, by_k in p["by_temperature"].items():
            for k, d in by_k.items():
                lines.append(f"| {p['a']} - {p['b']} | {k} | {temp_label(t)} | {fmt(d['difference'], 3)} | "
                             f"{fmt_ci(d['ci'])} | {fmt(d['relative'], 3)} | {fmt_ci(d['relative_ci'])} |")
    if all("by_segment" in d for d in drafts.values()):
        lines += ["", "By segment (greedy; tau [95% CI], `empty` = no round):", "",
                  "| draft | k | " + " | ".join(sg.SEGMENTS) + " |", "|---|---|" + "---|" * len(sg.SEGMENTS)]
        for n, d in drafts.items():
            for k, cells in d["by_segment"].items():
                lines.append(f"| {n} | {k} | " + " | ".join(
                    "empty" if not c["num_rounds"] else f"{fmt(c['tau'])} {fmt_ci(c['tau_ci95'])}"
                    for c in cells.values()) + " |")
    return lines + ["", f"**Deploy** (serving setting: the smallest k at the largest temperature): "
                        f"{m['deploy']['statement']}.", ""]


def temp_label(t: str) -> str:
    return "greedy" if t == GREEDY else f"T={t}"


def summary_lines(m: dict) -> list[str]:
    """05's console lines: one per draft (tau per k at the serving temperature), then the deploy line."""
    t = GREEDY if not m["deploy"]["temperature"] else f"{m['deploy']['temperature']:g}"
    out = []
    for n, d in m["drafts"].items():
        taus = ", ".join(f"k={k} {fmt(c['tau'])} {fmt_ci(c['tau_ci95'])}" for k, c in d["tau"][t].items())
        out.append(f"[05] draft {n} ({d['layout']}, h{d['capture_points']}), {temp_label(t)}: {taus}")
    return out + [f"[05] {m['deploy']['statement']}"]
