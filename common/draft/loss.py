"""EAGLE-3 TTT teacher (target distribution over the draft vocab), per-step loss/accuracy, simulated tau."""
from __future__ import annotations

import torch
import torch.nn.functional as F

STEP_DECAY = 0.8  # loss = sum_k 0.8^k * loss_k (official EAGLE main.py, SpecForge ploss_decay)


@torch.no_grad()
def teacher_targets(final, lm_head, d2t, t2d, chunk_rows: int = 1024) -> dict:
    """The target's view of every position, from its final post-norm hidden state.

    final [B, T, H] (the lm_head input the target stored), lm_head [V, H], d2t [Dv], t2d [V].
    Returns, per position s (the target's distribution at s, i.e. over token s+1):
      target_p    [B, T, Dv] float32  softmax of the target logits restricted to the draft vocab
                                      columns (renormalised), column i = target id i + d2t[i]
      target_arg  [B, T] int64        the target's argmax over the FULL vocab, as a draft id (-1 when
                                      it is not in the draft vocab)
      in_vocab    [B, T] bool         whether that argmax is in the draft vocab (else: dropped)
    Computed in row chunks: the full [rows, V] logits are the big tensor (Kimi V = 163840).
    """
    b, t, h = final.shape
    dv = d2t.shape[0]
    draft_to_target = torch.arange(dv, device=d2t.device) + d2t             # [Dv] target id of each row
    target_to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.int64, device=d2t.device)
    target_to_draft[draft_to_target] = torch.arange(dv, device=d2t.device)  # [V], -1 outside
    flat = final.reshape(b * t, h)
    p_out = torch.empty(b * t, dv, dtype=torch.float32, device=final.device)
    arg_out = torch.empty(b * t, dtype=torch.int64, device=final.device)
    for a in range(0, b * t, chunk_rows):
        logits = (flat[a:a + chunk_rows].to(lm_head.dtype) @ lm_head.T).float()  # [c, V]
        arg_out[a:a + chunk_rows] = target_to_draft[logits.argmax(-1)]
        p_out[a:a + chunk_rows] = torch.softmax(logits[:, draft_to_target], dim=-1)
    arg = arg_out.view(b, t)
    return {"target_p": p_out.view(b, t, dv), "target_arg": arg, "in_vocab": arg >= 0}


def ttt_loss(step_logits: list, teacher: dict, loss_mask, decay: float = STEP_DECAY):
    """Total loss and per-step counts for the logits of a TTT unroll.

    Step k, query position t is labelled by position s = t+1+k: the label is target_p[s], supervised
    when loss_mask[s] (s is a token the target generated) and the target's argmax at s is in the draft
    vocab; other positions contribute nothing. loss_k = mean over supervised positions of the soft
    cross-entropy -sum_v p(v) log q(v). acc_k counts draft argmax == target argmax (as a draft id)
    over positions with loss_mask[s]; an out-of-vocab target argmax counts as a miss (the draft can
    never propose it), as in the official EAGLE accuracy.
    Returns (total = sum_k decay^k loss_k, stats dict of per-step lists of scalar tensors:
    loss_sum, num_loss, correct, num_acc).
    """
    total = 0.0
    stats = {"loss_sum": [], "num_loss": [], "correct": [], "num_acc": []}
    seq_len = loss_mask.shape[1]
    for k, logits in enumerate(step_logits):
        s = 1 + k
        if s >= seq_len:
            zero = logits.new_zeros(())
            for key in stats:
                stats[key].append(zero.detach())
            total = total + 0.0 * logits.sum()  # keep the graph alive for an all-short batch
            continue
        q = logits[:, : seq_len - s].float()                                  # [B, T-s, Dv]
        p = teacher["target_p"][:, s:]                                        # [B, T-s, Dv]
        sup = loss_mask[:, s:]                                                # [B, T-s]
        valid = sup & teacher["in_vocab"][:, s:]
        ce = -(p * F.log_softmax(q, dim=-1)).sum(-1)                          # [B, T-s]
        num_loss = valid.sum()
        loss_sum = (ce * valid).sum()
        total = total + decay ** k * loss_sum / num_loss.clamp(min=1)
        correct = ((q.argmax(-1) == teacher["target_arg"][:, s:]) & valid).sum()
        stats["loss_sum"].append(loss_sum.detach())
        stats["num_loss"].append(num_loss)
        stats["correct"].append(correct)
        stats["num_acc"].append(sup.sum())
    return total, stats


def simulated_tau(accs: list[float]) -> float:
    """Expected accepted tokens per verify round of a greedy chain, plus the bonus token:
    1 + sum_k prod_{j<=k} acc_j (acc_j = per-step accuracy, treated as the acceptance rate)."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= a
        tau += run
    return tau


class TTTMeter:
    """Sums per-step counts over batches; `summary()` gives loss_k, acc_k and simulated tau."""

    def __init__(self, ttt_steps: int):
        self.k = ttt_steps
        self.sums = {key: [0.0] * ttt_steps for key in ("loss_sum", "num_loss", "correct", "num_acc")}

    def add(self, stats: dict) -> None:
        for key, values in stats.items():
            for i, v in enumerate(values):
                self.sums[key][i] += float(v)

    def summary(self) -> dict:
        s = self.sums
        loss = [s["loss_sum"][i] / max(s["num_loss"][i], 1) for i in range(self.k)]
        acc = [s["correct"][i] / max(s["num_acc"][i], 1) for i in range(self.k)]
        return {"loss": loss, "acc": acc, "tau": simulated_tau(acc),
                "num_supervised": int(s["num_acc"][0])}
