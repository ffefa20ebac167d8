"""The agreement check: a real engine's acceptance, round by round, against 05's replay of the same draft
on the same tokens - the proof that the export, the capture convention and the acceptance rule are
right in a real engine.

For each prompt the engine answers greedily (its per-round accepted counts come with the answer:
vLLM's `per_step_accepted`), and its Prometheus counters are differenced around the whole check. Replay
(common/benchmark/replay.py) then runs our copy of the draft against the ENGINE's answer: one target
forward over prompt + answer gives the auxiliary states, one TTT forward gives every round's
proposals, and the rounds are walked with the engine's accounting (`replay_rounds` below). In float32
both sides compute the same numbers, so the per-round counts must be equal; in other precisions the
relative tau difference must stay within the tolerance.

When they differ, the check names the layer, testing in this order:
  target outputs   the engine's answer is not our target's greedy continuation (teacher-forced argmax
                   at some position; compared up to the first round that disagrees)
  draft's inputs   replay with auxiliary states from other layers (capture points shifted by -1 / +1)
                   reproduces the engine's counts: the engine feeds the draft other layers
  accounting       the engine's rounds do not add up to its own answer (accepted + 1 per round + the
                   prefill token != answer length), or the number of rounds differs with every
                   shared round equal
  draft's outputs  otherwise: same inputs and tokens, other proposals (weights, d2t, norms, RoPE)

Engine accounting (vLLM 0.32 `v1/core/sched/scheduler.py`, `v1/spec_decode/metrics.py`): every round
drafts k tokens, also near the end of the token budget (no partial drafts), and counts the drafts the
target accepted before the output is cut at max_tokens or at an end-of-turn token: a round whose
drafts run past the answer's end is judged on what the target would say there. Replay extends the
answer by k greedy tokens of our target (end-of-turn ignored) and walks the rounds the same way
(`replay_rounds`). Seen on the first run: counting the way 05's loop does (stop at an accepted
end-of-turn) gave 2 of 465 rounds one accepted draft fewer, both last rounds ending in `<|im_end|>`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.benchmark.reference import first_difference
from common.draft.manifest import DraftManifest
from common.stage import StageError


def replay_rounds(pred: list[list[int]], seq: list[int], num_prompt: int, answer_len: int, k: int,
                  eos_ids: set[int]) -> list[int]:
    """Per-round accepted counts of a k-token chain with the engine's accounting.

    seq = prompt + the engine's answer (answer_len tokens) + the target's greedy continuation past the
    answer's end (at least k tokens: what the engine's verify forward sees when a round runs past an
    end-of-turn or the budget). pred[j][t] = the draft's proposal (target id) for token t+2+j at anchor
    t (replay.draft_predictions over seq). A round runs while the answer is unfinished (its newest
    token is no end-of-turn and the answer goes on); it accepts the longest prefix of its k drafts that
    equals the target's greedy tokens, end-of-turn tokens and the budget notwithstanding (the engine
    counts them before it cuts the output), and commits that many + 1.
    """
    end = num_prompt + answer_len
    accepted, n_ctx = [], num_prompt            # n_ctx: positions with target features; pending = seq[n_ctx]
    while n_ctx + 1 < end and seq[n_ctx] not in eos_ids:
        t = n_ctx - 1
        a = 0
        while a < k and t + 2 + a < len(seq) and pred[a][t] == seq[t + 2 + a]:
            a += 1
        accepted.append(a)
        n_ctx += a + 1
    return accepted


@dataclass
class AgreementCheck:
    """05's agreement check, called once per EAGLE-3 server after its preflight (sweep.run_server_benchmark)."""
    engine: object
    target_dir: Path
    export_dir: Path
    m04: DraftManifest
    prompts: list[list[int]]
    max_new_tokens: int
    timeout: float
    tolerance: float   # 0: exact (float32); else the largest relative tau difference allowed
    out: Path
    sampling: tuple = ()   # sd.SamplingParams per temperature > 0: the sampled check after the greedy one
    seed: int = 0          # 05's --seed: the per-request seeds (sampled.prompt_seed, stream "engine")

    def __post_init__(self):
        self._models = None
        self._defect = ()  # engine.sampling_defect(), probed once (() = not yet)

    def models(self):
        """(target, draft, eos ids, capture points), loaded once, float32 on the CPU."""
        if self._models is None:
            import torch
            from transformers import AutoModelForCausalLM

            from common.text.target_format import load_target_format
            from common.text.tokenizer import load_tokenizer
            from common.draft.export_sglang import load_sglang_export

            target = AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=torch.float32).eval()
            draft = load_sglang_export(self.export_dir, target.get_input_embeddings().weight.detach()).eval()
            text_format = load_target_format(self.target_dir, load_tokenizer(self.target_dir))
            self._models = (target, draft, set(text_format.stop_ids), list(self.m04.capture_points))
        return self._models

    def __call__(self, url: str, key: str, setting) -> dict:
        from common.io import write_json

        k = setting[0]
        start = self.engine.window_start(url)
        answers = with_ids(url, [self.engine.request(url, ids, self.max_new_tokens, self.timeout)
                                 for ids in self.prompts])
        window = self.engine.window_end(url, start)
        result = check_answers(self.models(), self.prompts, answers, k, self.tolerance)
        result["server_counters"] = window
        counters_ok = (window["num_drafts"] == result["engine"]["num_rounds"]
                       and window["accepted_per_position"][:k] == result["engine"]["accepted_per_position"])
        result["counters_equal_per_request_sums"] = counters_ok
        write_json(self.out / "agreement" / f"{key.replace('/', '_')}.json", result)
        e, r = result["engine"], result["replay"]
        print(f"[05b] agreement {key}: {self.engine.label} tau {e['tau']:.4f} ({e['num_rounds']} rounds, accepted "
              f"per position {e['accepted_per_position']}) vs replay {r['tau']:.4f} ({r['num_rounds']} rounds, "
              f"{r['accepted_per_position']}) on {len(self.prompts)} prompts: "
              f"{'AGREE' if result['agree'] else 'DISAGREE'}")
        if not counters_ok:
            raise StageError(f"agreement {key}: {url}'s /metrics counters over the check ({window}) are not the sum "
                             f"of its per-request rounds ({e}): the engine's accounting disagrees with itself")
        if not result["agree"]:
            raise StageError(f"agreement {key}: {self.engine.label} and replay disagree - {result['layer']}: "
                             f"{result['detail']} (details in {self.out / 'agreement'})")
        if self.sampling:
            result["sampled"] = self.sampled(url, key, k)
            write_json(self.out / "agreement" / f"{key.replace('/', '_')}.json", result)
        return result

    def sampled(self, url: str, key: str, k: int) -> dict:
        """The same prompts answered sampled (temperature, top_p, a seed per request): check_sampled_answers
        per temperature; raises when a round differs, or when the engine accepts drafts more or less often than
        p(d) predicts along its own answers (probability_gate), unless a known engine defect explains it."""
        from common.benchmark import sampled as smp
        from common.io import write_json

        if self._defect == ():
            self._defect = self.engine.sampling_defect()
        out, defect = {}, self._defect
        if defect:
            print(f"[05b] agreement {key}: {self.engine.label} cannot verify sampled drafts here: {defect}. Its "
                  "sampled tau below measures that defect, not the draft")
        for params in self.sampling:
            answers = with_ids(url, [self.engine.request(url, ids, self.max_new_tokens, self.timeout, sampling={
                "temperature": params.temperature, "top_p": params.top_p,
                "seed": smp.prompt_seed(self.seed, ids, params, "engine") % 2 ** 31}) for ids in self.prompts])
            res = check_sampled_answers(self.models(), self.prompts, answers, k, params, self.max_new_tokens,
                                        self.seed)
            res["top_p"], res["engine_defect"] = params.top_p, defect
            out[f"{params.temperature:g}"] = res
            write_json(self.out / "agreement" / f"{key.replace('/', '_')}_sampled.json", out)   # before any stop below
            x, g = res["expected"], res["expected"]["along_answers"]
            verdict = "agree" if x["agree"] else ("engine defect" if defect else "DISAGREE")
            gate = "pass" if g["agree"] else ("engine defect" if defect else "FAIL")
            print(f"[05b] agreement {key} T={params.temperature:g} top-p {params.top_p:g}: {res['exact_prompts']}/"
                  f"{len(self.prompts)} answers' rounds equal replay along them; {self.engine.label} tau "
                  f"{x['engine_tau']:.3f} vs sampled replay {x['replay_tau']:.3f}, difference {x['difference']:+.3f} "
                  f"[{x['ci'][0]:+.3f}, {x['ci'][1]:+.3f}] ({verdict}); along its answers {gate_summary(g)} ({gate})")
            if not res["exact"]:
                bad = next(r for r in res["per_prompt"] if not r["equal"])
                raise StageError(f"agreement {key} T={params.temperature:g}: {self.engine.label}'s sampled rounds on "
                                 f"prompt {bad['prompt']} ({bad['engine']}) are not replay's along its own answer "
                                 f"({bad['replay']}): the engine does not accept exactly the drafts equal to the "
                                 f"tokens it commits (docs/design.md section 11; details in {self.out / 'agreement'})")
            if not g["agree"] and not defect:   # a known defect is named above and voids the row instead
                raise StageError(f"agreement {key} T={params.temperature:g} top-p {params.top_p:g}: "
                                 f"{self.engine.label} {gate_summary(g)}, beyond {g['threshold']:g} standard "
                                 "deviations: it does not accept a draft d with the probability p(d) of the requested "
                                 "temperature and top-p (docs/design.md section 11; details in "
                                 f"{self.out / 'agreement'})")
        return out


def with_ids(url: str, answers: list[dict]) -> list[dict]:
    """The check replays the engine's own answer token by token, so an answer without its ids (a server
    that ignored the request for them) cannot be checked: one line, not a TypeError deep in replay."""
    if any(a.get("output_ids") is None for a in answers):
        raise StageError(f"agreement: {url} sent answers without token ids (requested): the check replays the "
                         "engine's own tokens and cannot run without them")
    return answers


def totals(rounds: list[list[int]], k: int) -> dict:
    flat = [a for r in rounds for a in r]
    n = len(flat)
    per_pos = [sum(a > j for a in flat) for j in range(k)]
    return {"num_rounds": n, "accepted_per_position": per_pos,
            "tau": 1 + sum(flat) / n if n else None}  # vLLM's definition: the prefill token not counted


def engine_sequence(target, ids: list[int], answer: list[int], k: int) -> list[int]:
    """prompt + the engine's answer + k greedy tokens of our target past its end (end-of-turn ignored)."""
    from common.benchmark.spec_decode import greedy_decode

    more, _ = greedy_decode(target, list(ids) + list(answer), k, set())
    return list(ids) + list(answer) + more


def replay_prompt(models, ids: list[int], answer: list[int], k: int, points: list[int] | None = None):
    """(our rounds, the answer's first token off our target's greedy path or None) for one prompt;
    `points` overrides the capture points the draft reads (the diagnosis)."""
    import torch

    from common.benchmark import replay as rp

    target, draft, eos, trained_points = models
    seq = engine_sequence(target, ids, answer, k)
    with torch.no_grad():
        aux, argmax = rp.target_features(target, seq, points or trained_points)
    rounds = replay_rounds(rp.draft_predictions(draft, aux, seq, k).tolist(), seq, len(ids), len(answer), k, eos)
    n = len(ids)
    off = next((j for j, (a, b) in enumerate(zip(argmax[n - 1:n - 1 + len(answer)], answer)) if a != b), None)
    return rounds, off


def check_answers(models, prompts: list[list[int]], answers: list[dict], k: int, tolerance: float) -> dict:
    """Replay every engine answer and compare round by round; on disagreement name the layer."""
    per_prompt, engine_rounds, our_rounds = [], [], []
    first_bad = None
    for i, (ids, ans) in enumerate(zip(prompts, answers)):
        if ans.get("per_step_accepted") is None:
            raise StageError("the engine returned no per-round acceptance (per_step_accepted)")
        ours, off = replay_prompt(models, ids, ans["output_ids"], k)
        eng = [int(a) for a in ans["per_step_accepted"]]
        at = first_difference(eng, ours)
        per_prompt.append({"prompt": i, "engine": eng, "replay": ours, "first_disagreeing_round": at,
                           "answer_not_greedy_at": off, "answer_tokens": len(ans["output_ids"])})
        engine_rounds.append(eng)
        our_rounds.append(ours)
        if at is not None and first_bad is None:
            first_bad = i
    e_tot, r_tot = totals(engine_rounds, k), totals(our_rounds, k)
    rel = abs(e_tot["tau"] - r_tot["tau"]) / r_tot["tau"] if r_tot["tau"] else 0.0
    exact = first_bad is None
    result = {"num_draft_tokens": k, "engine": e_tot, "replay": r_tot, "relative_tau_difference": rel,
              "exact": exact, "tolerance": tolerance, "per_prompt": per_prompt,
              "agree": exact if tolerance == 0 else rel <= tolerance, "layer": None, "detail": None}
    if not result["agree"]:
        result["layer"], result["detail"] = diagnose(models, prompts, answers, per_prompt, k, first_bad)
    return result


def check_sampled_answers(models, prompts: list[list[int]], answers: list[dict], k: int, params,
                          max_new_tokens: int, seed: int) -> dict:
    """A sampled engine against replay (docs/design.md section 11), two ways.

    exact: under the engines' rule (vLLM 0.32's default greedy draft, q one-hot) a draft is accepted iff the
      committed token equals it, so replay along the engine's OWN sampled answer must give its rounds. Every
      round but the last is compared for equality; the last may run past the answer's end, where the
      engine judged its drafts on tokens it sampled and then cut (budget, end of turn), which replay cannot
      see, so there the engine's count must be >= replay's.
    expected: the sampled replay's prediction (our target samples independent continuations of the same
      prompts, sampled.replay_prompt) against the engine's tau, both counted as 05's loop counts (tokens
      committed in rounds / rounds), with the paired bootstrap interval over prompts of the difference
      (reported); and, enforced, `along_answers`: every draft the engine judged on a token of its own
      answer against p(d), the probability the requested temperature and top-p give it (probability_gate).
      The exact half holds for ANY target distribution (accepted iff committed == draft); this one sees it."""
    from common.benchmark import replay as rp
    from common.benchmark import sampled as smp
    from common.benchmark import spec_decode as sd

    target, draft, eos, points = models
    per_prompt, engine_rounds, our_rounds, predicted, judged = [], [], [], [], []
    for i, (ids, ans) in enumerate(zip(prompts, answers)):
        if ans.get("per_step_accepted") is None:
            raise StageError("the engine returned no per-round acceptance (per_step_accepted)")
        seq = list(ids) + list(ans["output_ids"])
        aux, probs = smp.target_probs(target, seq, points, params)   # the one forward: aux and p at T / top-p
        pred = rp.draft_predictions(draft, aux, seq, k).tolist()
        ours = replay_rounds(pred, seq, len(ids), len(ans["output_ids"]), k, eos)
        eng = [int(a) for a in ans["per_step_accepted"]]
        judged += judged_drafts(eng, pred, probs, len(ids), len(seq))
        equal = len(eng) == len(ours) and eng[:-1] == ours[:-1] and (not eng or eng[-1] >= ours[-1])
        per_prompt.append({"prompt": i, "engine": eng, "replay": ours, "equal": equal,
                           "answer_tokens": len(ans["output_ids"])})
        engine_rounds.append(eng)
        our_rounds.append(ours)
        g = smp.generator(target.device, smp.prompt_seed(seed, list(ids), params, "replay"))
        cont = sd.sample_decode(target, list(ids), max_new_tokens, eos, params, g)
        res, _ = smp.replay_prompt(target, {"d": draft}, list(ids) + cont, len(ids), points, params, [k],
                                   max_new_tokens, eos)
        predicted.append(res["d"][k])
    enum, eden = [len(a["output_ids"]) - 1 for a in answers], [len(r) for r in engine_rounds]
    pnum, pden = [p.emitted for p in predicted], [p.rounds for p in predicted]
    diff = rp.bootstrap_paired_difference(enum, eden, pnum, pden, seed=seed)
    exact_prompts = sum(r["equal"] for r in per_prompt)
    return {"temperature": params.temperature, "top_p": params.top_p, "num_draft_tokens": k,
            "engine": totals(engine_rounds, k), "replay": totals(our_rounds, k),
            "exact": exact_prompts == len(per_prompt), "exact_prompts": exact_prompts, "per_prompt": per_prompt,
            "expected": {"engine_tau": sum(enum) / sum(eden), "replay_tau": sum(pnum) / sum(pden),
                         "difference": diff["difference"], "ci": diff["ci"],
                         "agree": diff["ci"][0] <= 0 <= diff["ci"][1],
                         "along_answers": probability_gate(judged, k)}}


def judged_drafts(accepted: list[int], pred: list[list[int]], probs, num_prompt: int,
                  end: int) -> list[tuple[int, float, bool]]:
    """(draft position j, p(d), accepted) of every draft the engine judged on a token of its own answer
    (seq[num_prompt:end]), walking its rounds by its own counts `accepted`: a round at anchor t judges
    drafts j = 0.. until the first rejection; draft j proposes pred[j][t] for token t+2+j, judged by p row
    t+1+j (sampled.acceptance_tables' alpha, engine rule). Drafts judged past the answer's end (the last
    round's, on tokens the engine sampled and cut) are left out: their prefix is unknown. Whether a
    draft is in the answer is known before it is judged (budget, an earlier end of turn), so leaving
    the others out selects nothing by outcome."""
    out, n_ctx = [], num_prompt
    for a in accepted:
        t = n_ctx - 1
        for j in range(min(a + 1, len(pred))):
            if t + 2 + j >= end:
                break
            out.append((j, float(probs[t + 1 + j, pred[j][t]]), j < a))
        n_ctx += a + 1
    return out


# The gate: z = (accepted - sum p) / sqrt(sum p(1 - p)) over every judged draft. Each draft's acceptance
# is a Bernoulli(p(d)) given everything before it, so accepted - sum p is a martingale with that
# predictable variance and z is standard normal for a correct engine (martingale CLT). |z| > 4 happens
# 6e-5 of the time under the normal law; 05 runs a few of these per sweep (settings x temperatures) and
# the suite many, so 3 (2.7e-3, a false stop every few hundred checks) is too loose, while an engine off
# by a factor in temperature lands far past 4 (tests/test_sampled.py, 3x the temperature: z -11 to -17
# over 20 seeds, the right engine |z| <= 2.0). The normal law is
# worst where p is near 0 or 1 (the count is then Poisson-like and skewed): with sum p(1-p) >= 10 a
# Poisson count still exceeds 4 standard deviations less than 3e-4 of the time, so below that the gate
# reports and does not judge.
Z_MAX = 4.0
MIN_VARIANCE = 10.0


def probability_gate(judged: list[tuple[int, float, bool]], k: int) -> dict:
    """judged_drafts of every answer -> per draft position and in all: judged, accepted, expected
    (sum p), z; `agree` False only when judged (sum p(1-p) >= MIN_VARIANCE) and |z| > Z_MAX."""
    def z(rows):   # None without variance (nothing judged, or every p 0 or 1): no z to give
        var = sum(p * (1 - p) for _, p, _ in rows)
        return (sum(acc for *_, acc in rows) - sum(p for _, p, _ in rows)) / var ** 0.5 if var > 0 else None

    by_pos = [[r for r in judged if r[0] == j] for j in range(k)]
    variance = sum(p * (1 - p) for _, p, _ in judged)
    total = z(judged)
    return {"judged": [len(r) for r in by_pos], "accepted": [sum(acc for *_, acc in r) for r in by_pos],
            "expected": [sum(p for _, p, _ in r) for r in by_pos], "z_by_position": [z(r) for r in by_pos],
            "z": total, "variance": variance, "threshold": Z_MAX, "min_variance": MIN_VARIANCE,
            "enforced": variance >= MIN_VARIANCE, "agree": variance < MIN_VARIANCE or abs(total) <= Z_MAX}


def gate_summary(g: dict) -> str:
    """One line of probability_gate's result: in all and per draft position (1-based), accepted of judged
    against the expected count."""
    per = ", ".join(f"{j + 1}: {a}/{n} vs {e:.1f}" for j, (n, a, e) in enumerate(zip(g["judged"], g["accepted"],
                                                                                      g["expected"])) if n)
    note = "" if g["enforced"] else f", too few to judge (sum p(1-p) {g['variance']:.1f} < {g['min_variance']:g})"
    return (f"accepts {sum(g['accepted'])} of {sum(g['judged'])} judged drafts where p(d) expects "
            f"{sum(g['expected']):.1f} (z {'-' if g['z'] is None else format(g['z'], '+.1f')}; by draft position "
            f"{per or '-'}{note})")


def diagnose(models, prompts, answers, per_prompt, k: int, first_bad: int | None) -> tuple[str, str]:
    """Which layer of the stack explains the disagreement (the order of the module docstring)."""
    target, _, _, points = models
    i = first_bad if first_bad is not None else 0
    rec = per_prompt[i]
    rnd = rec["first_disagreeing_round"] or 0
    start = sum(a + 1 for a in rec["replay"][:rnd]) + 1  # answer tokens committed before that round
    if rec["answer_not_greedy_at"] is not None and rec["answer_not_greedy_at"] <= start + k:
        return ("target outputs", f"prompt {i}: the engine's answer leaves our target's greedy path at answer "
                f"token {rec['answer_not_greedy_at']}, at or before round {rnd}")
    num_hidden = int(target.config.num_hidden_layers)
    for shift in (-1, 1):
        moved = [p + shift for p in points]
        if not all(1 <= p <= num_hidden - 1 for p in moved):
            continue
        if all(first_difference([int(x) for x in a["per_step_accepted"]],
                                replay_prompt(models, ids, a["output_ids"], k, moved)[0]) is None
               for ids, a in zip(prompts, answers)):
            return ("draft's inputs", f"the engine's counts are those of a draft fed the inputs of layers {moved}, "
                    f"not the capture points {points} it was trained on")
    eng, ours = rec["engine"], rec["replay"]
    if 1 + len(eng) + sum(eng) < rec["answer_tokens"] or (rnd >= min(len(eng), len(ours)) and len(eng) != len(ours)):
        return ("accounting", f"prompt {i}: the engine counts {len(eng)} rounds accepting {sum(eng)} drafts for a "
                f"{rec['answer_tokens']}-token answer; replay walks {len(ours)} rounds")
    return ("draft's outputs", f"prompt {i}, round {rnd} (answer token {start}): the engine accepted "
            f"{eng[rnd] if rnd < len(eng) else '-'} drafts, our draft's proposals give "
            f"{ours[rnd] if rnd < len(ours) else '-'} on the same tokens and inputs")
