"""benchmarks/warm_start_study.py without its hours of CPU: the rows' 04 flags and the table it writes
from 05's side-by-side metrics (the training and measuring parts are 04's and 05's, tested there)."""
import argparse
import importlib
from pathlib import Path

from common.stage import TRAIN, stage_dir

study = importlib.import_module("benchmarks.warm_start_study")


def args(**kw):
    base = dict(seed=0, train_flags=["batch-tokens=2048"], l2sp_weight=0.01, shares=[0.25, 1.0],
                epochs_curve=3, recipe_share=None, num_draft_tokens=[3, 5], warm_recipes=["learning-rate=1e-4"])
    return argparse.Namespace(**{**base, **kw})


def test_row_flags():
    standin = Path("/s/export_sglang")
    assert study.row_flags("scratch", 10, standin, args()) == {
        "train-seed": 0, "candidates-per-epoch": 1, "batch-tokens": "2048", "max-train-samples": 10}
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
             "scratch_epochs3", "warm_epochs3", "warm_epochs3-step10", "warm_epochs3-step20", "warm_lr0.0001_1"]
    tau = dict(zip(names, (1.5, 1.4, 1.3, 1.6, 1.55, 1.8, 1.75, 1.52, 1.82, 1.84, 1.82, 1.71)))
    general = {**tau, "standin": 2.0, "warm_0.25": 1.9, "warm_1": 1.8}
    rows = {n: {} for n in names if n not in ("04", "standin") and "-step" not in n} | {"scratch_1": {}}
    sel = {"num_draft_tokens": 3, "chosen_step": 20, "candidates": [
        {"step": 0, "replay_tau": 1.2}, {"step": 10, "replay_tau": 1.7, "sim_tau": 1.75},
        {"step": 20, "replay_tau": 1.8, "sim_tau": 1.9}]}
    results = {"rows": rows, "in_domain": metrics(names, tau), "general": metrics(names, general),
               "selection": {"warm_epochs3": sel, "scratch_epochs3": {}}}
    table = study.report(results, args())
    assert "| warm_1 | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] | 1.800 [1.70, 1.90] |" in table
    # share 1: warm vs 04 (the full-size scratch) +20.0%; forgetting on the general set: 1.8 vs 2.0 = -10.0%
    line = next(x for x in table.splitlines() if x.startswith("| 1 | 0 |"))
    assert "+20.0% [+16.7, +23.3]" in line and "-10.0% [-12.5, -7.5]" in line
    # the curve: step 0 is the stand-in; selection chose step 20, which is 1.1% below step 10 on 05's prompts
    assert "| 0 | - | 1.200 | 1.400 [1.30, 1.50] |" in table
    assert "| **20** | **1.900** | **1.800** | **1.820 [1.72, 1.92]** |" in table
    assert "warm_epochs3 vs scratch_epochs3 at k = 5, in-domain / general: T 0: +19.7% [+16.4, +23.0]" in table
    assert "| warm_lr0.0001_1 vs warm_1 | 0 | -5.0% [-7.8, -2.2] | -5.0% [-7.8, -2.2] |" in table
    assert "Chosen step 20 on the reported prompts: -1.1% against the best candidate there (step 10)" in table


def test_a_row_not_trained_yet_reads_not_run():
    """A grid spread over sessions: a pair with a row that is not evaluated says so instead of failing."""
    names = ["04", "standin", "warm_1"]
    tau = dict(zip(names, (1.5, 1.4, 1.8)))
    results = {"rows": {"scratch_1": {}, "warm_1": {}}, "in_domain": metrics(names, tau),
               "general": metrics(names, tau), "selection": {}}
    line = next(x for x in study.report(results, args()).splitlines() if x.startswith("| 1 | 0 |"))
    assert "+20.0%" in line and "not run" in line  # warm vs 04 measured; warm_l2sp_1 not run


def test_candidate_exports_hold_each_candidates_weights(micro_target, tmp_path):
    """The curve rows' candidates are exported as they were kept (not the chosen one each time), step 0 (the
    stand-in) left out, and a second call re-uses the exports."""
    import json

    import torch
    from safetensors.torch import load_file

    from common.draft.export_sglang import export_sglang
    from common.training.selection import save_candidate
    from tests.units.draft.test_draft_import import random_draft

    row = tmp_path / "warm_0.25_epochs2"
    d = stage_dir(row, TRAIN)
    chosen, other = random_draft(micro_target, 300, seed=1), random_draft(micro_target, 300, seed=2)
    export_sglang(chosen, d / "export_sglang", [2, 4, 5])
    for step, model in ((0, other), (5, other), (10, chosen)):
        save_candidate(d, step, model, torch.bfloat16, {"replay_tau": 1.0})
    (d / "manifest.json").write_text(json.dumps({
        "target": {"path": str(micro_target)}, "capture_points": [2, 4, 5],
        "selection": {"chosen_step": 10, "candidates": [{"step": s} for s in (0, 5, 10)]}}))
    got = study.export_candidates(row)
    assert sorted(got) == ["warm_0.25_epochs2-step10", "warm_0.25_epochs2-step5"]
    five, ten = (load_file(str(got[f"warm_0.25_epochs2-step{s}"] / "model.safetensors")) for s in (5, 10))
    final = load_file(str(d / "export_sglang" / "model.safetensors"))
    assert all(torch.equal(ten[k], final[k]) for k in final)
    assert torch.equal(five["fc.weight"], other.fc.weight.detach().to(torch.bfloat16))
    stamp = (got["warm_0.25_epochs2-step5"] / "config.json").stat().st_mtime_ns
    study.export_candidates(row)
    assert (got["warm_0.25_epochs2-step5"] / "config.json").stat().st_mtime_ns == stamp


def test_rows_name_the_curve_share(monkeypatch):
    monkeypatch.setattr(study.dr, "num_train", lambda base, config: 100)
    a = args(base=None, config=None, shares=[0.5, 1.0], warm_recipes=[])
    full = study.rows(a, Path("/s"))
    assert full["warm_epochs3"]["num-epochs"] == 3 and "max-train-samples" not in full["warm_epochs3"]
    quarter = study.rows(args(base=None, config=None, shares=[1.0], warm_recipes=[], recipe_share=0.25),
                         Path("/s"))
    assert quarter["scratch_0.25_epochs3"]["max-train-samples"] == 25 and "warm_epochs3" not in quarter
    lr = study.rows(args(base=None, config=None, shares=[1.0], recipe_share=0.25), Path("/s"))["warm_lr0.0001_0.25"]
    assert lr["learning-rate"] == 1e-4 and lr["max-train-samples"] == 25 and lr["init-from"] == "/s"


def test_recipe_rows_change_one_flag_and_are_told_from_the_l2sp_variant(monkeypatch):
    import pytest

    monkeypatch.setattr(study.dr, "num_train", lambda base, config: 100)
    a = args(base=None, config=None, shares=[1.0], recipe_share=0.25,
             warm_recipes=["warmup-ratio=0.2", "l2sp-weight=1", "learning-rate=1e-3"])
    rows = study.rows(a, Path("/s"))
    warm = study.row_flags("warm", 25, Path("/s"), a)   # the preset's warm row at 25 samples
    assert rows["warm_warmup0.2_0.25"] == {**warm, "warmup-ratio": 0.2}
    assert rows["warm_l2sp1_0.25"] == {**warm, "l2sp-weight": 1.0}
    assert rows["warm_lr0.001_0.25"] == {**warm, "learning-rate": 1e-3}
    assert [n for n in rows if study.RECIPE_ROW.match(n)] == ["warm_warmup0.2_0.25", "warm_l2sp1_0.25", "warm_lr0.001_0.25"]
    for bad in ("num-epochs=3", "learning-rate=fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            study.recipe(bad)
