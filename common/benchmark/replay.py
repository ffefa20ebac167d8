"""Greedy acceptance without a target forward per round: replay the draft against the target's fixed
greedy continuation, and bootstrap intervals over prompts.

Why this is exact (greedy, chain drafts, k tokens per round). In common/benchmark/spec_decode.py a round
starts with n_ctx target-backed positions and the pending token x[n_ctx]; the draft's chain step j
(0-based) sits at anchor t = n_ctx - 1, attends to the step-0 entries of positions <= t (built from the
target's features) plus its own chain entries, reads token x[t+1+j] at RoPE position t+j and proposes
x[t+2+j]. The round accepts the longest prefix of proposals equal to the target's greedy tokens. Up
to the first rejection every proposal IS the greedy token, so the chain inputs equal the teacher-forced
inputs of the training-time-test unroll (common/draft/model.py forward) at anchor t, step j; after the
first rejection nothing counts. Hence one target forward over prompt + greedy continuation (all
features) and one TTT forward of the draft give every round's acceptance: `draft_predictions`
[K, L] holds the draft's argmax (as a target id) at every anchor and step, and `replay` walks the
rounds with exactly the loop's accounting (token budget, end-of-turn, correction/bonus token). The
step-by-step loop stays the lossless check; tests prove both give the same statistics.
"""
from __future__ import annotations

import random

import torch

from common.benchmark.spec_decode import SpecResult, commit_round, target_forward


@torch.no_grad()
def target_features(target, seq: list[int], capture_points: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One teacher-forced target forward over `seq`: (aux [1, L, 3H], argmax [L] = the target's greedy
    next token after each prefix)."""
    logits, aux = target_forward(target, torch.tensor([seq], device=target.device), None, capture_points)
    return aux, logits[0].argmax(-1).tolist()


def union_points(points: list[int], draft_points: dict | None) -> list[int]:
    """The points to capture once so every draft finds its own: `points` and each of `draft_points`'
    values ({name: points}, drafts that read others), ascending."""
    return sorted(set(points).union(*(draft_points or {}).values()))


def select_points(aux: torch.Tensor, have: list[int], want: list[int]) -> torch.Tensor:
    """aux [.., len(have) * H] captured at `have` -> the columns of `want` (a subset), in want's order:
    the features a draft reading `want` gets from one forward at the union of every draft's points."""
    if list(want) == list(have):
        return aux
    return aux.unflatten(-1, (len(have), -1))[..., [have.index(p) for p in want], :].flatten(-2)


@torch.no_grad()
def draft_predictions(draft, aux: torch.Tensor, seq: list[int], num_steps: int) -> torch.Tensor:
    """[K, L] target ids: row j, column t = the draft's greedy proposal for token t+2+j at anchor t,
    given the true tokens up to t+1+j (the TTT unroll with teacher-forced inputs)."""
    ids = torch.tensor([seq], device=aux.device)
    outs = draft(aux, ids, num_steps)                         # K x [1, L, H] pre-norm outputs
    return torch.stack([draft.draft_to_target(draft.logits(h)[0].argmax(-1)) for h in outs])


def replay(pred: torch.Tensor, seq: list[int], num_prompt: int, num_draft_tokens: int,
           max_new_tokens: int, eos_ids: set[int]) -> SpecResult:
    """The rounds of spec_decode.speculative_decode, from predictions instead of forwards.

    seq = prompt (num_prompt ids) + the target's greedy continuation, which ends at the first
    end-of-turn token or after max_new_tokens. pred: draft_predictions(..., K >= num_draft_tokens).
    """
    k = num_draft_tokens
    assert pred.shape[0] >= k, (pred.shape, k)
    pred = pred[:k].tolist()
    cont = seq[num_prompt:]
    assert cont, "empty continuation"
    res = SpecResult(tokens=[cont[0]])            # the prefill's token
    n_ctx = num_prompt                            # positions with target features; pending = seq[n_ctx]
    while seq[n_ctx] not in eos_ids and len(res.tokens) < max_new_tokens:
        k_eff = min(k, max_new_tokens - len(res.tokens) - 1)
        t = n_ctx - 1                             # anchor: the newest target-backed position
        a = 0
        while a < k_eff and pred[a][t] == seq[t + 2 + a]:
            a += 1
            if seq[t + 1 + a] in eos_ids:         # an accepted end-of-turn: the loop judges no more
                break
        # the a accepted drafts + the target's own token, counted exactly as the loop counts them
        if commit_round(res, seq[n_ctx + 1:n_ctx + 2 + a], a, k_eff, eos_ids, max_new_tokens):
            break
        n_ctx += a + 1
    assert res.tokens == cont[:len(res.tokens)], "replay left the greedy continuation"
    return res


def prompt_totals(results: list[SpecResult]) -> tuple[list[int], list[int]]:
    """Per prompt: (tokens committed in rounds, rounds). tau = sum(emitted) / sum(rounds)."""
    return [sum(r.emitted) for r in results], [len(r.emitted) for r in results]


def bootstrap_ratio(num: list[float], den: list[float], num_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float | None, float | None]:
    """Percentile interval of sum(num)/sum(den) when prompts are resampled with replacement."""
    n = len(num)
    if n == 0 or sum(den) == 0:
        return None, None
    rng = random.Random(seed)
    stats = []
    for _ in range(num_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        d = sum(den[i] for i in idx)
        if d:
            stats.append(sum(num[i] for i in idx) / d)
    stats.sort()
    return _quantile(stats, (1 - level) / 2), _quantile(stats, (1 + level) / 2)


def _quantile(sorted_values: list[float], p: float) -> float:
    """The p-quantile of an ascending list (the element at rank floor(p * n), clipped to the last)."""
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def bootstrap_paired_difference(num_a, den_a, num_b, den_b, num_boot: int = 2000, seed: int = 0,
                                level: float = 0.95) -> dict:
    """tau_a - tau_b over the SAME prompts (resampled together): the point difference, its interval,
    and the relative difference (tau_a / tau_b - 1) with its interval."""
    n = len(num_a)
    assert n == len(num_b) == len(den_a) == len(den_b) and n > 0
    rng = random.Random(seed)
    diffs, rels = [], []
    for _ in range(num_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        da, db = sum(den_a[i] for i in idx), sum(den_b[i] for i in idx)
        if da and db:
            ta, tb = sum(num_a[i] for i in idx) / da, sum(num_b[i] for i in idx) / db
            diffs.append(ta - tb)
            rels.append(ta / tb - 1)
    diffs.sort()
    rels.sort()
    lo, hi = (1 - level) / 2, (1 + level) / 2
    ta, tb = sum(num_a) / sum(den_a), sum(num_b) / sum(den_b)
    return {"difference": ta - tb, "ci": [_quantile(diffs, lo), _quantile(diffs, hi)],
            "relative": ta / tb - 1, "relative_ci": [_quantile(rels, lo), _quantile(rels, hi)]}
