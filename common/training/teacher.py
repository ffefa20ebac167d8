"""The two TTT teachers: the target's distribution over the draft vocab at every supervised position.

teacher_targets   from the final post-norm hidden state and the target's lm_head (teacher "full")
teacher_from_topk from stored top-k logits (02b feature format teacher "topk"), same contract
Both return target_p rows in supervised_rows' layout; step_counts gives each TTT step's denominator.

02b stores, per position, the target's k largest logits over its FULL vocab (ids + values). The draft
learns the target's distribution restricted to the draft vocab, renormalised; with top-k it is the
softmax over the stored entries whose ids are in the draft vocab (the tail beyond the k-th logit is
dropped: for greedy-like text the top 32 hold nearly all the mass). The target's argmax is the top-1
id; a position whose argmax is not draftable is dropped from the loss, as with the full teacher.
No lm_head is needed in 04 (Kimi: 2.35 GB less GPU memory) and no [T, V] logits are ever built.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def teacher_targets(final, lm_head, d2t, t2d, loss_mask, chunk_rows: int = 1024) -> dict:
    """The target's view of every supervised position, from its final post-norm hidden state.

    final [B, T, H] (the lm_head input the target stored), lm_head [V, H], d2t [Dv], t2d [V],
    loss_mask [B, T] bool. For position s the target's distribution is over token s+1. Returns
      target_p    [M, Dv] float32  for the M supervised positions in (b, t) order: softmax of the
                                   target logits restricted to the draft vocab columns (renormalised),
                                   column i = target id i + d2t[i]
      row         [B, T] int64     the target_p row of each position, -1 where loss_mask is 0
      target_arg  [B, T] int64     the target's argmax over the FULL vocab as a draft id; -1 when it
                                   is not in the draft vocab or the position is not supervised
      in_vocab    [B, T] bool      target_arg >= 0 (supervised positions whose argmax is draftable)
    Computed in row chunks: the [rows, V] logits are the big tensor (Kimi V = 163840).
    """
    b, t, h = final.shape
    draft_to_target, target_to_draft = vocab_maps(d2t, t2d)
    where, row = supervised_rows(loss_mask)
    flat = final.reshape(b * t, h)
    p_out = torch.empty(len(where), d2t.shape[0], dtype=torch.float32, device=final.device)
    arg = torch.full((b * t,), -1, dtype=torch.int64, device=final.device)
    for a in range(0, len(where), chunk_rows):
        idx = where[a:a + chunk_rows]
        logits = flat[idx].to(lm_head.dtype) @ lm_head.T                    # [c, V]
        arg[idx] = target_to_draft[logits.max(-1).indices]                # (argmax: 7x slower on bf16 CPU)
        p_out[a:a + len(idx)] = torch.softmax(logits[:, draft_to_target].float(), dim=-1)
    arg = arg.view(b, t)
    return {"target_p": p_out, "row": row, "target_arg": arg, "in_vocab": arg >= 0}


def vocab_maps(d2t, t2d):
    """(draft_to_target [Dv]: the target id of each draft id, target_to_draft [V]: the draft id of each
    target id, -1 outside the draft vocab), on d2t's device."""
    dv = d2t.shape[0]
    draft_to_target = torch.arange(dv, device=d2t.device) + d2t
    target_to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.int64, device=d2t.device)
    target_to_draft[draft_to_target] = torch.arange(dv, device=d2t.device)
    return draft_to_target, target_to_draft


def supervised_rows(loss_mask):
    """(where [M]: the flat (b, t) positions with loss_mask, in order; row [B, T]: each position's index
    into them, -1 where loss_mask is 0): the layout of a teacher's target_p rows."""
    where = loss_mask.reshape(-1).nonzero().squeeze(1)
    row = torch.full((loss_mask.numel(),), -1, dtype=torch.int64, device=loss_mask.device)
    row[where] = torch.arange(len(where), device=loss_mask.device)
    return where, row.view(loss_mask.shape)


def step_counts(teacher: dict, ttt_steps: int):
    """[K] int64: positions whose loss step k covers (label s = t+1+k supervised and draftable)."""
    return torch.stack([teacher["in_vocab"][:, 1 + k:].sum() for k in range(ttt_steps)])


def teacher_from_topk(topk_ids, topk_logits, d2t, t2d, loss_mask) -> dict:
    """topk_ids [B, T, k] int64 target ids (largest logit first), topk_logits [B, T, k] float,
    d2t [Dv], t2d [V], loss_mask [B, T] bool. Returns target_p [M, Dv] float32, row [B, T],
    target_arg [B, T] (draft id of the top-1 target id, -1 when not draftable or not supervised),
    in_vocab [B, T] (see teacher_targets)."""
    b, t, _ = topk_ids.shape
    dev = topk_ids.device
    _, target_to_draft = vocab_maps(d2t.to(dev), t2d)
    where, row = supervised_rows(loss_mask)
    ids = target_to_draft[topk_ids.reshape(b * t, -1)[where]]                 # [M, k] draft ids, -1 outside
    logits = topk_logits.reshape(b * t, -1)[where].float().masked_fill(ids < 0, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)                     # a row with no draftable entry: 0
    target_p = torch.zeros(len(where), d2t.shape[0], dtype=torch.float32, device=dev)
    target_p.scatter_add_(1, ids.clamp_min(0), probs)                         # -1 entries add 0 at column 0
    arg = torch.full((b * t,), -1, dtype=torch.int64, device=dev)
    arg[where] = ids[:, 0]
    arg = arg.view(b, t)
    return {"target_p": target_p, "row": row, "target_arg": arg, "in_vocab": arg >= 0}
