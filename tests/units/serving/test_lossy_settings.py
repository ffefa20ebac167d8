"""Lossy and simulated acceptance settings are refused in any measurement (issue 34, items 6 and 7): SGLang's
accept thresholds, its rejection sampling, SGLANG_SIMULATE_ACC_LEN / _METHOD, vLLM's synthetic rejection
sampling. Each engine has one function that says why a launch or a server is lossy or simulated
(`lossy_or_simulated`); 05b refuses from the launch line and environment before anything launches, and from
the info document of every EAGLE-3 server it checks (launched or attached)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.serving import process
from common.serving import sglang as srv
from common.serving import vllm
from common.stage import SERVE_BENCH, StageError, stage_dir
from tests.sglang_server_stub import StubServer, StubState
from tests.units.serving.test_sweep import FakeLaunches, free_ports, make_work, run_05b
from tests import paths

FIXTURES = paths.FIXTURES / "vllm"


def test_sglang_lossy_settings_from_the_launch_line_the_environment_and_the_info_document():
    clean = srv.server_command("/m", 1, 1, 0.8, True, "/d", (3, 1, 4), "py")
    assert srv.lossy_or_simulated(clean, {"PATH": "/bin"}, {"speculative_accept_threshold_single": 1.0,
                                                            "speculative_accept_threshold_acc": 1.0,
                                                            "speculative_use_rejection_sampling": False}) == []
    # argparse's forms: `=`, a separate value, an unambiguous prefix; the last value wins
    for extra, field in ((["--speculative-accept-threshold-single", "0.5"], "threshold_single 0.5"),
                         (["--speculative-accept-threshold-acc=0.8"], "threshold_acc 0.8"),
                         (["--speculative-accept-threshold-a", "2"], "threshold_acc 2"),  # accepts less than p(d)
                         (["--speculative-accept-threshold-s=0.3"], "threshold_single 0.3"),
                         (["--speculative-accept-threshold-acc", "0.5", "--speculative-accept-threshold-acc", "0.7"],
                          "threshold_acc 0.7"),
                         (["--speculative-use-rejection-sampling"], "use_rejection_sampling"),
                         (["--speculative-use"], "use_rejection_sampling")):
        why = srv.lossy_or_simulated(clean + extra)
        assert len(why) == 1 and field in why[0] and why[0].startswith("the launch line sets"), (extra, why)
    assert srv.lossy_or_simulated(clean + ["--speculative-accept-threshold-single", "1.0",
                                           "--speculative-accept-threshold-acc=1"]) == []
    assert srv.lossy_or_simulated(clean + ["--speculative-accept", "0.5"]) == []  # ambiguous: argparse refuses it
    why = srv.lossy_or_simulated(clean, {"SGLANG_SIMULATE_ACC_LEN": "3.2", "SGLANG_SIMULATE_ACC_METHOD": "match-expected"})
    assert [w.split(" (")[0] for w in why] == ["the environment sets SGLANG_SIMULATE_ACC_LEN=3.2",
                                               "the environment sets SGLANG_SIMULATE_ACC_METHOD=match-expected"]
    info = {"speculative_accept_threshold_acc": 0.6,
            "internal_states": [{"speculative_accept_threshold_single": 0.9, "speculative_use_rejection_sampling": True}]}
    why = srv.lossy_or_simulated(info=info)
    assert [w.split(":")[0] for w in why] == ["the info document reports speculative_accept_threshold_acc 0.6",
                                              "internal_states[0] reports speculative_accept_threshold_single 0.9",
                                              "internal_states[0] reports speculative_use_rejection_sampling"]


def test_vllm_synthetic_acceptance_from_the_launch_line_and_the_info_document():
    settings = vllm.VllmSettings(python="py")
    clean = vllm.server_command("/m", 1, settings, False, "/d", 3)
    assert vllm.lossy_or_simulated(clean) == [] and vllm.speculative_config_of(clean)["method"] == "eagle3"
    synthetic = json.dumps({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
                            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.5})
    for argv in (["--speculative-config", synthetic], ["--speculative_config=" + synthetic], ["-sc", synthetic],
                 clean + ["--speculative-config.rejection_sample_method", "synthetic",
                          "--speculative-config.synthetic_acceptance_length=3.5"]):
        why = vllm.lossy_or_simulated(argv)
        assert [w.split(" (")[0] for w in why] == [
            "the launch line's speculative config sets rejection_sample_method 'synthetic'",
            "the launch line's speculative config sets synthetic_acceptance_length 3.5"], (argv, why)
    # 05b's own launch: --server-extra-args may not carry the speculative config in any of vLLM's forms
    for extra in (["--speculative-config.rejection_sample_method=synthetic"], ["--speculative_config", synthetic],
                  ["-sc", synthetic], ["--config", "serve.yaml"], ["--spec-method", "eagle"]):
        with pytest.raises(StageError, match="may not contain"):
            vllm.check_extra_args(extra)
    info = json.loads((FIXTURES / "server_info_eagle3.json").read_text())["vllm_config"]
    info["speculative_config"].update(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.8, 0.7])
    with pytest.raises(StageError, match=r"^the EAGLE-3 server u is lossy or simulated: the info document's "
                                         r"speculative_config sets rejection_sample_method 'synthetic' .*; the info "
                                         r"document's speculative_config sets synthetic_acceptance_rates \[0.9, 0.8, "
                                         r"0.7\]\. Its tau would credit the draft"):
        vllm.check_eagle3_info(info, Path(info["speculative_config"]["model"]), None, "u")


def test_05b_refuses_a_lossy_sglang_launch_before_any_server_starts(tmp_path, micro_target, monkeypatch):
    """From --server-extra-args and from the environment the servers inherit: nothing is launched."""
    make_work(tmp_path, micro_target)
    fake = FakeLaunches()
    monkeypatch.setattr(process, "launch_server", fake.launch)
    monkeypatch.setattr(process, "stop_server", fake.stop)
    base, spec = free_ports(2)
    ports = ["--baseline-port", base, "--eagle3-port", spec, "--spec-settings", "3,1,4", "--cuda-graph", "on"]
    with pytest.raises(StageError, match=r"^the SGLang server 05b would launch for 3-1-4/graph is lossy or simulated: "
                                         r"the launch line sets speculative_accept_threshold_acc 0.5"):
        run_05b(tmp_path, *ports, "--server-extra-args", "--speculative-accept-threshold-acc 0.5")
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "3")
    with pytest.raises(StageError, match=r"is lossy or simulated: the environment sets SGLANG_SIMULATE_ACC_LEN=3 "):
        run_05b(tmp_path, *ports)
    assert fake.launched == [] and not (stage_dir(tmp_path, SERVE_BENCH) / "manifest.json").exists()


def test_05b_refuses_an_attached_sglang_server_that_reports_lossy_settings(tmp_path, micro_target):
    """Read from its info document, before anything is measured: the server args, and each rank's internal state
    (the scheduler's own values)."""
    export = make_work(tmp_path, micro_target)
    for field, where, value in (("speculative_use_rejection_sampling", "args", True),
                                ("speculative_accept_threshold_single", "state", 0.7)):
        state = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target))
        if where == "args":
            state.server_args[field] = value
        else:
            state.internal_state[field] = value
        with StubServer(state) as e:
            with pytest.raises(StageError, match=rf"^the EAGLE3 server {e} is lossy or simulated: .*{field}"):
                run_05b(tmp_path, "--eagle3-url", e)
        assert state.requests == []
