"""benchmarks/warm_start_study.py without its hours of CPU: the rows' 04 flags and the table it writes
from 05's side-by-side metrics (the training and measuring parts are 04's and 05's, tested there)."""
import argparse
import importlib
from pathlib import Path

study = importlib.import_module("benchmarks.warm_start_study")


def args(**kw):
    base = dict(seed=0, train_flags=["batch-tokens=2048"], l2sp_weight=0.01, shares=[0.25, 1.0],
                epochs_curve=3, num_draft_tokens=[3, 5], warm_learning_rates=[1e-4])
    return argparse.Namespace(**{**base, **kw})


def test_row_flags():
    standin = Path("/s/export_sglang")
    assert study.row_flags("scratch", 10, standin, args()) == {
        "seed": 0, "candidates-per-epoch": 1, "batch-tokens": "2048", "max-train-samples": 10}
    warm = study.row_flags("warm_l2sp", None, standin, args())
    assert warm["init-from"] == str(standin) and warm["init-vocab"] == "map" and warm["l2sp-weight"] == 0.01
    assert "max-train-samples" not in warm and "l2sp-weight" not in study.row_flags("warm", 5, standin, args())


def metrics(names, tau):
    """05's `drafts`/`pairs` for `names`, tau[name] at every (T, k), pairs with their differences."""
    cell = lambda x: {"tau": x, "tau_ci95": [x - 0.1, x + 0.1]}  # noqa: E731
    drafts = {n: {"tau": {t: {k: cell(tau[n]) for k in ("3", "5")} for t in ("0", "1.0")}} for n in names}
    pairs = [{"a": a, "b": b, "by_temperature": {t: {k: {"difference": tau[a] - tau[b], "ci": [tau[a] - tau[b] - 0.05,
                                                                                                 tau[a] - tau[b] + 0.05]}
                                                     for k in ("3", "5")} for t in ("0", "1.0")}}
             for i, b in enumerate(names) for a in names[i + 1:]]
    return {"num_prompts": 120, "drafts": drafts, "pairs": pairs, "deploy": {}}


def test_report_shows_both_held_out_sets_the_paired_gains_and_the_curves():
    names = ["04", "standin", "scratch_0.25", "warm_0.25", "warm_l2sp_0.25", "warm_1", "warm_l2sp_1",
             "scratch_epochs3", "warm_epochs3"]
    tau = dict(zip(names, (1.5, 1.4, 1.3, 1.6, 1.55, 1.8, 1.75, 1.52, 1.82)))
    general = {**tau, "standin": 2.0, "warm_0.25": 1.9, "warm_1": 1.8}
    rows = {n: {} for n in names if n not in ("04", "standin")} | {"scratch_1": {}}
    sel = {"num_draft_tokens": 3, "chosen_step": 20, "candidates": [{"step": 10, "replay_tau": 1.7},
                                                                   {"step": 20, "replay_tau": 1.8}]}
    results = {"rows": rows, "in_domain": metrics(names, tau), "general": metrics(names, general),
               "selection": {"warm_epochs3": sel, "scratch_epochs3": {}}}
    table = study.report(results, args())
    assert "| warm_1 | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] |" in table
    # share 1: warm vs 04 (the full-size scratch) +20.0%; forgetting on the general set: 1.8 vs 2.0 = -10.0%
    line = next(x for x in table.splitlines() if x.startswith("| 1 | 0 |"))
    assert "+20.0% [+16.7, +23.3]" in line and "-10.0% [-12.5, -7.5]" in line
    assert "- warm_epochs3: 10: 1.700, **20: 1.800**" in table


def test_a_row_not_trained_yet_reads_not_run():
    """A grid spread over sessions: a pair with a row that is not evaluated says so instead of failing."""
    names = ["04", "standin", "warm_1"]
    tau = dict(zip(names, (1.5, 1.4, 1.8)))
    results = {"rows": {"scratch_1": {}, "warm_1": {}}, "in_domain": metrics(names, tau),
               "general": metrics(names, tau), "selection": {}}
    line = next(x for x in study.report(results, args()).splitlines() if x.startswith("| 1 | 0 |"))
    assert "+20.0%" in line and "not run" in line  # warm vs 04 measured; warm_l2sp_1 not run
