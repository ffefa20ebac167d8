"""02b backend `sglang`: capture h at the capture points and the final hidden state through SGLang.

SGLang's public generate API returns one hidden-state tensor per request (`return_hidden_states`): the
aux concat when the model captures aux layers, else the final state, never both. So this backend uses
SGLang the way SpecForge's offline data preparation does (sgl-project/SpecForge
`specforge/offline_capture/sglang_backend/{capture,utils,model_runner}.py`): an in-process ModelRunner
(`ServerArgs(enable_return_hidden_states=True, disable_cuda_graph=True, chunked_prefill_size=-1,
pp_size=1, ...)`), the target's `set_eagle3_layers_to_capture(ids)` hook (ids = OUTPUT of layer j,
SGLang adds +1, so ids = capture points - 1), every LogitsProcessor wrapped to keep all tokens and
return `aux_hidden_states` [sum_T, 3H] and the post-norm `last_hidden_states` [sum_T, H] of one extend
pass, split per request: `capture_eagle3(input_ids [B, T], ...) -> (data, aux_rows, last_rows)` in the
pinned SpecForge (@e630ca4e, sglang==0.5.14), `capture_rows(list of id lists)` in newer ones.

Around that one call (tested on CPU with a stand-in): batching by a token budget (ragged, no padding),
settings that would skip aux capture refused, each returned tensor's shape checked before it is stored.
Prefix caching cannot hide tokens: each batch is a fresh ScheduleBatch whose requests carry no prefix
(SpecForge builds the Req with empty prefix_indices and clears the pools after every call) and
`disable_radix_cache=True` is passed as well.
"""
from __future__ import annotations

import json

from common.stage import StageError

# Settings under which SGLang's DeepSeek path does not capture aux states (REFERENCE section 1) or
# that would let a cached prefix hide tokens.
REFUSED = {"enable_two_batch_overlap": True, "disable_radix_cache": False}


def engine_kwargs(tp_size: int, mem_fraction_static: float, extra_json: str | None) -> dict:
    """ServerArgs keyword arguments for the capture runner; refuses what would skip aux capture."""
    extra = json.loads(extra_json) if extra_json else {}
    if not isinstance(extra, dict):
        raise StageError("--capture-engine-args must be a JSON object of ServerArgs fields")
    if int(extra.get("pp_size", 1)) > 1:
        raise StageError("pipeline parallel > 1: SGLang's set_eagle3_layers_to_capture returns early on "
                         "non-last PP ranks, so aux states are not captured; use tensor parallel only")
    for key, bad in REFUSED.items():
        if key in extra and bool(extra[key]) == bad:
            why = ("two-batch overlap runs layers outside the capturing loop" if key.startswith("enable")
                   else "a radix-cache hit returns hidden states only for the uncached tokens")
            raise StageError(f"--capture-engine-args {key}={extra[key]} refused: {why}")
    for key in ("tp_size", "mem_fraction_static", "speculative_algorithm"):
        if key in extra:
            raise StageError(f"--capture-engine-args may not set {key} (use the stage's own flag)")
    if tp_size < 1 or not 0 < mem_fraction_static < 1:
        raise StageError("--sglang-tp-size must be >= 1 and --mem-fraction-static in (0, 1)")
    return {"mem_fraction_static": mem_fraction_static, "disable_radix_cache": True,
            "enable_two_batch_overlap": False, **extra}


def batch_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sample indices grouped so each batch's total tokens <= budget (ragged: no padding).

    SGLang packs requests along tokens, so the cost is the sum of lengths, not batch x longest.
    A sample longer than the budget runs alone; the last partial batch is kept.
    """
    batches: list[list[int]] = []
    total = 0
    for j, n in enumerate(lengths):
        if batches and total + n <= budget:
            batches[-1].append(j)
            total += n
        else:
            batches.append([j])
            total = n
    return batches


def check_shapes(sample_id: str, aux, final, seq_len: int, hidden: int) -> None:
    """A returned tensor that is not [T, 3H] / [T, H] is never stored (e.g. EAGLE-mode H-wide states)."""
    if tuple(aux.shape) != (seq_len, 3 * hidden) or tuple(final.shape) != (seq_len, hidden):
        raise StageError(
            f"SGLang returned aux {tuple(aux.shape)} and final {tuple(final.shape)} for {sample_id}; "
            f"expected ({seq_len}, {3 * hidden}) and ({seq_len}, {hidden}). Aux capture is off or partial "
            "(capture ids, two-batch overlap, PP > 1) or tokens were served from a prefix cache.")


def capture_samples_sglang(backend, rows: list[dict], capture_rows_fn, budget: int, hidden: int,
                           store_dtype, on_batch=None) -> list[dict]:
    """Capture every row through capture_rows_fn(backend, [ids...]) -> (aux_rows, final_rows)."""
    out = []
    for batch in batch_by_tokens([len(r["input_ids"]) for r in rows], budget):
        ids = [list(rows[j]["input_ids"]) for j in batch]
        aux_rows, final_rows = capture_rows_fn(backend, ids)
        if len(aux_rows) != len(batch) or len(final_rows) != len(batch):
            raise StageError(f"SGLang returned {len(aux_rows)}/{len(final_rows)} rows for {len(batch)} requests")
        for j, aux, final in zip(batch, aux_rows, final_rows):
            row = rows[j]
            check_shapes(row["id"], aux, final, len(row["input_ids"]), hidden)
            out.append({"id": row["id"], "input_ids": row["input_ids"], "loss_mask": row["loss_mask"],
                        "aux": aux.to("cpu", store_dtype), "final": final.to("cpu", store_dtype)})
        if on_batch:
            on_batch(sum(len(i) for i in ids))
    return out


def check_world(tp_size: int) -> int:
    """This process's rank, after build_backend set up the process group (one process per TP rank).

    Every rank runs the same batches in lockstep (TP shards the model, not the data); rank 0 writes.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != tp_size:
        raise StageError(f"--sglang-tp-size {tp_size} but {world} process(es): launch with "
                         f"`torchrun --nproc_per_node {tp_size} 02b_extract_hidden_states_sglang.py ...`")
    return dist.get_rank() if dist.is_initialized() else 0


def build_backend(target_dir, capture_points: list[int], kwargs: dict, tp_size: int):  # GPU only
    """SpecForge's offline SGLang runner for the target, capturing h at `capture_points`.

    SpecForge (@e630ca4e) takes the TP size from its own TP process group, so its
    init_distributed(tp_size=...) runs first (torchrun env://, also for TP 1).
    """
    import torch
    import torch.distributed as dist
    from specforge.distributed import init_distributed
    from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend

    if not dist.is_initialized():
        init_distributed(timeout=60, tp_size=tp_size)  # minutes; the 1T checkpoint loads slowly
    backend = OfflineSGLangCaptureBackend.build(str(target_dir), torch_dtype=torch.bfloat16,
                                                trust_remote_code=True, **kwargs)
    backend.set_eagle3_capture_layers([p - 1 for p in capture_points])  # SGLang adds +1
    return backend


def capture_rows(backend, ids: list[list[int]]):  # GPU only
    """(aux_rows [T_i, 3H], final_rows [T_i, H]) for the requests `ids`.

    Newer SpecForge packs ragged rows into one prefill (`capture_rows`); the pinned one takes a
    [B, T] tensor (`capture_eagle3`, no padding allowed here), so rows go one at a time there.
    """
    import torch

    if hasattr(backend, "capture_rows"):
        return backend.capture_rows(ids)
    aux_rows, final_rows = [], []
    for row in ids:
        t = torch.tensor([row], dtype=torch.long)
        _, aux, final = backend.capture_eagle3(input_ids=t, attention_mask=torch.ones_like(t),
                                               loss_mask=torch.ones_like(t))
        aux_rows.append(aux[0])
        final_rows.append(final[0])
    return aux_rows, final_rows
