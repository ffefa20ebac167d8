"""EAGLE-3 TTT loss: per-step soft cross-entropy against a teacher (common/training/teacher.py), accuracy,
simulated tau.

Only supervised positions (loss_mask: tokens the target generated) are labels, so the draft's lm_head and the soft cross-entropy are computed for those rows alone; prompt rows cost
nothing past the decoder layer. The soft cross-entropy is one autograd function that keeps only the
logits and one log-sum-exp per row for its backward (no float32 copies of [rows, Dv]).

Objectives (ttt_loss `objective`, 04 `--loss`): "kl" is the EAGLE soft cross-entropy (forward KL up to the
teacher's entropy, a constant). "lk_alpha" and "lk_lambda" are the LK losses of Samarin et al., "LK Losses:
Direct Acceptance Rate Optimization for Speculative Decoding" (arXiv 2602.23881), which target the
speculative-sampling acceptance rate of a position directly: alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)
(p the teacher's distribution over the draft vocab, q the draft's softmax).
  lk_alpha:  -log(alpha) per supervised position (the paper's LK^alpha)
  lk_lambda: lam * KL + (1 - lam) * (1 - alpha) per position, lam = exp(-LK_ETA * mean alpha) with the
             mean taken over the step's supervised rows of the whole global batch (every data-parallel
             rank's) and detached (the paper's LK^lambda: KL while the draft is poor, the acceptance itself
             as it improves).
Both use the same per-step decay, valid rows and denominators as "kl". Form and defaults as in the
authors' SpecForge implementation (sgl-project/SpecForge PR #492, specforge/core/lk_loss.py: the mean of
-log alpha over positions; kl_weight = exp(-decay * batch-mean alpha), detached; compute_acceptance_rate
passes the masked sum and count through its reduce_fn, the data-parallel all-reduce, before dividing) and
NVIDIA Model-Optimizer's masked_lk_lambda_loss (eta = 3, "sections 4.2 and 4.4"). Why the reduction: a
per-rank mean gives each rank its own lam, so 8 GPUs would train another objective than 1 on the same
global batches, and a resume on another world size would change the run. The KL term here is the soft-CE,
whose gradient is the KL's. The logged loss_sum stays the soft-CE under every objective, so logs remain
comparable.
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
OBJECTIVES = ("kl", "lk_alpha", "lk_lambda")
LK_ETA = 3.0           # lk_lambda: lam = exp(-LK_ETA * mean alpha) (Model-Optimizer's eta default; SpecForge's is 1)
LK_ALPHA_FLOOR = 1e-12  # lk_alpha: -log(max(alpha, floor)); a row of zero overlap (e.g. a top-k teacher row
                        # with no draftable entry: never a valid row) stays finite and gets no gradient


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


class _SoftCrossEntropyAcceptance(torch.autograd.Function):
    """(ce [N], alpha [N], argmax [N]) of logits [N, Dv] against p[r] = target_p[rows[r]]: the soft-CE
    (as _SoftCrossEntropy) and the acceptance rate alpha[r] = sum_v min(p[r, v], q[r, v]), q = softmax(
    logits[r]). Both differentiable:
      d ce / d logits    = q - p
      d alpha / d logits = q * (m - sum_v m_v q_v),  m_v = [q_v < p_v]  (d min(p, q)/dq = 1 where q < p)
    The backward rebuilds q chunk by chunk from the logits and the saved log-sum-exp (no [N, Dv] tensor
    is kept between passes); an output that nothing used gets no work. Computes in float32, or in the
    logits' dtype when wider (float64: gradcheck)."""

    @staticmethod
    def forward(ctx, logits, target_p, rows):
        n = logits.shape[0]
        dt = torch.promote_types(logits.dtype, torch.float32)
        ce = torch.empty(n, dtype=dt, device=logits.device)
        lse, alpha = torch.empty_like(ce), torch.empty_like(ce)
        arg = torch.empty(n, dtype=torch.int64, device=logits.device)
        step, labels = _chunk_rows(logits), _label_rows(target_p, rows)
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, n, step):
                z, p = logits[a:a + step].to(dt), labels(a, a + step).to(dt)      # [c, Dv]
                top, arg[a:a + step] = z.max(-1)
                q = (z - top.unsqueeze(-1)).exp_()
                s = q.sum(-1)
                lse[a:a + step] = top + s.log()
                ce[a:a + step] = lse[a:a + step] - torch.linalg.vecdot(p, z)
                q.div_(s.unsqueeze(-1))                                        # softmax
                alpha[a:a + step] = torch.minimum(q, p, out=q).sum(-1)
        ctx.save_for_backward(logits, target_p, rows, lse)
        ctx.mark_non_differentiable(arg)
        ctx.set_materialize_grads(False)
        return ce, alpha, arg

    @staticmethod
    def backward(ctx, grad_ce, grad_alpha, _grad_arg):
        if grad_ce is None and grad_alpha is None:
            return None, None, None
        logits, target_p, rows, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        step, labels = _chunk_rows(logits), _label_rows(target_p, rows)
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, logits.shape[0], step):
                b = a + step
                q = (logits[a:b].to(lse.dtype) - lse[a:b, None]).exp_()          # softmax
                p, g = labels(a, b), None
                if grad_alpha is not None:
                    g = torch.where(q < p, q, 0.0)                              # m * q
                    g.addcmul_(q, g.sum(-1, keepdim=True), value=-1.0).mul_(grad_alpha[a:b, None])
                if grad_ce is not None:
                    q.sub_(p).mul_(grad_ce[a:b, None])                          # (q - p) * grad_ce
                    g = q if g is None else g.add_(q)
                grad[a:b] = g
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


def soft_cross_entropy_acceptance(logits, target_p, rows):
    """(ce [N], alpha [N] acceptance rate, argmax [N]) of logits [N, Dv] against the rows `rows` [N] of
    target_p [M, Dv]; ce and alpha are differentiable."""
    return _SoftCrossEntropyAcceptance.apply(logits, target_p, rows)


def ttt_loss(step_hidden: list, head, teacher: dict, loss_mask, denominators, decay: float = STEP_DECAY,
             objective: str = "kl", reduce=None):
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
    objective (OBJECTIVES): "kl" as above; "lk_alpha" / "lk_lambda" replace the per-position soft-CE in
    loss_k by the LK losses (module docstring: -log alpha, or lam * soft-CE + (1 - lam) * (1 - alpha)),
    same rows, decay and denominators. stats' loss_sum is the summed soft-CE under every objective.
    reduce: a tensor -> its sum over the data-parallel ranks (common/training/distributed.all_sum; None =
    this process alone); lk_lambda's mean alpha goes through it, one call per unroll, on every rank alike.
    Returns (total = sum_k decay^k loss_k, stats dict of per-step lists of scalar tensors:
    loss_sum, num_loss, correct, num_acc).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {OBJECTIVES}")
    total = 0.0
    stats = {"loss_sum": [], "num_loss": [], "correct": [], "num_acc": []}
    lam_terms = []   # lk_lambda: (k, soft-CE sum, alpha, valid) per step, combined once lam is known
    for k, hidden in enumerate(step_hidden):
        s = 1 + k
        bi, ti = loss_mask[:, s:].nonzero(as_tuple=True)                     # queries with a label
        label = (bi, ti + s)
        valid = teacher["in_vocab"][label]                                   # [N]
        if objective == "kl":
            ce, arg = soft_cross_entropy(head(hidden[bi, ti]), teacher["target_p"], teacher["row"][label])
            loss_sum = (ce * valid).sum()
            total = total + decay ** k * loss_sum / denominators[k]
        else:
            ce, alpha, arg = soft_cross_entropy_acceptance(head(hidden[bi, ti]), teacher["target_p"],
                                                           teacher["row"][label])
            loss_sum = (ce * valid).sum()
            if objective == "lk_alpha":
                objective_sum = torch.where(valid, -alpha.clamp_min(LK_ALPHA_FLOOR).log(), 0.0).sum()
                total = total + decay ** k * objective_sum / denominators[k]
            else:
                lam_terms.append((k, loss_sum, alpha, valid))
        stats["loss_sum"].append(loss_sum.detach())
        stats["num_loss"].append(valid.sum())
        stats["correct"].append(((arg == teacher["target_arg"][label]) & valid).sum())
        stats["num_acc"].append(torch.tensor(len(bi), device=bi.device))
    if lam_terms:
        total = total + _lk_lambda(lam_terms, denominators, decay, reduce)
    return total, stats


def _lk_lambda(terms: list, denominators, decay: float, reduce):
    """sum_k decay^k (lam_k soft-CE_k + (1 - lam_k) sum_rows (1 - alpha)) / denominators[k], lam_k =
    exp(-LK_ETA * mean alpha of step k), detached: the masked sums and counts of all steps [K, 2] summed
    over the ranks by `reduce` in one call, so every rank weighs its rows by the global batch's lam."""
    sums = torch.stack([torch.stack([(alpha.detach() * valid).sum(), valid.sum().to(alpha.dtype)])
                        for _, _, alpha, valid in terms])
    sums = sums if reduce is None else reduce(sums)
    total = 0.0
    for (k, loss_sum, alpha, valid), (num, count) in zip(terms, sums):
        lam = torch.exp(-LK_ETA * num / count.clamp(min=1))
        total = total + decay ** k * (lam * loss_sum + (1 - lam) * ((1 - alpha) * valid).sum()) / denominators[k]
    return total


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
