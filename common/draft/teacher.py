"""The teacher from stored top-k logits (02b feature format teacher "topk"), same contract as
common/draft/loss.teacher_targets (which computes it from the final hidden state and the lm_head).

02b stores, per position, the target's k largest logits over its FULL vocab (ids + values). The draft
learns the target's distribution restricted to the draft vocab, renormalised; with top-k it is the
softmax over the stored entries whose ids are in the draft vocab (the tail beyond the k-th logit is
dropped: for greedy-like text the top 32 hold nearly all the mass). The target's argmax is the top-1
id; a position whose argmax is not draftable is dropped from the loss, as with the full teacher.
No lm_head is needed in 04 (Kimi: 2.35 GB less GPU memory) and no [T, V] logits are ever built.
"""
from __future__ import annotations

import torch

from common.draft.loss import supervised_rows, vocab_maps


def teacher_from_topk(topk_ids, topk_logits, d2t, t2d, loss_mask) -> dict:
    """topk_ids [B, T, k] int64 target ids (largest logit first), topk_logits [B, T, k] float,
    d2t [Dv], t2d [V], loss_mask [B, T] bool. Returns target_p [M, Dv] float32, row [B, T],
    target_arg [B, T] (draft id of the top-1 target id, -1 when not draftable or not supervised),
    in_vocab [B, T] (see loss.teacher_targets)."""
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
