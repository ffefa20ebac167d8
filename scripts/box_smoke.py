"""The smoke run: the whole serving path on a small real target, through a real engine.

--engine sglang (the default; the first thing to run on a GPU box): on SmolLM2-135M-Instruct
(00_build_smollm2_world.py; a Llama target) and a few dozen prompts it runs: 01 -> an SGLang server for
the target -> 01b (openai engine) against it -> 01c -> 02b through SGLang (torchrun, SpecForge's
runner) AND through transformers on the same samples, shard against shard -> 03 -> a short 04 -> 05
(the reference: transformers speculative decoding, k = 3) and 05b (serving: SGLang, EAGLE3 3,1,4,
launched by 05b with its preflight and its agreement check: SGLang's verify counts against the rounds its
own answers give with our draft, greedy and sampled at T 1.0 / top-p 0.95, and the probability gate on every
draft it judged; the one place where SGLang's sampled verify is proven) -> SGLang's accept length against the
reference tau. Not yet run on a GPU: see docs/sglang.md ("Smoke run").

--engine vllm (runs on this CPU machine; vLLM's CPU build from `make engine`): 01 -> a vLLM server for
the target -> 01b against it, its answers compared with the shipped greedy answers -> 01c -> 02b
(transformers) -> 03 -> a short 04 -> 05 (reference) -> 05b (serving) with vLLM at k = 3, 5, 7,
whose agreement check must find every round of vLLM's acceptance equal to replay's (docs/serving.md).

It stops at the first step that fails or disagrees and names the layer of the stack that does. Every
stage gets its flags here (no preset), so a preset change cannot turn it into another run.

Usage: bash scripts/box_smoke.sh [--engine sglang|vllm] [--dry-run]
       (environment: ENGINE, TARGET, DATA, WORK, PY, SGLANG_PY, VLLM_PY, PORT)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.serving.registry import engine_class  # noqa: E402
from common.stage import (BENCH, EXTRACT, GENERATE, MERGE, PREPARE, SERVE_BENCH, SMOLLM2_WORLD, TRAIN,  # noqa: E402
                          VOCAB, stage_dir, stage_script)

SERVED_NAME = "smoke-target"
NUM_DRAFT_TOKENS = 3  # reference k = 3 <-> SGLang chain (steps 3, topk 1, 4 draft tokens)
SPEC_SETTING = "3,1,4"
VLLM_SETTINGS = ("3,1,4", "5,1,6", "7,1,8")  # k = 3, 5, 7: each checked round by round against replay
SHIPPED_ANSWERS = Path("assets/smollm2/responses.jsonl.gz")  # the default target's greedy answers


class SmokeMismatch(SystemExit):
    """A step failed or two layers of the stack disagree: printed as one line naming the layer."""

    def __init__(self, layer: str, detail: str):
        super().__init__(f"SMOKE FAILED - {layer} disagrees: {detail}")
        self.layer, self.detail = layer, detail


@dataclass
class Settings:
    target: Path
    data: Path  # train_code.jsonl and heldout.jsonl, as 00_build_smollm2_world.py writes them
    work: Path
    py: str
    sglang_py: str
    engine: str = "sglang"
    vllm_py: str = "build/vllm-venv/bin/python"
    port: int = 30000
    num_train: int = 64          # training prompts (a few dozen)
    num_heldout: int = 16        # held-out prompts 05 and 05b measure (benchmark-only), the same in both
    num_warmup: int = 16         # more held-out prompts, never timed: 05b's warm-up and agreement check
    max_new_tokens: int = 256    # 01b answer budget (tokens)
    bench_new_tokens: int = 128  # answer budget of 05 and 05b (tokens)
    train_steps: int = 400       # 04 optimizer steps (GPU)
    cpu_train_steps: int = 200   # 04 optimizer steps (--engine vllm, on the CPU: one sample each)
    mem_fraction: float = 0.6    # SGLang mem_fraction_static (weights + KV pool share of the GPU)
    shard_rel_tol: float = 0.05  # 02b sglang vs hf: ||a - b|| / ||b|| per capture point and final state
    tau_rel_tol: float = 0.05    # 05b's accept length vs 05's reference tau
    # SGLang's agreement check (bf16 on the GPU against float32 replay on the CPU): the relative tau difference
    # it allows, greedy and sampled, and the probability gate's band on p(d)
    agreement_tolerance: float = 0.05
    temperature: float = 1.0     # the sampled agreement: Kimi-K2.5's serving temperature and top-p
    top_p: float = 0.95

    @property
    def on_cpu(self) -> bool:
        """vLLM's CPU build: every stage on this machine, 02b through transformers alone. SGLang: the GPU box, where
        02b also captures through SGLang and the two captures are compared."""
        return self.engine == "vllm"

    @property
    def engine_py(self) -> str:
        """The python of the serving engine's venv (VLLM_PY on the CPU, SGLANG_PY on the box)."""
        return self.vllm_py if self.on_cpu else self.sglang_py

    @property
    def label(self) -> str:
        """The engine's name for people (Engine.label)."""
        return engine_class(self.engine).label

    @property
    def work_hf(self) -> Path:  # 02b through transformers on the same 01c output
        return self.work.parent / (self.work.name + "_hf")


@dataclass
class Step:
    name: str
    argv: list[str]
    layer: str  # what disagrees when this command fails
    env: dict = field(default_factory=dict)


DEFAULT_TARGET = Path("build/smollm2/target")


def settings_from_env(environ=os.environ, engine: str | None = None) -> Settings:
    py = environ.get("PY", sys.executable)
    target = Path(environ.get("TARGET", str(DEFAULT_TARGET)))
    return Settings(target=target, data=Path(environ.get("DATA", str(target.parent / "data"))),
                    work=Path(environ.get("WORK", "runs/box_smoke")), py=py,
                    sglang_py=environ.get("SGLANG_PY", py), engine=engine or environ.get("ENGINE", "sglang"),
                    vllm_py=environ.get("VLLM_PY", "build/vllm-venv/bin/python"),
                    port=int(environ.get("PORT", "30000")))


def data_specs(s: Settings) -> str:
    """01's --datasets: training prompts, and held-out prompts kept whole for 05 (never generated)."""
    return json.dumps([
        {"name": "smoke_train", "adapter": "messages", "path": str(s.data / "train_code.jsonl"),
         "max-records": s.num_train},
        {"name": "smoke_heldout", "adapter": "messages", "path": str(s.data / "heldout.jsonl"),
         "max-records": s.num_heldout + s.num_warmup, "benchmark-only": True},
    ])


def target_server_command(s: Settings) -> tuple[list[str], dict]:
    """The server 01b generates against (the target alone, served under SERVED_NAME) and its env: the engine's
    own (Engine.target_server)."""
    return engine_class(s.engine).target_server(s.target, s.port, s.engine_py, SERVED_NAME, 4096, s.mem_fraction)


def stage_steps(s: Settings) -> dict[str, list[Step]]:
    """The commands, grouped by the points where the driver does something between them."""
    py, w, t = s.py, str(s.work), str(s.target)
    bench = ["--num-prompts", str(s.num_heldout), "--benchmark-max-new-tokens", str(s.bench_new_tokens)]
    # one timed pass: the smoke compares tau and agreement, not speed (05 then decides no speed ratio)
    once = ["--bench-repeats", "1"]
    label = s.label
    steps = {
        "build": [Step("00 build the small target", [py, stage_script(SMOLLM2_WORLD), "--config",
                                                        "configs/smollm2.yaml"], "the small-target build (00)")],
        "prepare": [Step("01 prepare", [py, stage_script(PREPARE), "--work-dir", w, "--target-path", t,
                                        "--datasets", data_specs(s), "--max-new-tokens", str(s.max_new_tokens),
                                        "--max-context", "4096"], "data preparation (01)")],
        "generate": [Step(f"01b generate through {label}", [
            py, stage_script(GENERATE), "--work-dir", w, "--target-path", t, "--generation-engine",
            "openai", "--server-url", f"http://127.0.0.1:{s.port}/v1", "--served-model-name", SERVED_NAME,
            "--max-new-tokens", str(s.max_new_tokens), "--max-context", "4096", "--concurrency", "16"],
            f"{label} serving the target through its OpenAI API (01b against its server)")],
    }
    merge = Step("01c merge", [py, stage_script(MERGE), "--work-dir", w, "--benchmark-size", "0"],
                 "merge and tokenization (01c)")
    vocab = Step("03 draft vocab", [py, stage_script(VOCAB), "--work-dir", w, "--draft-vocab-size", "4096"],
                 "draft vocabulary (03)")
    if s.on_cpu:  # all on this machine's CPU, float32 where numbers are compared
        steps["capture"] = [merge, Step("02b capture through transformers", [
            py, stage_script(EXTRACT), "--work-dir", w, "--capture-engine", "hf", "--device", "cpu"],
            "transformers capture (02b --capture-engine hf)")]
        steps["train"] = [vocab, Step("04 short training", [
            py, stage_script(TRAIN), "--work-dir", w, "--max-steps", str(s.cpu_train_steps), "--learning-rate", "1e-3",
            "--max-samples-per-batch", "1", "--batch-tokens", "4096", "--precision", "fp32", "--device", "cpu"],
            "draft training (04)")]
        steps["benchmark"] = [
            Step("05 reference (transformers)", [py, stage_script(BENCH), "--work-dir", w,
                                                  "--num-draft-tokens", "3", "5", "7", "--loop-prompts", "4",
                                                  "--device", "cpu", *bench],
                 "reference speculative decoding (05, transformers)"),
            Step("05b serve (vLLM eagle3, agreement with replay)", [
                py, stage_script(SERVE_BENCH), "--work-dir", w, "--engine", "vllm",
                "--vllm-python", s.vllm_py, "--spec-settings", *VLLM_SETTINGS, "--cuda-graph", "off",
                "--bench-concurrency", "1", "4", "--agreement-prompts", str(s.num_warmup),
                "--warmup-requests", "2", "--min-accept-length", "1.1", "--baseline-port", str(s.port + 10),
                "--eagle3-port", str(s.port + 20), *bench, *once],
                "vLLM EAGLE-3 serving (05b --engine vllm: launch, draft loading, preflight, "
                "agreement with replay)")]
        return steps
    steps["capture"] = [
        merge,
        Step("02b capture through SGLang", [
            py, "-m", "torch.distributed.run", "--nproc_per_node", "1", stage_script(EXTRACT),
            "--work-dir", w, "--capture-engine", "sglang", "--sglang-tp-size", "1",
            "--mem-fraction-static", str(s.mem_fraction), "--hidden-states-dtype", "bfloat16"],
            "SGLang capture (02b --capture-engine sglang: SpecForge's runner, set_eagle3_layers_to_capture)"),
        Step("02b capture through transformers", [
            py, stage_script(EXTRACT), "--work-dir", str(s.work_hf), "--capture-engine", "hf",
            "--device", "cuda", "--hidden-states-dtype", "bfloat16"],
            "transformers capture (02b --capture-engine hf)")]
    steps["train"] = [vocab, Step("04 short training", [
        py, stage_script(TRAIN), "--work-dir", w, "--max-steps", str(s.train_steps), "--learning-rate", "1e-3",
        "--batch-tokens", "4096", "--device", "cuda"], "draft training (04)")]
    steps["benchmark"] = [
        Step("05 reference (transformers)", [py, stage_script(BENCH), "--work-dir", w,
                                              "--num-draft-tokens", str(NUM_DRAFT_TOKENS), "--device", "cuda",
                                              *bench],
             "reference speculative decoding (05, transformers)"),
        Step("05b serve (SGLang EAGLE3, agreement with replay greedy and sampled)", [
            py, stage_script(SERVE_BENCH), "--work-dir", w, "--spec-settings", SPEC_SETTING,
            "--cuda-graph", "on", "--bench-concurrency", "1", "--sglang-tp-size", "1",
            "--mem-fraction-static", str(s.mem_fraction), "--sglang-python", s.sglang_py,
            "--agreement-prompts", str(s.num_warmup), "--agreement-tolerance", str(s.agreement_tolerance),
            "--acceptance-temperatures", str(s.temperature), "--acceptance-top-p", str(s.top_p),
            "--warmup-requests", "2", "--min-accept-length", "1.1", "--baseline-port", str(s.port + 10),
            "--eagle3-port", str(s.port + 20), *bench, *once],
            "SGLang EAGLE3 serving (05b: launch, draft loading, preflight, agreement with replay: its verify "
            "counts against its answers, greedy and sampled, and the probability gate)")]
    return steps


def run_step(step: Step, dry_run: bool) -> None:
    print(f"==> {step.name}\n    {shlex.join(step.argv)}", flush=True)
    if dry_run:
        return
    t0 = time.time()
    done = subprocess.run(step.argv, cwd=REPO, env={**os.environ, **step.env})
    if done.returncode != 0:
        raise SmokeMismatch(step.layer, f"`{step.name}` exited with status {done.returncode} (output above)")
    print(f"<== {step.name}: {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------- comparisons (CPU-testable)
def compare_shards(sglang_dir: Path, hf_dir: Path, rel_tol: float) -> dict:
    """02b through SGLang against 02b through transformers, same samples: ids and masks exactly, each
    capture point's slice of aux and the final state within `rel_tol` (relative Frobenius error over
    all tokens; bf16 kernels differ, a wrong layer differs by a whole layer's update). Prints the max
    absolute difference and the relative error of each; stops at the first that disagrees."""
    from common.target.manifests import HiddenStatesManifest
    from common.target.shards import ShardReader, list_shards

    layer = "SGLang capture (02b sglang) vs transformers capture (02b hf)"
    ms, mh = HiddenStatesManifest.read(sglang_dir), HiddenStatesManifest.read(hf_dir)
    if ms.capture_points != mh.capture_points or ms.hidden_size != mh.hidden_size:
        raise SmokeMismatch(layer, f"capture points {list(ms.capture_points)} vs {list(mh.capture_points)}")
    points, hidden = list(ms.capture_points), ms.hidden_size
    names = [p.name for p in list_shards(sglang_dir)]
    if names != [p.name for p in list_shards(hf_dir)] or not names:
        raise SmokeMismatch(layer, f"shard files differ: {names} vs {[p.name for p in list_shards(hf_dir)]}")
    parts = [f"h{p}" for p in points] + ["final"]
    diff2 = dict.fromkeys(parts, 0.0)
    ref2 = dict.fromkeys(parts, 0.0)
    max_abs = dict.fromkeys(parts, 0.0)
    for name in names:
        a, b = ShardReader(sglang_dir / name), ShardReader(hf_dir / name)
        if a.sample_ids != b.sample_ids:
            raise SmokeMismatch(layer, f"{name} holds other samples ({a.sample_ids[:2]}... vs {b.sample_ids[:2]}...)")
        for i in range(len(a)):
            x, y = a[i], b[i]
            for key in ("input_ids", "loss_mask"):
                if not bool((x[key] == y[key]).all()):
                    raise SmokeMismatch(layer, f"{name} sample {x['id']}: {key} differ")
            slices = {f"h{p}": (x["aux"][:, k * hidden:(k + 1) * hidden], y["aux"][:, k * hidden:(k + 1) * hidden])
                      for k, p in enumerate(points)}
            slices["final"] = (x["final"], y["final"])
            for part, (u, v) in slices.items():
                d = u.float() - v.float()
                diff2[part] += float(d.pow(2).sum())
                ref2[part] += float(v.float().pow(2).sum())
                max_abs[part] = max(max_abs[part], float(d.abs().max()))
    report = {}
    for part in parts:
        rel = (diff2[part] / ref2[part]) ** 0.5 if ref2[part] else float("inf")
        report[part] = {"max_abs_diff": max_abs[part], "rel_error": rel}
        print(f"[smoke] 02b sglang vs hf, {part:>6}: max |diff| {max_abs[part]:.4g}, relative error {rel:.4f}")
    for part in parts:
        if not report[part]["rel_error"] <= rel_tol:
            where = ("the final post-norm state" if part == "final"
                     else f"capture point {part} (input of layer {part[1:]})")
            raise SmokeMismatch(layer, f"{where}: relative error {report[part]['rel_error']:.4f} > {rel_tol} "
                                "(a layer-id rule or capture-hook difference; see common/target/capture.py)")
    return report


def compare_tau(reference_metrics: dict, server_metrics: dict, rel_tol: float) -> dict:
    """SGLang's accept length at (3,1,4), batch 1, against reference tau at k = 3 on the same prompts.

    Reference tau excludes the prefill token (common/benchmark/spec_decode.acceptance_stats); SGLang's
    completion_tokens / spec_verify_ct includes it, one token per request: removed before comparing.
    """
    layer = "SGLang's EAGLE3 decoding (05b) vs reference speculative decoding (05)"
    ref = reference_metrics["by_num_draft_tokens"][str(NUM_DRAFT_TOKENS)]["tau"]
    key = f"{SPEC_SETTING.replace(',', '-')}/graph"
    run = server_metrics["runs"][key]["by_temperature"]["0"]["by_concurrency"]["1"]  # greedy, batch 1
    if run.get("refused"):  # 05b did not believe the server's counts (common.serving.sweep.refuse): no tau to compare
        raise SmokeMismatch(layer, f"05b refused the run: {run['refused']}")
    pooled = run["accept_length_pooled"]
    rounds = run["completion_tokens"] / pooled
    corrected = (run["completion_tokens"] - run["num_requests"]) / rounds
    rel = abs(corrected - ref) / ref
    print(f"[smoke] tau: reference {ref:.3f} (k={NUM_DRAFT_TOKENS}); SGLang {key} {pooled:.3f} as reported, "
          f"{corrected:.3f} without the prefill token; relative difference {rel:.3f}")
    if not rel <= rel_tol:
        raise SmokeMismatch(layer, f"accept length {corrected:.3f} vs reference tau {ref:.3f} ({rel:.1%} > "
                            f"{rel_tol:.0%}): draft loading (d2t, layer ids, embedding) or the verify rule differs")
    return {"reference_tau": ref, "server_accept_length": pooled, "server_accept_length_no_prefill": corrected,
            "relative_difference": rel}


# ---------------------------------------------------------------- the run
def compare_answers(s: Settings) -> dict | None:
    """01b's answers from the engine against the shipped greedy answers (transformers, float32) of the
    default target: the share that match exactly and where the others first diverge. None for another
    target (nothing shipped to compare with)."""
    from common.generation.response_cache import compare_with_cache

    if s.target != DEFAULT_TARGET or not (REPO / SHIPPED_ANSWERS).is_file():
        return None
    rows = sorted(stage_dir(s.work, GENERATE).glob("*/generated.jsonl"))
    cmp = compare_with_cache(rows, REPO / SHIPPED_ANSWERS)
    firsts = sorted(d["at"] for d in cmp["divergences"])
    print(f"[smoke] 01b through {s.engine} vs the shipped transformers answers: {cmp['num_exact']}/"
          f"{cmp['num_compared']} identical token for token"
          + (f"; the others first differ at answer tokens {firsts}" if firsts else ""))
    return cmp


def check_agreement(server_metrics: dict) -> dict:
    """--engine vllm: every EAGLE-3 server's agreement with replay (05b already stops on a disagreement;
    this also refuses a run where the check did not happen)."""
    layer = "vLLM's EAGLE-3 decoding (05b) vs replay of the same draft"
    agreement = server_metrics.get("agreement") or {}
    keys = [f"{x.replace(',', '-')}/nograph" for x in VLLM_SETTINGS]
    missing = [k for k in keys if k not in agreement]
    if missing:
        raise SmokeMismatch(layer, f"no agreement check for {missing}")
    out = {}
    for key in keys:
        a = agreement[key]
        if not a["exact"]:
            raise SmokeMismatch(layer, f"{key}: {a['layer']}: {a['detail']}")
        out[key] = {"tau": a["engine"]["tau"], "rounds": a["engine"]["num_rounds"],
                    "accepted_per_position": a["engine"]["accepted_per_position"]}
        print(f"[smoke] {key}: vLLM = replay on every round: tau {a['engine']['tau']:.4f}, "
              f"{a['engine']['num_rounds']} rounds, accepted per position {a['engine']['accepted_per_position']}")
    return out


def check_sglang_agreement(server_metrics: dict, temperature: float) -> dict:
    """--engine sglang: the agreement check ran on the EAGLE3 server, greedy and sampled, and its probability gate
    judged (05b already stops on a disagreement or a failed gate; this refuses a run where they did not happen,
    or where the gate had too few drafts to judge)."""
    layer = "SGLang's EAGLE3 verify (05b) vs replay of the same draft"
    key = f"{SPEC_SETTING.replace(',', '-')}/graph"
    a = (server_metrics.get("agreement") or {}).get(key)
    if not a or not a.get("judged", True):
        raise SmokeMismatch(layer, f"no agreement check for {key}" + (f": {a['why']}" if a else ""))
    if not a["agree"]:
        raise SmokeMismatch(layer, f"{key} greedy: {a['layer']}: {a['detail']}")
    t = f"{temperature:g}"
    x = (a.get("sampled") or {}).get(t)
    if not x:
        raise SmokeMismatch(layer, f"{key}: no sampled agreement at T {t}")
    g = x["expected"]["along_answers"]
    if not (x["rounds_agree"] and g["enforced"] and g["agree"]):
        raise SmokeMismatch(layer, f"{key} T {t}: rounds agree {x['rounds_agree']}, gate judged {g['enforced']} "
                            f"and passed {g['agree']} (z {g['z']}, outside the band {g['z_band']})")
    print(f"[smoke] {key}: SGLang's verify counts follow from its answers (greedy tau {a['engine']['tau']:.4f} vs "
          f"replay {a['replay']['tau']:.4f}); sampled T {t}: {x['exact_prompts']}/{len(x['per_prompt'])} answers "
          f"exact, {sum(g['accepted'])} of {sum(g['judged'])} judged drafts accepted vs {sum(g['expected']):.1f} "
          f"expected (z {g['z']:+.2f}, band +-{g['band']:.0%}, sees deviations beyond +-{g['resolution']:.0%})")
    return {"greedy": {"engine_tau": a["engine"]["tau"], "replay_tau": a["replay"]["tau"], "exact": a["exact"]},
            "sampled": {"temperature": temperature, "exact_prompts": x["exact_prompts"], "z": g["z"],
                        "z_band": g["z_band"], "band": g["band"], "resolution": g["resolution"],
                        "accepted": sum(g["accepted"]), "expected": sum(g["expected"]), "judged": sum(g["judged"])}}


def serve_target_for_01b(s: Settings, steps: dict, dry_run: bool) -> None:
    from common.serving import process, sglang

    label = s.label
    cmd, env = target_server_command(s)
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"==> {label} server for 01b\n    {shown + ' ' if shown else ''}{shlex.join(cmd)}", flush=True)
    if dry_run:
        run_step(steps["generate"][0], True)
        return
    log = s.work / "smoke_logs" / "target_server.log"
    proc = process.launch_server(cmd, log, env)
    try:
        try:
            process.wait_ready(f"http://127.0.0.1:{s.port}", proc, 900, log_path=log)
            if s.engine == "sglang":  # and it answers its info document
                sglang.get_server_info(f"http://127.0.0.1:{s.port}")
        except SystemExit as e:  # StageError: exited early or never ready
            raise SmokeMismatch(f"{label} serving the target", str(e)) from None
        run_step(steps["generate"][0], False)
    finally:
        process.stop_server(proc)


def main(argv=None, environ=os.environ) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--engine", choices=("sglang", "vllm"), default=None,
                   help="serving engine (default: $ENGINE, else sglang; vllm runs on this CPU machine)")
    args = p.parse_args(argv)
    s = settings_from_env(environ, args.engine)
    steps = stage_steps(s)
    t0 = time.time()
    dirs = [s.work] if s.on_cpu else [s.work, s.work_hf]
    print(f"[smoke] engine {s.engine}, target {s.target}, work dirs {' and '.join(map(str, dirs))}; "
          f"{'DRY RUN' if args.dry_run else ''}")
    if not args.dry_run:
        for d in dirs:
            if d.exists():
                shutil.rmtree(d)  # a smoke run starts clean: every stage must run, none may be skipped
    if args.dry_run or not (s.target / "config.json").is_file():
        if not args.dry_run and s.target != DEFAULT_TARGET:
            raise SmokeMismatch("the small target", f"TARGET={s.target} has no config.json (unset TARGET to "
                                f"build {DEFAULT_TARGET} with 00_build_smollm2_world.py)")
        run_step(steps["build"][0], args.dry_run)
    run_step(steps["prepare"][0], args.dry_run)
    serve_target_for_01b(s, steps, args.dry_run)
    answers = None if args.dry_run else compare_answers(s)

    run_step(steps["capture"][0], args.dry_run)  # 01c
    if not s.on_cpu and not args.dry_run:  # the hf capture reads the same 01c output
        s.work_hf.mkdir(parents=True, exist_ok=True)
        shutil.copytree(stage_dir(s.work, MERGE), stage_dir(s.work_hf, MERGE))
    for step in steps["capture"][1:]:
        run_step(step, args.dry_run)
    if not s.on_cpu and not args.dry_run:
        compare_shards(stage_dir(s.work, EXTRACT), stage_dir(s.work_hf, EXTRACT), s.shard_rel_tol)
    for step in steps["train"] + steps["benchmark"]:
        run_step(step, args.dry_run)
    if args.dry_run:
        return
    bench = stage_dir(s.work, BENCH).parent
    server = json.loads((bench / "server" / "metrics.json").read_text())
    if s.on_cpu:
        result = {"engine": "vllm", "answers_vs_shipped": answers, "agreement": check_agreement(server),
                  "reference_tau": {k: e["tau"] for k, e in json.loads(
                      (bench / "reference" / "metrics.json").read_text())["by_num_draft_tokens"].items()}}
        what = "vLLM serving and EAGLE-3 decoding agree with replay on every round at k = 3, 5, 7"
    else:
        result = compare_tau(json.loads((bench / "reference" / "metrics.json").read_text()), server, s.tau_rel_tol)
        result["agreement"] = check_sglang_agreement(server, s.temperature)
        what = ("SGLang capture, serving and EAGLE3 decoding agree with transformers, and its sampled verify "
                "accepts each draft with p(d)")
    result["wall_s"] = time.time() - t0
    (s.work / "smoke_result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[smoke] PASSED in {result['wall_s']:.0f} s: {what} ({s.work / 'smoke_result.json'})")


if __name__ == "__main__":
    main()
