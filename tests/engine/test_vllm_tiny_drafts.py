"""A real engine serves the MLA draft form on the Kimi-shaped target: vLLM's CPU build (build/vllm-venv) serves
the tiny world's DeepSeek-V3 target with MLA drafts that 04 trained on it (`--draft-attention mla`, the public
K2.5 MLA drafts' `Eagle3DeepseekV2ForCausalLM`), and with the EAGLE-3.1 options (`--fc-norm --norm-output`):
- 05b --engine vllm attaches to a baseline and launches the MLA draft's EAGLE-3 server (the capture points h2/h4/h5
  of the 8-layer target, DeepSeek's convention in both id spellings of the export): every greedy round equals
  replay's, vLLM's own per-position counters included;
- the MLA + 3.1 draft, served on its own with the CPU build's sampling fix: every greedy and sampled round (T 1 /
  top-p 0.95) equals replay's and the sampled gate passes, drafts accepted (the MLA form sampled on the
  Kimi-shaped target; 05b's own sampled agreement is test_vllm_real.py's, so 05b runs greedy here);
- a planted fault is caught: the same MLA + 3.1 weights with `norm_output` switched off in config.json, so vLLM
  feeds the next draft step the pre-norm state while the draft was trained on the post-norm one; the agreement
  check against 04's export names the disagreement. (Together with the previous test: vLLM reads norm_output as
  replay does, both ways.)
A 60-prompt chain (the shipped answers: no generation), two 04 runs, three server starts of its own (05b's baseline
is the tier's tiny-target server, tests/engine/conftest.py). If the engine venv is missing this FAILS (make test
builds it first).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest

from common.draft.manifest import DraftManifest
from common.io import iter_jsonl
from common.serving import vllm
from common.stage import (EXTRACT, GENERATE, MERGE, PREPARE, SERVE_BENCH, StageError, TRAIN, VOCAB, stage_dir)
from common.target.manifests import HiddenStatesManifest
from tests.engine.servers import Served, free_port, need_engine, settings
from tests.paths import ENGINE_PY, REPO

pytestmark = pytest.mark.engine

SERVED = "tiny-kimi"
BUDGET = 32          # new tokens per benchmark and agreement answer
POINTS = [2, 4, 5]   # [2, N//2, N-3] of the 8-layer target
stage = {name: importlib.import_module(name) for name in (PREPARE, GENERATE, MERGE, EXTRACT, VOCAB,
                                                          TRAIN, SERVE_BENCH)}
TRAIN_FLAGS = ["--max-steps", "160", "--learning-rate", "5e-3", "--precision", "fp32", "--device", "cpu",
               "--eval-fraction", "0", "--batch-tokens", "1024", "--log-every", "40", "--save-every", "1000"]


def build_chain(root: Path, world: Path) -> tuple[Path, Path]:
    """On the unpacked tiny world (the tier's, tests/engine/conftest.py), 01 -> 03 on 60 of its prompts (transformers
    answers: at the preset's 256-token cap 01b reads all 60 from the shipped response cache, configs/tiny.yaml,
    where another cap would generate them, about 50 s), and two 04 runs on the same features: MLA (work `mla`) and
    MLA + EAGLE-3.1 (work `mla31`, linking mla's 01c/02b/03)."""
    cfg = ["--config", str(REPO / "configs" / "tiny.yaml")]
    target = world / "target"
    datasets = json.dumps([{"name": "tiny", "adapter": "messages", "path": str(world / "data" / "prompts.jsonl"),
                            "max-records": 60}])
    mla, mla31 = root / "mla", root / "mla31"
    w = [*cfg, "--work-dir", str(mla), "--target-path", str(target)]   # every stage: not the preset's build/ path
    stage[PREPARE].main([*w, "--datasets", datasets, "--max-new-tokens", "256", "--max-context", "1024"])
    stage[GENERATE].main([*w, "--max-new-tokens", "256", "--max-context", "1024"])
    stage[MERGE].main([*w, "--benchmark-size", "8", "--max-seq-len", "1024"])
    stage[EXTRACT].main([*w, "--capture-engine", "hf", "--device", "cpu"])
    stage[VOCAB].main([*w, "--draft-vocab-size", "512"])
    stage[TRAIN].main([*w, "--draft-attention", "mla", *TRAIN_FLAGS])
    mla31.mkdir()
    for s in (MERGE, EXTRACT, VOCAB):
        os.symlink(stage_dir(mla, s).resolve(), stage_dir(mla31, s))
    stage[TRAIN].main([*cfg, "--work-dir", str(mla31), "--target-path", str(target), "--draft-attention", "mla",
                       "--fc-norm", "--norm-output", *TRAIN_FLAGS])
    return mla, mla31


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_world):
    need_engine()
    root, world = tmp_path_factory.mktemp("vllm_tiny_drafts"), tiny_world
    mla, mla31 = build_chain(root, world)
    export31 = stage_dir(mla31, TRAIN) / "export_sglang"
    planted = root / "norm_output_off"
    shutil.copytree(export31, planted)
    cfg = json.loads((planted / "config.json").read_text())
    assert cfg["norm_output"] is True and cfg["fc_norm"] is True
    cfg["norm_output"] = False
    (planted / "config.json").write_text(json.dumps(cfg))
    servers = {}
    try:   # both start while 05b runs its own (they share the cores; only agreement is checked on them)
        servers = {name: Served(name, world / "target", root / "logs", draft, 3, served_name=SERVED,
                                server_settings=settings(fix_sampling=True))   # EAGLE-3 at k = 3, the sampling fix
                   for name, draft in (("served31", export31), ("planted", planted))}
        yield {"world": world, "mla": mla, "mla31": mla31, "export31": export31, "root": root, **servers}
    finally:
        for s in servers.values():
            s.stop()


def agreement(chain, server, sampled: bool):
    """05b's agreement check of `server` against the MLA + 3.1 export (04's in work mla31), k = 3."""
    from common.benchmark.spec_decode import SamplingParams
    from common.serving.agreement import AgreementCheck

    work = chain["mla31"]
    m02b, m04 = HiddenStatesManifest.read(stage_dir(work, EXTRACT)), DraftManifest.read(stage_dir(work, TRAIN))
    target = chain["world"] / "target"
    engine = vllm.VllmEngine(target, chain["export31"], chain["export31"], m02b, m04, settings(fix_sampling=True))
    prompts = [r["prompt_ids"] for r in iter_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl")][:4]
    check = AgreementCheck(engine, target, chain["export31"], m04, prompts, BUDGET, 300, 0.0,
                           chain["root"] / f"agreement_{server.port}",
                           sampling=(SamplingParams(1.0, 0.95),) if sampled else ())
    return check(server.ready().url, "3-1-4/nograph", (3, 1, 4))


def test_05b_vllm_serves_04s_mla_draft_equal_to_replay(chain, tiny_baseline):
    """05b attaches to the tier's tiny-target baseline (tests/engine/conftest.py, the server test_vllm_tiny.py
    checks against transformers), launches the MLA draft (04's export_sglang: no speculators form for MLA) and
    checks it against replay, greedy round by round and per position (sampled: the next test, on the MLA + 3.1
    draft)."""
    work = chain["mla"]
    m04 = DraftManifest.read(stage_dir(work, TRAIN))
    assert m04.draft_config["attention"] == "mla" and m04.export_speculators_dir is None
    export = json.loads((Path(m04.export_dir) / "config.json").read_text())
    assert export["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and export["model_type"] == "kimi_k2"
    # DeepSeek's capture convention in both spellings: SGLang's ids [1, 3, 4] (+1 when the first is 1), vLLM's the points
    assert export["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [p - 1 for p in POINTS]
    assert export["eagle_aux_hidden_state_layer_ids"] == POINTS
    stage[SERVE_BENCH].main([
        "--config", str(REPO / "configs" / "tiny.yaml"), "--work-dir", str(work), "--engine", "vllm",
        "--target-path", str(chain["world"] / "target"),
        "--vllm-python", str(ENGINE_PY), "--vllm-kv-cache-space", "1", "--cuda-graph", "off",
        "--spec-settings", "3,1,4", "--bench-concurrency", "1", "--num-prompts", "2", "--agreement-prompts", "4",
        "--benchmark-max-new-tokens", str(BUDGET), "--warmup-requests", "1", "--min-accept-length", "1.02",
        "--baseline-url", tiny_baseline.ready().url, "--eagle3-port", str(free_port()), "--bench-repeats", "1",
        "--acceptance-temperatures", "0"])
    m = json.loads((stage_dir(work, SERVE_BENCH) / "metrics.json").read_text())
    a = m["agreement"]["3-1-4/nograph"]
    assert a["exact"] and a["agree"] and a["counters_equal_per_request_sums"]
    assert a["engine"] == a["replay"] and sum(a["engine"]["accepted_per_position"]) > 0   # a trained draft
    assert all(p["engine"] == p["replay"] for p in a["per_prompt"])
    assert m["runs"]["3-1-4/nograph"]["preflight"]["aux_layers_reported"] == POINTS


def test_the_mla_eagle31_draft_is_served_equal_to_replay(chain):
    """Greedy, and sampled at T 1 / top-p 0.95 with the sampling fix: every round along the engine's answers is
    replay's, the gate passes (the check raises otherwise), and drafts are accepted (none without the fix)."""
    result = agreement(chain, chain["served31"], sampled=True)
    assert result["exact"] and result["agree"] and result["engine"] == result["replay"]
    assert sum(result["engine"]["accepted_per_position"]) > 0
    smp = result["sampled"]["1"]
    assert smp["exact"] and smp["engine_defect"] is None and sum(smp["engine"]["accepted_per_position"]) > 0


def test_norm_output_switched_off_in_the_served_config_is_caught(chain):
    """vLLM serves the planted copy as written (pre-norm state fed back): its rounds leave replay's."""
    with pytest.raises(StageError, match="disagree"):
        agreement(chain, chain["planted"], sampled=False)
