"""benchmarks/regen_temperature.py without its hour of CPU: the preset it derives, the data summary and
the table (the generating, training and measuring parts are 01b's, 04's and 05's, tested there)."""
import argparse
import importlib
import json

import yaml

from common.stage import EXTRACT, GENERATE, MERGE, TRAIN, VOCAB, stage_dir, stage_folder

regen = importlib.import_module("benchmarks.regen_temperature")


def test_the_sampled_preset_drops_only_the_greedy_response_cache(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"response-cache": "a.jsonl.gz", "max-new-tokens": 256, "seed": 0}))
    got = yaml.safe_load(regen.sampled_preset(preset, tmp_path / "out").read_text())
    assert got == {"max-new-tokens": 256, "seed": 0}


def test_data_summary_counts_loops_and_the_token_cap_without_benchmark_prompts(tmp_path):
    stage_dir(tmp_path, MERGE).mkdir()
    stage_dir(tmp_path, GENERATE).mkdir()
    (stage_dir(tmp_path, MERGE) / "stats.json").write_text(json.dumps({"totals": {
        "num_samples": 200, "num_response_tokens": 5000, "repetition_loops": 30}}))
    (stage_dir(tmp_path, GENERATE) / "manifest.json").write_text(json.dumps({"counts": {
        "code": {"finish_reasons": {"length": 40, "stop": 60}},
        "chat": {"finish_reasons": {"stop": 100}},
        "heldout": {"benchmark_only": True, "finish_reasons": {"null": 120}}}}))
    d = regen.data_summary(tmp_path)
    assert d["loop_share"] == 0.15 and d["length_share"] == 0.2 and d["num_response_tokens"] == 5000


def test_report_gives_both_temperatures_and_the_paired_difference():
    cell = lambda x: {"tau": x, "tau_ci95": [x - 0.1, x + 0.1]}  # noqa: E731
    tau = {"04": {"0": 1.5, "1.0": 1.3}, "sampled_data": {"0": 1.45, "1.0": 1.4}}
    drafts = {n: {"tau": {t: {k: cell(v) for k in ("3", "5")} for t, v in by_t.items()}} for n, by_t in tau.items()}
    pairs = [{"a": "04", "b": "sampled_data", "by_temperature": {
        t: {k: {"difference": tau["04"][t] - tau["sampled_data"][t], "ci": [-0.02, 0.12]} for k in ("3", "5")}
        for t in ("0", "1.0")}}]
    data = {"num_samples": 100, "num_response_tokens": 9000, "repetition_loops": 14, "loop_share": 0.14,
            "length_share": 0.3}
    results = {"data": {"greedy": data, "sampled": {**data, "repetition_loops": 1, "loop_share": 0.01}},
               "eval": {"num_prompts": 120, "drafts": drafts, "pairs": pairs}}
    args = argparse.Namespace(temperature=1.0, top_p=0.95, num_draft_tokens=[3, 5])
    table = regen.report(results, args)
    assert "| sampled | 100 | 9000 | 1 (1.0%) | 30.0% |" in table
    assert "| 1.0 | sampled_data | 1.400 [1.30, 1.50] | 1.400 [1.30, 1.50] |" in table
    # stored as 04 - sampled_data; shown as sampled - greedy, the interval turned round
    assert "| 1.0 | sampled - greedy | +0.100 [-0.120, +0.020] |" in table


def test_a_greedy_row_from_elsewhere_is_checked(tmp_path):
    """--greedy-row re-uses a finished row only when it was trained on the base's 02b/03 with the same flags."""
    import pytest

    from common.stage import input_manifests

    base = tmp_path / "base"
    for s in (EXTRACT, VOCAB):
        stage_dir(base, s).mkdir(parents=True)
        (stage_dir(base, s) / "manifest.json").write_text(json.dumps({"stage": s}))
    row = tmp_path / "row"
    stage_dir(row, TRAIN).mkdir(parents=True)
    inputs = input_manifests(base, stage_dir(base, EXTRACT), stage_dir(base, VOCAB))
    flags = {"train-seed": 0, "candidates-per-epoch": 1, "max-train-samples": 100}

    def write(config, inputs):
        (stage_dir(row, TRAIN) / "manifest.json").write_text(json.dumps({"config": config, "inputs": inputs}))

    write({"train_seed": 0, "candidates_per_epoch": 1, "max_train_samples": 100}, inputs)
    regen.check_row(row, base, flags)
    write({"train_seed": 0, "candidates_per_epoch": 1, "max_train_samples": 50}, inputs)
    with pytest.raises(SystemExit, match="max-train-samples"):
        regen.check_row(row, base, flags)
    write({"train_seed": 0, "candidates_per_epoch": 1, "max_train_samples": 100},
          {**inputs, f"{stage_folder(EXTRACT)}/manifest.json": "0" * 64})
    with pytest.raises(SystemExit, match="other 02b/03"):
        regen.check_row(row, base, flags)


def test_a_greedy_row_from_elsewhere_is_refused_with_sources(tmp_path):
    """--greedy-row was trained on all the base's datasets: beside --sources it would compare other data."""
    import pytest

    with pytest.raises(SystemExit, match="--greedy-row trains on all"):
        regen.main(["--base", str(tmp_path), "--out", str(tmp_path / "o"), "--sources", "code",
                    "--greedy-row", str(tmp_path / "row")])
    assert not (tmp_path / "o").exists()
