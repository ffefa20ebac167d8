"""The 04 sections of benchmarks/gpu_check.py: 04_train.py measured at Kimi-K2.5's draft shape.

  train_04   04 under torchrun (DDP world 1), bf16 autocast, one sample per step, random features in the
             compact (fp8 + top-32) and bf16 (+ final) formats, a warm start (--init-from), and the MLA +
             EAGLE-3.1 draft form (--draft-attention mla --fc-norm --norm-output: the public K2.5 MLA draft's
             shape, the target's MLA dims): tokens/s after warm-up, peak memory, loss
  attention  the TTT attention kernel alone at the same shapes: its share of a step
The torchrun worker is this file (`--run-04 STATS -- <04 flags>`): 04's main, then the process's peak memory.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from bench_04_train import synthetic_target, synthetic_upstream  # noqa: E402
from gpu_check_exact import check, error_of, free, sync  # noqa: E402

from common.config import declared_flags, load_config  # noqa: E402
from common.draft.model import draft_config  # noqa: E402
from common.io import read_json, write_json  # noqa: E402
from common.stage import EXTRACT, TRAIN, VOCAB, stage_dir, stage_script  # noqa: E402
from common.target.manifests import HiddenStatesManifest  # noqa: E402
from common.target.shards import FeatureFormat  # noqa: E402

PRESET = REPO / "configs" / "kimi-k2.5.yaml"
SUPERVISED_SHARE = 0.31   # share of supervised tokens u in train_plan_v4.md section 2.3's projection
FORMATS = {"compact": FeatureFormat(aux="fp8", teacher="topk", topk=32), "bf16": FeatureFormat()}


@dataclass(frozen=True)
class TrainShape:
    target_config: dict                  # config.json of the synthetic target (04 reads its text_config)
    draft_vocab: int
    seq_lens: tuple[int, ...]            # the compact format at each, the bf16 one and the warm start at the first
    warmup_steps: int                    # 04 steps dropped before the rate is taken
    measured_steps: int
    draft_heads: tuple[int, int] | None  # draft attention / KV heads; None: the preset's
    ttt_steps: int = 7


# The draft forms the check trains (04's flags). The preset's form is MLA; "mha" is the Llama form at the heads
# configs/kimi-k2.5.yaml names for it (56 x 128 = 7168, 8 KV heads), the shape section 2.3's projection used.
MHA_HEADS = (56, 8)
FORMS = {"mha": ["--draft-attention", "mha"], "mla": ["--draft-attention", "mla", "--fc-norm", "--norm-output"]}


def draft_shape(ts: TrainShape, form: str = "mha") -> dict:
    """The draft 04 builds for the synthetic target: MHA_HEADS (or the tiny run's) and the preset's MLP; the
    MLA form keeps the target's heads and MLA dims (04 ignores the head flags' KV count for MLA)."""
    preset = load_config(PRESET)
    heads, kv = ts.draft_heads or MHA_HEADS
    tcfg = ts.target_config.get("text_config") or ts.target_config
    if form == "mla":
        return draft_config(tcfg, ts.draft_vocab, None, None, preset.get("draft-intermediate-size"),
                            attention="mla", fc_norm=True, norm_output=True)
    return draft_config(tcfg, ts.draft_vocab, heads, kv, preset.get("draft-intermediate-size"))


def train_04(result: dict, device: str, ts: TrainShape, scratch: Path) -> None:
    """04 on random features: the compact and bf16 formats and a warm start at the first T, then the
    compact format at the other T (a longer T that runs out of memory is recorded, not failed)."""
    cfg = draft_shape(ts)
    t0 = time.time()
    target = synthetic_target(scratch / "target", ts.target_config, prefix="language_model.", device=device)
    result.update(draft_config=cfg, build_target_s=round(time.time() - t0, 1), runs=[])
    first = ts.seq_lens[0]
    plan = [("compact", first, False, "mha"), ("bf16", first, False, "mha"), ("compact", first, True, "mha"),
            ("compact", first, False, "mla")]
    plan += [("compact", t, False, "mha") for t in ts.seq_lens[1:]]
    works, checks = {}, result.setdefault("checks", {})
    for fmt, seq_len, warm, form in plan:
        name = f"{fmt}_T{seq_len}" + ("_warm_start" if warm else "") + ("" if form == "mha" else f"_{form}")
        run = {"name": name, "format": FORMATS[fmt].as_dict(), "teacher": FORMATS[fmt].teacher, "seq_len": seq_len,
               "form": form}
        result["runs"].append(run)
        flag = "init-from" if warm else ("draft-attention" if form != "mha" else None)
        if flag and flag not in declared_flags(REPO / stage_script(TRAIN)):
            run["status"] = f"skipped: 04 has no --{flag}"
            checks[name] = check(True, status=run["status"])
            continue
        try:
            if (fmt, seq_len) not in works:
                t0 = time.time()
                works[fmt, seq_len] = synthetic_upstream(scratch / f"work_{fmt}_{seq_len}", target, seq_len, 2,
                                                         ts.draft_vocab, SUPERVISED_SHARE, FORMATS[fmt], device)
                run["build_inputs_s"] = round(time.time() - t0, 1)
                free(device)   # the top-k teacher's lm_head: 04 runs in a process of its own
            init_from = warm_export(works[fmt, seq_len], cfg, device, scratch) if warm else None
            run.update(run_04(works[fmt, seq_len], target, seq_len, ts, device, scratch, init_from, FORMS[form]))
            run["flop_per_token"] = flop_per_token(draft_shape(ts, form), seq_len, ts.ttt_steps, SUPERVISED_SHARE,
                                                   run["teacher"])
            checks[name] = check(all(abs(x) < float("inf") for x in run["loss_step0"]),   # finite (NaN fails too)
                                 tokens_per_s=run["tokens_per_s"])
        except Exception as e:
            run["error"] = error_of(e)[-3000:]
            too_long = "out of memory" in str(e).lower() and seq_len != first   # a longer T runs if memory allows
            if too_long:
                run["status"] = "did not fit in memory"
            checks[name] = check(too_long, error=run["error"][-500:])


def warm_export(work: Path, cfg: dict, device: str, scratch: Path) -> Path:
    """A randomly initialised draft of 04's shape with 03's vocab mapping, in the SGLang export layout."""
    from safetensors.torch import load_file

    from common.draft.export_sglang import export_sglang
    from common.draft.model import Eagle3DraftModel
    mapping = load_file(str(stage_dir(work, VOCAB) / "vocab_mapping.safetensors"))
    points = list(HiddenStatesManifest.read(stage_dir(work, EXTRACT)).capture_points)
    with torch.device(device):   # Kimi's draft: 2 B parameters with the embedding, built in seconds on a GPU
        model = Eagle3DraftModel(cfg)
    model.set_vocab_mapping(mapping["d2t"], mapping["t2d"])
    out = export_sglang(model, scratch / "warm_start_draft", points)
    del model
    free(device)
    return out


def run_04(work: Path, target: Path, seq_len: int, ts: TrainShape, device: str, scratch: Path,
           init_from: Path | None, form_flags: list[str] = ()) -> dict:
    """Run 04 (TRAIN) with the preset under torchrun (world 1) through this file's --run-04 worker; one
    sample of seq_len tokens per step; stops with a checkpoint (never exports: no matplotlib needed)."""
    steps = ts.warmup_steps + ts.measured_steps
    argv = ["--config", str(PRESET), "--work-dir", str(work), "--target-path", str(target), "--device", device,
            "--precision", "bf16", "--batch-tokens", str(seq_len), "--max-seq-len", str(seq_len),
            "--max-samples-per-batch", "1", "--eval-fraction", "0", "--num-epochs", str(steps),
            "--max-steps", str(steps + 1), "--stop-at-step", str(steps), "--log-every", "1",
            "--eval-every", "1000000", "--save-every", "1000000", "--overwrite"]
    if "candidates-per-epoch" in declared_flags(REPO / stage_script(TRAIN)):
        argv += ["--candidates-per-epoch", "0"]   # the preset's checkpoint selection needs an eval split
    tcfg = ts.target_config.get("text_config") or ts.target_config
    if "mla" in form_flags:   # the MLA form keeps the target's heads
        argv += [*form_flags, "--draft-num-attention-heads", str(tcfg["num_attention_heads"])]
    else:
        heads, kv = ts.draft_heads or MHA_HEADS
        argv += [*form_flags, "--draft-num-attention-heads", str(heads), "--draft-num-key-value-heads", str(kv)]
    if init_from:
        argv += ["--init-from", str(init_from)]
    stats, log = scratch / "run_04_stats.json", scratch / "run_04.log"
    stats.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(Path(__file__).resolve()), "--run-04", str(stats), "--", *argv]
    t0 = time.time()
    rc = run_child(cmd, log)
    wall = time.time() - t0
    if rc != 0:   # 04's own output, without torchrun's report of the failure
        raise RuntimeError(f"04 exited {rc}: {log.read_text().split('torch.distributed.elastic')[0][-2500:]}")
    out = stage_dir(work, TRAIN)
    rows = [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if r["split"] == "train"]
    ms = statistics.median(r["ms_per_step"] for r in rows if r["step"] > ts.warmup_steps)
    shutil.rmtree(out)   # its checkpoint: 11.5 GB at Kimi's shape
    return {"tokens_per_s": seq_len * 1000 / ms, "ms_per_step": ms, "wall_s": round(wall, 1), "steps": len(rows),
            "loss_step0": [rows[0]["loss"][0], rows[-1]["loss"][0]], **read_json(stats)}


def run_child(cmd: list[str], log: Path) -> int:
    """Run cmd in a process group of its own, output to `log`; on any interruption (the section's alarm)
    the whole group (torchrun and its worker) is killed."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def run_04_child(stats: Path, argv: list[str]) -> None:
    """The torchrun worker: 04's main, then this process's peak memory (GPU allocator, or CPU RSS)."""
    train = importlib.import_module(TRAIN)
    try:
        train.main(argv)
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30}
        else:
            peak = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30}
        write_json(stats, peak)


def flop_per_token(cfg: dict, seq_len: int, ttt_steps: int, share: float, teacher: str) -> float:
    """Model FLOP per token of a 04 step, counted as train_plan_v4.md section 2.3 counts them: 6 x the
    parameters of the decoder layer (every TTT step) and of fc, the draft head on supervised rows (share u)
    every step, TTT attention (QK and PV over ~T/2 causal keys + k same-position keys; backward ~2x the
    forward) and the final-state teacher's lm_head on supervised rows. The MLA form: its five projections,
    and attention at the q/k width qk_nope + qk_rope (v is padded to it in the kernel)."""
    h, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    if cfg.get("attention") == "mla":
        ql, kvl, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        d, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
        attn = 2 * h * ql + ql * nh * d + 2 * h * (kvl + rope) + kvl * nh * (d - rope + v) + nh * v * h
    else:
        attn = 2 * h * nh * d + 2 * 2 * h * nkv * d + nh * d * h
    layer = attn + 3 * h * cfg["intermediate_size"]
    attention_flop = 3 * sum(4 * nh * d * (seq_len / 2 + k) for k in range(ttt_steps))
    head = 6 * h * cfg["draft_vocab_size"] * ttt_steps * share
    teach = 2 * cfg["vocab_size"] * h * share if teacher == "final" else 0
    return 6 * layer * ttt_steps + 6 * 3 * h * h + head + attention_flop + teach


def attention(result: dict, device: str, ts: TrainShape, runs: list[dict]) -> None:
    """The TTT attention (common/draft/ttt_attention.py) alone at 04's shapes: forward + backward of the
    TTT steps in bf16, median of 3 after a warm-up, and its share of the compact run's step time."""
    from common.draft.ttt_attention import ttt_attention
    cfg = draft_shape(ts)
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    step_ms = {r["seq_len"]: r["ms_per_step"] for r in runs
               if r["name"] == f"compact_T{r['seq_len']}" and "ms_per_step" in r}
    result["by_seq_len"] = []
    for seq_len in ts.seq_lens:
        kw = {"device": device, "dtype": torch.bfloat16}
        q = torch.randn(1, nh, seq_len, d, **kw, requires_grad=True)
        keys = [torch.randn(1, nkv, seq_len, d, **kw, requires_grad=True) for _ in range(ts.ttt_steps)]
        values = [torch.randn(1, nkv, seq_len, d, **kw, requires_grad=True) for _ in range(ts.ttt_steps)]
        up = torch.randn(1, nh, seq_len, d, **kw)
        times = []
        for _ in range(4):
            sync(device)
            t0 = time.perf_counter()
            for k in range(ts.ttt_steps):
                ttt_attention(q, keys[:k + 1], values[:k + 1]).backward(up)
            sync(device)
            times.append(1000 * (time.perf_counter() - t0))
        ms, step = statistics.median(times[1:]), step_ms.get(seq_len)
        result["by_seq_len"].append({"seq_len": seq_len, "ms": ms, "step_ms": step, "share": step and ms / step})
        del q, keys, values
        free(device)
    result["checks"] = {"measured": check(result["by_seq_len"][0]["share"] is not None)}


if __name__ == "__main__":
    assert sys.argv[1] == "--run-04" and sys.argv[3] == "--", sys.argv   # see run_04
    run_04_child(Path(sys.argv[2]), sys.argv[4:])
