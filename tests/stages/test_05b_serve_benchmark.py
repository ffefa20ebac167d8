"""05b, the serving benchmark, as a stage of its own next to 05 (the reference benchmark): each one's flags,
the old `--mode` refused by name, and 05 recorded as 05b's optional input. The sweep itself is tested in
tests/units/serving/test_sweep.py."""
from __future__ import annotations

import argparse
import importlib
import json
import re

import pytest

from common.io import write_json
from common.stage import (BENCH, EXTRACT, MERGE, SERVE_BENCH, StageError, TRAIN, input_manifests, stage_dir,
                          stage_folder, write_manifest)
from tests.units.serving.test_sweep import fake_launches, make_work, sweep_05b  # noqa: F401 (fixture)

SHARED = {"draft", "benchmark-max-new-tokens", "num-prompts", "target-path", "bench-seed", "acceptance-temperatures",
          "acceptance-top-p"}
REFERENCE = {"num-draft-tokens", "acceptance-rule", "acceptance-loop-prompts", "loop-prompts", "loop-untrained",
             "replay-cache-dir", "response-cache", "device", "cpu-threads", "sample-batch-size", "benchmark-workers"}
SERVING = {"engine", "draft-format", "agreement-prompts", "agreement-tolerance", "spec-settings", "bench-concurrency",
           "bench-context", "bench-context-prompts", "bench-repeats", "instant-temperature", "cuda-graph",
           "baseline-url", "eagle3-url", "baseline-port", "eagle3-port", "sglang-tp-size", "mem-fraction-static",
           "sglang-draft-attention-backend", "server-extra-args", "sglang-python", "vllm-python", "vllm-dtype",
           "vllm-kv-cache-space", "vllm-threads", "vllm-thread-binding", "vllm-max-model-len", "vllm-preload-iomp",
           "vllm-fix-sampling", "vllm-mla-backend", "server-timeout", "request-timeout", "max-retried-requests",
           "warmup-requests", "min-accept-length", "simulate-accept-lengths", "simulate-settings", "simulate-draft",
           "map-engines", "known-tau"}
BASE = {"help", "work-dir", "config", "overwrite"}


@pytest.mark.parametrize("stage, own, other", [(BENCH, REFERENCE, SERVING),
                                               (SERVE_BENCH, SERVING, REFERENCE)])
def test_each_05_stage_has_its_own_flags_and_its_help_names_none_of_the_others(stage, own, other):
    """One script used to show 48 flags for two stages without saying which read which: now 05's --help holds
    the reference flags, 05b's the serving ones, each with the flags both use, and neither names the other's."""
    parser = importlib.import_module(stage).build_parser()
    flags = {o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert flags == BASE | SHARED | own
    text = parser.format_help()
    assert not [f for f in other | {"mode"} if re.search(rf"--{f}(?![\w-])", text)], stage


def test_an_old_mode_flag_names_the_script_to_run(tmp_path):
    """`05_benchmark.py --mode server` lines renamed to 05b but keeping --mode: one line saying to drop it."""
    stage = importlib.import_module(SERVE_BENCH)
    for argv in (["--mode", "server"], ["--mode=server"]):
        with pytest.raises(StageError, match=r"^--mode: 05b_serve_benchmark.py is the serving benchmark .* drop "
                                             r"--mode$"):
            stage.main(["--work-dir", str(tmp_path), *argv])
    assert not stage_dir(tmp_path, BENCH).parent.exists()


def reference_of(work, draft_dir) -> None:
    """A complete 05 folder that measured the draft in `draft_dir` (its manifest's inputs say so)."""
    ref = stage_dir(work, BENCH)
    write_json(ref / "metrics.json", {"by_num_draft_tokens": {"5": {"per_position_acceptance": [0.8, 0.6, 0.5, 0.4,
                                                                                                0.3]}}})
    write_manifest(ref, BENCH, argparse.Namespace(), inputs=input_manifests(work, draft_dir))


def test_05_is_an_optional_input_recorded_in_the_manifest(tmp_path, micro_target, fake_launches):
    """05b reads 04, 01c and 02b, and 05's metrics when 05 measured this draft (the cost model's per-depth tau):
    its manifest records each as stage.input_manifests does for every stage; without 05, or with a 05 of
    another draft, it runs the same and records no such input."""
    make_work(tmp_path, micro_target)
    fake_launches()
    sweep_05b(tmp_path)
    out = stage_dir(tmp_path, SERVE_BENCH)
    upstream = input_manifests(tmp_path, *(stage_dir(tmp_path, s) for s in (TRAIN, MERGE, EXTRACT)))
    assert json.loads((out / "manifest.json").read_text())["inputs"] == upstream
    deploy = json.dumps(json.loads((out / "metrics.json").read_text())["deploy"])
    assert "replay per-position acceptance" not in deploy
    reference_of(tmp_path, stage_dir(tmp_path, TRAIN))
    sweep_05b(tmp_path, "--overwrite")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == {**upstream, **input_manifests(tmp_path, stage_dir(tmp_path, BENCH))}
    assert "replay per-position acceptance" in json.dumps(json.loads((out / "metrics.json").read_text())["deploy"])
    write_manifest(stage_dir(tmp_path, TRAIN), TRAIN, argparse.Namespace(retrained=True),
                   **{k: v for k, v in json.loads((stage_dir(tmp_path, TRAIN) / "manifest.json").read_text()).items()
                      if k in ("tokenizer", "target", "capture_points", "draft_vocab_size")})
    sweep_05b(tmp_path, "--overwrite")   # 05 measured the draft before this one: not an input
    assert f"{stage_folder(BENCH)}/manifest.json" not in json.loads((out / "manifest.json").read_text())["inputs"]

