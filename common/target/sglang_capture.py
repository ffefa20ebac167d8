"""02b engine `sglang`: capture h at the capture points and the final hidden state through SGLang.

SGLang's public generate API returns one hidden-state tensor per request (`return_hidden_states`): the
aux concat when the model captures aux layers, else the final state, never both. So this engine uses
SGLang the way SpecForge's offline data preparation does (sgl-project/SpecForge @e630ca4e,
`specforge/offline_capture/sglang_backend/capture.py`, for sglang==0.5.14): an in-process ModelRunner
built by `OfflineSGLangCaptureBackend.build(path, torch_dtype=..., trust_remote_code=..., **kwargs)`,
which itself passes `ServerArgs(model_path, trust_remote_code, dtype, enable_return_hidden_states=True,
disable_cuda_graph=True, chunked_prefill_size=-1, tp_size, pp_size=1, **kwargs)`; the target's
`set_eagle3_layers_to_capture(ids)` hook through `set_eagle3_capture_layers`; and one call,
`capture_eagle3(input_ids [B, T], attention_mask, loss_mask) -> (data, aux_rows, last_rows)`, that runs
all B rows in ONE extend pass and returns per row `aux_hidden_states` [T, 3H] and the post-norm
`last_hidden_states` [T, H]. Every row becomes a request of exactly T tokens: the attention mask is
not read, so rows cannot be padded, and a call only takes rows of one length.

Around that one call (tested on CPU with a stand-in): rows grouped by equal length under a token
budget, settings that would skip aux capture or collide with SpecForge's own keyword arguments
refused, the process count checked against the TP size before anything loads, and each returned
tensor's shape checked before it is stored. Prefix caching cannot hide tokens: each call is a fresh
ScheduleBatch whose requests carry no prefix (SpecForge clears the pools after every call) and
`disable_radix_cache=True` is passed as well.
"""
from __future__ import annotations

import json
import os

from common.stage import StageError

# Keyword arguments SpecForge's OfflineSGLangCaptureBackend.build already gives ServerArgs: passing one
# again raises "got multiple values for keyword argument" deep inside the GPU job.
SPECFORGE_SETS = ("model_path", "trust_remote_code", "dtype", "enable_return_hidden_states",
                  "disable_cuda_graph", "chunked_prefill_size", "tp_size", "pp_size")
# ServerArgs this stage sets from its own flags, or that make no sense for capture.
OWN_FLAGS = {"mem_fraction_static": "--mem-fraction-static",
             "speculative_algorithm": "none, capture runs the target alone"}
# Settings under which SGLang's DeepSeek path does not capture aux states (two-batch overlap runs
# layers outside the capturing loop) or that would let a cached prefix hide tokens.
REFUSED = {"enable_two_batch_overlap": True, "disable_radix_cache": False}


def engine_kwargs(tp_size: int, mem_fraction_static: float, extra_json: str | None) -> dict:
    """ServerArgs keyword arguments for the capture runner; refuses what would skip aux capture."""
    extra = json.loads(extra_json) if extra_json else {}
    if not isinstance(extra, dict):
        raise StageError("--capture-engine-args must be a JSON object of ServerArgs fields")
    if "pp_size" in extra:
        raise StageError("--capture-engine-args may not set pp_size: SpecForge already passes pp_size=1, "
                         "and pipeline parallel > 1 would skip aux capture (set_eagle3_layers_to_capture "
                         "returns early on non-last PP ranks); use tensor parallel only")
    fixed = [k for k in SPECFORGE_SETS if k in extra]
    if fixed:
        raise StageError(f"--capture-engine-args may not set {', '.join(fixed)}: SpecForge's capture "
                         f"backend passes {', '.join(SPECFORGE_SETS)} itself (tp_size from --sglang-tp-size)")
    for key, flag in OWN_FLAGS.items():
        if key in extra:
            raise StageError(f"--capture-engine-args may not set {key} (use the stage's own flag: {flag})")
    for key, bad in REFUSED.items():
        if key in extra and bool(extra[key]) == bad:
            why = ("two-batch overlap runs layers outside the capturing loop" if key.startswith("enable")
                   else "a radix-cache hit returns hidden states only for the uncached tokens")
            raise StageError(f"--capture-engine-args {key}={extra[key]} refused: {why}")
    if tp_size < 1 or not 0 < mem_fraction_static < 1:
        raise StageError("--sglang-tp-size must be >= 1 and --mem-fraction-static in (0, 1)")
    return {"mem_fraction_static": mem_fraction_static, "disable_radix_cache": True,
            "enable_two_batch_overlap": False, **extra}


def check_world(tp_size: int, environ=os.environ) -> int:
    """This process's rank, after checking torchrun started exactly one process per TP rank.

    Read from torchrun's environment (WORLD_SIZE, RANK) before any process group or model exists, so a
    mismatch stops every rank at once instead of after each has tried to load the full target.
    Every rank runs the same batches in lockstep (TP shards the model, not the data); rank 0 writes.
    """
    world = int(environ.get("WORLD_SIZE", "1"))
    if world != tp_size:
        raise StageError(f"--sglang-tp-size {tp_size} but {world} process(es) (WORLD_SIZE): launch with "
                         f"`torchrun --nproc_per_node {tp_size} 02b_extract_hidden_states_sglang.py ...`")
    return int(environ.get("RANK", "0"))


def init_process_group(tp_size: int) -> None:  # GPU only
    """SpecForge's process groups (torchrun env://, also for TP 1): its build() takes the TP size from
    its own TP group, and the stage's barrier needs the default group."""
    import torch.distributed as dist
    from specforge.distributed import init_distributed

    if not dist.is_initialized():
        init_distributed(timeout=60, tp_size=tp_size)  # minutes; the 1T checkpoint loads slowly


def barrier() -> None:  # GPU only
    """All ranks meet here (after rank 0 has prepared the stage folder)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def batch_equal_lengths(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices grouped into calls of equal length with rows x length <= budget tokens.

    capture_eagle3 takes one [B, T] tensor and cannot pad, so only equal lengths share a call (one
    extend pass for all of them). Groups follow the first appearance of each length; a row longer
    than the budget runs alone. How many rows share a length depends on the order 01c writes.
    """
    by_length: dict[int, list[list[int]]] = {}
    for j, n in enumerate(lengths):
        groups = by_length.setdefault(n, [[]])
        if groups[-1] and (len(groups[-1]) + 1) * n > budget:
            groups.append([])
        groups[-1].append(j)
    return [g for groups in by_length.values() for g in groups]


def check_shapes(sample_id: str, aux, final, seq_len: int, hidden: int) -> None:
    """A returned tensor that is not [T, 3H] / [T, H] is never stored (e.g. EAGLE-mode H-wide states)."""
    if tuple(aux.shape) != (seq_len, 3 * hidden) or tuple(final.shape) != (seq_len, hidden):
        raise StageError(
            f"SGLang returned aux {tuple(aux.shape)} and final {tuple(final.shape)} for {sample_id}; "
            f"expected ({seq_len}, {3 * hidden}) and ({seq_len}, {hidden}). Aux capture is off or partial "
            "(capture ids, two-batch overlap, PP > 1) or tokens were served from a prefix cache.")


def capture_samples_sglang(backend, rows: list[dict], capture_fn, budget: int, hidden: int,
                           store_dtype, on_batch=None) -> list[dict]:
    """Capture every row through capture_fn(backend, equal-length id lists) -> (aux_rows, final_rows).

    Returns samples in row order (a shard keeps 01c's order whatever the grouping).
    """
    out: list[dict | None] = [None] * len(rows)
    for group in batch_equal_lengths([len(r["input_ids"]) for r in rows], budget):
        ids = [list(rows[j]["input_ids"]) for j in group]
        aux_rows, final_rows = capture_fn(backend, ids)
        if len(aux_rows) != len(group) or len(final_rows) != len(group):
            raise StageError(f"SGLang returned {len(aux_rows)}/{len(final_rows)} rows for {len(group)} requests")
        for j, aux, final in zip(group, aux_rows, final_rows):
            row = rows[j]
            check_shapes(row["id"], aux, final, len(row["input_ids"]), hidden)
            out[j] = {"id": row["id"], "input_ids": row["input_ids"], "loss_mask": row["loss_mask"],
                      "aux": aux.to("cpu", store_dtype), "final": final.to("cpu", store_dtype)}
        if on_batch:
            on_batch(sum(len(i) for i in ids))
    assert all(s is not None for s in out)
    return out


def build_backend(target_dir, layer_ids: list[int], kwargs: dict):  # GPU only
    """SpecForge's offline SGLang runner for the target, capturing what the draft-config `layer_ids`
    name (common.target.capture.sglang_layer_ids: checked to be the capture points under SGLang's
    rule for this architecture). init_process_group must have run."""
    import torch
    from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend

    backend = OfflineSGLangCaptureBackend.build(str(target_dir), torch_dtype=torch.bfloat16,
                                                trust_remote_code=True, **kwargs)
    backend.set_eagle3_capture_layers(list(layer_ids))
    return backend


def capture_rows(backend, ids: list[list[int]]):  # GPU only
    """(aux_rows [T, 3H], final_rows [T, H]) for equal-length requests `ids`, in one extend pass."""
    import torch

    assert len({len(row) for row in ids}) == 1, "capture_eagle3 takes rows of one length (no padding)"
    t = torch.tensor(ids, dtype=torch.long)  # [B, T]
    ones = torch.ones_like(t)
    _, aux_rows, final_rows = backend.capture_eagle3(input_ids=t, attention_mask=ones, loss_mask=ones)
    return aux_rows, final_rows
