"""A third engine is one Engine subclass and one registry entry (docs/serving.md, "Adding an engine"): this file's
StubEngine, registered for the test alone, runs 05b end to end - its own flag in its own group of 05b's parser,
its command and environment, its checks and preflight, its request for every answer, its label in the report, its
measurement-only flags dropped from the launch line - with no other file knowing it exists. Its servers are
in-process fakes (nothing is launched: process.launch_server is replaced), so each answer is the stub's own."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.draft.manifest import DraftManifest
from common.serving import deploy, process, registry
from common.serving.engine import Engine, ServedDraft
from common.stage import SERVE_BENCH, stage_dir
from common.target.manifests import HiddenStatesManifest
from tests.units.serving.test_sweep import free_ports, load_05b, make_work

BUILT = []  # every StubEngine 05b built, for the test to read back


@dataclass
class StubEngine(Engine):
    """Answers in-process: every answer is `max_new_tokens` tokens; a speculative server commits
    `accept_length` (its --stub-accept-length) tokens a verify round."""
    target_dir: Path
    export_dir: Path
    m02b: HiddenStatesManifest
    m04: DraftManifest
    accept_length: float = 2.0
    foreign: list[ServedDraft] = field(default_factory=list)
    served: dict = field(default_factory=dict)     # port -> the setting its server was launched with
    requests: list = field(default_factory=list)   # (url, prompt ids, sampling) of every answer it gave
    name = "stub"
    label = "Stub engine"
    server_tau_note = "The stub keeps no tau of its own."
    measurement_flags = {"--port": 1, "--stub-count-rounds": 0}
    measurement_env = ("STUB_MEASURE",)

    @classmethod
    def add_flags(cls, group):
        group.add_argument("--stub-accept-length", type=float, default=2.0,
                           help="tokens a verify round of a stub server commits")

    @classmethod
    def from_args(cls, args, export_dir, m02b, m04, target_dir, work_dir, foreign):
        return cls(target_dir, export_dir, m02b, m04, accept_length=args.stub_accept_length, foreign=list(foreign))

    def __post_init__(self):
        BUILT.append(self)

    @property
    def draft_dir(self):
        return self.export_dir

    @staticmethod
    def check_launch_line(argv):
        if "--stub-draft" not in argv:
            raise ValueError(f"not a stub EAGLE-3 line: {argv}")

    def command(self, port, graph, setting, draft=None):
        self.served[port] = setting
        spec = ["--stub-draft", str((draft or self.drafts[0]).path), "--stub-setting", ",".join(map(str, setting)),
                "--stub-accept-length", f"{self.accept_length:g}"] if setting else []
        return ["stub-python", "-m", "stub.serve", "--port", str(port), "--stub-count-rounds", *spec], \
            {"STUB_MEASURE": "1", "STUB_THREADS": "1"}

    def setting_of(self, url):
        return self.served[int(url.rsplit(":", 1)[1])]

    def context_length(self):
        return 4096, "the stub's"

    def check_baseline(self, url):
        assert self.setting_of(url) is None
        return False

    def check_eagle3(self, url, drafts=None, simulated=None):
        return False, self.setting_of(url), (drafts or self.drafts)[0]

    def preflight(self, url, log, warmup_fn, draft=None, simulated=None):
        return {"warmup_tau": warmup_fn(url)}

    def request(self, url, ids, max_new_tokens, timeout, sampling=None, logprobs=None):
        self.requests.append((url, list(ids), sampling))
        rounds = math.ceil(max_new_tokens / self.accept_length) if self.setting_of(url) else None
        return {"completion_tokens": max_new_tokens, "output_ids": [7] * max_new_tokens, "spec_verify_ct": rounds,
                "accept_length": max_new_tokens / rounds if rounds else None, "ttft_s": 0.001, "latency_s": 0.002}


class FakeProc:
    def poll(self):
        return None


def test_a_stub_engine_runs_05b_through_its_own_flag_command_request_and_label(tmp_path, micro_target, monkeypatch):
    BUILT.clear()
    monkeypatch.setitem(registry.ENGINES, StubEngine.name, StubEngine)
    launched = []
    monkeypatch.setattr(process, "launch_server", lambda cmd, log, env=None: launched.append((cmd, env)) or FakeProc())
    monkeypatch.setattr(process, "wait_ready", lambda *a, **k: None)
    monkeypatch.setattr(process, "stop_server", lambda *a, **k: None)
    make_work(tmp_path, micro_target)
    groups = {g.title: [a.dest for a in g._group_actions] for g in load_05b().build_parser()._action_groups}
    assert groups["Stub engine servers (--engine stub)"] == ["stub_accept_length"]

    base, spec = free_ports(2)
    load_05b().main(["--work-dir", str(tmp_path), "--engine", "stub", "--stub-accept-length", "4",
                     "--spec-settings", "3,1,4", "--cuda-graph", "off", "--bench-concurrency", "1",
                     "--benchmark-max-new-tokens", "8", "--warmup-requests", "1", "--baseline-port", base,
                     "--eagle3-port", spec])

    (engine,) = BUILT
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert m["engine"] == "stub" and json.loads((out / "manifest.json").read_text())["engine"] == "stub"
    assert [cmd[cmd.index("--port") + 1] for cmd, _ in launched] == [base, spec]
    assert launched[1][0][-2:] == ["--stub-accept-length", "4"] and launched[1][1]["STUB_MEASURE"] == "1"
    # every answer the sweep read came from the stub's own request: warm-up and both timed passes, both servers
    assert len(engine.requests) == 2 * (1 + 2 * 2)
    cell = m["runs"]["3-1-4/nograph"]["by_temperature"]["0"]["by_concurrency"]["1"]
    assert cell["accept_length_pooled"] == pytest.approx(4.0) and "refused" not in cell
    assert m["preflight"]["warmup_tau"] == pytest.approx(4.0)
    assert (out / "report.md").read_text().startswith("# 05 server benchmark (Stub engine)")
    line = deploy.launch_line("stub", m["commands"]["3-1-4/nograph"], True)
    assert line == (f"STUB_THREADS=1 python -m stub.serve --stub-draft {engine.export_dir} --stub-setting 3,1,4 "
                    "--stub-accept-length 4")
