"""The break-even map on a real engine: vLLM's CPU build (build/vllm-venv) serves SmolLM2-135M with an untrained
draft of our shape, as train_plan_v4.md step 2b serves the public draft before anything is trained (05b without 04:
01c's held-out prompts and a declared --draft). One 05b run, three server starts (the real EAGLE-3 server and two
simulated ones; the baseline is the SmolLM2 one tests/engine/conftest.py shares, attached as --baseline-url):
- vLLM's synthetic acceptance, with the CPU build's fix loaded (scripts/vllm_cpu_fix "synthetic": its CPU kernels
  refuse synthetic mode), commits the requested length a verify round: every round at L = 4 (k = 3: every draft),
  1.5 drafts a round on average at L = 2.5, read from vLLM's own per-round counts;
- each simulated server is confirmed simulated by vllm.lossy_or_simulated (launch line and info document), and the
  same test refuses it as a measurement;
- the simulated rows never reach a measured-draft table: metrics["runs"], the report's tables, the deploy choice,
  the manifest's runs hold the baseline and the real EAGLE-3 server only;
- the CPU build runs Model Runner V1, which has no block verification (why 05b refuses ',block' there).
If the engine venv or the SmolLM2 world is missing, this FAILS (make test builds both first)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from common.serving import vllm
from common.stage import GENERATE, MERGE, PREPARE, SERVE_BENCH, stage_dir
from tests.engine.servers import free_port
from tests.engine.test_vllm_real import ENGINE_PY, POINTS, SHIPPED, TARGET, datasets

pytestmark = pytest.mark.engine   # the real-engine tier: `make test` runs it, `make test-fast` leaves it out

stage = {name: importlib.import_module(name) for name in (PREPARE, GENERATE, MERGE, SERVE_BENCH)}


def untrained_draft(out: Path) -> Path:
    """An EAGLE-3 draft of our shape for SmolLM2, never trained (draft ids: the first 2048 target ids)."""
    import torch

    from common.draft.export_sglang import export_sglang
    from common.draft.model import Eagle3DraftModel, draft_config

    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(json.loads((TARGET / "config.json").read_text()), draft_vocab_size=2048))
    t2d = torch.zeros(model.t2d.shape[0], dtype=torch.bool)
    t2d[:2048] = True
    model.set_vocab_mapping(torch.zeros(2048, dtype=torch.int64), t2d)
    return export_sglang(model, out, POINTS, "float32")


def test_vllm_synthetic_acceptance_draws_the_map_and_stays_out_of_the_measured_tables(tmp_path, smollm2_baseline):
    if not ENGINE_PY.is_file() or not (TARGET / "config.json").is_file():
        pytest.fail(f"{ENGINE_PY} or {TARGET} is missing: `make engine` and 00_build_smollm2_world.py (make test)")
    work, w, t = tmp_path / "work", ["--work-dir", str(tmp_path / "work")], ["--target-path", str(TARGET)]
    stage[PREPARE].main([*w, *t, "--datasets", datasets(4, 6), "--max-new-tokens", "256", "--max-context", "2048"])
    stage[GENERATE].main([*w, *t, "--generation-engine", "hf", "--hf-batch-size", "1", "--response-cache",
                          str(SHIPPED), "--max-new-tokens", "256", "--max-context", "2048"])
    stage[MERGE].main([*w, "--benchmark-size", "0", "--max-seq-len", "2048"])
    draft = untrained_draft(tmp_path / "untrained")
    stage[SERVE_BENCH].main([
        *w, "--engine", "vllm", "--vllm-python", str(ENGINE_PY), "--vllm-kv-cache-space", "1", "--cuda-graph", "off",
        "--draft", f"shape={draft}", "--spec-settings", "3,1,4", "--simulate-accept-lengths", "2.5", "4",
        "--bench-concurrency", "1", "--num-prompts", "2", "--benchmark-max-new-tokens", "24", "--warmup-requests", "2",
        "--bench-repeats", "1", "--min-accept-length", "1.0", "--acceptance-temperatures", "0",
        "--baseline-url", smollm2_baseline.ready().url, "--eagle3-port", str(free_port())])
    out = stage_dir(work, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    board = m["map"]["engines"]["vllm"]
    # the requested acceptance, from vLLM's own per-round counts (the preflight's warm-up) and the timed runs
    for key, length in (("shape/3-1-4-sim2.5/nograph", 2.5), ("shape/3-1-4-sim4/nograph", 4.0)):
        run = board["runs"][key]
        assert run["simulated"]["accept_length"] == length and run["preflight"]["simulated_accept_length"] == length
        assert run["preflight"]["warmup_tau"] == pytest.approx(length, rel=0.15 if length < 4 else 1e-9), key
        cmd = board["commands"][key]
        assert vllm.simulated_length(cmd["argv"]) == length and "synthetic" in cmd["env"]["EAGLE3_VLLM_FIXES"]
        assert vllm.lossy_or_simulated(cmd["argv"])   # a measurement would refuse it
        cell = run["by_temperature"]["0"]["by_concurrency"]["1"]
        print(f"{key}: server tau {cell['server_accept_length']}, {cell['output_tokens_per_s']:.1f} tok/s, "
              f"x{cell['speed_ratio']:.2f} the map's baseline")
        assert cell["server_accept_length"] == pytest.approx(length, rel=0.15 if length < 4 else 1e-9), key
    # never in a measured table: runs, report tables, deploy, manifest
    assert set(m["runs"]) == {"baseline/nograph", "shape/3-1-4/nograph"}
    measured, mapped = (out / "report.md").read_text().split("## Break-even map")
    assert "-sim" not in measured and "shape/3-1-4-sim4/nograph" in mapped
    assert "-sim" not in json.dumps(m["deploy"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert "-sim" not in json.dumps(manifest["runs"]) and manifest["map"]["simulated"] is True
    real = m["runs"]["shape/3-1-4/nograph"]["by_temperature"]["0"]["by_concurrency"]["1"]
    assert real["server_accept_length"] < 1.3   # the untrained draft itself: its real tau, not the map's
    (row,) = m["map"]["breakeven"]["rows"]
    print(f"break-even on this CPU (k 3, greedy, short, c 1): {json.dumps(row['fit']['break_even'])}")
    assert row["fit"] is not None and (out / "breakeven_map.png").is_file()
    log = out / "server_logs" / "map_vllm_shape_3-1-4-sim4_nograph.log"
    assert vllm.runner_in_log(log)["model_runner"] == "V1"   # no block verification on the CPU build
