"""common/benchmark/replay.py: the replayed rounds equal the step-by-step loop's, statistic for statistic."""
from __future__ import annotations

import pytest
import torch

from common.benchmark import replay as rp
from common.benchmark import spec_decode as sd

# The micro target, its prompts and the one-thread setting are 05's test fixtures (same module scope).
from tests.test_05_benchmark import POINTS, one_thread, prompts, random_draft, target  # noqa: E402,F401


class PlantedDraft:
    """Both surfaces of a draft (the loop's `step`, the TTT `forward` + `logits`) proposing, for token
    position q, the target's greedy token seq[q] - except at `wrong` positions, where it proposes
    another token. Its proposals depend on the position only, so loop and replay must count the same
    rounds; anything else is an accounting difference."""

    def __init__(self, seq, vocab, wrong):
        self.seq, self.vocab, self.wrong = seq, vocab, set(wrong)

    def propose(self, q):
        tok = self.seq[q] if q < len(self.seq) else 0
        return (tok + 1) % self.vocab if q in self.wrong else tok

    def project(self, aux):
        return aux

    def draft_to_target(self, ids):
        return ids

    def step(self, hidden, input_ids, position_ids, cache):
        pos = position_ids[0].tolist()
        marks = torch.zeros(1, 1, len(pos), 1)
        cache.update(0, marks, marks)
        logits = torch.zeros(1, len(pos), self.vocab)
        logits[0, torch.arange(len(pos)), [self.propose(p + 2) for p in pos]] = 1.0  # RoPE pos p -> token p+2
        return logits, torch.zeros_like(hidden)

    def __call__(self, aux, ids, num_steps):
        t = ids.shape[1]
        return [torch.full((1, t, 1), float(k)) for k in range(num_steps)]   # step k, every anchor

    def logits(self, h):
        k, t = int(h[0, 0, 0]), h.shape[1]
        out = torch.zeros(1, t, self.vocab)
        out[0, torch.arange(t), [self.propose(a + 2 + k) for a in range(t)]] = 1.0  # anchor a, step k
        return out


def loop_and_replay(target, draft, ids, k, max_new, eos):
    loop = sd.speculative_decode(target, draft, ids, k, max_new, eos, POINTS)
    cont, _ = sd.greedy_decode(target, ids, max_new, eos)
    seq = ids + cont
    aux, argmax = rp.target_features(target, seq, POINTS)
    assert argmax[len(ids) - 1:-1] == cont  # the teacher-forced forward agrees with greedy decoding
    pred = rp.draft_predictions(draft, aux, seq, k)
    return loop, rp.replay(pred, seq, len(ids), k, max_new, eos)


@pytest.mark.parametrize("k,max_new", [(1, 12), (3, 17), (5, 30)])
def test_replay_equals_loop_with_planted_misses(target, prompts, k, max_new):
    for i, ids in enumerate(prompts):
        n = len(ids)
        seq = ids + sd.greedy_decode(target, ids, max_new, set())[0]
        wrong = {n + 2 + 3 * i, n + 5, n + 6, n + 11, n + 19}
        draft = PlantedDraft(seq, target.config.vocab_size, wrong)
        loop, rep = loop_and_replay(target, draft, ids, k, max_new, set())
        assert (rep.tokens, rep.drafted, rep.accepted, rep.emitted) == \
               (loop.tokens, loop.drafted, loop.accepted, loop.emitted), (i, k)
    assert any(a == k for a in loop.accepted) and any(a < k for a in loop.accepted)


def test_replay_equals_loop_when_an_accepted_draft_ends_the_turn(target, prompts):
    """End-of-turn inside an accepted chain, and as the round's own target token."""
    ids, max_new, k = prompts[0], 24, 4
    cont = sd.greedy_decode(target, ids, max_new, set())[0]
    seq = ids + cont
    for stop_at in (6, 9, 13):
        eos = {cont[stop_at]} - set(cont[:stop_at])
        if not eos:
            continue
        draft = PlantedDraft(seq, target.config.vocab_size, {len(ids) + 3})
        loop, rep = loop_and_replay(target, draft, ids, k, max_new, eos)
        assert loop.tokens[-1] in eos
        assert (rep.tokens, rep.drafted, rep.accepted, rep.emitted) == \
               (loop.tokens, loop.drafted, loop.accepted, loop.emitted), stop_at


def test_replay_equals_loop_with_real_drafts(target, prompts, tmp_path):
    """Exported Eagle3 drafts (random init, several seeds): the real forward surfaces, end to end."""
    eos = sd.eos_ids_of(target.config)
    for seed in (0, 1):
        draft = random_draft(target, tmp_path / f"export{seed}", seed=seed)
        for ids in prompts:
            for k in (2, 5):
                loop, rep = loop_and_replay(target, draft, ids, k, 14, eos)
                assert (rep.tokens, rep.drafted, rep.accepted, rep.emitted) == \
                       (loop.tokens, loop.drafted, loop.accepted, loop.emitted)


def test_bootstrap_intervals():
    num, den = [10, 20, 30, 40] * 10, [5, 10, 10, 20] * 10
    lo, hi = rp.bootstrap_ratio(num, den)
    tau = sum(num) / sum(den)
    assert lo < tau < hi and hi - lo < 0.5
    assert rp.bootstrap_ratio([3] * 8, [2] * 8) == (1.5, 1.5)
    same = rp.bootstrap_paired_difference(num, den, num, den)
    assert same["difference"] == 0 and same["ci"] == [0, 0]
    better = rp.bootstrap_paired_difference([n + 2 for n in num], den, num, den)
    assert better["difference"] > 0 and better["ci"][0] > 0 and better["relative_ci"][0] > 0
