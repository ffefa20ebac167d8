"""05b's report (common/serving/report.py): what report.md says about the engine's own tau and the sampled agreement
rows. The deploy section's report lines are tested with deploy (test_deploy.py)."""
from __future__ import annotations

from common.serving.agreement import probability_gate
from common.serving.report import sampled_agreement_lines, write_report


def test_report_says_what_the_windowed_server_tau_includes(tmp_path):
    """SGLang's reset zeroes the lifetime counters, not the per-interval ones: the report says the server's
    windowed number may hold up to 39 decode iterations from before the run."""
    run = {"output_tokens_per_s": 10.0, "ttft_mean_s": 0.1, "accept_length_mean": 2.0, "accept_length_pooled": 2.0,
           "server_accept_length": 2.1, "speed_ratio": 1.2}
    m = {"engine": "sglang", "target": "t", "draft": "d", "num_prompts": 1, "max_new_tokens": 8,
         "runs": {"3-1-4/graph": {"by_concurrency": {"1": run}}}, "preflight": {}}
    write_report(tmp_path, m)
    text = (tmp_path / "report.md").read_text()
    assert "up to 39 decode iterations from before the run" in text and "Per-request tau is exact" in text


def test_sampled_agreement_rows_name_an_engine_defect():
    """The report's sampled agreement: a row that disagrees because the engine build cannot verify sampled
    drafts says so (with the reason) instead of blaming the draft; one that disagrees otherwise says DISAGREE."""
    gate = probability_gate([(0, 0.5, True), (0, 0.5, False), (1, 0.25, False)] * 20, 3, 0.05)
    x = {"expected": {"engine_tau": 1.0, "replay_tau": 1.43, "difference": -0.43, "ci": [-0.5, -0.36], "agree": False,
                      "along_answers": gate}, "top_p": 0.95, "per_prompt": [{"z": -1.25}, {"z": 0.5}, {"z": None}]}
    lines = sampled_agreement_lines({"3-1-4/nograph": {"sampled": {"1": {**x, "engine_defect": "its expand drops floats"}}},
                                     "5-1-6/nograph": {"sampled": {"1": {**x, "engine_defect": None}}},
                                     "7-1-8/nograph": {}})
    text = "\n".join(lines)
    assert "| 3-1-4/nograph | 1 | 0.95 | 1.000 | 1.430 | -0.430 [-0.500, -0.360] | engine defect* |" in text
    assert ("| 5-1-6/nograph | 1 | 0.95 | 1.000 | 1.430 | -0.430 [-0.500, -0.360] | DISAGREE | 20 / 25.0 | -1.35 (-1.01, "
            "band +-5%) | 64% | -1.2, +0.5 |") in text, text  # A 20, S 25, V 13.75
    assert text.endswith("*its expand drops floats") and "7-1-8" not in text
    assert sampled_agreement_lines({"3-1-4/nograph": {"exact": True}}) == []
