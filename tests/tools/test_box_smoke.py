"""The GPU smoke run (scripts/box_smoke.sh -> scripts/box_smoke.py) on CPU: its command lines (the dry run,
each stage command parsed by that stage's own parser) and its comparisons (shard against shard, SGLang
accept length against reference tau), which stop at the first disagreement and name the layer."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.target.shards import shard_name, write_shard
from common.stage import BENCH, EXTRACT, GENERATE, PREPARE, SERVE_BENCH, stage_script, write_manifest
from tests.paths import REPO



def load_smoke():
    spec = importlib.util.spec_from_file_location("_box_smoke", REPO / "scripts" / "box_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def load_stage(path: Path):
    return importlib.import_module(path.stem)  # stages import by name from the repo root, as the other tests do


def dry_run(tmp_path, *flags) -> list[list[str]]:
    env = {**os.environ, "TARGET": str(tmp_path / "models" / "target"), "WORK": str(tmp_path / "smoke"),
           "PY": sys.executable, "SGLANG_PY": "/opt/sglang/bin/python", "PORT": "31000"}
    env.pop("ENGINE", None)
    done = subprocess.run(["bash", str(REPO / "scripts" / "box_smoke.sh"), "--dry-run", *flags], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "smoke").exists()  # a dry run creates nothing
    return [shlex.split(line) for line in done.stdout.splitlines() if line.startswith("    ")]


def test_dry_run_commands_parse_with_each_stage(tmp_path):
    cmds = dry_run(tmp_path)
    stages = [c for c in cmds if any(a.endswith(".py") and a[:2].isdigit() for a in c)]
    assert len(stages) == 10  # 00 01 01b 01c 02b-sglang 02b-hf 03 04 05 05b
    for cmd in stages:
        i = next(k for k, a in enumerate(cmd) if a.endswith(".py") and a[:2].isdigit())
        parser = load_stage(REPO / cmd[i]).build_parser()
        parser.error = lambda msg, c=cmd: pytest.fail(f"{shlex.join(c)}: {msg}")  # unknown flag or bad value
        parser.parse_args(cmd[i + 1:])

    by_script = {}
    for cmd in stages:
        by_script.setdefault(next(a for a in cmd if a.endswith(".py") and a[:2].isdigit()), []).append(cmd)
    work, work_hf = str(tmp_path / "smoke"), str(tmp_path / "smoke_hf")
    sg, hf = by_script[stage_script(EXTRACT)]
    assert sg[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    assert sg[sg.index("--capture-engine") + 1] == "sglang" and sg[sg.index("--work-dir") + 1] == work
    assert hf[hf.index("--capture-engine") + 1] == "hf" and hf[hf.index("--work-dir") + 1] == work_hf
    (ref,), (server,) = by_script[stage_script(BENCH)], by_script[stage_script(SERVE_BENCH)]
    assert ref[ref.index("--num-draft-tokens") + 1] == "3"
    assert server[server.index("--spec-settings") + 1] == "3,1,4"
    assert server[server.index("--sglang-python") + 1] == "/opt/sglang/bin/python"
    # the sampled gate against SGLang: the agreement check on the warm-up prompts, at Kimi's T 1.0 / top-p 0.95
    args = load_stage(REPO / stage_script(SERVE_BENCH)).build_parser().parse_args(
        server[server.index(stage_script(SERVE_BENCH)) + 1:])
    assert args.engine == "sglang" and args.agreement_prompts == 16 and args.agreement_tolerance == 0.05
    assert args.acceptance_temperatures == [1.0] and args.acceptance_top_p == 0.95
    for a, b in ((ref, server),):  # the same held-out prompts and answer budget in 05 and 05b
        for flag in ("--num-prompts", "--benchmark-max-new-tokens", "--work-dir"):
            assert a[a.index(flag) + 1] == b[b.index(flag) + 1]
    # 01 reads the prompts next to the target folder; 01b talks to the server the driver starts
    prep = by_script[stage_script(PREPARE)][0]
    specs = json.loads(prep[prep.index("--datasets") + 1])
    assert [d["path"] for d in specs] == [str(tmp_path / "models" / "data" / f) for f in
                                          ("train_code.jsonl", "heldout.jsonl")]
    assert specs[1]["benchmark-only"] is True
    server_cmd = next(c for c in cmds if "sglang.launch_server" in c)
    gen = by_script[stage_script(GENERATE)][0]
    assert server_cmd[0] == "/opt/sglang/bin/python" and server_cmd[server_cmd.index("--port") + 1] == "31000"
    assert gen[gen.index("--server-url") + 1] == "http://127.0.0.1:31000/v1"
    assert server_cmd[server_cmd.index("--served-model-name") + 1] == gen[gen.index("--served-model-name") + 1]
    assert server_cmd[server_cmd.index("--model-path") + 1] == str(tmp_path / "models" / "target")


def test_dry_run_with_vllm_runs_on_the_cpu(tmp_path):
    """--engine vllm: no SGLang anywhere, every stage on the CPU, 05b with vLLM at k = 3, 5, 7 and
    the agreement check; the stage commands parse with each stage's own parser."""
    cmds = dry_run(tmp_path, "--engine", "vllm")
    joined = [" ".join(c) for c in cmds]
    assert not any("sglang.launch_server" in j or "--capture-engine sglang" in j or "--sglang-" in j for j in joined)
    stages = [c for c in cmds if any(a.endswith(".py") and a[:2].isdigit() for a in c)]
    assert len(stages) == 9  # 00 01 01b 01c 02b-hf 03 04 05 05b
    for cmd in stages:
        i = next(k for k, a in enumerate(cmd) if a.endswith(".py") and a[:2].isdigit())
        parser = load_stage(REPO / cmd[i]).build_parser()
        parser.error = lambda msg, c=cmd: pytest.fail(f"{shlex.join(c)}: {msg}")
        args = parser.parse_args(cmd[i + 1:])
        if getattr(args, "device", None) is not None:
            assert args.device == "cpu", cmd
    server = next(c for c in stages if stage_script(SERVE_BENCH) in c)
    assert server[server.index("--engine") + 1] == "vllm"
    assert server[server.index("--spec-settings") + 1:server.index("--spec-settings") + 4] == ["3,1,4", "5,1,6", "7,1,8"]
    assert int(server[server.index("--agreement-prompts") + 1]) > 0
    target = next(c for c in cmds if "vllm.entrypoints.openai.api_server" in c)
    assert target[target.index("--port") + 1] == "31000" and "--speculative-config" not in target


def write_02b(folder: Path, samples: list[dict], points=(2, 4, 5)) -> None:
    write_shard(folder / shard_name(0), samples, torch.bfloat16)
    write_manifest(folder, EXTRACT, argparse.Namespace(), capture_points=list(points),
                   hidden_size=8)


def make_samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate((5, 9)):
        out.append({"id": f"s/{k}", "input_ids": list(range(n)), "loss_mask": [0, 1] * (n // 2) + [1] * (n % 2),
                    "aux": torch.randn(n, 24, generator=g) * 4, "final": torch.randn(n, 8, generator=g)})
    return out


def test_compare_shards(tmp_path, capsys):
    smoke = load_smoke()
    ref = make_samples()
    write_02b(tmp_path / "hf", ref)
    # bf16-kernel-sized noise (0.5% relative) passes, and the numbers are printed
    g = torch.Generator().manual_seed(1)
    noisy = [{**s, "aux": s["aux"] * (1 + 0.005 * torch.randn(s["aux"].shape, generator=g)),
              "final": s["final"] * (1 + 0.005 * torch.randn(s["final"].shape, generator=g))} for s in ref]
    write_02b(tmp_path / "sg", noisy)
    report = smoke.compare_shards(tmp_path / "sg", tmp_path / "hf", 0.05)
    assert set(report) == {"h2", "h4", "h5", "final"} and all(r["rel_error"] < 0.02 for r in report.values())
    out = capsys.readouterr().out
    assert "h4: max |diff|" in out and "final: max |diff|" in out

    # the middle capture point replaced by another layer's state (an off-by-one layer id): named
    other = make_samples(seed=7)
    wrong = [{**s, "aux": torch.cat([s["aux"][:, :8], o["aux"][:, 8:16], s["aux"][:, 16:]], 1)}
             for s, o in zip(ref, other)]
    write_02b(tmp_path / "wrong_mid", wrong)
    with pytest.raises(smoke.SmokeMismatch, match=r"capture point h4 \(input of layer 4\)") as e:
        smoke.compare_shards(tmp_path / "wrong_mid", tmp_path / "hf", 0.05)
    assert e.value.layer.startswith("SGLang capture")
    wrong_final = [{**s, "final": o["final"]} for s, o in zip(ref, other)]
    write_02b(tmp_path / "wrong_final", wrong_final)
    with pytest.raises(smoke.SmokeMismatch, match="final post-norm state"):
        smoke.compare_shards(tmp_path / "wrong_final", tmp_path / "hf", 0.05)
    write_02b(tmp_path / "other_ids", [{**s, "input_ids": [1] * len(s["input_ids"])} for s in ref])
    with pytest.raises(smoke.SmokeMismatch, match="input_ids differ"):
        smoke.compare_shards(tmp_path / "other_ids", tmp_path / "hf", 0.05)


def test_compare_tau():
    smoke = load_smoke()
    reference = {"by_num_draft_tokens": {"3": {"tau": 2.5}}}

    def server(completion, requests, pooled):
        return {"runs": {"3-1-4/graph": {"by_temperature": {"0": {"by_concurrency": {"1": {
            "completion_tokens": completion, "num_requests": requests, "accept_length_pooled": pooled}}}}}}}
    # 16 requests, 2016 tokens over 800 verify rounds: 2.52 as reported, 2.5 without the prefill tokens
    res = smoke.compare_tau(reference, server(2016, 16, 2016 / 800), 0.05)
    assert res["server_accept_length_no_prefill"] == pytest.approx(2.5) and res["relative_difference"] < 1e-9
    with pytest.raises(smoke.SmokeMismatch, match="SGLang's EAGLE3 decoding .* disagrees: accept length 2.20"):
        smoke.compare_tau(reference, server(1776, 16, 1776 / 800), 0.05)


def test_a_failed_step_names_its_layer(capsys):
    smoke = load_smoke()
    step = smoke.Step("05b serve", [sys.executable, "-c", "raise SystemExit(3)"], "SGLang EAGLE3 serving")
    with pytest.raises(smoke.SmokeMismatch, match="SGLang EAGLE3 serving disagrees: `05b serve` exited with status 3"):
        smoke.run_step(step, dry_run=False)
    smoke.run_step(step, dry_run=True)  # printed, not run
    assert "raise SystemExit(3)" in capsys.readouterr().out


def test_the_smoke_run_requires_sglangs_sampled_gate_to_have_judged():
    """The smoke run's pass needs 05b's agreement check on SGLang's EAGLE3 server: greedy, and sampled at T 1.0 with
    its probability gate judged and passed; a run without it, or whose gate had too few drafts to judge, fails
    naming SGLang's verify."""
    from common.serving.agreement import probability_gate

    smoke = load_smoke()
    gate = probability_gate([(0, 0.5, True), (0, 0.5, False)] * 40, 3, 0.05)
    sampled = {"rounds_agree": True, "exact_prompts": 16, "per_prompt": [{}] * 16,
               "expected": {"along_answers": gate}}
    good = {"agreement": {"3-1-4/graph": {"agree": True, "exact": False, "engine": {"tau": 2.4},
                                          "replay": {"tau": 2.41}, "sampled": {"1": sampled}}}}
    res = smoke.check_sglang_agreement(good, 1.0)
    assert res["sampled"]["judged"] == 80 and res["sampled"]["band"] == 0.05
    with pytest.raises(smoke.SmokeMismatch, match="SGLang's EAGLE3 verify .* disagrees: no agreement check for "
                                                  "3-1-4/graph"):
        smoke.check_sglang_agreement({"agreement": {}}, 1.0)
    few = {**sampled, "expected": {"along_answers": probability_gate([(0, 0.5, True)] * 4, 3, 0.05)}}
    with pytest.raises(smoke.SmokeMismatch, match="gate judged False"):
        smoke.check_sglang_agreement({"agreement": {"3-1-4/graph": {**good["agreement"]["3-1-4/graph"],
                                                                    "sampled": {"1": few}}}}, 1.0)
