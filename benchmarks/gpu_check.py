"""One prepared GPU check: 04 measured at Kimi-K2.5's draft shape, every CUDA path checked against the CPU.

Sections, in this order; each runs under a time budget inside try/except, a failure is recorded with its
error and the next section runs, and the summary is rewritten after every section (a killed run keeps
what it had):
  preflight    torch, the device, the packages the code paths import
  ttt_kernel   TTT attention forward + backward on the device against the float64 masked reference,
               fp32 and bf16, at the CPU test's tolerances (tests/units/draft/test_eagle3.py)
  step_04      one 04 step (04's run_batch + backward, both teachers) on the device against the CPU in
               fp32; the same step in bf16 autocast against it within bf16 bounds
  replay_05    05's replay (common/benchmark/reference.py ReplaySet) on the device against the CPU in
               fp32, small Llama target: the same answers and identical accepted counts
  capture_02b  02b's HF capture (its loader, batching and dtype: bf16 on CUDA) on the device against the
               CPU's fp32 capture, small Llama target (SmolLM2's shape classes), within bf16 tolerance
  train_04     04_train.py under torchrun (DDP world 1), Kimi-K2.5's draft shape (preset heads and MLP,
               draft vocab 32,000, target vocab 163,840, TTT 7), bf16 autocast, random features in the
               compact (fp8 + top-32) and bf16 (+ final) formats at T 4,096, the compact at 8,192, and a
               warm start (--init-from an exported draft): tokens/s after warm-up, peak memory, loss, MFU
  attention    the TTT attention's share of a step: its forward + backward over the 7 steps timed alone
  projection   R_1 of one RTX PRO 6000 Blackwell from the H200's tokens/s (a projection, not a measurement)
The sections live in benchmarks/gpu_check_exact.py (the exactness checks) and benchmarks/gpu_check_train.py
(04); this file holds the runner, the GPU constants, the projection and the summary. Big inputs (the 4.7 GB
Kimi-shaped target, shards, 11.5 GB checkpoints) go to --scratch (default: a temporary folder, removed at
the end), never to OUT or the repo. Needs torch, transformers (with its tqdm and pyyaml) and safetensors.
Writes: OUT/gpu_check.json, OUT/gpu_check.md
GPU:    bash scripts/gpu_check.sh OUT                    (one H200: ~5 min, <= 8)
CPU:    bash scripts/gpu_check.sh --device cpu --tiny OUT   (tiny, ~1 min: tests/tools/test_gpu_check.py)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from gpu_check_exact import capture_02b, check, replay_05, step_04, ttt_kernel  # noqa: E402
from gpu_check_train import TrainShape, attention, train_04  # noqa: E402

from common.io import atomic_path, read_json, write_json  # noqa: E402
from common.stage import git_revision  # noqa: E402

KIMI_CONFIG = REPO / "assets" / "kimi_k25" / "config.json"   # the real Kimi-K2.5 config.json
# bf16 dense tensor peak (FLOP/s) and memory bandwidth (B/s), by CUDA device name (first match wins).
GPUS = (
    # https://www.nvidia.com/en-us/data-center/h200/ : BF16 Tensor Core 1,979 TFLOPS (H200 SXM) and
    # 1,671 TFLOPS (H200 NVL), both "with sparsity", so dense is half; GPU memory bandwidth 4.8 TB/s.
    ("H200 NVL", 835.5e12, 4.8e12),
    ("H200", 989.5e12, 4.8e12),
    # NVIDIA RTX Blackwell GPU architecture whitepaper (images.nvidia.com/aem-dam/Solutions/geforce/
    # blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf), RTX PRO 6000 Blackwell: peak FP16/BF16
    # tensor 503.8 TFLOPS dense with FP32 accumulate (1,007.6 with sparsity; 188 SMs x 2.617 GHz x 1,024
    # FLOP/clock). https://www.nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/ :
    # 96 GB GDDR7, 512-bit, 1,792 GB/s.
    ("RTX PRO 6000", 503.8e12, 1.792e12),
)
RTX = "RTX PRO 6000"
RTX_MEMORY_GIB = 96.0
# train_plan_v4.md section 2.3: T = 370.6 M training tokens, 3 epochs, 8 GPUs, data-parallel efficiency 0.9
PLAN_TOKENS, PLAN_EPOCHS, PLAN_GPUS, PLAN_EFFICIENCY = 370.6e6, 3, 8, 0.9


@dataclass(frozen=True)
class Shapes:
    """What the sections size themselves by: Kimi-K2.5's draft on a GPU, a tiny one for the CPU run."""
    train: TrainShape
    kernel: tuple[tuple[int, int, int, int], ...]   # TTT kernel check: (query heads, KV heads, T, head dim)
    step: dict                           # 04 step check: draft config of its small model
    step_seq_len: int
    llama: dict                          # small Llama target of replay and capture (LlamaConfig kwargs)
    num_prompts: int
    max_new_tokens: int                  # replay's answers


def kimi_shapes() -> Shapes:
    """Kimi-K2.5's draft (its config, the preset's heads, draft vocab 32,000, T 4,096 and 8,192), the
    kernel at the CPU test's shape and the draft's heads, SmolLM2-135M's shape for replay and capture."""
    step = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 4096,
            "vocab_size": 4096, "draft_vocab_size": 1024}
    smollm2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0,
               "max_position_embeddings": 8192, "initializer_range": 0.1}   # 0.02 answers one token forever
    train = TrainShape(read_json(KIMI_CONFIG), 32000, (4096, 8192), warmup_steps=3, measured_steps=8,
                       draft_heads=None)
    return Shapes(train, ((8, 2, 17, 16), (56, 8, 383, 128)), step, 256, smollm2, 6, 48)


def tiny_shapes() -> Shapes:
    cfg = read_json(KIMI_CONFIG)     # the same wrapper, scaled: 04 reads text_config as on the real target
    cfg["text_config"] = {**cfg["text_config"], "hidden_size": 64, "intermediate_size": 128, "vocab_size": 1024,
                          "num_hidden_layers": 8, "num_attention_heads": 4}
    step = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 256,
            "vocab_size": 128, "draft_vocab_size": 64}
    llama = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "initializer_range": 0.3}
    train = TrainShape(cfg, 256, (48,), warmup_steps=1, measured_steps=2, draft_heads=(4, 2))
    return Shapes(train, ((8, 2, 17, 16),), step, 24, llama, 3, 10)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", help="cuda|cpu: where the checked paths run (the CPU side is the CPU)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU run of make test)")
    p.add_argument("--scratch", type=Path, default=None,
                   help="folder for the big inputs (Kimi-shaped target, shards, checkpoints: ~20 GB on a GPU); "
                        "default: a temporary folder, removed at the end")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole check (s); sections not started by then are "
                        "not run and fail the check (default 460 on a GPU, 300 tiny); each section's own "
                        "budget scales with it (a loaded CPU: give it more)")
    return p


# ---- the run: sections under budgets, the report rewritten after each ----

class SectionTimeout(Exception):
    pass


@dataclass
class Report:
    out: Path
    deadline: float
    data: dict = field(default_factory=dict)
    scale: float = 1.0   # --budget-s over its default: every section's budget grows with the whole's

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / "gpu_check.json", self.data)
        with atomic_path(self.out / "gpu_check.md") as tmp:
            tmp.write_text(markdown(self.data))


def run_section(report: Report, name: str, budget_s: float, fn, *args) -> dict:
    """fn(result, *args) fills `result` (kept even when it fails midway); its checks decide passed/failed.
    A section is not run when under 30 s of the whole budget are left; one running past its own budget is
    stopped (SIGALRM) and fails. Section budgets are those of the default --budget-s, scaled with it."""
    t0, result, budget_s = time.time(), {}, budget_s * report.scale
    left = report.deadline - t0
    if left < min(30.0, budget_s):
        result["status"] = f"not run: {left:.0f} s left of the budget"
    else:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, int(min(budget_s, left))))
        try:
            fn(result, *args)
            if not result.get("status"):
                checks = [c["ok"] for c in result.get("checks", {}).values()]
                result["status"] = "passed" if all(checks) else "failed"
        except SectionTimeout:
            result.update(status="failed", error=f"timed out after {min(budget_s, left):.0f} s")
        except Exception as e:  # recorded, and the next section runs (the point of this driver)
            result.update(status="failed", error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc()[-3000:])
        finally:
            signal.alarm(0)
    result["seconds"] = round(time.time() - t0, 1)
    report.data["sections"][name] = result
    report.write()
    print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)"
          + (f" {result['error']}" if "error" in result else ""), flush=True)
    return result


def _alarm(signum, frame):
    raise SectionTimeout()


# ---- the driver's own sections ----

def preflight(result: dict, device: str) -> None:
    result["torch"] = torch.__version__
    result["python"] = platform.python_version()
    result["packages"] = {name: importlib.util.find_spec(name) is not None
                          for name in ("transformers", "safetensors", "tiktoken", "tqdm", "yaml", "matplotlib")}
    result["cpu_count"] = os.cpu_count()
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_gib": round(props.total_memory / 2 ** 30, 1), "cuda": torch.version.cuda}
    # 04 and 02b import tqdm and yaml at the top (transformers depends on both); matplotlib is only needed
    # by 04's export, which this check never reaches (--stop-at-step).
    needed = ("transformers", "safetensors", "tqdm", "yaml")
    result["checks"] = {"packages": check(all(result["packages"][n] for n in needed), needed=list(needed)),
                        "device": check(torch.device(device).type == "cpu" or torch.cuda.is_available())}


def gpu_spec(name: str) -> tuple[str, float, float] | None:
    """(label, bf16 dense FLOP/s, memory B/s) of a CUDA device name, or None when GPUS does not know it."""
    return next((g for g in GPUS if g[0].lower() in name.lower()), None)


def add_mfu(runs: list[dict], gpu: str | None) -> None:
    """Model FLOP utilisation of each measured 04 run against the card's bf16 dense peak."""
    spec = gpu_spec(gpu or "")
    for r in runs:
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * r["flop_per_token"] / spec[1] if spec else None


def projection(result: dict, gpu: str | None, runs: list[dict]) -> None:
    """R_1 of one RTX PRO 6000 Blackwell from the measured GPU's tokens/s, scaled by the bf16 dense peak
    ratio (compute-bound) and by the memory-bandwidth ratio (bandwidth-bound), and the plan's training
    hours at each. A projection: only a run on the box measures R_1."""
    src, rtx = gpu_spec(gpu or ""), gpu_spec(RTX)
    if src is None or src[0] == RTX:
        result["status"] = (f"skipped: {gpu or 'no GPU'} is not in GPUS or is the {RTX} itself" if gpu
                            else "skipped: no GPU measured")
        return
    result.update(kind="projection", source=src[0], target=RTX, compute_ratio=rtx[1] / src[1],
                  bandwidth_ratio=rtx[2] / src[2], runs=[])
    for r in (r for r in runs if "tokens_per_s" in r):
        rates = {"compute_bound": r["tokens_per_s"] * rtx[1] / src[1],
                 "bandwidth_bound": r["tokens_per_s"] * rtx[2] / src[2]}
        hours = {k: PLAN_EPOCHS * PLAN_TOKENS / (PLAN_GPUS * PLAN_EFFICIENCY * v) / 3600 for k, v in rates.items()}
        result["runs"].append({"name": r["name"], "measured_tokens_per_s": r["tokens_per_s"],
                               "projected_tokens_per_s": rates, "plan_training_hours_3_epochs_8_gpus": hours,
                               "fits_rtx_memory": r.get("peak_reserved_gib", 0) <= 0.95 * RTX_MEMORY_GIB})
    preset = {r["name"]: r for r in result["runs"]}.get("compact_T4096")
    if preset:   # the plan's R_1: the preset's format (fp8 + top-32) at T 4,096
        result["R_1"] = {"run": preset["name"], **preset["projected_tokens_per_s"],
                         "basis": f"measured on {src[0]}, projected to the {RTX}"}
    result["checks"] = {"projected": check(bool(result["runs"]))}


# ---- the summary ----

def num(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def cell(text: str, limit: int = 200) -> str:
    """One line of a markdown table cell: newlines and pipes out, cut to `limit` characters."""
    return " ".join(str(text).split()).replace("|", "/")[:limit]


def markdown(data: dict) -> str:
    secs = data["sections"]
    gpu = secs.get("preflight", {}).get("gpu", {}).get("name", data["device"])
    shape = "tiny shapes" if data["tiny"] else "Kimi-K2.5 draft shape"
    took = f", {data['seconds']:.0f} s" if "seconds" in data else ""
    lines = [f"# GPU check: {gpu}", "",
             f"`{data['command']}` at {data['started']} (git {data['git']}); {shape}; "
             f"status **{data.get('status', 'running')}**{took}",
             "", "| section | status | s | checks |", "|---|---|---|---|"]
    for name, s in secs.items():
        checks = ", ".join(f"{k} {'ok' if c['ok'] else 'FAILED'}" for k, c in s.get("checks", {}).items())
        lines.append(f"| {name} | {s['status']} | {s['seconds']} | {checks or cell(s.get('error', ''))} |")
    return "\n".join(lines + runs_table(secs) + projection_lines(secs.get("projection", {}))) + "\n"


def runs_table(secs: dict) -> list[str]:
    runs = secs.get("train_04", {}).get("runs", [])
    if not runs:
        return []
    share = {r["seq_len"]: r["share"] for r in secs.get("attention", {}).get("by_seq_len", [])}
    lines = ["", "## 04 (torchrun world 1, bf16 autocast, one sample per step, random features)", "",
             "| run | teacher | T | tokens/s | ms/step | peak alloc GiB | peak reserved GiB (CPU: RSS) "
             "| TTT attention share | MFU | loss step 0 (first -> last) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        head = f"| {r['name']} | {r['teacher']} | {r['seq_len']} |"
        if "tokens_per_s" not in r:
            lines.append(f"{head} {cell(r.get('status') or r.get('error', ''))} |")
            continue
        attn = share.get(r["seq_len"]) if r["name"] == f"compact_T{r['seq_len']}" else None
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.0f} | {num(r.get('peak_allocated_gib'))} | "
                     f"{num(r.get('peak_reserved_gib', r.get('peak_rss_gib')))} | {num(attn, '.1%')} | "
                     f"{num(r.get('mfu'), '.1%')} | {r['loss_step0'][0]:.3f} -> {r['loss_step0'][1]:.3f} |")
    return lines


def projection_lines(proj: dict) -> list[str]:
    if proj.get("kind") != "projection":
        return []
    r1 = proj.get("R_1")
    lines = ["", f"## Projection to one {proj['target']} (PROJECTED from {proj['source']}, not measured)", "",
             f"bf16 dense peak ratio {proj['compute_ratio']:.3f}, memory-bandwidth ratio {proj['bandwidth_ratio']:.3f} "
             "(sources: benchmarks/gpu_check.py GPUS)."
             + (f" **R_1 = {r1['bandwidth_bound']:,.0f}-{r1['compute_bound']:,.0f} tok/s per GPU** ({r1['run']}; "
                f"{r1['basis']})." if r1 else ""), "",
             "| run | measured tok/s | R_1 compute-bound | R_1 bandwidth-bound | plan hours (3 epochs, 8 GPUs) "
             "| fits 96 GB |", "|---|---|---|---|---|---|"]
    for r in proj["runs"]:
        p, h = r["projected_tokens_per_s"], r["plan_training_hours_3_epochs_8_gpus"]
        lines.append(f"| {r['name']} | {r['measured_tokens_per_s']:,.0f} | {p['compute_bound']:,.0f} | "
                     f"{p['bandwidth_bound']:,.0f} | {h['compute_bound']:.1f}-{h['bandwidth_bound']:.1f} | "
                     f"{'yes' if r['fits_rtx_memory'] else 'NO'} |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    shapes = tiny_shapes() if args.tiny else kimi_shapes()
    default_budget = 300.0 if args.tiny else 460.0
    budget = args.budget_s or default_budget
    t0 = time.time()
    report = Report(args.out, t0 + budget, scale=budget / default_budget, data={
        "command": "bash scripts/gpu_check.sh " + " ".join(argv), "device": args.device, "tiny": args.tiny,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "git": git_revision(), "budget_s": budget, "sections": {}})
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    scratch.mkdir(parents=True, exist_ok=True)
    secs, dev = report.data["sections"], args.device
    try:
        run_section(report, "preflight", 30, preflight, dev)
        run_section(report, "ttt_kernel", 60, ttt_kernel, dev, shapes.kernel)
        run_section(report, "step_04", 60, step_04, dev, shapes.step, shapes.step_seq_len, shapes.train.ttt_steps)
        run_section(report, "replay_05", 90, replay_05, dev, shapes.llama, shapes.num_prompts, shapes.max_new_tokens,
                    scratch)
        run_section(report, "capture_02b", 60, capture_02b, dev, shapes.llama, shapes.num_prompts, scratch)
        run_section(report, "train_04", 360, train_04, dev, shapes.train, scratch)
        gpu, runs = secs["preflight"].get("gpu", {}).get("name"), secs["train_04"].get("runs", [])
        add_mfu(runs, gpu)
        run_section(report, "attention", 40, attention, dev, shapes.train, runs)
        run_section(report, "projection", 10, projection, gpu, runs)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    failed = [n for n, s in secs.items() if s["status"] != "passed" and not s["status"].startswith("skipped: ")]
    report.data.update(seconds=round(time.time() - t0, 1), failed=failed,
                       status="passed" if not failed else "failed: " + ", ".join(failed))
    report.write()
    print(f"[gpu_check] {report.data['status']} in {report.data['seconds']:.0f} s: {args.out / 'gpu_check.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
