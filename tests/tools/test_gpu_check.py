"""scripts/gpu_check.sh, the prepared GPU check (benchmarks/gpu_check.py), on the CPU with tiny shapes: every
section runs and passes (the exactness checks compare the CPU with itself here; on a GPU they compare the
GPU with the CPU), it writes its JSON and markdown, and its FLOP count and projection hold. So the check is
ready, not rotten, the day a GPU is at hand."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check as gc  # noqa: E402
import gpu_check_train as gt  # noqa: E402

from common.config import declared_flags  # noqa: E402
from common.stage import TRAIN, stage_script  # noqa: E402

SECTIONS = ["preflight", "ttt_kernel", "step_04", "replay_05", "capture_02b", "train_04", "attention", "projection"]


# Three times the tiny run's default budget (300 s), and so each section's: the sections' budgets are sized
# for the GPU run; here they only measure how loaded the box is (train_04: ~25 s alone, 71 s at load 7).
TINY_BUDGET_S = 900


def test_gpu_check_tiny_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PY": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--tiny", "--budget-s", str(TINY_BUDGET_S),
                          str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=TINY_BUDGET_S + 60)
    data = json.loads((out / "gpu_check.json").read_text())
    secs = data["sections"]
    assert run.returncode == 0 and data["status"] == "passed", \
        (run.stdout[-3000:], run.stderr[-3000:], {n: s for n, s in secs.items() if s["status"] != "passed"})
    assert list(secs) == SECTIONS and sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    for name, s in secs.items():   # every check ran and held; only the projection needs a GPU to start from
        assert s["status"] == ("skipped: no GPU measured" if name == "projection" else "passed"), name
        assert name == "projection" or (s["checks"] and all(c["ok"] for c in s["checks"].values())), name
    assert len(secs["step_04"]["checks"]) == 4 and len(secs["ttt_kernel"]["checks"]) == 2
    runs = {r["name"]: r for r in secs["train_04"]["runs"]}
    assert list(runs) == ["compact_T48", "bf16_T48", "compact_T48_warm_start", "compact_T48_mla"]
    assert runs["compact_T48_mla"]["form"] == "mla" and runs["compact_T48"]["form"] == "mha"
    assert runs["compact_T48_mla"]["flop_per_token"] != runs["compact_T48"]["flop_per_token"]
    for r in runs.values():
        if r["name"].endswith("warm_start") and "init-from" not in declared_flags(REPO / stage_script(TRAIN)):
            assert r["status"] == "skipped: 04 has no --init-from"
            continue
        assert r["tokens_per_s"] > 0 and r["steps"] == 3 and r["peak_rss_gib"] > 0 and r["mfu"] is None
    assert runs["compact_T48"]["teacher"] == "topk" and runs["bf16_T48"]["teacher"] == "final"
    assert 0 < secs["attention"]["by_seq_len"][0]["share"] < 1
    md = (out / "gpu_check.md").read_text()
    assert "| train_04 | passed |" in md and "| compact_T48 | topk | 48 |" in md


def test_section_budgets_scale_with_the_whole_budget(tmp_path, monkeypatch):
    """A section's alarm is its budget times --budget-s over the default, capped by what is left of the whole."""
    alarms = []
    monkeypatch.setattr(gc.signal, "alarm", alarms.append)
    for scale, deadline_s, want in ((1.0, 1000, 60), (3.0, 1000, 180), (3.0, 100.5, 100)):
        data = {"command": "x", "started": "now", "git": "g", "tiny": True, "device": "cpu", "sections": {}}
        report = gc.Report(tmp_path, time.time() + deadline_s, data, scale=scale)
        gc.run_section(report, "s", 60, lambda result: None)
        assert alarms[-2:] == [want, 0] and report.data["sections"]["s"]["status"] == "passed", (scale, alarms)


def test_flop_per_token_is_the_plans():
    """train_plan_v4.md section 2.3 at a mean sample of ~3,700 tokens with 31% supervised: about 28 GFLOP per
    token for the preset's MLA draft (final-state teacher; the top-k teacher 0.73 less), 30.1 for the MHA
    form at 56/8 heads, 40.4 for the public MLA draft's full 163,840-row head (the warm start)."""
    from dataclasses import replace
    ts = gc.kimi_shapes().train
    mha, mla = gt.draft_shape(ts), gt.draft_shape(ts, "mla")
    assert (mha["num_attention_heads"], mha["num_key_value_heads"], mha["head_dim"]) == (56, 8, 128)
    assert (mla["num_attention_heads"], mla["q_lora_rank"], mla["kv_lora_rank"]) == (64, 1536, 512)
    final = lambda cfg: gt.flop_per_token(cfg, 3700, 7, 0.31, "final")  # noqa: E731
    assert 27.6e9 < final(mla) < 28.6e9 and 29.6e9 < final(mha) < 30.6e9
    assert abs(final(mha) - gt.flop_per_token(mha, 3700, 7, 0.31, "topk") - 0.73e9) < 0.01e9
    assert 39.9e9 < final(gt.draft_shape(replace(ts, draft_vocab=163840), "mla")) < 40.9e9


def test_projection_to_one_rtx_pro_6000():
    runs = [{"name": "compact_T4096", "tokens_per_s": 10_000.0, "peak_reserved_gib": 60.0},
            {"name": "compact_T8192", "tokens_per_s": 9_000.0, "peak_reserved_gib": 99.0}]
    result = {}
    gc.projection(result, "NVIDIA H200", runs)
    assert result["kind"] == "projection" and result["source"] == "H200"
    assert abs(result["compute_ratio"] - 503.8 / 989.5) < 1e-12 and abs(result["bandwidth_ratio"] - 1.792 / 4.8) < 1e-12
    r1 = result["R_1"]
    assert r1["run"] == "compact_T4096" and round(r1["compute_bound"]) == 5091 and round(r1["bandwidth_bound"]) == 3733
    hours = result["runs"][0]["plan_training_hours_3_epochs_8_gpus"]
    assert abs(hours["compute_bound"] - 3 * 370.6e6 / (8 * 0.9 * r1["compute_bound"]) / 3600) < 1e-9
    assert [r["fits_rtx_memory"] for r in result["runs"]] == [True, False]
    md = gc.markdown({"command": "x", "started": "now", "git": "g", "tiny": False, "device": "cuda",
                      "sections": {"projection": {**result, "status": "passed", "seconds": 0}}})
    assert "PROJECTED from H200" in md and "**R_1 = 3,733-5,091 tok/s per GPU**" in md
    nvl, rtx = {}, {}
    gc.projection(nvl, "NVIDIA H200 NVL", runs)
    gc.projection(rtx, "NVIDIA RTX PRO 6000 Blackwell Server Edition", runs)
    assert nvl["source"] == "H200 NVL" and rtx["status"].startswith("skipped")
