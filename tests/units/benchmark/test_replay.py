"""common/benchmark/replay.py: the replayed rounds equal the step-by-step loop's, statistic for statistic."""
from __future__ import annotations

import pytest

from common.benchmark import replay as rp
from common.benchmark import spec_decode as sd

from tests.spec_helpers import POINTS, PlantedDraft, random_draft


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
