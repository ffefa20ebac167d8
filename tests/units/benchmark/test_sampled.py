"""common/benchmark/sampled.py + the sampled loop of spec_decode.py: acceptance under sampling.

The micro target is random and nearly uniform at T = 1 (max probability ~0.002); at T = 0.02 its mean
max probability is ~0.58, so the tests sample there: acceptances are neither all 0 nor all 1."""
from __future__ import annotations

import importlib
import json
import re

import pytest
import torch

from common.benchmark import replay as rp
from common.benchmark import sampled as smp
from common.benchmark import spec_decode as sd

from common.stage import BENCH, stage_dir
from tests.spec_helpers import POINTS, PlantedDraft, make_chain

T_SHARP = 0.02


class PrefixOracle:
    """A draft whose logits at every position are `scale` x the target's own logits given the true prefix:
    its argmax is the target's argmax (engine rule: accepted w.p. p_T(argmax)), its q = softmax(scale x
    logits / T) differs from p when scale != 1 (textbook rule). Both surfaces: the loop's `step` rebuilds
    the prefix from the tokens it is fed (row at position p carries token p+1; token 0 is the prompt's),
    the TTT `__call__` + `logits` read one forward over the whole sequence."""

    def __init__(self, target, first_token: int, scale: float = 1.0):
        self.target, self.scale, self.toks, self.memo = target, scale, [first_token], {}

    def project(self, aux):
        return aux

    def draft_to_target(self, ids):
        return ids

    def _logits(self, seq):
        with torch.no_grad():
            return self.target(input_ids=torch.tensor([seq])).logits[0].float()   # [L, V]

    def step(self, hidden, input_ids, position_ids, cache):
        pos = position_ids[0].tolist()
        del self.toks[cache.length + 1:]                     # the loop cropped its cache: forget those tokens
        for p, tok in zip(pos, input_ids[0].tolist()):
            assert len(self.toks) == p + 1, (len(self.toks), p)
            self.toks.append(tok)
        marks = torch.zeros(1, 1, len(pos), 1)
        cache.update(0, marks, marks)
        if any(tuple(self.toks[:p + 2]) not in self.memo for p in pos):   # prefixes recur after rollbacks
            full = self._logits(self.toks)                    # row r: the target after toks[..r]
            self.memo.update({tuple(self.toks[:r + 1]): full[r] for r in range(len(self.toks))})
        rows = torch.stack([self.memo[tuple(self.toks[:p + 2])] for p in pos])
        return self.scale * rows[None], torch.zeros_like(hidden)

    def __call__(self, aux, ids, num_steps):
        full = self._logits(ids[0].tolist())                  # [L, V]
        pad = torch.zeros(num_steps + 1, full.shape[1])
        rows = torch.cat([full, pad])                         # step j, anchor t: row t+1+j
        return [rows[1 + j:1 + j + full.shape[0]][None] for j in range(num_steps)]

    def logits(self, h):
        return self.scale * h


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (6,), generator=g).tolist() for _ in range(n)]


def test_sampling_probs_tempers_before_top_p_and_renormalises():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(sd.sampling_probs(logits, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # T = 1, top-p 0.8: the mass above 0.15 is 0.8, not < 0.8 -> the nucleus is {0.5, 0.3}.
    assert torch.allclose(sd.sampling_probs(logits, 1.0, 0.8), torch.tensor([0.625, 0.375, 0, 0]))
    # T = 0.5 first (p^2 renormalised: 0.685, 0.247, 0.062, 0.007), THEN top-p 0.9: {0.685, 0.247}. The
    # classic mistake (top-p on the untempered p, then tempering) keeps three tokens here.
    got = sd.sampling_probs(logits, 0.5, 0.9)
    assert torch.allclose(got, torch.tensor([0.25, 0.09, 0, 0]) / 0.34, atol=1e-6)
    assert torch.allclose(got.sum(), torch.tensor(1.0))
    assert sd.sampling_probs(torch.tensor([3.0, 1.0]), 1.0, 0.01).tolist() == [1.0, 0.0]  # the top one always stays


def test_expected_rounds_with_certain_acceptance_equal_replay(target, prompts):
    """0/1 acceptances (the engine rule along a continuation): the walk over positions gives replay.replay's
    integer counts exactly - budget, planted misses and end-of-turn included."""
    k_max = 5
    for i, ids in enumerate(prompts):
        cont = sd.greedy_decode(target, ids, 30, set())[0]
        seq, n = ids + cont, len(ids)
        for eos in (set(), {cont[9]} - set(cont[:9])):
            draft = PlantedDraft(seq, target.config.vocab_size, {n + 2 + 3 * i, n + 5, n + 6, n + 11, n + 19})
            aux, _ = rp.target_features(target, seq, POINTS)
            pred = rp.draft_predictions(draft, aux, seq, k_max)
            cut = seq[:n + next((j + 1 for j, t in enumerate(cont) if t in eos), len(cont))]
            accept = [[float(t + 2 + j < len(cut) and pred[j][t] == cut[t + 2 + j]) for t in range(len(cut))]
                      for j in range(k_max)]
            for k in (1, 3, 5):
                ref = rp.replay(pred, cut, n, k, 30, eos)
                got = smp.expected_rounds(accept, accept, cut, n, k, 30, eos)
                stats = sd.acceptance_stats([ref], k)
                assert got.rounds == len(ref.emitted) and got.emitted == sum(ref.emitted), (i, k, eos)
                assert got.histogram == stats["accept_length_histogram"]
                assert got.reached == stats["per_position_reached"]
                assert smp.expected_stats([got], k)["per_position_acceptance"] == stats["per_position_acceptance"]


def test_expected_rounds_arithmetic():
    """A hand-checked case: k = 2, every acceptance 0.5, no eos, a budget of 4 tokens."""
    seq = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    accept = [[0.5] * len(seq), [0.5] * len(seq)]
    got = smp.expected_rounds(accept, accept, seq, 1, 2, 4, set())
    # Budget 4 tokens: the prefill's + 3. Round 1 (k_eff 2) commits 1, 2 or 3 (p 0.5, 0.25, 0.25); after 1
    # the next round has k_eff 1 (commits 1 or 2), after 2 a last round with k_eff 0 commits 1, after 3 done.
    rounds = 1 + 0.5 * (1 + 0.5) + 0.25
    assert got.rounds == pytest.approx(rounds)
    assert got.emitted == pytest.approx(3.0)               # every path commits exactly the 3 remaining tokens
    assert got.histogram == pytest.approx([0.5 + 0.25 + 0.5, 0.25 + 0.25, 0.25])   # k_eff 0: a = 0


def test_sampled_loop_is_seeded_and_replay_along_its_output_gives_its_rounds(target, prompts):
    """Engine rule: a draft is accepted exactly when the committed token equals it, so replay along the loop's
    own output reproduces every round. Same seed, same output; another seed, another output."""
    params = sd.SamplingParams(T_SHARP, 0.9)
    outputs = []
    for ids in prompts:
        for seed in (0, 1):
            res = sd.speculative_decode(target, PrefixOracle(target, ids[0]), ids, 3, 16, set(), POINTS, params,
                                        smp.generator("cpu", seed))
            seq = ids + res.tokens
            pred = rp.draft_predictions(PrefixOracle(target, ids[0]), torch.zeros(1, len(seq), 1), seq, 3)
            walk = rp.replay(pred, seq, len(ids), 3, 16, set())
            assert (walk.accepted, walk.emitted) == (res.accepted, res.emitted), (ids, seed)
            outputs.append(res.tokens)
    again = sd.speculative_decode(target, PrefixOracle(target, prompts[0][0]), prompts[0], 3, 16, set(), POINTS,
                                  params, smp.generator("cpu", 0))
    assert again.tokens == outputs[0] and outputs[0] != outputs[1]
    assert {a for r in [again] for a in r.accepted} - {0}           # some drafts accepted, some not
    s1 = sd.sample_decode(target, prompts[0], 20, set(), params, smp.generator("cpu", 5))
    assert s1 == sd.sample_decode(target, prompts[0], 20, set(), params, smp.generator("cpu", 5))
    assert smp.prompt_seed(0, prompts[0], params, "replay") != smp.prompt_seed(0, prompts[0], params, "loop/k3")
    assert smp.prompt_seed(0, prompts[0], params, "replay") != smp.prompt_seed(1, prompts[0], params, "replay")


def loop_vs_replay(target, rule: str, scale: float, k: int, n: int, max_new: int = 12,
                   replay_temperatures=(T_SHARP,)):
    """The sampled loop at T_SHARP on n prompts against the replay's prediction at each of
    `replay_temperatures` (independent seeds): {T: (paired bootstrap of loop tau - replay tau, replay stats)}
    and the loop's stats."""
    loop_p = sd.SamplingParams(T_SHARP, 1.0, rule)
    loops, preds = [], {t: [] for t in replay_temperatures}
    for ids in random_prompts(n, target.config.vocab_size):
        g = smp.generator("cpu", smp.prompt_seed(0, ids, loop_p, f"loop/k{k}"))
        loops.append(sd.speculative_decode(target, PrefixOracle(target, ids[0], scale), ids, k, max_new, set(),
                                           POINTS, loop_p, g))
        for t in replay_temperatures:
            rep_p = sd.SamplingParams(t, 1.0, rule)
            cont = sd.sample_decode(target, ids, max_new, set(), rep_p,
                                    smp.generator("cpu", smp.prompt_seed(0, ids, rep_p, "replay")))
            res, _ = smp.replay_prompt(target, {"d": PrefixOracle(target, ids[0], scale)}, ids + cont, len(ids),
                                       POINTS, rep_p, [k], max_new, set())
            preds[t].append(res["d"][k])
    lnum, lden = rp.prompt_totals(loops)
    out = {t: (rp.bootstrap_paired_difference(lnum, lden, [p.emitted for p in ps], [p.rounds for p in ps]),
               smp.expected_stats(ps, k)) for t, ps in preds.items()}
    return out, sd.acceptance_stats(loops, k)


def check_agreement(diff, loop, pred):
    assert diff["ci"][0] <= 0 <= diff["ci"][1], (diff, loop["tau"], pred["tau"])
    assert diff["ci"][1] - diff["ci"][0] < 0.7                      # a real test, not a vacuous interval
    assert 1.3 < loop["tau"] < loop["num_rounds"]                   # acceptances neither all 0 nor all 1
    for a, b in zip(loop["per_position_acceptance"], pred["per_position_acceptance_given_prefix"]):
        assert abs(a - b) < 0.15, (loop["per_position_acceptance"], pred["per_position_acceptance_given_prefix"])


def test_sampled_loop_agrees_with_sampled_replay_and_catches_the_wrong_temperature(target):
    """Engine rule, 20 prompts: the replay at the loop's temperature agrees; the classic mistake - acceptance
    from a distribution tempered otherwise than the sampler's (here 2T) - falls outside the interval."""
    by_t, loop = loop_vs_replay(target, "engine", 1.0, k=3, n=20, replay_temperatures=(T_SHARP, 2 * T_SHARP))
    check_agreement(by_t[T_SHARP][0], loop, by_t[T_SHARP][1])
    wrong, _ = by_t[2 * T_SHARP]
    assert wrong["ci"][0] > 0, wrong                                # the loop accepts more than that predicts


def test_textbook_sampled_loop_agrees_with_sampled_replay(target):
    """Textbook rule (the draft samples from q = softmax(0.6 x target logits / T) != p): the expected walk
    with min(1, q/p) per judged draft predicts the loop."""
    by_t, loop = loop_vs_replay(target, "textbook", 0.6, k=2, n=20)
    check_agreement(by_t[T_SHARP][0], loop, by_t[T_SHARP][1])


def test_main_reports_greedy_and_sampled_side_by_side(micro_target, target, prompts, tmp_path):
    """05 with --acceptance-temperatures 0 T: the greedy numbers are those of a run without the flag, and the
    report shows both temperatures and the loop check."""
    make_chain(tmp_path, micro_target, target, prompts)
    stage = importlib.import_module(BENCH)
    argv = ["--work-dir", str(tmp_path), "--num-draft-tokens", "2", "--benchmark-max-new-tokens", "10",
            "--num-prompts", "3", "--loop-prompts", "1", "--device", "cpu", "--target-path", str(micro_target),
            "--replay-cache-dir", str(tmp_path / "replay_cache")]
    stage.main(argv)
    out = stage_dir(tmp_path, BENCH)
    greedy = json.loads((out / "metrics.json").read_text())
    assert "sampled" not in greedy
    stage.main(argv + ["--overwrite", "--acceptance-temperatures", "0", str(T_SHARP), "--acceptance-top-p", "0.9",
                       "--acceptance-loop-prompts", "3"])
    m = json.loads((out / "metrics.json").read_text())
    for k in ("by_num_draft_tokens", "num_continuation_tokens", "continuation_tokens_not_teacher_forced_argmax"):
        assert m[k] == greedy[k] or k == "by_num_draft_tokens" and _without_speed(m[k]) == _without_speed(greedy[k])
    e = m["sampled"]["by_temperature"][f"{T_SHARP:g}"]["by_num_draft_tokens"]["2"]
    assert e["tau_ci95"][0] <= e["tau"] <= e["tau_ci95"][1] and len(e["per_prompt_rounds"]) == 3
    assert e["loop_equals_replay_along_its_output"] == 3 and "loop_agrees" in e
    report = (out / "report.md").read_text()
    assert f"tau T={T_SHARP:g}" in report and "tau T=0" in report and "sampled loop" in report
    assert list((tmp_path / "replay_cache").glob(f"*_T{T_SHARP:g}_topp0.9_seed0_{smp.SAMPLER_VERSION}.jsonl"))
    assert json.loads((out / "manifest.json").read_text())["tau_by_temperature"][f"{T_SHARP:g}"].keys() == {"2"}
    # the README's block, printed from these files (benchmarks/demo_table.py)
    block = importlib.import_module("benchmarks.demo_table").block(tmp_path)
    row = f"| 2 | {m['by_num_draft_tokens']['2']['tau']:.2f} | "
    assert row in block and f"| tau T={T_SHARP:g} | 95% CI |" in block and "| loop tau (1) |" in block
    assert f"{e['tau']:.2f} | [{e['tau_ci95'][0]:.2f}, {e['tau_ci95'][1]:.2f}] |" in block
    assert "The sampled loop (3 prompts)" in block and " cores)" in block


def test_workers_give_the_one_process_numbers(micro_target, target, prompts, tmp_path):
    """05 --benchmark-workers 2 (the target features, the sampled answers, the sampled replay and the sampled loop in
    two forked processes, common/parallel.py) writes the numbers of one process: every prompt draws from its own
    seeded generator, and the answers are sampled in the same batches."""
    make_chain(tmp_path, micro_target, target, prompts)
    stage = importlib.import_module(BENCH)
    argv = ["--work-dir", str(tmp_path), "--num-draft-tokens", "2", "3", "--benchmark-max-new-tokens", "10",
            "--num-prompts", "4", "--loop-prompts", "1", "--device", "cpu", "--target-path", str(micro_target),
            "--acceptance-temperatures", "0", str(T_SHARP), "--acceptance-top-p", "0.9",
            "--acceptance-loop-prompts", "4", "--sample-batch-size", "2", "--overwrite"]
    runs = []
    for workers in ("1", "2"):   # each run samples its own answers: two batches of 2 prompts
        stage.main(argv + ["--benchmark-workers", workers, "--replay-cache-dir", str(tmp_path / f"cache{workers}")])
        runs.append(json.loads((stage_dir(tmp_path, BENCH) / "metrics.json").read_text()))
    one, two = runs
    assert two["sampled"] == one["sampled"]
    assert _without_speed(two["by_num_draft_tokens"]) == _without_speed(one["by_num_draft_tokens"])
    assert two["sampled"]["loop_prompts"] == 4
    assert two["sampled"]["by_temperature"][f"{T_SHARP:g}"]["by_num_draft_tokens"]["3"]["loop_tau"] > 0


def _without_speed(per_k: dict) -> dict:
    """The timing fields differ run to run; everything else of the greedy entry must not."""
    timing = {"tokens_per_s_speculative", "tokens_per_s_target_only", "speed_ratio"}
    return {k: {f: v for f, v in e.items() if f not in timing and f not in ("trained", "untrained")}
            | {n: {f: v for f, v in e[n].items() if f != "seconds"} for n in ("trained", "untrained")}
            for k, e in per_k.items()}


def test_sampled_engine_answers_checked_round_by_round(target):
    """agreement.check_sampled_answers on answers shaped like vLLM's (output ids + per_step_accepted): the
    sampled loop (the engines' rule) passes; an engine that accepts by another rule (here one draft more
    in some round) is caught."""
    from common.serving.agreement import check_sampled_answers

    params, k, max_new = sd.SamplingParams(T_SHARP, 0.9), 3, 12
    prompts = random_prompts(6, target.config.vocab_size, seed=1)
    answers = [engine_answer(target, ids, k, max_new, params, smp.prompt_seed(0, ids, params, "engine"))
               for ids in prompts]
    oracle = PrefixOracle(target, 0)   # only its TTT surface is used here, which needs no first token
    got = check_sampled_answers((target, oracle, set(), POINTS), prompts, answers, k, params, max_new, 0)
    assert got["exact"] and got["exact_prompts"] == 6, [r for r in got["per_prompt"] if not r["equal"]]
    assert got["expected"]["along_answers"]["agree"], got["expected"]["along_answers"]
    assert got["expected"]["ci"][0] <= got["expected"]["difference"] <= got["expected"]["ci"][1]
    i = next(i for i, a in enumerate(answers) if 0 in a["per_step_accepted"][:-1])
    j = answers[i]["per_step_accepted"].index(0)
    answers[i] = dict(answers[i], per_step_accepted=answers[i]["per_step_accepted"][:j] + [1]
                      + answers[i]["per_step_accepted"][j + 1:])
    bad = check_sampled_answers((target, oracle, set(), POINTS), prompts, answers, k, params, max_new, 0)
    assert not bad["exact"] and bad["exact_prompts"] == 5


def engine_answer(target, ids: list[int], k: int, max_new: int, verify: sd.SamplingParams, seed: int) -> dict:
    """An answer shaped like vLLM's (output ids + per_step_accepted) from the sampled loop under the engines'
    rule, verifying at `verify`. vLLM's accounting: every round judges k drafts, also the last one, whose
    drafts may run past the budget (docs/serving.md). So the loop runs k + 1 tokens longer; the answer is
    cut at max_new and keeps the rounds that started before the cut, with their full counts."""
    res = sd.speculative_decode(target, PrefixOracle(target, ids[0]), ids, k, max_new + k + 1, set(), POINTS,
                                verify, smp.generator("cpu", seed))
    starts = [1 + sum(res.emitted[:r]) for r in range(len(res.emitted))]   # tokens committed before round r
    return {"output_ids": res.tokens[:max_new],
            "per_step_accepted": [a for a, c in zip(res.accepted, starts) if c < max_new]}


class LoopEngine:
    """What AgreementCheck.sampled asks of an engine, answered by the sampled loop: it verifies at the
    request's temperature and top-p, or, with `verify`, at those whatever the request asks."""
    label = "loop"

    def __init__(self, target, verify: sd.SamplingParams | None = None):
        self.target, self.verify = target, verify

    def sampling_defect(self):
        return None

    def engine_probabilities(self, url):
        return "the loop returns no probabilities"

    def request(self, url, ids, max_new_tokens, timeout, sampling, logprobs=None):
        verify = self.verify or sd.SamplingParams(sampling["temperature"], sampling["top_p"])
        return engine_answer(self.target, ids, 3, max_new_tokens, verify, sampling["seed"])


def test_sampled_gate_fails_an_engine_verifying_at_another_temperature(target, tmp_path):
    """An engine that verifies at 3x the requested temperature with top-p off accepts a draft iff it equals
    the token it commits, like any engine of the engines' rule: the exact half passes. Along its answers it
    accepts far fewer drafts than p(d) at the requested T / top-p predicts: 05 stops in one line naming the
    draft positions with their observed and expected counts. The engine that verifies as asked passes (on
    8 prompts x 16 tokens, 20 seeds gave |z| <= 2.0 for it and z from -11 to -17 for the 3x one; the test
    runs seed 0: each seed costs a sampled loop and its check, ~5 s)."""
    from common.draft.manifest import DraftManifest
    from common.serving.agreement import AgreementCheck
    from common.stage import StageError

    asked = sd.SamplingParams(T_SHARP, 0.95)
    prompts = random_prompts(8, target.config.vocab_size, seed=2)

    def check(engine, seed):
        c = AgreementCheck(engine, tmp_path, tmp_path, DraftManifest.from_dict({}), prompts, 16, 0, 0.0, tmp_path,
                           (asked,), seed)
        c._models = (target, PrefixOracle(target, 0), set(), POINTS)   # the micro target, not loaded from disk
        return c.sampled("u", "3-1-4", 3)

    gate = check(LoopEngine(target), 0)[f"{T_SHARP:g}"]["expected"]["along_answers"]
    assert gate["enforced"] and gate["agree"] and sum(gate["judged"]) > 60, gate
    with pytest.raises(StageError) as err:
        check(LoopEngine(target, verify=sd.SamplingParams(3 * T_SHARP, 1.0)), 0)
    msg = str(err.value)
    assert "\n" not in msg and "3-1-4 T=0.02 top-p 0.95: loop accepts" in msg, msg
    assert re.search(r"judged drafts where p\(d\) expects [\d.]+ \(z -\d+\.\d; it sees deviations beyond \+-\d+%; "
                     r"by draft position 1: \d+/\d+ vs [\d.]+, 2: .*beyond 4 standard deviations, it does not", msg), msg
