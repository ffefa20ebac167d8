"""What 05b tells a user to deploy, from the sweep's own numbers (report.write_report),
per temperature level of the sweep (greedy, and each serving temperature of the preset: every run's
`by_temperature`); the recommendation is the serving temperature's (the highest level above 0, the one the
model is served at; greedy for a greedy preset), the other levels shown beside it:

- per measured concurrency, the best EAGLE-3 setting - of every draft served (04's and each declared
  --draft) - with its output tok/s against the fastest baseline and a 95% interval (`pass_interval`),
  or the plain statement that no setting beats the baseline, or, when every run that could be compared
  was refused (answers not believed, or measured under faults: sweep.py), that nothing valid was
  measured - then nothing is recommended, not even running without speculation;
- the exact launch line of that setting (the engine's own command, 05's measurement-only parts dropped;
  `launch_line` refuses one that is not EAGLE3 / eagle3), with the draft named when several were served;
- a cost model per draft fitted from the sweep's timings, which predicts chain depths the sweep did not try.
  Predictions are labelled as such and are never put in a table of measurements.

The interval is over the sweep's repeated timed passes (--bench-repeats R): pass r of a setting is paired
with pass r of the baseline (taken beside it in the sweep's order), and the t-interval of the mean log ratio
over the R pairs is mapped back to a ratio. It holds the timing noise between passes - what decides whether
a measured difference is real on a busy machine - on THESE prompts; it does not hold the prompt mix (every
pass answers the same prompts). With R = 2 it has one degree of freedom (t = 12.7): only a setting whose two
passes agree closely clears 1. Fewer than 2 passes: no interval, nothing decided.

Cost model (one verify round of a chain of `steps` drafts verifying `n` tokens, n = steps + 1):
    t_round = c_draft * steps + t_fixed + c_token * n
fitted by least squares on each EAGLE-3 setting's per-request round time (sum(latency - TTFT) / sum
rounds, at each concurrency). From chains alone c_draft and c_token are not separable (steps and n move
together): the fit then reports their sum, which is all a chain prediction needs; a tree setting
(topk > 1, n != steps + 1) in the sweep separates them. Predicted tok/s of depth d = eta * c * tau(d) /
t_round(d), with eta (prefill, the batch's tail) fitted on the measured settings at that concurrency;
tau(d) from 05 reference's per-position acceptance (replay on the held-out prompts) scaled to the sweep's
measured taus, or, without it, the sweep's own taus (beyond the deepest measured chain: held constant,
labelled "extrapolated").
"""
from __future__ import annotations

import math
import shlex
import statistics

import numpy as np

from common.benchmark.formatting import fmt
from common.draft import OURS
from common.serving import load_model
from common.serving.context import SHORT, context_level, measured_buckets
from common.serving.registry import engine_class
from common.serving.settings import fixed_chain, is_adaptive, is_block

def request_record(result: dict, tag: dict | None) -> dict:
    """The per-request numbers the report needs (timing, rounds, the prompt's source / thinking)."""
    rec = {k: result.get(k) for k in ("completion_tokens", "latency_s", "ttft_s", "spec_verify_ct")}
    return {**rec, **(tag or {})}


# Student's t, two-sided 95%, by degrees of freedom (1..20); beyond, 1.96 + 2.37 / df (within 0.01 of it)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086)


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else 1.96 + 2.37 / df


def pass_interval(spec_tps: list, base_tps: list) -> tuple[float, float] | None:
    """95% interval of a setting's tok/s ratio to the baseline over paired timed passes (pass r with pass r):
    the t-interval of the mean log ratio, mapped back (a ratio's noise is multiplicative). None with fewer
    than 2 pairs, or a pass without a number."""
    pairs = list(zip(spec_tps or [], base_tps or []))
    if len(pairs) < 2 or any(not s or not b for s, b in pairs):
        return None
    logs = [math.log(s / b) for s, b in pairs]
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.mean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def pass_ratio(spec: dict, base: dict) -> tuple[float | None, list | None]:
    """(mean tok/s ratio, its 95% interval over the paired passes or None) of one run against a baseline."""
    if not spec.get("output_tokens_per_s") or not base.get("output_tokens_per_s"):
        return None, None
    ci = pass_interval(spec.get("output_tokens_per_s_passes"), base.get("output_tokens_per_s_passes"))
    return spec["output_tokens_per_s"] / base["output_tokens_per_s"], list(ci) if ci else None


# ---------------------------------------------------------------- temperature levels
def temperature_levels(metrics: dict) -> list[str]:
    """The sweep's temperature levels ("0", "1", ...: f"{T:g}"), in numeric order."""
    return sorted({t for e in metrics["runs"].values() for t in e.get("by_temperature", {})}, key=float)


def serving_level(levels: list[str]) -> str:
    """The level a recommendation comes from: the highest temperature above 0 (the preset's serving
    temperature: the model is served sampled), greedy when the sweep has none."""
    sampled = [t for t in levels if float(t) > 0]
    return sampled[-1] if sampled else "0"


def at_temperature(metrics: dict, t: str, ctx: str = SHORT) -> dict:
    """`metrics` seen at one temperature level and prompt bucket (--bench-context; the short prompts by
    default): each run's by_concurrency is that cell row's (the shape the functions below read)."""
    runs = {k: {**e, "by_concurrency": context_level(e.get("by_temperature", {}).get(t, {}), ctx).get(
        "by_concurrency", {})} for k, e in metrics["runs"].items()}
    return {**metrics, "runs": runs}


def reference_at(reference: dict | None, t: str) -> dict | None:
    """05 reference's per-position acceptance at level t: greedy's, or its sampled replay's at that T."""
    if reference is None or t == "0":
        return reference
    return ((reference.get("sampled") or {}).get("by_temperature") or {}).get(t)


def best_settings(metrics: dict) -> dict:
    """{concurrency: {baseline, best or None, candidates}} over every graph mode and draft (04's and each
    declared --draft), at one temperature level (at_temperature): each EAGLE-3 run is compared with the
    FASTEST baseline at that concurrency (what one could deploy without speculation), paired over the timed
    passes; the best is the highest ratio whose interval lies above 1. A refused baseline (sweep.refuse)
    is no baseline; `nothing_valid` lists the refusals when no baseline or no EAGLE-3 run is left to compare."""
    runs = metrics["runs"]
    concs = sorted({c for e in runs.values() for c in e["by_concurrency"]}, key=int)
    out = {}
    for c in concs:
        every = [(k, e["by_concurrency"][c]) for k, e in runs.items() if e.get("setting") is None
                 and c in e["by_concurrency"]]
        if not every:
            continue
        bases = [(k, s) for k, s in every if not s.get("refused")]
        if not bases:
            out[c] = {"baseline": None, "baseline_tokens_per_s": None, "candidates": [], "best": None,
                      "undecided": False, "nothing_valid": [f"{k}: {s['refused']}" for k, s in every]}
            continue
        bkey, bsum = max(bases, key=lambda kv: kv[1]["output_tokens_per_s"] or 0)
        cands = []
        for key, e in runs.items():
            s = e["by_concurrency"].get(c)
            if e.get("setting") is None or s is None or not bsum["output_tokens_per_s"]:
                continue
            draft = e.get("draft", OURS)
            why = s.get("ratio_refused") or s.get("refused")
            if why:
                cands.append({"key": key, "draft": draft, "setting": e["setting"], "refused": why})
                continue
            ratio, ci = pass_ratio(s, bsum)
            cands.append({"key": key, "draft": draft, "setting": list(e["setting"]),
                          "tokens_per_s": s["output_tokens_per_s"], "ratio": ratio, "ratio_ci95": ci})
        winners = [x for x in cands if x.get("ratio_ci95") and x["ratio_ci95"][0] > 1]
        refused = [f"{x['key']}: {x['refused']}" for x in cands if "refused" in x]
        out[c] = {"baseline": bkey, "baseline_tokens_per_s": bsum["output_tokens_per_s"], "candidates": cands,
                  "best": max(winners, key=lambda x: x["ratio"]) if winners else None,
                  # fewer than two timed passes (--bench-repeats 1) give no interval: then nothing is
                  # decided either way
                  "undecided": not winners and any("ratio" in x and x["ratio_ci95"] is None for x in cands),
                  # every EAGLE-3 run refused: "no setting beats the baseline" would be a verdict on nothing
                  "nothing_valid": refused if cands and len(refused) == len(cands) else None}
    return out


def launch_line(engine: str, command, speculative: bool) -> str:
    """The command a user types: the engine's argv as 05 ran it, minus 05's measurement-only flags and
    environment and the test box's --host/--port (the engine's measurement_flags and measurement_env), the
    interpreter as `python`. Refuses (ValueError) a speculative command that is not EAGLE-3 by the engine's own
    rule (Engine.check_launch_line: SGLang `--speculative-algorithm EAGLE3`, vLLM method `eagle3`); an engine
    05b does not know is refused too."""
    cls = engine_class(engine)
    argv, env = (command["argv"], command.get("env") or {}) if isinstance(command, dict) else (command, {})
    argv = ["python"] + list(argv[1:])
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in cls.measurement_flags:
            i += 1 + cls.measurement_flags[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    if speculative:
        cls.check_launch_line(kept)
    prefix = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k not in cls.measurement_env]
    return " ".join(prefix + [shlex.join(kept)])


# ---------------------------------------------------------------- the cost model
def round_time(reqs: list[dict]) -> float | None:
    """Seconds per verify round as the requests saw it: decode time (latency - TTFT) over rounds."""
    rounds = sum(r["spec_verify_ct"] or 0 for r in reqs)
    if not rounds or any(r["ttft_s"] is None for r in reqs):
        return None
    return sum(r["latency_s"] - r["ttft_s"] for r in reqs) / rounds


def fit_costs(points: list[tuple[int, int, float]]) -> dict | None:
    """Least squares of t_round = c_draft * steps + t_fixed + c_token * n over (steps, n, t_round).
    Chains only (n = steps + 1 everywhere): t = (t_fixed + c_token) + (c_draft + c_token) * steps, and
    only those two sums are fitted ("separable": False). None with fewer points than unknowns."""
    x = np.array([[s, 1.0, n] for s, n, _ in points])
    y = np.array([t for _, _, t in points])
    if len(points) >= 3 and np.linalg.matrix_rank(x) == 3:
        (cd, t0, ct), *_ = np.linalg.lstsq(x, y, rcond=None)
        fit = {"separable": True, "c_draft": cd, "t_fixed": t0, "c_token": ct}
    elif len({s for s, _, _ in points}) >= 2:
        (b, a), *_ = np.linalg.lstsq(x[:, :2], y, rcond=None)   # columns: steps, 1
        fit = {"separable": False, "c_draft_plus_token": b, "t_fixed_plus_token": a}
    else:
        return None
    pred = [predict_round(fit, s, n) for s, n, _ in points]
    fit["max_relative_residual"] = max(abs(p - t) / t for p, (_, _, t) in zip(pred, points))
    fit["num_points"], fit["num_unknowns"] = len(points), 3 if fit["separable"] else 2
    return {k: float(v) if isinstance(v, (float, np.floating)) else v for k, v in fit.items()}


def predict_round(fit: dict, steps: int, n: int) -> float:
    if fit["separable"]:
        return fit["c_draft"] * steps + fit["t_fixed"] + fit["c_token"] * n
    assert n == steps + 1, "a chains-only fit predicts chains only"
    return fit["t_fixed_plus_token"] + fit["c_draft_plus_token"] * steps


def chain_tau(per_position: list[float | None], depth: int) -> float:
    """Expected tokens per round of a depth-d chain from conditional per-position acceptance p_j
    (replay's `per_position_acceptance`: accepted at j given j-1 accepted): 1 + sum_j prod_{i<=j} p_i.
    Beyond the measured positions the last p is held (extrapolation)."""
    p = [x or 0.0 for x in per_position]
    tau, reach = 1.0, 1.0
    for j in range(depth):
        reach *= p[min(j, len(p) - 1)]
        tau += reach
    return tau


def tau_by_depth(depths: list[int], measured: dict[int, float], reference: dict | None) -> dict[int, dict]:
    """{depth: {tau, source}}. With 05 reference metrics (replay on the held-out prompts): chain_tau of
    the deepest k's per-position acceptance, scaled by the mean ratio of the sweep's measured taus to
    it at the measured depths (the sweep's prompts and tau definition differ from the reference's).
    Without: the sweep's taus interpolated between measured depths (and tau(0) = 1), held constant
    beyond the deepest one."""
    out = {}
    if reference:
        ks = sorted(int(k) for k in reference["by_num_draft_tokens"])
        p = reference["by_num_draft_tokens"][str(ks[-1])]["per_position_acceptance"]
        scale = (float(np.mean([measured[d] / chain_tau(p, d) for d in measured])) if measured else 1.0)
        for d in depths:
            src = "replay per-position acceptance" if d <= ks[-1] else \
                f"extrapolated (replay's position-{ks[-1]} acceptance held)"
            out[d] = {"tau": scale * chain_tau(p, d), "source": f"{src}, x{scale:.3f} to the sweep"}
        return out
    xs = sorted(measured)
    for d in depths:
        if d > xs[-1]:
            out[d] = {"tau": measured[xs[-1]], "source": f"extrapolated (the sweep's tau at depth {xs[-1]} held)"}
        else:
            lo = max([0] + [x for x in xs if x <= d])
            hi = min(x for x in xs if x >= d)
            tl, th = (1.0 if lo == 0 else measured[lo]), measured[hi]
            t = tl if hi == lo else tl + (th - tl) * (d - lo) / (hi - lo)
            out[d] = {"tau": t, "source": "interpolated from the sweep's taus"}
    return out


def cost_models(metrics: dict, reference: dict | None) -> list[dict]:
    """One fit per (draft, graph mode, concurrency) with its predictions for untried chain depths; a draft's
    cost and tau are its own, and `reference` (05 reference of 04's draft) serves 04's alone."""
    names = dict.fromkeys(e.get("draft", OURS) for e in metrics["runs"].values() if e.get("setting") is not None)
    return [m for name in names for m in draft_cost_models(metrics, name, reference if name == OURS else None)]


def draft_cost_models(metrics: dict, draft: str, reference: dict | None) -> list[dict]:
    """cost_models for one draft's runs (each against the baseline of its graph mode)."""
    runs, out = metrics["runs"], []
    for graph in sorted({bool(e.get("cuda_graph")) for e in runs.values()}):
        concs = sorted({c for e in runs.values() if bool(e.get("cuda_graph")) == graph for c in e["by_concurrency"]}, key=int)
        for c in concs:
            base = next((e["by_concurrency"].get(c) for e in runs.values()
                         if bool(e.get("cuda_graph")) == graph and e.get("setting") is None), None)
            base = None if (base or {}).get("refused") else base
            pts, measured, eff = [], {}, []
            for e in runs.values():
                s = e["by_concurrency"].get(c)
                if (bool(e.get("cuda_graph")) != graph or e.get("setting") is None or not fixed_chain(e["setting"])
                        or e.get("draft", OURS) != draft or not s or not s.get("requests") or s.get("refused")):
                    continue  # the baseline, an adaptive (its steps vary) or block setting, another draft, no
                    # requests, counts not believed
                steps, topk, n = e["setting"]
                t = round_time(s["requests"])
                if t is None or not s.get("accept_length_pooled"):
                    continue
                pts.append((steps, n, t))
                if topk == 1:
                    measured[steps] = s["accept_length_pooled"]
                eff.append(s["output_tokens_per_s"] / (int(c) * s["accept_length_pooled"] / t))
            fit = fit_costs(pts)
            if fit is None:
                continue
            eta = float(np.mean(eff))
            top = max([s for s, _, _ in pts] + [int(k) for k in (reference or {}).get("by_num_draft_tokens", {})])
            depths = [d for d in range(1, top + 3) if d not in measured]
            taus = tau_by_depth(depths, measured, reference) if measured else {}
            preds = []
            for d in depths if taus else []:
                t = predict_round(fit, d, d + 1)
                tps = eta * int(c) * taus[d]["tau"] / t
                preds.append({"setting": [d, 1, d + 1], "round_s": t, "tau": taus[d]["tau"],
                              "tau_source": taus[d]["source"], "tokens_per_s": tps,
                              "ratio": tps / base["output_tokens_per_s"] if base and base["output_tokens_per_s"] else None})
            out.append({"draft": draft, "cuda_graph": graph, "concurrency": int(c), "fit": fit, "eta": eta,
                        "points": [list(p) for p in pts], "predicted": preds})
    return out


# ---------------------------------------------------------------- per-request tau by source and thinking
def tau_by_group(metrics: dict, field: str) -> dict:
    """{setting key: {group value: (requests, pooled tau)}} at concurrency 1 (tau does not depend on the
    batch) over every timed pass, for `field` = "source" or "thinking" of each request's prompt."""
    out = {}
    for key, e in metrics["runs"].items():
        run = e["by_concurrency"].get("1") or {}
        reqs = [] if run.get("refused") else [r for r in run.get("requests") or [] if r["spec_verify_ct"]]
        groups = {}
        for r in reqs:
            value = r.get(field)
            label = {True: "thinking on", False: "thinking off"}.get(value, str(value)) if field == "thinking" \
                else str(value)
            groups.setdefault(label, []).append(r)
        if groups:
            out[key] = {g: (len(rs), sum(r["completion_tokens"] for r in rs) / sum(r["spec_verify_ct"] for r in rs))
                        for g, rs in sorted(groups.items())}
    return out


def summary(metrics: dict, reference: dict | None) -> dict:
    """The report's deploy section as data (metrics.json "deploy"): per temperature level - the short prompts'
    verdicts (`best`, with their launch lines), each prompt-length bucket's (`by_context`), the grid of both
    (`grid`: bucket x concurrency) and the load model's predictions - and `best` = the serving level's (the
    recommendation), each with the grid cells it holds at."""
    levels = temperature_levels(metrics)
    serving = serving_level(levels)
    buckets = measured_buckets(metrics)
    by_t = {}
    for t in levels:
        by_t[t] = level_summary(at_temperature(metrics, t), reference_at(reference, t))
        by_t[t]["by_context"] = {ctx: {"best": best_settings(at_temperature(metrics, t, ctx))} for ctx in buckets[1:]}
        by_t[t]["load_models"] = [m for ctx in buckets for m in load_models(
            at_temperature(metrics, t, ctx), reference_at(reference, t) if ctx == SHORT else None, ctx)]
    for t in levels if metrics.get("sampling_defect") else []:
        for best in level_rows(by_t[t]).values() if float(t) > 0 else []:
            for rec in best.values():
                rec["engine_defect"], rec["launch"] = metrics["sampling_defect"], None  # its numbers time the defect
    for t in levels:
        by_t[t]["grid"] = grid(by_t[t])
        for rec in by_t[t]["best"].values():
            if rec["best"]:
                rec["holds_at"], rec["fails_at"] = holds_at(rec["best"]["key"], by_t[t])
    return {"serving_temperature": serving, "drafts": metrics.get("drafts") or {}, "buckets": buckets,
            "by_temperature": by_t, "best": by_t[serving]["best"] if serving in by_t else {}}


# ---------------------------------------------------------------- the grid: prompt length x concurrency
def level_rows(level: dict) -> dict:
    """{prompt bucket: best_settings' per-concurrency records} of one level's summary, short first."""
    return {SHORT: level["best"], **{ctx: x["best"] for ctx, x in (level.get("by_context") or {}).items()}}


def cell_verdict(rec: dict) -> dict:
    """One (prompt bucket, concurrency) cell from best_settings' record: "best" (the setting, its ratio and
    interval), "off" (nothing beats the baseline with its interval above 1: run without speculation there; the
    closest setting shown), "undecided" (one pass), "nothing valid" (all refused) or "engine defect"."""
    if rec.get("engine_defect") or rec.get("nothing_valid"):
        return {"verdict": "engine defect" if rec.get("engine_defect") else "nothing valid"}
    b = rec["best"] or max((x for x in rec["candidates"] if x.get("ratio") is not None), key=lambda x: x["ratio"],
                           default=None)
    verdict = "best" if rec["best"] else "undecided" if rec.get("undecided") else "off"
    return {"verdict": verdict, **({"key": b["key"], "ratio": b["ratio"], "ratio_ci95": b["ratio_ci95"]} if b else {})}


def grid(level: dict) -> dict:
    """{prompt bucket: {concurrency: cell_verdict}} of one temperature level's summary."""
    return {ctx: {c: cell_verdict(rec) for c, rec in best.items()} for ctx, best in level_rows(level).items()}


def nothing_measured(summary_: dict) -> bool:
    """Every (temperature, prompt bucket, concurrency) cell of summary() is "nothing valid": each run, or each
    baseline, was refused. 05 then stops with exit 1 and writes no manifest (a re-run measures again)."""
    cells = [x for level in summary_["by_temperature"].values() for row in level["grid"].values() for x in row.values()]
    return bool(cells) and all(x["verdict"] == "nothing valid" for x in cells)


def holds_at(key: str, level: dict) -> tuple[list[str], list[str]]:
    """(cells where run `key` beats the baseline with its interval above 1, the cells where it does not), as
    "short c=1" / "65536 c=64", over every prompt bucket and concurrency of one level: where a recommendation
    made on the short prompts at one concurrency still holds."""
    held, not_held = [], []
    for ctx, best in level_rows(level).items():
        for c, rec in best.items():
            x = next((x for x in rec["candidates"] if x["key"] == key), None)
            ok = bool(x and x.get("ratio_ci95") and x["ratio_ci95"][0] > 1 and not rec.get("engine_defect"))
            (held if ok else not_held).append(f"{ctx} c={c}")
    return held, not_held


# ---------------------------------------------------------------- the load model (load_model.py)
def step_time(reqs: list[dict]) -> float | None:
    """Seconds per decode step of a baseline run as its requests saw it: decode time over tokens after the first."""
    steps = sum(max(0, (r["completion_tokens"] or 0) - 1) for r in reqs)
    if not steps or any(r["ttft_s"] is None for r in reqs):
        return None
    return sum(r["latency_s"] - r["ttft_s"] for r in reqs) / steps


def load_points(base: list[dict], spec: list[dict]) -> tuple[list[tuple], dict[int, list[float]]]:
    """(load_model points, {chain steps: measured taus}) from the baseline runs' decode steps and the fixed
    settings' rounds, at every concurrency each measured with believed counts."""
    points, taus = [], {}
    for e in base + spec:
        for c, s in e["by_concurrency"].items():
            if not s or s.get("refused") or not s.get("requests"):
                continue
            steps, topk, n = (0, 1, 1) if e.get("setting") is None else e["setting"][:3]
            t = step_time(s["requests"]) if not steps else round_time(s["requests"])
            if not t or t <= 0:   # no decode step timed (one-token answers): nothing to fit
                continue
            points.append((steps, int(c), n, t))
            if steps and topk == 1 and s.get("accept_length_pooled"):
                taus.setdefault(steps, []).append(s["accept_length_pooled"])
    return points, taus


def load_models(view: dict, reference: dict | None, ctx: str) -> list[dict]:
    """The load model per (draft, graph mode) at one temperature level and prompt bucket (`view`:
    at_temperature's): fitted on its baseline's steps and the draft's fixed settings' rounds at every
    concurrency, predicting each chain depth's ratio at the measured concurrencies and at twice the largest.
    tau per depth: measured (the mean over concurrencies), else tau_by_depth (`reference`: 05 reference, for
    the short prompts of 04's draft)."""
    runs, out = view["runs"], []
    drafts = dict.fromkeys(e.get("draft", OURS) for e in runs.values() if e.get("setting") is not None)
    for draft in drafts:
        for graph in sorted({bool(e.get("cuda_graph")) for e in runs.values()}):
            same = [e for e in runs.values() if bool(e.get("cuda_graph")) == graph]
            base = [e for e in same if e.get("setting") is None]
            spec = [e for e in same if e.get("setting") is not None and e.get("draft", OURS) == draft
                    and fixed_chain(e["setting"])]   # adaptive steps vary; block verifies otherwise
            points, taus = load_points(base, spec)
            costs = load_model.fit(points)
            if costs is None or not taus:
                continue
            measured = {d: statistics.mean(v) for d, v in taus.items()}
            top = max([*measured, *[int(k) for k in (reference or {}).get("by_num_draft_tokens", {})]])
            depth_taus = {**tau_by_depth([d for d in range(1, top + 3) if d not in measured], measured,
                                         reference if draft == OURS else None),
                          **{d: {"tau": v, "source": "measured"} for d, v in measured.items()}}
            concs = sorted({c for _, c, _, _ in points})
            out.append({"draft": draft, "cuda_graph": graph, "context": ctx, "fit": costs,
                        "points": [list(p) for p in points],
                        "predicted": load_model.predictions(costs, depth_taus, concs + [2 * concs[-1]])})
    return out


def level_summary(view: dict, reference: dict | None) -> dict:
    """One temperature level's deploy data (`view`: at_temperature's)."""
    best = best_settings(view)
    for rec in best.values():
        b = rec["best"]
        key = b["key"] if b else rec["baseline"]
        if rec["undecided"] or rec.get("nothing_valid"):
            rec["launch"] = None  # nothing to recommend, the baseline's command included
            continue
        rec["launch"] = launch_line(view.get("engine", "sglang"), view["commands"][key], b is not None) \
            if key in view.get("commands", {}) else None
    return {"best": best, "cost_models": cost_models(view, reference),
            "tau_by_source": tau_by_group(view, "source"), "tau_by_thinking": tau_by_group(view, "thinking")}


def level_title(t: str, serving: str) -> str:
    what = "greedy" if t == "0" else f"T {t}"
    if t == serving:
        return f"{what}: the serving temperature, the recommendation" if t != "0" else f"{what}: the recommendation"
    return f"{what}: beside the recommendation (T {serving}), not one"


def report_lines(deploy: dict, engine_label: str) -> list[str]:
    drafts = deploy.get("drafts") or {}
    serving = deploy.get("serving_temperature", "0")
    levels = sorted(deploy.get("by_temperature") or {}, key=lambda t: (t != serving, float(t)))
    several = len(deploy.get("buckets") or [SHORT]) > 1
    lines = ["", "## What to deploy", "",
             "Per concurrency" + (" (on the short prompts; every prompt length in the grid below)" if several else "")
             + ": the EAGLE-3 setting" + (" (draft and setting)" if len(drafts) > 1 else "")
             + " with the highest output tok/s against the fastest baseline "
             "whose 95% interval lies above 1 (paired over the sweep's timed passes, pass r of the setting with pass "
             "r of the baseline: it holds the timing noise between passes on these prompts, not the prompt mix; with "
             "2 passes it is wide). The recommendation is taken at the serving temperature (the preset's highest "
             "above 0); the other levels are shown beside it.", ""]
    if several and serving in (deploy.get("by_temperature") or {}):
        lines += grid_lines(deploy["by_temperature"][serving]["grid"], serving)
    for t in levels:
        rec = deploy["by_temperature"][t]
        lines += [f"### {level_title(t, serving)}", ""]
        for c, best in rec["best"].items():
            lines += best_lines(c, best, drafts, engine_label, launch=t == serving, holds=several and t == serving)
        lines.append("")
    if any(deploy["by_temperature"][t]["cost_models"] for t in levels):
        lines += ["## Predicted, not measured: untried chain depths (cost model)", "",
                  "t_round = c_draft x steps + t_fixed + c_token x verified tokens, least squares on each setting's "
                  "per-request round time (sum(latency - TTFT) / rounds); tok/s = eta x concurrency x tau / t_round "
                  "with eta fitted on the measured settings. **Every row below is a prediction.**", ""]
        for t in levels:
            for m in deploy["by_temperature"][t]["cost_models"]:
                lines += cost_model_lines(m, t, drafts)
    lines += load_model_lines((deploy.get("by_temperature") or {}).get(serving, {}).get("load_models"), serving, drafts)
    for field, title in (("tau_by_source", "source dataset"), ("tau_by_thinking", "thinking on/off")):
        for t in levels:
            lines += tau_group_lines(deploy["by_temperature"][t][field], title, t)
    return lines


def grid_lines(cells: dict, t: str) -> list[str]:
    """The per-cell table at the serving level: a row per prompt bucket, a column per concurrency; each cell the
    best setting with its ratio and interval, or "off" (nothing beats the baseline with its interval above 1:
    run without speculation there), with the closest setting beside it."""
    concs = sorted({c for row in cells.values() for c in row}, key=int)
    lines = [f"### Per prompt length and concurrency ({'greedy' if t == '0' else f'T {t}'}, the recommendation's "
             "temperature)", "", "| prompts | " + " | ".join(f"c={c}" for c in concs) + " |",
             "|---" * (len(concs) + 1) + "|"]
    for ctx, row in cells.items():
        shown = []
        for c in concs:
            x = row.get(c) or {"verdict": "-"}
            ci = x.get("ratio_ci95")
            num = f"x{fmt(x.get('ratio'))} [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else f"x{fmt(x.get('ratio'))}"
            shown.append(f"**{x['key']}** {num}" if x["verdict"] == "best" else
                         f"{x['verdict']} ({x['key']} {num})" if x.get("key") else x["verdict"])
        lines.append(f"| {ctx if ctx == SHORT else f'~{ctx} tokens'} | " + " | ".join(shown) + " |")
    return lines + ["", "off = no setting's interval lies above 1 there: run without speculation at that load and "
                    "prompt length (the closest setting is shown in brackets).", ""]


def best_lines(c: str, rec: dict, drafts: dict, engine_label: str, launch: bool, holds: bool = False) -> list[str]:
    """One concurrency's verdict at one level; the launch line only where it is the recommendation, and with
    `holds` the grid cells where the same setting also beats the baseline (interval above 1) and where not."""
    b = rec["best"]
    if rec.get("engine_defect"):
        return [f"- **concurrency {c}: nothing is recommended at this temperature**: the engine cannot verify "
                f"sampled drafts here ({rec['engine_defect']}), so these numbers time that defect, not the draft."]
    if rec.get("nothing_valid"):
        return [f"- **concurrency {c}: nothing valid was measured**: every run that could be compared was "
                f"refused ({'; '.join(rec['nothing_valid'])}). Nothing is recommended, not even running "
                "without speculation: fix what the refusals name and re-run 05b_serve_benchmark.py."]
    if rec.get("undecided"):
        return [f"- concurrency {c}: **undecided**: fewer than two timed passes, so no ratio has an interval "
                "(ratios: " + ", ".join(f"{x['key']} x{fmt(x['ratio'])}" for x in rec["candidates"] if "ratio" in x)
                + "); re-run 05b_serve_benchmark.py with --bench-repeats 2 or more."]
    if b is None:
        shown = ", ".join(f"{x['key']} refused" if "refused" in x else
                          f"{x['key']} x{fmt(x.get('ratio'))} [{fmt((x.get('ratio_ci95') or [None])[0])}, "
                          f"{fmt((x.get('ratio_ci95') or [None, None])[1])}]" for x in rec["candidates"])
        lines = [f"- **concurrency {c}: no setting beats the baseline** ({rec['baseline']}, "
                 f"{fmt(rec['baseline_tokens_per_s'], 1)} tok/s; {shown or 'no EAGLE-3 run'})."
                 + (" Run without speculation:" if launch else "")]
    else:
        lo, hi = b["ratio_ci95"]
        named = f"draft {b['draft']}, `{drafts[b['draft']]}`; " if len(drafts) > 1 else ""
        where = (f" It holds (interval above 1) at {', '.join(rec['holds_at']) or 'no cell'}; not at "
                 f"{', '.join(rec['fails_at']) or 'any other cell'}." if holds and "holds_at" in rec else "")
        lines = [f"- **concurrency {c}: {b['key']}** ({named}steps, topk, draft tokens = {tuple(b['setting'][:3])}"
                 f"{', adaptive' if is_adaptive(b['setting']) else ', block verification' if is_block(b['setting']) else ''}): {fmt(b['tokens_per_s'], 1)} tok/s, "
                 f"**x{fmt(b['ratio'])} [{fmt(lo)}, {fmt(hi)}]** against {rec['baseline']} "
                 f"({fmt(rec['baseline_tokens_per_s'], 1)} tok/s).{where}" + (f" {engine_label}:" if launch else "")]
    if launch and rec.get("launch"):
        lines += ["", "  ```", f"  {rec['launch']}", "  ```"]
    return lines


def cost_model_lines(m: dict, t: str, drafts: dict) -> list[str]:
    f = m["fit"]
    costs = (f"c_draft {1e3 * f['c_draft']:.2f} ms/step, t_fixed {1e3 * f['t_fixed']:.2f} ms, c_token "
             f"{1e3 * f['c_token']:.2f} ms/token" if f["separable"] else
             f"c_draft + c_token {1e3 * f['c_draft_plus_token']:.2f} ms per chain step, t_fixed + c_token "
             f"{1e3 * f['t_fixed_plus_token']:.2f} ms (chains only: draft and verify cost not separable "
             "without a tree setting)")
    lines = [f"T {t}, {m['draft'] + ', ' if len(drafts) > 1 else ''}{'graph' if m['cuda_graph'] else 'nograph'}, "
             f"concurrency {m['concurrency']}: {costs}; eta "
             f"{m['eta']:.2f}; {f['num_points']} settings for {f['num_unknowns']} unknowns"
             + (f", largest residual {100 * f['max_relative_residual']:.1f}%." if f["num_points"] > f["num_unknowns"]
                else " (an exact fit: nothing checks it; more settings would)."),
             ""]
    if m["predicted"]:
        lines += ["| setting (predicted) | round (ms) | tau | tau from | tok/s (predicted) | x baseline (predicted) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {','.join(map(str, p['setting']))} | {1e3 * p['round_s']:.1f} | {p['tau']:.2f} | "
                  f"{p['tau_source']} | {p['tokens_per_s']:.1f} | {fmt(p['ratio'])} |" for p in m["predicted"]]
        lines.append("")
    return lines


def load_model_lines(models: list[dict] | None, t: str, drafts: dict) -> list[str]:
    """The load model's section at the serving level: its costs and where they come from (fitted or ASSUMED),
    and the predicted decode-phase ratio per chain depth and concurrency, every number marked predicted."""
    if not models:
        return []
    concs = sorted({c for m in models for p in m["predicted"] for c in p["ratio_by_concurrency"]}, key=int)
    lines = ["## Predicted, not measured: speed against load (verify cost growing with the tokens in flight)", "",
             "t_step = a + b x c (a plain decode step at concurrency c), t_round = c_draft x steps + a + b x c x n "
             "(c requests verifying n tokens each), fitted on the baseline's steps and the fixed settings' rounds "
             "(common/serving/load_model.py); predicted ratio = tau x t_step / t_round, the decode phase only "
             f"({'greedy' if t == '0' else f'T {t}'}). **Every number below is a prediction**; measured ratios are "
             "in the tables above.", ""]
    for m in models:
        f = m["fit"]
        prompts = "short prompts" if m["context"] == SHORT else f"prompts of ~{m['context']} tokens"
        lines += [f"{m['draft'] + ', ' if len(drafts) > 1 else ''}{'graph' if m['cuda_graph'] else 'nograph'}, "
                  f"{prompts}: "
                  f"a {1e3 * f['a']:.2f} ms, b {1e3 * f['b']:.4f} ms per token in flight, c_draft "
                  f"{1e3 * f['c_draft']:.2f} ms per draft step ({f['source']}; {f['num_points']} points, largest "
                  f"residual {100 * f['max_relative_residual']:.1f}%).", "",
                  "| setting (predicted) | tau | tau from | " + " | ".join(f"c={c}" for c in concs)
                  + " | pays up to c (predicted) |", "|---" * (len(concs) + 4) + "|"]
        for p in m["predicted"]:
            up = p["pays_up_to_concurrency"]
            lines.append(f"| {','.join(map(str, p['setting']))} | {p['tau']:.2f} | {p['tau_source']} | "
                         + " | ".join(f"x{fmt(p['ratio_by_concurrency'].get(c))}" if c in p["ratio_by_concurrency"]
                                      else "-" for c in concs)
                         + f" | {'every load' if up is None else f'{up:.0f}'} |")
        lines.append("")
    return lines


def tau_group_lines(groups_by_key: dict, title: str, t: str) -> list[str]:
    if not groups_by_key:
        return []
    groups = sorted({g for v in groups_by_key.values() for g in v})
    lines = ["", f"## Per-request tau by {title} (T {t}, concurrency 1, pooled over the passes)", "",
             "| setting | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    return lines + [f"| {key} | " + " | ".join(f"{v[g][1]:.2f} (n={v[g][0]})" if g in v else "-" for g in groups)
                    + " |" for key, v in groups_by_key.items()]
