"""Capture the target's hidden states for every training sample (the draft's inputs and teacher).

Reads:  <work-dir>/01c_merged/tokenized_data.jsonl (+ manifest.json: tokenizer, target)
Writes: <work-dir>/02b_hidden_states/shard_00000.safetensors ..., manifest.json
Real:   torchrun --nproc_per_node 8 02b_extract_hidden_states_sglang.py --config configs/kimi-k2.5.yaml
            --config configs/datasets_v4.yaml --work-dir /data/eagle3
Tiny:   python 02b_extract_hidden_states_sglang.py --config configs/tiny.yaml --work-dir runs/tiny

Per sample: the residual stream h_i at the capture points (default [2, N//2, N-3], low|mid|high, [T, 3H]),
the teacher (the final post-norm state [T, H], or with --teacher-format topk the target's largest logits)
and input_ids/loss_mask, in the feature format of common/target/shards.py (fp8 aux states, top-k teacher,
prompt-tail window; recorded in the manifest, read by 03/04 without flags). Shard k holds samples
[k*S, (k+1)*S) of tokenized_data.jsonl, so a re-run keeps every finished shard and redoes the rest; the
disk the remaining shards need is checked before the model loads. Engines: `hf` (common/target/capture.py)
and `sglang` (common/target/sglang_capture.py: SGLang's model runner, tensor parallel under torchrun, rank 0
writes; docs/sglang.md). Capture points SGLang would not serve as the draft's are refused
(common/target/capture.sglang_layer_ids). On a CPU `--capture-workers N` captures shards in N forked
processes of one thread each (common/parallel.py).
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from common.config import base_parser, parse_args
from common.io import iter_jsonl
from common.parallel import ordered_map
from common.stage import (EXTRACT, MERGE, StageError, input_manifests, is_complete, require_complete, resolve_target,
                          stage_dir, stage_script, start_stage, write_manifest)
from common.target import sglang_capture as cs
from common.target.capture import (capture_hf, default_capture_points, load_target_config, sglang_layer_ids,
                                   target_architecture, target_dims, validate_capture_points)
from common.target.head import load_target_head
from common.target.shards import FeatureFormat, ShardReader, list_shards, shard_name, write_shard

STAGE = EXTRACT
UPSTREAM = MERGE
STORAGE_DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("extract")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; read from the 01c manifest, and when given it must match")
    g.add_argument("--capture-engine", choices=("hf", "sglang"), default="hf",
                   help="how the target runs: hf = transformers forward with output_hidden_states; "
                        "sglang = SGLang model runner (GPU; run under torchrun --nproc_per_node TP)")
    g.add_argument("--sglang-tp-size", type=int, default=1,
                   help="SGLang tensor-parallel size (GPUs) for the target, in 02b and 05b's servers")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="SGLang mem_fraction_static: share of GPU memory for weights + KV pool (0-1)")
    g.add_argument("--capture-engine-args", default=None,
                   help="JSON object of extra SGLang ServerArgs fields for the sglang engine, e.g. "
                        "'{\"attention_backend\": \"flashinfer\"}'; keys SpecForge sets itself (pp_size, "
                        "tp_size, dtype, ...) and two-batch overlap are refused")
    g.add_argument("--capture-points", type=int, nargs="+", default=None,
                   help="h_i indices (INPUT of decoder layer i), 3 ascending in 1..N-1; "
                        "default [2, N//2, N-3] from the target config")
    g.add_argument("--capture-workers", type=int, default=1,
                   help="hf engine: processes that capture shards side by side, one thread each (2 on a 2-core "
                        "CPU box; common/parallel.py); the shards equal one process's at one thread")
    g.add_argument("--samples-per-shard", type=int, default=64,
                   help="samples per shard file (a shard is assembled in memory: S x tokens x bytes/token)")
    g.add_argument("--capture-batch-tokens", type=int, default=8192,
                   help="token budget per forward batch (batch size x longest sample, padding included; "
                        "sglang: rows of equal length only, rows x length)")
    g.add_argument("--hidden-states-dtype", choices=STORAGE_DTYPES, default="bfloat16",
                   help="storage dtype of dense hidden states (compute is fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--aux-format", choices=("bf16", "fp8"), default="bf16",
                   help="aux states: bf16 = dense in --hidden-states-dtype; fp8 = float8 e4m3 with one float32 "
                        "scale per token and capture point (3H + 12 B instead of 6H B per token)")
    g.add_argument("--teacher-format", choices=("final", "topk"), default="final",
                   help="teacher: final = the final hidden state (04 applies the target's lm_head); topk = the "
                        "target's --teacher-topk largest logits over its full vocab (ids + fp16 values)")
    g.add_argument("--teacher-topk", type=int, default=32, help="entries per position of --teacher-format topk")
    g.add_argument("--prompt-window", type=int, default=None,
                   help="store only the last W prompt tokens before each sample's first supervised token "
                        "(tokens; their true positions are kept); default: the whole prompt")
    g.add_argument("--allow-unknown-architecture", action="store_true",
                   help="accept a target whose architecture is not in SGLang's layer-id table "
                        "(common/target/capture.py), assuming SGLang captures h_(id+1) for draft-config id")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the target runs (default: cuda if available)")
    g.add_argument("--disk-margin", type=float, default=0.05,
                   help="extra free disk required beyond the estimate (fraction, 0.05 = 5%%)")
    return p


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (module-level so tests can replace it)."""
    return shutil.disk_usage(path).free


def check_disk(out: Path, num_tokens: int, bytes_per_token: int, margin: float) -> int:
    """Print the space the remaining shards need; stop when the disk cannot hold it (plus margin)."""
    needed = num_tokens * bytes_per_token
    free = free_disk_bytes(out)
    print(f"[02b] disk: {num_tokens:,} tokens to capture x {bytes_per_token:,} B/token = "
          f"{needed / 1e9:.3f} GB (+{margin:.0%} margin); free on {out}: {free / 1e9:.3f} GB")
    if needed * (1 + margin) > free:
        raise StageError(
            f"not enough disk for 02b: need {needed / 1e9:.3f} GB x (1 + {margin}) = "
            f"{needed * (1 + margin) / 1e9:.3f} GB, but only {free / 1e9:.3f} GB is free on {out}. "
            "Free space, point --work-dir at a larger disk, or capture fewer samples/tokens in 01c.")
    return needed




def scan_samples(path: Path, vocab_size: int) -> list[dict]:
    """Per sample id, seq_len, supervised-token count; checks each row before any compute starts."""
    meta = []
    for k, row in enumerate(iter_jsonl(path)):
        n = len(row["input_ids"])
        if n == 0 or n != row["seq_len"] or len(row["loss_mask"]) != n:
            raise StageError(f"{path} row {k} ({row.get('id')}): input_ids {n}, loss_mask "
                             f"{len(row['loss_mask'])}, seq_len {row['seq_len']} must agree and be > 0; "
                             f"re-run `python {stage_script(UPSTREAM)} --overwrite`")
        if max(row["input_ids"]) >= vocab_size or min(row["input_ids"]) < 0:
            raise StageError(f"{path} row {k} ({row['id']}): token id outside the target vocab "
                             f"[0, {vocab_size}); was it tokenized for another target?")
        first = next((i for i, m in enumerate(row["loss_mask"]) if m), 0)
        meta.append({"id": row["id"], "seq_len": n, "num_supervised": int(sum(row["loss_mask"])),
                     "first_supervised": first})
    if not meta:
        raise StageError(f"{path} holds no samples: re-run `python {stage_script(UPSTREAM)}`")
    return meta


def existing_shard_tokens(path: Path, expected_ids: list[str], features) -> int:
    """Rows in a complete shard, after checking it holds exactly the samples planned for it, in `features`."""
    shard = ShardReader(path)
    if shard.format != features:
        raise StageError(f"{path} was written in feature format {shard.format.as_dict()}, this run asks for "
                         f"{features.as_dict()}: use the same flags to resume, or --overwrite")
    if shard.sample_ids != expected_ids:
        raise StageError(f"{path} holds other samples than tokenized_data.jsonl assigns to it (another "
                         "01c run or --samples-per-shard?): re-run this stage with --overwrite")
    return shard.num_tokens


def pack_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices into forward batches with batch size x longest <= budget tokens.

    Longest first, so each batch pads to a similar length; a sample longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    batches: list[list[int]] = []
    for j in order:
        # The first index of a batch is its longest sample (descending order).
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def capture_samples(model, rows: list[dict], capture_fn, points: list[int], budget: int,
                    device: str, store_dtype, on_batch=None) -> list[dict]:
    """Capture every row (right padding + attention_mask); returns samples in row order, no pad rows."""
    out: list[dict | None] = [None] * len(rows)
    for batch in pack_batches([len(r["input_ids"]) for r in rows], budget):
        t_max = len(rows[batch[0]]["input_ids"])
        # Pad id 0 is never seen by a real token: right padding + attention_mask 0 on the pads.
        ids = torch.zeros(len(batch), t_max, dtype=torch.long)
        mask = torch.zeros(len(batch), t_max, dtype=torch.long)
        for b, j in enumerate(batch):
            n = len(rows[j]["input_ids"])
            ids[b, :n] = torch.tensor(rows[j]["input_ids"])
            mask[b, :n] = 1
        aux, final = capture_fn(model, ids.to(device), mask.to(device), points)  # [B,T,3H], [B,T,H]
        for b, j in enumerate(batch):
            n = len(rows[j]["input_ids"])
            out[j] = {"id": rows[j]["id"], "input_ids": rows[j]["input_ids"],
                      "loss_mask": rows[j]["loss_mask"],
                      "aux": aux[b, :n].to("cpu", store_dtype),  # [T, 3H]; pad rows dropped here
                      "final": final[b, :n].to("cpu", store_dtype)}  # [T, H]
        if on_batch:
            on_batch(int(mask.sum()))
    assert all(s is not None for s in out)
    return out


def load_model(target_dir: Path, device: str, dtype):
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype, trust_remote_code=True)
    return model.to(device).eval()


def prepare_out_dir(out: Path, overwrite: bool, rank: int, barrier) -> bool:
    """Rank 0 alone readies the stage folder (--overwrite removal, partial `*.tmp` writes of a killed
    run deleted); every rank then meets at `barrier`. Returns False when the stage is already complete.

    Under torchrun 8 processes run this; if each deleted files, all but one would find them gone.
    """
    proceed = True
    if rank == 0:
        proceed = start_stage(out, overwrite, STAGE)
        for tmp in sorted(out.glob("*.tmp")) if proceed else []:  # redone below
            tmp.unlink()
    barrier()
    if rank != 0:  # rank 0 removed the manifest (--overwrite) or left a complete stage alone
        proceed = not is_complete(out)
    return proceed


def plan_shards(meta: list[dict], samples_per_shard: int, features) -> dict[int, list[dict]]:
    """Shard k -> its samples (consecutive in 01c's order), each with the rows its shard stores
    (`num_rows`: a prompt-tail window drops the rest of the prompt)."""
    for m in meta:
        m["num_rows"] = m["seq_len"] - (max(0, m["first_supervised"] - features.window) if features.window else 0)
    S = samples_per_shard
    return {k: meta[k * S:(k + 1) * S] for k in range(math.ceil(len(meta) / S))}


def completed_shards(out: Path, plan: dict[int, list[dict]], features) -> dict[int, int]:
    """Shard k -> stored rows, for the shards an earlier run finished (checked sample by sample); a
    shard outside the plan is refused (its run had other inputs)."""
    planned = {shard_name(k) for k in plan}
    strays = [p.name for p in list_shards(out) if p.name not in planned]
    if strays:
        raise StageError(f"{out} holds shards outside the plan ({', '.join(strays[:3])}...): "
                         "re-run with --overwrite")
    return {k: existing_shard_tokens(out / shard_name(k), [m["id"] for m in rows], features)
            for k, rows in plan.items() if (out / shard_name(k)).exists()}


def shard_rows(data: Path, plan: dict[int, list[dict]], todo: list[int]):
    """(k, rows) for every shard in `todo`, streaming tokenized_data.jsonl once."""
    S = len(plan[0])
    todo_set, rows = set(todo), []
    for i, row in enumerate(iter_jsonl(data)):
        k = i // S
        if k in todo_set:
            assert row["id"] == plan[k][i % S]["id"], "tokenized_data.jsonl changed during the run"
            rows.append(row)
            if len(rows) == len(plan[k]):
                yield k, rows
                rows = []
    assert not rows, "tokenized_data.jsonl changed during the run"


def capture_shards(data: Path, plan: dict[int, list[dict]], todo: list[int], capture, write, calls: dict,
                   show: bool, workers: int = 1) -> dict[int, int]:
    """Each shard in `todo` is captured (`capture(rows, on_batch)`) and written (`write(k, samples)` -> stored
    rows) as soon as its rows are read, by `workers` processes (common/parallel.py; 1: this one). `calls`
    counts this run's forward calls, tokens and seconds (capture + host copy + write: the hours to plan;
    with workers, the wall-clock seconds of the whole capture)."""
    bar = tqdm(total=sum(m["seq_len"] for k in todo for m in plan[k]), unit="tok", desc="02b capture",
               disable=not show)

    def job(item):
        k, rows = item
        counts = {"num_forward_calls": 0, "num_tokens": 0}

        def on_batch(num_tokens: int) -> None:
            counts["num_forward_calls"] += 1
            counts["num_tokens"] += num_tokens
            if workers == 1:
                bar.update(num_tokens)

        t_shard = time.time()
        stored = write(k, capture(rows, on_batch))
        return k, stored, counts, time.time() - t_shard

    t0, written = time.time(), {}
    for k, stored, counts, seconds in ordered_map(job, shard_rows(data, plan, todo), workers):
        written[k] = stored
        calls["num_forward_calls"] += counts["num_forward_calls"]
        calls["num_tokens"] += counts["num_tokens"]
        calls["seconds"] += seconds if workers == 1 else 0.0
        if workers > 1:
            bar.update(counts["num_tokens"])
    if workers > 1:
        calls["seconds"] += time.time() - t0
    bar.close()
    return written


def check_flags(args) -> None:
    if min(args.samples_per_shard, args.capture_batch_tokens, args.capture_workers) < 1:
        raise StageError("--samples-per-shard, --capture-batch-tokens and --capture-workers must be >= 1")
    if args.capture_workers > 1 and args.capture_engine != "hf":
        raise StageError("--capture-workers is the hf engine's: SGLang spreads the target over GPUs with "
                         "--sglang-tp-size under torchrun")


def main(argv=None):
    args = parse_args(build_parser(), argv)
    src = stage_dir(args.work_dir, UPSTREAM)
    upstream = require_complete(src, UPSTREAM)
    target_dir = resolve_target(args.target_path, upstream, src, UPSTREAM)
    check_flags(args)

    target_cfg = load_target_config(target_dir)
    dims = target_dims(target_cfg)
    n_layers, hidden, vocab = dims["num_hidden_layers"], dims["hidden_size"], dims["vocab_size"]
    points = validate_capture_points(args.capture_points or default_capture_points(n_layers), n_layers)
    # The draft is served by SGLang whichever engine captures: refuse points it would not capture.
    architecture = target_architecture(target_cfg)
    layer_ids = sglang_layer_ids(points, architecture, args.allow_unknown_architecture)

    rank, barrier = 0, (lambda: None)
    if args.capture_engine == "sglang":  # checked on every rank before any process group or model
        engine_args = cs.engine_kwargs(args.sglang_tp_size, args.mem_fraction_static, args.capture_engine_args)
        rank = cs.check_world(args.sglang_tp_size)
        cs.init_process_group(args.sglang_tp_size)
        barrier = cs.barrier
    try:
        features = FeatureFormat(aux=args.aux_format, teacher=args.teacher_format, window=args.prompt_window,
                            topk=args.teacher_topk if args.teacher_format == "topk" else None)
    except ValueError as e:
        raise StageError(f"feature format: {e}") from None
    out = stage_dir(args.work_dir, STAGE)
    if not prepare_out_dir(out, args.overwrite, rank, barrier):
        return
    t0 = time.time()
    bytes_per_token = features.bytes_per_token(hidden, DTYPE_BYTES[args.hidden_states_dtype])
    print(f"[02b] target {target_dir} ({architecture}): N={n_layers} layers, H={hidden}, vocab {vocab}; "
          f"capture points h{points} (inputs of decoder layers {points}; SGLang draft ids {layer_ids}); "
          f"features {features.as_dict()} ({args.hidden_states_dtype} dense), {bytes_per_token} B/stored token")

    data = src / "tokenized_data.jsonl"
    meta = scan_samples(data, vocab)
    S = args.samples_per_shard
    plan = plan_shards(meta, S, features)
    num_shards = len(plan)
    done = completed_shards(out, plan, features)
    todo = [k for k in plan if k not in done]
    print(f"[02b] {len(meta)} samples, {sum(m['seq_len'] for m in meta):,} tokens -> {num_shards} shards "
          f"of {S}; {len(done)} already complete, {len(todo)} to capture")
    check_disk(out, sum(m["num_rows"] for k in todo for m in plan[k]), bytes_per_token, args.disk_margin)

    device = "cuda" if args.capture_engine == "sglang" else (
        args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.capture_workers > 1 and device != "cpu":
        raise StageError("--capture-workers forks CPU processes (CUDA does not survive a fork): on a GPU one "
                         "process captures, or the sglang engine with --sglang-tp-size")
    # fp32 on CPU (tests compare against fp32 references); bf16 on CUDA (the checkpoint's dtype).
    compute_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    store_dtype = getattr(torch, args.hidden_states_dtype)
    # fp8 and a top-k teacher are encoded at write time from states kept in the compute dtype; top-k uses
    # the target's lm_head on the capture device (rank 0 writes; Kimi: 2.35 GB of bf16 on its GPU).
    keep_dtype = compute_dtype if (features.teacher == "topk" or features.aux == "fp8") else store_dtype
    lm_head = None
    if features.teacher == "topk" and rank == 0 and todo:
        lm_head = load_target_head(target_dir, dtype=compute_dtype, device=device)[1]
    written = dict(done)
    calls = {"num_forward_calls": 0, "num_tokens": 0, "seconds": 0.0}  # this run's shards: calls, tokens, time
    if todo:
        if args.capture_engine == "sglang":  # GPU box: SGLang runner on every rank, rank 0 writes
            model = cs.build_backend(target_dir, layer_ids, engine_args)
            capture = lambda m, rows, cb: cs.capture_samples_sglang(  # noqa: E731
                m, rows, cs.capture_rows, args.capture_batch_tokens, hidden, keep_dtype, on_batch=cb)
        else:
            model = load_model(target_dir, device, compute_dtype)
            capture = lambda m, rows, cb: capture_samples(  # noqa: E731
                m, rows, capture_hf, points, args.capture_batch_tokens, device, keep_dtype, on_batch=cb)

        def write(k: int, samples) -> int:  # rank 0 writes; the other ranks only took part in the capture
            if rank == 0:
                return write_shard(out / shard_name(k), samples, store_dtype, features, lm_head)
            return sum(m["num_rows"] for m in plan[k])

        written |= capture_shards(data, plan, todo, lambda rows, cb: capture(model, rows, cb), write, calls,
                                  show=rank == 0, workers=args.capture_workers)
        assert set(written) == set(plan), "tokenized_data.jsonl changed during the run"
        if rank != 0:
            return

    finish(args, out, t0, plan, written, meta, calls, upstream=upstream, src=src, device=device,
           compute_dtype=compute_dtype, points=points, architecture=architecture, layer_ids=layer_ids, dims=dims,
           features=features, bytes_per_token=bytes_per_token)


def finish(args, out, t0, plan, written, meta, calls, *, upstream, src, device, compute_dtype, points, architecture,
           layer_ids, dims, features, bytes_per_token):
    """Every shard's rows checked against the plan, then the manifest (the stage's completion mark)."""
    n_layers, hidden, vocab = dims["num_hidden_layers"], dims["hidden_size"], dims["vocab_size"]
    shards = {}
    for k, members in plan.items():
        expected = sum(m["num_rows"] for m in members)
        assert written[k] == expected, f"shard {k}: {written[k]} rows, expected {expected}"
        shards[shard_name(k)] = {"num_samples": len(members), "num_tokens": expected}
    num_tokens = sum(s["num_tokens"] for s in shards.values())   # stored rows
    num_sample_tokens = sum(m["seq_len"] for m in meta)           # tokens of the samples, window or not
    num_bytes = sum((out / name).stat().st_size for name in shards)  # on disk, headers included
    write_manifest(
        out, STAGE, args,
        capture_engine=args.capture_engine, device=device,
        compute_dtype=str(compute_dtype).removeprefix("torch."), capture_points=points,
        target_architecture=architecture, sglang_layer_ids=layer_ids,
        hidden_size=hidden, num_hidden_layers=n_layers, vocab_size=vocab, dtype=args.hidden_states_dtype,
        feature_format=features.as_dict(), bytes_per_token=bytes_per_token,
        num_samples=len(meta), num_tokens=num_tokens, num_sample_tokens=num_sample_tokens,
        bytes_per_sample_token=round(num_bytes / num_sample_tokens, 1),
        num_supervised_tokens=sum(m["num_supervised"] for m in meta), num_bytes=num_bytes,
        samples_per_shard=args.samples_per_shard, shards=shards, tokenizer=upstream["tokenizer"], target=upstream["target"],
        inputs=input_manifests(args.work_dir, src),
        this_run={**calls, "seconds": round(calls["seconds"], 2),
                  "tokens_per_s": round(calls["num_tokens"] / calls["seconds"], 1) if calls["seconds"] else None},
        elapsed_s=round(time.time() - t0, 2))
    print(f"[02b] done: {len(meta)} samples, {num_tokens:,} stored rows, {len(plan)} shards, "
          f"{num_bytes / 1e9:.3f} GB in {out} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
