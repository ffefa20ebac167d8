"""How a verify round's cost grows with the tokens in flight: the load half of 05's cost model (deploy.py).
Every number it gives is a prediction, and the report says so.

Why: a decode step of the target processes every running request's tokens at once. c requests each verifying
n tokens put c x n tokens through the MoE; at batch 1 that is memory-bound and a 4-token verify costs little
more than a plain step, but as the tokens in flight grow the step turns compute-bound and its time grows with
them, so the verify round that pays at batch 1 can cost more than speculation saves at high load. Public
numbers for Kimi-K2.5 on 8x RTX PRO 6000 (SM120; vLLM TP 8, FP8 KV, a 3-token MLA draft): x1.29 at c = 1,
x1.39 at c = 16, x0.98 at c = 128 on short prompts, x0.61 at c = 128 with 64K context; there a 4-token verify
of the INT4 MoE costs about 2 plain decode steps.

The model, per (draft, graph mode, temperature, prompt bucket):
    t_step(c)            = a + b * c                      a plain decode step (the baseline), 1 token a request
    t_round(c, steps, n) = c_draft * steps + a + b * c * n   an EAGLE-3 round: steps draft forwards, n verified
fitted by least squares on the baseline's decode steps and every fixed setting's rounds at every measured
concurrency (`fit`), every cost >= 0 (a noisy sweep can otherwise fit a negative draft step; the fit says which
cost it held at 0). The predicted decode-phase speed ratio of a depth-d chain at concurrency c is
    ratio(d, c) = tau(d) * t_step(c) / t_round(c, d, d + 1)
(prefill is not in it), and speculation pays (ratio > 1) up to
    c* = (a * (tau - 1) - c_draft * d) / (b * (d + 1 - tau)).
When the sweep cannot separate a from b (one concurrency level: c * n moves with steps), a and b come from
the baseline's decode steps when it ran at two or more concurrencies; otherwise they are ASSUMED from the box's
"a 4-token verify costs ~2 decode steps" (a + 4b = 2 (a + b), so a = 2b), scaled to the baseline's measured
step, and the fit says so (`source`).
"""
from __future__ import annotations

import itertools

import numpy as np

ASSUMED = ("ASSUMED a = 2 b: a 4-token verify of Kimi-K2.5's INT4 MoE costs ~2 plain decode steps at batch 1 "
           "(public numbers on 8x RTX PRO 6000, vLLM TP 8, FP8 KV), scaled to this baseline's measured step")


def fit(points: list[tuple[int, int, int, float]]) -> dict | None:
    """{a, b, c_draft, source, num_points, max_relative_residual} from (steps, concurrency, verified tokens
    per request, seconds per step or round) points; a baseline point is (0, c, 1, t_step). None when there
    is no baseline point to scale an assumption to and the points alone cannot be fitted."""
    x = np.array([[s, 1.0, c * n] for s, c, n, _ in points]) if points else np.zeros((0, 3))
    y = np.array([t for *_, t in points])
    if len(points) >= 3 and np.linalg.matrix_rank(x) == 3:
        (cd, a, b), held = non_negative_lstsq(x, y)
        out = {"a": a, "b": b, "c_draft": cd, "source": "fitted on the baseline's steps and the settings' rounds"
               + "".join(f"; {('c_draft', 'a', 'b')[i]} held at 0 (fitted free it was negative)" for i in held)}
    else:
        out = assumed_costs(points)
        if out is None:
            return None
    pred = [predict_round(out, s, c, n) for s, c, n, _ in points]
    out["max_relative_residual"] = max(abs(p - t) / t for p, (*_, t) in zip(pred, points))
    out["num_points"] = len(points)
    return {k: float(v) if isinstance(v, (float, np.floating)) else v for k, v in out.items()}


def non_negative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Least squares with every coefficient >= 0 (a time cost is never negative; noisy rounds can make the
    free fit say so), and the columns held at 0. Exact for these few columns: the best of the free fits on
    every subset of columns whose coefficients all come out >= 0."""
    free, *_ = np.linalg.lstsq(x, y, rcond=None)
    if (free >= 0).all():
        return free, []
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y ** 2))
    subsets = itertools.chain.from_iterable(itertools.combinations(range(x.shape[1]), r) for r in range(1, x.shape[1]))
    for keep in subsets:
        sub, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sub >= 0).all():
            coef = np.zeros(x.shape[1])
            coef[list(keep)] = sub
            err = float(np.sum((x @ coef - y) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best, [i for i in range(x.shape[1]) if best[i] == 0]


def assumed_costs(points: list[tuple[int, int, int, float]]) -> dict | None:
    """a and b when the points cannot separate them: fitted on the baseline's decode steps at two or more
    concurrencies, else ASSUMED a = 2 b through the baseline's step at its concurrency; c_draft then from the
    settings' rounds (their mean residual per draft step; 0 without a setting)."""
    base = [(c, t) for s, c, n, t in points if s == 0 and n == 1]
    if not base:
        return None
    if len({c for c, _ in base}) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.array([[1.0, c] for c, _ in base]), np.array([t for _, t in base]), rcond=None)
        source = "a, b fitted on the baseline's decode steps; c_draft from the settings' rounds"
    else:
        c0, t0 = base[0][0], float(np.mean([t for _, t in base]))
        b = t0 / (2 + c0)   # t_step(c0) = a + b c0 with a = 2 b
        a, source = 2 * b, ASSUMED
    spec = [(s, c, n, t) for s, c, n, t in points if s > 0]
    cd = float(np.mean([(t - a - b * c * n) / s for s, c, n, t in spec])) if spec else 0.0
    if cd < 0:
        cd, source = 0.0, source + "; c_draft held at 0 (fitted free it was negative)"
    return {"a": a, "b": b, "c_draft": cd, "source": source}


def predict_round(costs: dict, steps: int, c: int, n: int) -> float:
    """Seconds per step (steps 0, n 1: a plain decode step) or verify round at concurrency c."""
    return costs["c_draft"] * steps + costs["a"] + costs["b"] * c * n


def ratio(costs: dict, depth: int, tau: float, c: int) -> float:
    """Predicted decode-phase tok/s of a depth-`depth` chain over the baseline's at concurrency c."""
    return tau * predict_round(costs, 0, c, 1) / predict_round(costs, depth, c, depth + 1)


def break_even(costs: dict, depth: int, tau: float) -> float | None:
    """The concurrency up to which the chain is predicted to pay (ratio > 1): 0 when it never does, None
    when it does at every load (verify cost not growing with the tokens in flight)."""
    gain = costs["a"] * (tau - 1) - costs["c_draft"] * depth   # what the chain saves at c -> 0
    slope = costs["b"] * (depth + 1 - tau)                      # what each request in flight costs it
    if gain <= 0:
        return 0.0
    return None if slope <= 0 else float(gain / slope)


def predictions(costs: dict, taus: dict[int, dict], concurrencies: list[int]) -> list[dict]:
    """One row per chain depth: its tau (and where it comes from), the predicted ratio at each concurrency,
    and the concurrency up to which it pays."""
    return [{"setting": [d, 1, d + 1], "tau": t["tau"], "tau_source": t["source"],
             "ratio_by_concurrency": {str(c): ratio(costs, d, t["tau"], c) for c in concurrencies},
             "pays_up_to_concurrency": break_even(costs, d, t["tau"])} for d, t in sorted(taus.items())]
