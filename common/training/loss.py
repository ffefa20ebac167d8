"""EAGLE-3 TTT loss: per-step soft cross-entropy against a teacher (common/training/teacher.py), accuracy,
simulated tau.

Only supervised positions (loss_mask: tokens the target generated) are labels, so the draft's lm_head and the soft cross-entropy are computed for those rows alone; prompt rows cost
nothing past the decoder layer. The soft cross-entropy is one autograd function that keeps only the
logits and one log-sum-exp per row for its backward (no float32 copies of [rows, Dv]).
"""
from __future__ import annotations

import torch

STEP_DECAY = 0.8  # loss = sum_k 0.8^k * loss_k (official EAGLE main.py, SpecForge ploss_decay)
# What each step's summed soft-CE is divided by: "supervised" = the positions that step's loss covers
# (a mean per supervised position); "batch" = samples x padded length of the batch, B*T (SpecForge).
NORMALIZATIONS = ("supervised", "batch")
# rows x vocab per chunk of the soft-CE's float32 temporaries: on a CPU small enough to stay in cache
# across the passes over a chunk (measured 2-3x faster than 64 MB chunks), on a GPU large (fewer launches)
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 26}


class _SoftCrossEntropy(torch.autograd.Function):
    """ce[r] = -sum_v p[r, v] log softmax(logits[r])_v = lse(logits[r]) - p[r] . logits[r] (sum_v p = 1),
    with p[r] = target_p[rows[r]]; also the argmax of each row (not differentiable). The gradient
    softmax(logits) - p is rebuilt in the backward from the logits and the saved log-sum-exp, chunk by
    chunk, so no [N, Dv] float32 tensor is ever held."""

    @staticmethod
    def forward(ctx, logits, target_p, rows):
        n, dv = logits.shape
        ce = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse, arg = torch.empty_like(ce), torch.empty(n, dtype=torch.int64, device=logits.device)
        step, labels = _chunk_rows(logits), _label_rows(target_p, rows)
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, n, step):
                q = logits[a:a + step].float()                                  # [c, Dv]
                top, arg[a:a + step] = q.max(-1)
                dot = torch.linalg.vecdot(labels(a, a + step), q)                # p . logits
                lse[a:a + step] = top + (q - top.unsqueeze(-1)).exp_().sum(-1).log_()
                ce[a:a + step] = lse[a:a + step] - dot
        ctx.save_for_backward(logits, target_p, rows, lse)
        ctx.mark_non_differentiable(arg)
        return ce, arg

    @staticmethod
    def backward(ctx, grad_ce, _grad_arg):
        logits, target_p, rows, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        step, labels = _chunk_rows(logits), _label_rows(target_p, rows)
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, logits.shape[0], step):
                g = (logits[a:a + step].float() - lse[a:a + step, None]).exp_()   # softmax
                g.sub_(labels(a, a + step)).mul_(grad_ce[a:a + step, None])
                grad[a:a + step] = g
        return grad, None, None


def _label_rows(target_p, rows):
    """(a, b) -> target_p[rows[a:b]]: a view when the rows are one contiguous range (one sample with a
    contiguous supervised span, the common case), a gather otherwise."""
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool((rows[1:] > rows[:-1]).all()):
        first = int(rows[0])
        return lambda a, b: target_p[first + a:first + min(b, len(rows))]
    return lambda a, b: target_p[rows[a:b]]


def _chunk_rows(logits) -> int:
    return max(1, CHUNK_ELEMENTS.get(logits.device.type, 1 << 26) // logits.shape[1])


def soft_cross_entropy(logits, target_p, rows):
    """(ce [N] float32, argmax [N]) of logits [N, Dv] against the rows `rows` [N] of target_p [M, Dv]."""
    return _SoftCrossEntropy.apply(logits, target_p, rows)


def ttt_loss(step_hidden: list, head, teacher: dict, loss_mask, denominators, decay: float = STEP_DECAY):
    """Total loss and per-step counts of a TTT unroll.

    step_hidden: per step k, the draft's pre-norm output [B, T, H]; head: pre-norm output [N, H] ->
    draft logits [N, Dv] (the draft's norm + lm_head). Step k, query position t is labelled by
    position s = t+1+k: the label is the teacher's distribution at s, supervised when loss_mask[s]
    (s is a token the target generated) and the target's argmax at s is in the draft vocab; only the
    rows with loss_mask[s] reach the head. loss_k = sum of the soft cross-entropy -sum_v p(v) log q(v)
    over those positions / denominators[k] (see NORMALIZATIONS; the caller sums it over data-parallel
    ranks). acc_k counts draft argmax == target argmax (as a draft id) over positions with
    loss_mask[s]; an out-of-vocab target argmax counts as a miss (the draft can never propose it), as
    in the official EAGLE accuracy.
    Returns (total = sum_k decay^k loss_k, stats dict of per-step lists of scalar tensors:
    loss_sum, num_loss, correct, num_acc).
    """
    total = 0.0
    stats = {"loss_sum": [], "num_loss": [], "correct": [], "num_acc": []}
    for k, hidden in enumerate(step_hidden):
        s = 1 + k
        bi, ti = loss_mask[:, s:].nonzero(as_tuple=True)                     # queries with a label
        label = (bi, ti + s)
        valid = teacher["in_vocab"][label]                                   # [N]
        ce, arg = soft_cross_entropy(head(hidden[bi, ti]), teacher["target_p"], teacher["row"][label])
        loss_sum = (ce * valid).sum()
        total = total + decay ** k * loss_sum / denominators[k]
        stats["loss_sum"].append(loss_sum.detach())
        stats["num_loss"].append(valid.sum())
        stats["correct"].append(((arg == teacher["target_arg"][label]) & valid).sum())
        stats["num_acc"].append(torch.tensor(len(bi), device=bi.device))
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
    """Sums per-step counts over batches (on the stats' device: no host sync per step); `summary()`
    gives loss_k, acc_k and simulated tau."""

    KEYS = ("loss_sum", "num_loss", "correct", "num_acc")

    def __init__(self, ttt_steps: int):
        self.k = ttt_steps
        self.sums = torch.zeros(len(self.KEYS), ttt_steps, dtype=torch.float64)  # [4, K]

    def add(self, stats: dict) -> None:
        rows = torch.stack([torch.stack([torch.as_tensor(v) for v in stats[key]]).to(torch.float64)
                            for key in self.KEYS])
        self.sums = self.sums.to(rows.device) + rows

    def summary(self) -> dict:
        s = dict(zip(self.KEYS, self.sums.tolist()))
        loss = [s["loss_sum"][i] / max(s["num_loss"][i], 1) for i in range(self.k)]
        acc = [s["correct"][i] / max(s["num_acc"][i], 1) for i in range(self.k)]
        return {"loss": loss, "acc": acc, "tau": simulated_tau(acc),
                "num_supervised": int(s["num_acc"][0])}
