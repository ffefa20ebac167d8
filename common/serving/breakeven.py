"""The break-even map (05b --simulate-accept-lengths): what tau a draft must reach, per engine, setting and cell
of the load x context grid, before it pays on this box - measured before any draft is trained.

Why: whether speculation pays depends on the draft's tau and on what a verify round costs here (engine, its
settings, the concurrency, the prompt length). The second is measurable without a trained draft: each engine can
be told to commit a chosen number of tokens a verify round (Engine.simulates: SGLANG_SIMULATE_ACC_LEN for SGLang,
speculative_config rejection_sample_method 'synthetic' for vLLM) while it drafts with a draft of the right shape
(04's, the public one, an untrained export) and verifies as it would. Each simulated server is confirmed to be
simulated by the same test that refuses simulation in a real measurement (engine.confirm_simulated, before launch
and from its info document) and by its warm-up (engine.check_simulated_tau); its runs live in metrics["map"] only
(sweep.Sweep), never in metrics["runs"], so no tau table, ratio table or deploy choice reads them.

Fairness: the map times its own baseline passes on the same baseline server, at the serving temperature, every
answer of the baseline and of the simulated servers run to the budget (`ignore_eos`): a simulated SGLang answer
never ends (id 100 to the budget), so answers of equal length keep the prefill's share equal. The measured ratios
(the sweep's) are taken on natural answer lengths.

The model, per (engine, graph mode, chain k, prompt bucket, concurrency), at the serving temperature:
    tok/s(tau) = 1 / (alpha + beta / tau)   time per token = a fixed part (prefill, per-request overheads) plus
                                            the round's cost shared by the tau tokens it commits
so the ratio to the baseline rho(tau) = 1 / (a + b / tau); a, b by least squares of 1/rho on 1/tau over the
simulated lengths (tau: the committed tokens per verify round each simulated run measured, the prefill token left
out: the tau of 05's replay and of the engines' own counters). The break-even tau for a target ratio r (1, 1.2, 1.5)
is tau*(r) = b / (1/r - a): infinite ("never") when 1/r <= a, and no draft at k reaches more than k + 1.

The interval: every server's timed passes scatter; that scatter (of log tok/s, pooled over the cell's baseline and
simulated servers, df = sum of passes - 1) is propagated through the fit by DRAWS seeded draws (each server's mean
moved by sigma' z / sqrt(passes), sigma' drawn from its chi-square law), and the 2.5 and 97.5 percentiles of
tau*(r) are its 95% interval. One pass: no interval.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from common.benchmark.formatting import fmt
from common.draft import OURS
from common.serving.context import SHORT, context_level
from common.serving.deploy import reference_at, serving_level
from common.serving.settings import fixed_chain, simulated, simulated_length
from common.stage import StageError

TARGETS = (1.0, 1.2, 1.5)
DRAWS = 2000
MAP_FILE = "breakeven_map.png"
CURVES_FILE = "breakeven_curves.png"


# ---------------------------------------------------------------- what the map serves
def map_settings(plan, engine) -> list[tuple]:
    """The chains the map simulates (--simulate-settings, default: the fixed chains of --spec-settings), each as
    the engine parses it; a setting that is not a plain chain is refused (its rounds are not one shape)."""
    texts = plan.simulate_settings or [s for s in plan.spec_settings if is_chain(engine.parse_setting(s))]
    out = []
    for text in texts:
        setting = engine.parse_setting(text)
        if not is_chain(setting):
            raise StageError(f"--simulate-settings {text!r}: the map simulates chains (steps,1,steps+1) only")
        out.append(setting)
    return out


def is_chain(setting) -> bool:
    """A plain chain (steps, 1, steps + 1): what the map simulates."""
    return fixed_chain(setting) and setting[1] == 1


def map_draft(plan, engine):
    """The draft whose shape the simulated servers serve (--simulate-draft NAME; default 04's, else the first
    declared one)."""
    drafts = engine.drafts
    if not drafts:
        raise StageError("--simulate-accept-lengths needs a draft of the shape to serve: 04's export or a --draft")
    name = plan.simulate_draft or drafts[0].name
    found = [d for d in drafts if d.name == name]
    if not found:
        raise StageError(f"--simulate-draft {name!r} is none of the served drafts ({', '.join(d.name for d in drafts)})")
    return found[0]


def simulations(plan, engine) -> list[tuple]:
    """(simulated setting, draft) of every server the map launches for `engine`, [] without the map. `plan`: the
    sweep's plan (sweep.SweepPlan: --simulate-accept-lengths, --simulate-settings, --simulate-draft, --known-tau,
    --spec-settings), as in map_settings, map_draft and board."""
    lengths = plan.simulate_accept_lengths
    if not lengths:
        return []
    draft = map_draft(plan, engine)
    return [(simulated(s, length), draft) for s in map_settings(plan, engine) for length in lengths]


def check_lengths(lengths: list[float]) -> None:
    if lengths and (len(set(lengths)) < 2 or min(lengths) < 1.0):
        raise StageError("--simulate-accept-lengths: at least two different lengths, each >= 1 (tokens a verify "
                         "round commits, the bonus token included)")


def board(metrics: dict, plan, engine) -> dict:
    """metrics["map"]'s record of `engine` (created with the map's own record on first use): where the Sweep puts
    the engine's simulated runs and its baseline's map passes, kept apart from metrics["runs"]."""
    m = metrics.setdefault("map", {"simulated": True, "lengths": [float(x) for x in plan.simulate_accept_lengths],
                                   "temperature": f"{serving_level(metrics['temperatures']):s}",
                                   "known_taus": parse_known_taus(plan.known_tau),
                                   "engines": {}})
    return m["engines"].setdefault(engine.name, {"label": engine.label, "simulates": engine.simulates,
                                                 "draft": map_draft(plan, engine).name, "runs": {}, "commands": {}})


def parse_known_taus(items: list[str]) -> list[dict]:
    """--known-tau NAME=TAU (at every k) or NAME@K=TAU: a draft's tau from elsewhere (a model card) to mark."""
    out = []
    for item in items:
        name, _, value = str(item).partition("=")
        label, _, k = name.partition("@")
        try:
            out.append({"name": label, "k": int(k) if k else None, "tau": float(value)})
        except ValueError:
            raise StageError(f"--known-tau {item!r}: expected NAME=TAU or NAME@K=TAU, e.g. public@3=2.69") from None
    return out


# ---------------------------------------------------------------- the fit
def cell(entry: dict | None, t: str, ctx: str, c: str) -> dict | None:
    level = (entry or {}).get("by_temperature", {}).get(t)
    x = context_level(level, ctx).get("by_concurrency", {}).get(c) if level else None
    return None if not x or x.get("refused") or not x.get("output_tokens_per_s_passes") else x


def round_tau(x: dict) -> float | None:
    """Committed tokens per verify round over a run's requests, each answer's prefill token left out."""
    reqs = [r for r in x.get("requests") or [] if r.get("spec_verify_ct")]
    rounds = sum(r["spec_verify_ct"] for r in reqs)
    return sum(r["completion_tokens"] - 1 for r in reqs) / rounds if rounds else None


def pooled_scatter(servers: list[list[float]]) -> tuple[float, int]:
    """(sigma, df) of log tok/s over each server's passes, pooled."""
    logs = [[math.log(v) for v in s] for s in servers if len(s) > 1]
    df = sum(len(s) - 1 for s in logs)
    ss = sum((v - statistics.mean(s)) ** 2 for s in logs for v in s)
    return (math.sqrt(ss / df) if df else 0.0), df


def fit_ratio(inv_tau: np.ndarray, inv_ratio: np.ndarray) -> tuple[float, float]:
    """(a, b) of 1/rho = a + b/tau by least squares (two or more distinct lengths)."""
    x = np.column_stack([np.ones_like(inv_tau), inv_tau])
    (a, b), *_ = np.linalg.lstsq(x, inv_ratio, rcond=None)
    return float(a), float(b)


def tau_star(a: float, b: float, r: float) -> float:
    """The tau at which rho = r: inf when no tau reaches it (1/r <= a), 1 when any tau does, nan when the fitted
    ratio does not rise with tau (b <= 0: the passes' noise is larger than what tau changes)."""
    if b <= 0:
        return math.nan
    g = 1.0 / r - a
    return math.inf if g <= 0 else max(1.0, b / g)


def ratio_at(a: float, b: float, tau: float) -> float:
    return 1.0 / (a + b / tau)


def fit_cell(base: dict, points: list[tuple[float, dict, float]]) -> dict | None:
    """The fit of one (engine, graph mode, k, bucket, c) from its map baseline cell and its (tau measured,
    simulated cell, simulated length) points; None with fewer than two distinct taus. Its "draws" (the
    interval's refits) are for this process only: summary() drops them before metrics.json."""
    pts = sorted((tau, x, length) for tau, x, length in points if tau)
    if len({round(t, 6) for t, _, _ in pts}) < 2:
        return None
    taus = np.array([t for t, _, _ in pts])
    servers = [base["output_tokens_per_s_passes"]] + [x["output_tokens_per_s_passes"] for _, x, _ in pts]
    means = np.array([statistics.mean(math.log(v) for v in s) for s in servers])
    a, b = fit_ratio(1.0 / taus, np.exp(means[0] - means[1:]))
    sigma, df = pooled_scatter(servers)
    out = {"a": a, "b": b, "taus": taus.tolist(), "lengths": [length for _, _, length in pts],
           "ratios": np.exp(means[1:] - means[0]).tolist(), "baseline_tokens_per_s": float(np.exp(means[0])),
           "sigma": sigma, "df": df, "tau_range": [float(taus.min()), float(taus.max())],
           "max_relative_residual": float(np.max(np.abs(ratio_at(a, b, taus) / np.exp(means[1:] - means[0]) - 1)))}
    draws = draw_fits(means, [len(s) for s in servers], 1.0 / taus, sigma, df) if df else None
    out["draws"] = draws
    out["break_even"] = {f"{r:g}": break_even(a, b, r, draws) for r in TARGETS}
    return out


def draw_fits(means: np.ndarray, passes: list[int], inv_tau: np.ndarray, sigma: float, df: int) -> list:
    """(a, b) of DRAWS seeded refits with every server's mean moved by its pass scatter (module docstring)."""
    rng = np.random.default_rng(0)
    n = np.array(passes, dtype=float)
    out = []
    for _ in range(DRAWS):
        s = sigma * math.sqrt(df / rng.chisquare(df))
        m = means + s * rng.standard_normal(len(means)) / np.sqrt(n)
        out.append(fit_ratio(inv_tau, np.exp(m[0] - m[1:])))
    return out


def break_even(a: float, b: float, r: float, draws: list | None) -> dict:
    point = tau_star(a, b, r)
    if not draws:
        return {"tau": point, "ci95": None}
    vals = np.nan_to_num(np.array([tau_star(x, y, r) for x, y in draws]), nan=math.inf)  # unresolved: no bound
    return {"tau": point, "ci95": [float(np.quantile(vals, 0.025, method="lower")),
                                   float(np.quantile(vals, 0.975, method="higher"))]}


def predicted_ratio(fit: dict, tau: float) -> tuple[float, list | None]:
    """The map's ratio at `tau` and its 95% interval over the draws."""
    point = ratio_at(fit["a"], fit["b"], tau)
    if not fit.get("draws"):
        return point, None
    vals = np.array([ratio_at(a, b, tau) for a, b in fit["draws"]])
    return point, [float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975))]


# ---------------------------------------------------------------- the map: every cell, its marks and verdicts
def summary(metrics: dict, reference: dict | None = None) -> dict:
    """metrics["map"]["breakeven"]: a row per (engine, graph mode, k, bucket, c) with its fit, break-even taus
    and intervals, the taus to hold against it (marks) and its verdict; the cells where no setting of an engine
    can pay (`off`); the best engine per cell when the map ran several (`best_engine`); and the simulated-vs-real
    check of the drafts the sweep measured (`simulation_check`). `reference`: 05's metrics of 04's draft."""
    rows = map_rows(metrics)
    for row in rows:
        row["marks"] = marks(metrics, reference, row)
        row["verdict"] = verdict(row)
    out = {"rows": rows, "off": off_cells(rows), "best_engine": best_engine(rows, metrics),
           "simulation_check": simulation_check(metrics, rows)}
    for row in rows:
        (row["fit"] or {}).pop("draws", None)
        for x in ((row["fit"] or {}).get("break_even") or {}).values():   # JSON: no Infinity, no NaN
            x["tau"], x["ci95"] = stored(x["tau"]), x["ci95"] and [stored(v) for v in x["ci95"]]
    return out


def stored(v: float):
    """A break-even tau as metrics.json keeps it: "never" for infinity, None when unresolved (nan)."""
    return "never" if math.isinf(v) else None if math.isnan(v) else v


def number(v) -> float:
    """stored's inverse."""
    return math.inf if v == "never" else math.nan if v is None else float(v)


def map_rows(metrics: dict) -> list[dict]:
    m, rows = metrics["map"], []
    t, concs = m["temperature"], [str(c) for c in metrics["concurrency"]]
    for name, b in m["engines"].items():
        for graph in sorted({bool(e["cuda_graph"]) for e in b["runs"].values()}):
            base = b["runs"].get(f"baseline/{'graph' if graph else 'nograph'}")
            sims = [e for e in b["runs"].values()
                    if simulated_length(e.get("setting")) is not None and bool(e["cuda_graph"]) == graph]
            for k in sorted({int(e["setting"][0]) for e in sims}):
                for ctx in metrics["contexts"]:
                    for c in concs:
                        bcell = cell(base, t, ctx, c)
                        pts = [(round_tau(x), x, simulated_length(e["setting"])) for e in sims
                               if int(e["setting"][0]) == k for x in [cell(e, t, ctx, c)] if x]
                        rows.append({"engine": name, "cuda_graph": graph, "setting": [k, 1, k + 1], "context": ctx,
                                     "concurrency": c, "fit": fit_cell(bcell, pts) if bcell else None})
    return rows


def marks(metrics: dict, reference: dict | None, row: dict) -> list[dict]:
    """The taus to read the row against: --known-tau ones for its k, 05's replay tau of 04's draft at its k and
    the map's temperature, and each draft the sweep served at its setting, graph mode and cell (per round, the
    prefill token left out), measured on the sweep's engine."""
    k, t = row["setting"][0], metrics["map"]["temperature"]
    out = [{"name": x["name"], "tau": x["tau"], "source": "--known-tau"} for x in metrics["map"]["known_taus"]
           if x["k"] in (None, k)]
    ref = ((reference_at(reference, t) or {}).get("by_num_draft_tokens") or {}).get(str(k))
    if ref and ref.get("tau"):
        out.append({"name": f"{OURS} replay", "tau": float(ref["tau"]), "source": "05 reference (replay)"})
    for key, e in metrics["runs"].items():
        if list(e.get("setting") or [])[:3] == row["setting"] and len(e["setting"]) == 3 \
                and bool(e["cuda_graph"]) == row["cuda_graph"]:
            x = cell(e, t, row["context"], row["concurrency"])
            tau = round_tau(x) if x else None
            if tau:
                out.append({"name": f"{e.get('draft', OURS)} served", "tau": tau,
                            "source": f"{metrics['engine']} {key}"})
    return out


def verdict(row: dict) -> str:
    """"never" (no tau reaches the baseline), "above k+1" (no draft at this k can), "above the best tau known"
    (none of its marks does), "pays above tau*", "unresolved" (the fitted ratio does not rise with tau: noise), or
    "no fit" (fewer than two simulated lengths were believed)."""
    fit = row["fit"]
    if fit is None:
        return "no fit"
    k, tau = row["setting"][0], fit["break_even"]["1"]["tau"]
    known = [m["tau"] for m in row["marks"]]
    if math.isnan(tau):
        return "unresolved (the ratio does not rise with tau: more passes)"
    if math.isinf(tau):
        return "never"
    if tau > k + 1:
        return "above k+1"
    if known and tau > max(known):
        return "above the best tau known"
    return "pays above tau*"


def off_cells(rows: list[dict]) -> list[dict]:
    """(engine, graph mode, bucket, c) where no simulated setting can pay: every fitted row is never, above k+1 or
    above the best tau known. Speculation stays off there."""
    groups = {}
    for row in rows:
        groups.setdefault((row["engine"], row["cuda_graph"], row["context"], row["concurrency"]), []).append(row)
    return [{"engine": e, "cuda_graph": g, "context": ctx, "concurrency": c,
             "why": "; ".join(f"k={r['setting'][0]}: {r['verdict']}" for r in rs)}
            for (e, g, ctx, c), rs in groups.items()
            if any(r["fit"] for r in rs) and all(r["verdict"] != "pays above tau*" for r in rs if r["fit"])]


def best_engine(rows: list[dict], metrics: dict) -> list[dict]:
    """With two or more engines in the map: per bucket and concurrency, at each tau to read it at (every mark,
    else every simulated length), the engine, graph mode and k whose fit gives the most tok/s, next to the fastest
    baseline of any engine (what runs without speculation)."""
    if len({r["engine"] for r in rows}) < 2:
        return []
    out = []
    for ctx in metrics["contexts"]:
        for c in [str(x) for x in metrics["concurrency"]]:
            here = [r for r in rows if r["context"] == ctx and r["concurrency"] == c and r["fit"]]
            if not here:
                continue
            base = max(here, key=lambda r: r["fit"]["baseline_tokens_per_s"])
            ats = {(m["name"], m["tau"]) for r in here for m in r["marks"]} or \
                {(f"L={x:g}", x) for x in metrics["map"]["lengths"]}
            for name, tau in sorted(ats, key=lambda x: x[1]):
                cand = [(r["fit"]["baseline_tokens_per_s"] * ratio_at(r["fit"]["a"], r["fit"]["b"], min(tau, r["setting"][0] + 1)), r)
                        for r in here]
                tps, r = max(cand, key=lambda x: x[0])
                out.append({"context": ctx, "concurrency": c, "at": name, "tau": tau, "engine": r["engine"],
                            "cuda_graph": r["cuda_graph"], "setting": r["setting"], "tokens_per_s": tps,
                            "fastest_baseline": base["engine"],
                            "baseline_tokens_per_s": base["fit"]["baseline_tokens_per_s"],
                            "speculate": tps > base["fit"]["baseline_tokens_per_s"]})
    return out


def simulation_check(metrics: dict, rows: list[dict]) -> list[dict]:
    """The simulation against reality: every measured run of the map's draft on the map's engine at a chain the
    map simulated, at the map's temperature, per cell: its ratio to the baseline (the sweep's, with its interval
    over paired passes) against the map's ratio at the tau that run measured (with the map's interval). They agree
    when the intervals overlap (check_at_tau)."""
    primary, out = metrics["engine"], []
    board_ = metrics["map"]["engines"].get(primary)
    if not board_:
        return out
    t = metrics["map"]["temperature"]
    for key, e in metrics["runs"].items():
        if e.get("draft", OURS) != board_["draft"] or not fixed_chain(e.get("setting")):
            continue
        for row in rows:
            if row["engine"] != primary or row["setting"] != list(e["setting"]) or not row["fit"] \
                    or row["cuda_graph"] != bool(e["cuda_graph"]):
                continue
            x = cell(e, t, row["context"], row["concurrency"])
            if x and x.get("speed_ratio") and round_tau(x):
                out.append({"run": key, "context": row["context"], "concurrency": row["concurrency"],
                            **check_at_tau(row["fit"], round_tau(x), x["speed_ratio"], x.get("speed_ratio_ci95"))})
    return out


def check_at_tau(fit: dict, tau: float, ratio: float, ratio_ci: list | None) -> dict:
    """One measured run against the map: the map's ratio at the run's tau (with its interval over the draws)
    against the run's ratio (with its interval over paired passes). `agree`: the intervals overlap (a missing one
    is its point); `in_range`: the tau lies within the simulated taus (else the map extrapolates)."""
    pred, pci = predicted_ratio(fit, tau)
    lo, hi = ratio_ci or [ratio, ratio]
    plo, phi = pci or [pred, pred]
    return {"tau": tau, "ratio": ratio, "ratio_ci95": ratio_ci, "predicted": pred, "predicted_ci95": pci,
            "in_range": fit["tau_range"][0] <= tau <= fit["tau_range"][1], "agree": lo <= phi and plo <= hi,
            "difference": ratio / pred - 1}


# ---------------------------------------------------------------- report.md and the PNGs
def fmt_tau(x: dict) -> str:
    """A break-even tau with its interval: 'never' for infinity."""
    show = lambda v: "never" if math.isinf(number(v)) else "-" if math.isnan(number(v)) else f"{v:.2f}"  # noqa: E731
    ci = x.get("ci95")
    return show(x["tau"]) + (f" [{show(ci[0])}, {show(ci[1])}]" if ci else "")


def where(row: dict) -> str:
    return f"{'~' + row['context'] + ' tokens' if row['context'] != SHORT else SHORT} c={row['concurrency']}"


def report_lines(metrics: dict) -> list[str]:
    """The map's section of report.md (after the measured tables and the deploy section, which never read it)."""
    m = metrics.get("map") or {}
    s = m.get("breakeven")
    if not s:
        return []
    how = "; ".join(f"{b['label']}: {b['simulates']}, draft {b['draft']}" for b in m["engines"].values())
    lines = ["", "## Break-even map (simulated acceptance: these rows measure the box, not a draft)", "",
             f"Every verify round of these servers was made to commit a set number of tokens ({how}), at lengths "
             f"{', '.join(f'{x:g}' for x in m['lengths'])}, at T {m['temperature']}, every answer (and the map's own "
             "baseline passes) run to the budget. tau* = the tau per verify round (prefill token left out: 05's replay "
             "tau) at which EAGLE-3 equals the baseline (x1.0), x1.2, x1.5, from tok/s = 1 / (alpha + beta / tau) fitted "
             "on the simulated taus; 95% interval: the servers' pass-to-pass scatter through the fit "
             "(common/serving/breakeven.py). None of these rows is in the tables above or in what to deploy. "
             f"`{MAP_FILE}`, `{CURVES_FILE}`.", "",
             "| engine | graph | setting | prompts, c | tau* x1.0 | x1.2 | x1.5 | taus to hold against it | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in s["rows"]:
        fit = row["fit"]
        be = fit["break_even"] if fit else None
        shown = ", ".join(f"{x['name']} {x['tau']:.2f}" for x in row["marks"]) or "-"
        lines.append(f"| {m['engines'][row['engine']]['label']} | {'on' if row['cuda_graph'] else 'off'} | "
                     f"{','.join(map(str, row['setting']))} | {where(row)} | "
                     + (" | ".join(fmt_tau(be[f'{r:g}']) for r in TARGETS) if be else "- | - | -")
                     + f" | {shown} | {row['verdict']}"
                     + (f" (fit residual {100 * fit['max_relative_residual']:.1f}%)" if fit else "") + " |")
    lines += off_lines(s["off"], m) + best_engine_lines(s["best_engine"], m) + check_lines(s["simulation_check"])
    return lines + simulated_run_lines(metrics)


def off_lines(off: list[dict], m: dict) -> list[str]:
    if not off:
        return ["", "No cell is out of reach: in every cell some simulated setting pays at a tau a draft can reach."]
    return ["", "**Cells no realistic draft can win** (break-even above k + 1, never, or above every tau known there): "
            "run without speculation there.", ""] + [
        f"- {m['engines'][x['engine']]['label']} graphs {'on' if x['cuda_graph'] else 'off'}, {where(x)}: {x['why']}"
        for x in off]


def best_engine_lines(rows: list[dict], m: dict) -> list[str]:
    if not rows:
        return []
    lines = ["", "### The best engine per cell (from the fits: predicted, not measured)", "",
             "| prompts, c | at tau | best | its tok/s | fastest baseline | baseline tok/s | speculate |",
             "|---|---|---|---|---|---|---|"]
    return lines + [f"| {where(r)} | {r['at']} ({r['tau']:.2f}) | {m['engines'][r['engine']]['label']} "
                    f"{','.join(map(str, r['setting']))} graphs {'on' if r['cuda_graph'] else 'off'} | "
                    f"{r['tokens_per_s']:.1f} | {m['engines'][r['fastest_baseline']]['label']} | "
                    f"{r['baseline_tokens_per_s']:.1f} | {'yes' if r['speculate'] else 'no'} |" for r in rows]


def check_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "### The simulation against reality", "",
             "Each measured run of the map's draft at a simulated chain: its ratio to the baseline against the map's "
             "ratio at the tau it measured; they agree when the intervals overlap.", "",
             "| run | prompts, c | tau measured | ratio measured | map's ratio at that tau | within the simulated "
             "taus | agree |", "|---|---|---|---|---|---|---|"]
    ci = lambda x: f" [{fmt(x[0])}, {fmt(x[1])}]" if x else ""  # noqa: E731
    return lines + [f"| {r['run']} | {where(r)} | {r['tau']:.2f} | x{fmt(r['ratio'])}{ci(r['ratio_ci95'])} | "
                    f"x{fmt(r['predicted'])}{ci(r['predicted_ci95'])} | {'yes' if r['in_range'] else 'no'} | "
                    f"{'yes' if r['agree'] else '**no**'} |" for r in rows]


def simulated_run_lines(metrics: dict) -> list[str]:
    m = metrics["map"]
    lines = ["", "### The map's runs (every row simulated, or the map's baseline passes)", "",
             "| engine | run | simulated length | prompts, c | tok/s (passes) | tau per round | x map baseline | 95% CI |",
             "|---|---|---|---|---|---|---|---|"]
    for b in m["engines"].values():
        for key, e in b["runs"].items():
            length = simulated_length(e.get("setting"))
            for ctx in metrics["contexts"]:
                for c in [str(x) for x in metrics["concurrency"]]:
                    x = cell(e, m["temperature"], ctx, c)
                    if x is None:
                        continue
                    ci = x.get("speed_ratio_ci95")
                    lines.append(f"| {b['label']} | {key} | {'-' if length is None else f'{length:g}'} | "
                                 f"{where({'context': ctx, 'concurrency': c})} | "
                                 f"{', '.join(fmt(v, 1) for v in x['output_tokens_per_s_passes'])} | "
                                 f"{fmt(round_tau(x)) if length is not None else '-'} | {fmt(x.get('speed_ratio'))} | "
                                 f"{f'[{fmt(ci[0])}, {fmt(ci[1])}]' if ci else '-'} |")
    return lines


def plot(out, metrics: dict) -> None:
    """breakeven_map.png: per engine and graph mode, cells (rows) x simulated chains (columns) coloured by
    tau* x1.0, each box its value with interval and the best tau known there (a tick when it clears tau*);
    breakeven_curves.png: per cell, each fit's ratio against tau, its points, and the measured runs' taus."""
    s = (metrics.get("map") or {}).get("breakeven")
    if not s or not any(r["fit"] for r in s["rows"]):
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["engine"], r["cuda_graph"]) for r in s["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 4.5 * len(panels) + 1), 1.1 * len(
        {(r["context"], r["concurrency"]) for r in s["rows"]}) + 2), squeeze=False)
    for ax, (engine, graph) in zip(axes[0], panels):
        map_panel(ax, [r for r in s["rows"] if (r["engine"], r["cuda_graph"]) == (engine, graph)],
                  f"{metrics['map']['engines'][engine]['label']}, graphs {'on' if graph else 'off'}")
    fig.suptitle(f"break-even tau per verify round (x1.0), T {metrics['map']['temperature']}, simulated acceptance;"
                 " 'best': the highest tau known there", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / MAP_FILE, dpi=100)
    plt.close(fig)
    curves(out, s["rows"], metrics, s["simulation_check"])


def map_panel(ax, rows: list[dict], title: str) -> None:
    cells_ = list(dict.fromkeys((r["context"], r["concurrency"]) for r in rows))
    ks = sorted({r["setting"][0] for r in rows})
    grid = np.full((len(cells_), len(ks)), np.nan)
    for r in rows:
        i, j = cells_.index((r["context"], r["concurrency"])), ks.index(r["setting"][0])
        tau = number(r["fit"]["break_even"]["1"]["tau"]) if r["fit"] else np.nan
        grid[i, j] = min(tau, ks[j] + 1.5)
        best = max([m["tau"] for m in r["marks"]], default=None)
        text = fmt_tau(r["fit"]["break_even"]["1"]).replace(" [", "\n[") if r["fit"] else "no fit"
        if best is not None and r["fit"] and not math.isnan(tau):
            text += f"\nbest {best:.2f} {'ok' if best >= tau else 'short'}"
        ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.imshow(grid, cmap="RdYlGn_r", vmin=1.0, vmax=max(ks) + 1.5, aspect="auto")
    ax.set_xticks(range(len(ks)), [f"{k},1,{k + 1}" for k in ks])
    ax.set_yticks(range(len(cells_)), [where({"context": x, "concurrency": c}) for x, c in cells_])
    ax.set_title(title, fontsize=9)


def curves(out, rows: list[dict], metrics: dict, checks: list[dict]) -> None:
    import matplotlib.pyplot as plt

    cells_ = list(dict.fromkeys((r["context"], r["concurrency"]) for r in rows))
    fig, axes = plt.subplots(1, len(cells_), figsize=(3.6 * len(cells_), 3.4), squeeze=False, sharey=True)
    for ax, (ctx, c) in zip(axes[0], cells_):
        for r in rows:
            if (r["context"], r["concurrency"]) != (ctx, c) or not r["fit"]:
                continue
            f, k = r["fit"], r["setting"][0]
            xs = np.linspace(1.0, k + 1.0, 50)
            label = f"{metrics['map']['engines'][r['engine']]['label']} k={k}{'' if r['cuda_graph'] else ' eager'}"
            line, = ax.plot(xs, [ratio_at(f["a"], f["b"], x) for x in xs], label=label)
            ax.plot(f["taus"], f["ratios"], "o", color=line.get_color())
            for mk in r["marks"]:
                ax.axvline(mk["tau"], color=line.get_color(), linestyle=":", linewidth=1)
        real = [x for x in checks if (x["context"], x["concurrency"]) == (ctx, c)]
        if real:
            ax.plot([x["tau"] for x in real], [x["ratio"] for x in real], "k*", markersize=10, label="measured run")
        for y in TARGETS:
            ax.axhline(y, color="grey", linewidth=0.6)
        ax.set_title(where({"context": ctx, "concurrency": c}), fontsize=9)
        ax.set_xlabel("tau per verify round")
    axes[0][0].set_ylabel("x baseline (map)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / CURVES_FILE, dpi=100)
    plt.close(fig)
