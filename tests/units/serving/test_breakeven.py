"""The break-even map (05b --simulate-accept-lengths, common/serving/breakeven.py): the fit and its intervals, the
verdicts and marks, the best engine per cell, the simulated-vs-real check; each engine's simulation knob, confirmed
by the engine's own lossy test (and refused in every real measurement); and the sweep against stub SGLang servers
with a cost model, where the simulated rows land in metrics["map"] only and never in a measured table, the deploy
choice, a tau table or the manifest's runs. The real engine: tests/engine/test_vllm_simulated.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from common.serving import breakeven, engine as eng, settings, sglang as srv, vllm
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.stage import SERVE_BENCH, StageError, stage_dir
from tests.units.serving.test_sweep import fake_launches, free_ports, make_work, run_05b  # noqa: F401 (fixture)
from tests import paths
from tests.paths import REPO

FIXTURES = paths.FIXTURES / "vllm"


def cell(tps_passes: list[float], tau: float | None = None, n: int = 24, rounds: int = 8) -> dict:
    reqs = [] if tau is None else [{"completion_tokens": n, "spec_verify_ct": rounds}]
    return {"output_tokens_per_s_passes": tps_passes, "output_tokens_per_s": sum(tps_passes) / len(tps_passes),
            "requests": reqs}


def model_points(a: float, b: float, taus, base=10.0, jitter=(1.0, 1.0)):
    """Cells whose ratio is exactly 1 / (a + b / tau), each pass scaled by `jitter`."""
    return [(t, cell([base / (a + b / t) * j for j in jitter]), t) for t in taus]


def test_the_fit_recovers_a_known_cost_and_its_break_even_taus():
    a, b = 0.1, 1.8   # 1/rho = a + b/tau: rho = 1 at tau 2, 1.2 at 2.7, 1.5 at 4.5
    fit = breakeven.fit_cell(cell([10.0, 10.0]), model_points(a, b, [1.5, 2.5, 3.5], jitter=(0.99, 1.01)))
    assert fit["a"] == pytest.approx(a, rel=1e-3) and fit["b"] == pytest.approx(b, rel=1e-3)   # geometric pass means
    for r, want in ((1.0, b / (1 - a)), (1.2, b / (1 / 1.2 - a)), (1.5, b / (1 / 1.5 - a))):
        x = fit["break_even"][f"{r:g}"]
        assert x["tau"] == pytest.approx(want, rel=1e-3)
        assert x["ci95"][0] < want < x["ci95"][1]
    assert fit["df"] == 4 and fit["max_relative_residual"] < 1e-6
    # more scatter between passes: a wider interval; one pass: none
    wide = breakeven.fit_cell(cell([9.0, 11.0]), model_points(a, b, [1.5, 2.5, 3.5], jitter=(0.9, 1.1)))
    w = lambda f: f["break_even"]["1"]["ci95"][1] - f["break_even"]["1"]["ci95"][0]  # noqa: E731
    assert w(wide) > 3 * w(fit)
    one = breakeven.fit_cell(cell([10.0]), model_points(a, b, [1.5, 3.5], jitter=(1.0,)))
    assert one["break_even"]["1"]["ci95"] is None and one["df"] == 0
    assert breakeven.fit_cell(cell([10.0]), model_points(a, b, [2.0, 2.0])) is None   # one length: nothing to fit


def test_a_target_no_tau_reaches_is_never_and_a_draft_cannot_pass_k_plus_1():
    assert breakeven.tau_star(0.9, 1.0, 1.2) == math.inf          # 1/1.2 < a: even an infinite tau stays below
    assert breakeven.tau_star(0.0, 0.5, 1.0) == 1.0               # pays at any tau
    assert breakeven.tau_star(0.2, 2.4, 1.0) == pytest.approx(3.0)
    assert math.isnan(breakeven.tau_star(0.9, -0.1, 1.0))           # the ratio falls with tau: noise, unresolved
    assert [breakeven.stored(v) for v in (math.inf, math.nan, 2.5)] == ["never", None, 2.5]
    row = {"setting": [3, 1, 4], "marks": [], "fit": {"break_even": {"1": {"tau": 4.6}}}}
    assert breakeven.verdict(row) == "above k+1"
    row["fit"]["break_even"]["1"]["tau"] = math.inf
    assert breakeven.verdict(row) == "never"
    row["fit"]["break_even"]["1"]["tau"] = math.nan
    assert breakeven.verdict(row).startswith("unresolved")
    row["fit"]["break_even"]["1"]["tau"] = 2.5
    assert breakeven.verdict(row) == "pays above tau*"
    row["marks"] = [{"name": "public", "tau": 2.2}, {"name": "04 served", "tau": 1.9}]
    assert breakeven.verdict(row) == "above the best tau known"
    assert breakeven.verdict({"setting": [3, 1, 4], "marks": [], "fit": None}) == "no fit"


def test_known_taus_and_the_cells_where_speculation_stays_off():
    assert breakeven.parse_known_taus(["public@3=2.69", "card=3.1"]) == [
        {"name": "public", "k": 3, "tau": 2.69}, {"name": "card", "k": None, "tau": 3.1}]
    with pytest.raises(StageError, match="NAME=TAU"):
        breakeven.parse_known_taus(["public"])
    fit = lambda tau: {"break_even": {"1": {"tau": tau}}}  # noqa: E731
    rows = [{"engine": "sglang", "cuda_graph": True, "context": ctx, "concurrency": "1", "setting": [k, 1, k + 1],
             "fit": fit(tau), "verdict": breakeven.verdict({"setting": [k, 1, k + 1], "marks": [], "fit": fit(tau)})}
            for ctx, k, tau in (("short", 3, 2.0), ("short", 5, 7.5), ("16384", 3, 4.5), ("16384", 5, math.inf))]
    off = breakeven.off_cells(rows)
    assert [(x["context"], x["why"]) for x in off] == [("16384", "k=3: above k+1; k=5: never")]


def fitted_row(engine, a, b, base, k=3, ctx="short", c="1", marks=()):
    fit = breakeven.fit_cell(cell([base, base]), model_points(a, b, [1.5, 2.5, 3.5], base=base, jitter=(0.99, 1.01)))
    return {"engine": engine, "cuda_graph": True, "setting": [k, 1, k + 1], "context": ctx, "concurrency": c,
            "fit": fit, "marks": list(marks)}


def test_the_best_engine_per_cell_against_the_fastest_baseline():
    """SGLang's baseline is faster but its rounds dearer; at a low tau the fastest engine runs without speculation,
    at a high one the engine whose rounds are cheap wins."""
    rows = [fitted_row("sglang", 0.1, 2.2, base=100.0), fitted_row("vllm", 0.1, 1.2, base=80.0)]
    metrics = {"contexts": ["short"], "concurrency": [1], "map": {"lengths": [1.2, 3.0]}}
    got = {r["at"]: r for r in breakeven.best_engine(rows, metrics)}
    low, high = got["L=1.2"], got["L=3"]
    assert low["fastest_baseline"] == "sglang" and not low["speculate"]      # 80 x 1 / (0.1 + 1) = 72.7 < 100
    assert high["engine"] == "vllm" and high["speculate"]                     # 80 / (0.1 + 0.4) = 160
    assert breakeven.best_engine(rows[:1], metrics) == []                     # one engine: nothing to choose


def test_the_simulation_against_a_real_run_at_its_tau():
    fit = breakeven.fit_cell(cell([10.0, 10.0]), model_points(0.1, 1.8, [1.5, 2.5, 3.5], jitter=(0.98, 1.02)))
    on = breakeven.check_at_tau(fit, 2.0, 1.0, [0.95, 1.05])
    assert on["agree"] and on["in_range"] and on["predicted"] == pytest.approx(1.0, rel=1e-3)
    off = breakeven.check_at_tau(fit, 2.0, 1.3, [1.25, 1.35])   # the real run is 30% faster than the map says
    assert not off["agree"] and off["difference"] == pytest.approx(0.3, rel=1e-2)
    assert not breakeven.check_at_tau(fit, 5.0, 1.6, None)["in_range"]   # beyond the simulated taus: extrapolated


def test_each_engine_declares_its_simulation_and_its_own_lossy_test_confirms_it():
    """SGLang: the environment; vLLM: the speculative config (read back from the info document as rates). A
    simulated launch is confirmed by lossy_or_simulated itself; anything lossy on top, another length, or no
    simulation at all is refused; and the real path keeps refusing what the map asks for."""
    sim = settings.simulated((3, 1, 4), 2.5)
    assert settings.simulated_length(sim) == 2.5 and not settings.fixed_chain(sim)
    env = srv.simulation_env(sim)
    assert env == {"SGLANG_SIMULATE_ACC_LEN": "2.5", "SGLANG_SIMULATE_ACC_METHOD": "match-expected"}
    argv = srv.server_command("/m", 1, 1, 0.8, True, "/d", sim, "py")
    eng.confirm_simulated(SGLangEngine, "s", 2.5, argv, env)
    with pytest.raises(StageError, match="also lossy: the launch line sets speculative_accept_threshold_acc"):
        eng.confirm_simulated(SGLangEngine, "s", 2.5, argv + ["--speculative-accept-threshold-acc", "0.5"], env)
    with pytest.raises(StageError, match="finds no simulation"):
        eng.confirm_simulated(SGLangEngine, "s", 2.5, argv, {})
    with pytest.raises(StageError, match="simulates accept length 3.0, not the 2.5"):
        eng.confirm_simulated(SGLangEngine, "s", 2.5, argv, {**env, "SGLANG_SIMULATE_ACC_LEN": "3"})
    with pytest.raises(StageError, match="simulates accept length None"):   # a mean that is not the length
        eng.confirm_simulated(SGLangEngine, "s", 2.5, argv, {**env, "SGLANG_SIMULATE_ACC_METHOD": "multinomial"})
    assert srv.lossy_or_simulated(argv, env)   # the real path still refuses it
    # vLLM: the launch line's speculative config, and the rates its info document reports for the length
    argv = vllm.server_command("/m", 1, vllm.VllmSettings(python="py"), False, "/d", 3, verify=vllm.verify_config(sim))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["rejection_sample_method"] == "synthetic" and spec["synthetic_acceptance_length"] == 2.5
    eng.confirm_simulated(VllmEngine, "v", 2.5, argv)
    assert vllm.lossy_or_simulated(argv)
    info = json.loads((FIXTURES / "server_info_eagle3.json").read_text())["vllm_config"]
    draft = Path(info["speculative_config"]["model"])
    with pytest.raises(StageError, match="finds no simulation"):
        vllm.check_eagle3_info(info, draft, None, "u", simulated=2.5)
    info["speculative_config"].update(rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.0, 0.5, 0.0])
    assert vllm.check_eagle3_info(info, draft, None, "u", simulated=2.5) == 3
    with pytest.raises(StageError, match="simulates accept length 2.5, not the 3"):
        vllm.check_eagle3_info(info, draft, None, "u", simulated=3.0)
    with pytest.raises(StageError, match="is lossy or simulated"):
        vllm.check_eagle3_info(info, draft, None, "u")   # a measurement: refused as before
    env = vllm.server_env(vllm.VllmSettings(), None, synthetic=True)
    assert env["EAGLE3_VLLM_FIXES"] == "synthetic"   # the CPU build's kernels refuse synthetic mode without it


def test_the_map_simulates_the_chains_of_the_sweep_by_default():
    """The Kimi preset's settings: trees and adaptive steps are not one shape a round, so only its chains."""
    import argparse
    from tests.units.serving.test_sweep import NO_MANIFESTS

    engine = SGLangEngine(Path("/t"), Path("/e"), *NO_MANIFESTS)
    args = argparse.Namespace(simulate_accept_lengths=[2.0, 3.0], simulate_settings=None, simulate_draft=None,
                              spec_settings=["3,1,4", "5,1,6", "7,1,8", "5,4,8", "3,1,4,adaptive"])
    assert [s for s, _ in breakeven.simulations(args, engine)] == [
        (3, 1, 4, "sim2"), (3, 1, 4, "sim3"), (5, 1, 6, "sim2"), (5, 1, 6, "sim3"), (7, 1, 8, "sim2"), (7, 1, 8, "sim3")]
    args.simulate_settings = ["5,4,8"]
    with pytest.raises(StageError, match="chains"):
        breakeven.simulations(args, engine)


def test_a_simulated_server_must_commit_its_length_and_sglangs_must_answer_id_100():
    answers = [{"completion_tokens": 25, "spec_verify_ct": 8, "output_ids": [7] + [100] * 24}]   # 24 / 8 = 3
    assert eng.check_simulated_tau("s", 3.0, answers, 3) == pytest.approx(3.0)
    with pytest.raises(StageError, match="committed 3.00 tokens a verify round"):
        eng.check_simulated_tau("s", 2.0, answers, 3)
    # vLLM's per-round counts are read exactly where the answers carry them
    assert eng.check_simulated_tau("v", 2.5, [{"spec_verify_ct": 2, "per_step_accepted": [1, 2],
                                                "completion_tokens": 6}], 3) == pytest.approx(2.5)
    srv.check_simulated_answers("u", answers)
    with pytest.raises(StageError, match="verified drafts for real"):
        srv.check_simulated_answers("u", [{"output_ids": [7, 8, 100, 9]}])


def map_run(tmp_path, fake, *extra):
    base, spec = free_ports(2)
    run_05b(tmp_path, "--baseline-port", base, "--eagle3-port", spec, "--spec-settings", "3,1,4", "--cuda-graph", "on",
            "--benchmark-max-new-tokens", "24", "--simulate-accept-lengths", "1.5", "2.5", "3.5", *extra)


def test_the_map_against_stub_servers_stays_out_of_every_measured_number(tmp_path, micro_target, fake_launches):
    """Stubs with a cost model (a plain step 10 ms, a verify round 20 ms): the real 3,1,4 server and three simulated
    ones next to the one baseline. The map finds the break-even tau the costs imply (the baseline's 24 tokens take
    24 steps, a simulated answer 23 / L rounds: tau* = 2 x 23 / 24 = 1.92), checks the real run against it, and
    its runs are nowhere but metrics["map"]. The steps are long against a request's own overhead: at 4 / 8 ms the
    real run and the map disagreed once beside another test process (make test-fast's two workers)."""
    make_work(tmp_path, micro_target)
    fake = fake_launches(step_s=0.010, round_s=0.020)
    map_run(tmp_path, fake, "--known-tau", "public@3=2.69")
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/graph", "3-1-4/graph"}
    board = m["map"]["engines"]["sglang"]
    assert set(board["runs"]) == {"baseline/graph", "3-1-4-sim1.5/graph", "3-1-4-sim2.5/graph", "3-1-4-sim3.5/graph"}
    assert all(e["map"] and (k.startswith("baseline") or e["simulated"]["accept_length"] in (1.5, 2.5, 3.5))
               for k, e in board["runs"].items())
    assert sorted(s.env["SGLANG_SIMULATE_ACC_LEN"] for _, s in fake.launched if s.simulate) == ["1.5", "2.5", "3.5"]
    assert all("SGLANG_SIMULATE_ACC_LEN" not in s.env for _, s in fake.launched if not s.simulate)
    # the baseline server answered the map's passes to the budget (ignore_eos) and the measured ones as they are
    base = next(s for _, s in fake.launched if s.server_args["speculative_algorithm"] is None)
    eos = [bool(r["sampling_params"].get("ignore_eos")) for r in base.requests]
    assert eos.count(True) == 4 and eos.count(False) >= 4   # 2 passes x 2 prompts each
    # nowhere else: the measured tables, the deploy choice, the tau tables, the manifest's runs
    report = (out / "report.md").read_text()
    measured, mapped = report.split("## Break-even map")
    assert "-sim" not in measured and "3-1-4-sim2.5/graph" in mapped
    assert "-sim" not in json.dumps(m["deploy"]) and "-sim" not in json.dumps(m["agreement"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert "-sim" not in json.dumps(manifest["runs"]) and manifest["map"]["simulated"] is True
    assert {p.get("map") for p in m["pass_order"]} == {None, "sglang"}
    # the break-even tau the costs imply, the known tau marked, the real run agreeing with the map
    (row,) = m["map"]["breakeven"]["rows"]
    be = row["fit"]["break_even"]
    assert be["1"]["tau"] == pytest.approx(2 * 23 / 24, rel=0.15)
    assert be["1"]["ci95"][0] <= be["1"]["tau"] <= be["1"]["ci95"][1]
    assert [x["name"] for x in row["marks"]] == ["public", "04 served"] and row["verdict"] == "pays above tau*"
    (check,) = m["map"]["breakeven"]["simulation_check"]
    assert check["run"] == "3-1-4/graph" and check["in_range"] and check["agree"], check
    for f in ("breakeven_map.png", "breakeven_curves.png"):
        assert (out / f).is_file()


def test_a_server_that_ignores_its_simulation_is_refused(tmp_path, micro_target, fake_launches):
    """A release that does not read SGLANG_SIMULATE_ACC_LEN verifies for real (here at tau 3): its warm-up shows
    it, and 05b stops before timing it. And the map cannot attach to a server it did not launch."""
    make_work(tmp_path, micro_target)
    fake = fake_launches(ignore_simulation=True)
    with pytest.raises(StageError, match=r"was made to simulate accept length 1.5, but its warm-up committed"):
        map_run(tmp_path, fake)
    with pytest.raises(StageError, match="drop --eagle3-url"):
        run_05b(tmp_path, "--eagle3-url", "http://127.0.0.1:1", "--simulate-accept-lengths", "2", "3")
    for bad, why in ((["--simulate-accept-lengths", "2"], "at least two different lengths"),
                     (["--simulate-accept-lengths", "2", "3", "--simulate-settings", "3,2,6"], "chains"),
                     (["--known-tau", "x=2"], "give --simulate-accept-lengths too")):
        with pytest.raises(StageError, match=why):
            run_05b(tmp_path, "--overwrite", *bad)


def test_the_map_before_training_serves_a_declared_draft_without_04(tmp_path, micro_target, fake_launches):
    """train_plan_v4.md step 2b: only 01c's held-out prompts exist (the pilot's); the public draft is declared and
    gives the map its shape, and is measured for real beside it. Nothing of 04 or 02b is read or recorded."""
    import argparse
    from common.io import write_jsonl
    from common.stage import MERGE, tokenizer_identity, target_identity, write_manifest
    from tests.units.serving.test_sweep import other_draft

    ident = {"tokenizer": tokenizer_identity(micro_target), "target": target_identity(micro_target)}
    write_jsonl(stage_dir(tmp_path, MERGE) / "benchmark_prompts.jsonl",
                [{"id": f"p{k}", "source": "t", "prompt": "x", "prompt_ids": [k + 1, k + 2]} for k in range(3)])
    write_manifest(stage_dir(tmp_path, MERGE), MERGE, argparse.Namespace(), **ident)
    public = other_draft(tmp_path, micro_target, "public", seed=1)
    fake = fake_launches(step_s=0.004, round_s=0.008)
    map_run(tmp_path, fake, "--draft", f"public={public}", "--agreement-prompts", "1")
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/graph", "public/3-1-4/graph"} and m["draft"] is None
    board = m["map"]["engines"]["sglang"]
    assert board["draft"] == "public" and "public/3-1-4-sim2.5/graph" in board["runs"]
    assert m["agreement"] == {}   # nothing of ours to replay
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["inputs"]) == ["01c_merged/manifest.json"] and manifest["target"] == ident["target"]
    assert {s.server_args["speculative_draft_model_path"] for _, s in fake.launched} == {None, str(public)}


def test_the_cpu_builds_synthetic_kernels_walk_the_drafts_as_vllms_triton_kernels_do():
    """scripts/vllm_cpu_fix "synthetic": the CPU stand-ins refuse SYNTHETIC_MODE; the fix walks each request's
    drafts as rejection_greedy_sample_kernel / rejection_random_sample_kernel do (accept while u < the conditional
    rate of the position and the id is >= 0; the first rejection takes the target's argmax or the recovered token;
    a full acceptance gets the bonus) and leaves every other call to the C++ kernel."""
    import importlib.util

    import torch

    path = REPO / "scripts" / "vllm_cpu_fix" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("vllm_cpu_fix_under_test", path)
    fix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fix)   # outside vLLM's venv: it patches nothing, its functions are there
    calls = []
    greedy = fix._synthetic_greedy(lambda *a, **k: calls.append(a))
    out = torch.full((2, 4), -1, dtype=torch.int32)
    args = (torch.tensor([3, 6]), torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([50, 51, 52, 53, 54, 55]),
            torch.tensor([[99], [98]]), None, 3)
    u = torch.tensor([0.1, 0.6, 0.2, 0.1, 0.2, 0.3], dtype=torch.float64)
    greedy(out, *args, u, torch.tensor([1.0, 0.5, 0.0]), True)
    assert out.tolist() == [[5, 51, -1, -1], [8, 9, 55, -1]]
    greedy(out, *args, u, torch.tensor([1.0, 1.0, 1.0]), True)
    assert out.tolist() == [[5, 6, 7, 99], [8, 9, 10, 98]] and calls == []
    greedy(out, *args, None, None, False)   # not synthetic: the C++ kernel's call
    assert len(calls) == 1
    random = fix._synthetic_random(lambda *a, **k: calls.append(a))
    out = torch.full((2, 4), -1, dtype=torch.int32)
    recovered = torch.tensor([60, 61, 62, 63, 64, 65])
    random(out, args[0], torch.tensor([5, -1, 7, 8, 9, 10]), None, None, args[3], recovered, u,
           torch.tensor([False, True]), 3, 100, torch.tensor([1.0, 1.0, 1.0]), True, True)
    assert out.tolist() == [[5, 61, -1, -1], [-1, -1, -1, -1]]   # a -1 draft is rejected; a greedy row is not its


def test_a_second_engine_draws_its_own_map_and_the_report_names_the_best_engine_per_cell(tmp_path, micro_target,
                                                                                          fake_launches, monkeypatch):
    """--map-engines: another engine (here an SGLang twin registered for the test) gets its own baseline and
    simulated servers on the same plan, nothing measured; the map compares the engines cell by cell."""
    from common.serving import registry

    class Twin(SGLangEngine):
        name, label = "twin", "Twin"

    monkeypatch.setitem(registry.ENGINES, "twin", Twin)
    make_work(tmp_path, micro_target)
    fake = fake_launches(step_s=0.004, round_s=0.008)
    map_run(tmp_path, fake, "--map-engines", "twin")
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/graph", "3-1-4/graph"}     # the twin measured nothing
    assert set(m["map"]["engines"]) == {"sglang", "twin"}
    assert set(m["map"]["engines"]["twin"]["runs"]) == set(m["map"]["engines"]["sglang"]["runs"])
    assert len(fake.launched) == 2 + 3 + 1 + 3     # sglang: baseline, 3,1,4, 3 simulated; twin: baseline, 3 simulated
    best = m["map"]["breakeven"]["best_engine"]
    assert {r["at"] for r in best} == {"04 served"} and {r["engine"] for r in best} <= {"sglang", "twin"}
    assert "### The best engine per cell" in (stage_dir(tmp_path, SERVE_BENCH) / "report.md").read_text()
