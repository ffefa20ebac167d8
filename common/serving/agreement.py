"""The agreement check: a real engine's acceptance, round by round, against 05's replay of the same draft
on the same tokens - the proof that the export, the capture convention and the acceptance rule are
right in a real engine.

For each prompt the engine answers greedily (vLLM's per-round accepted counts come with the answer:
`per_step_accepted`; SGLang's totals, below), and vLLM's Prometheus counters are differenced around the whole
check. Replay (common/benchmark/replay.py) then runs our copy of the draft against the ENGINE's answer: one
target forward over prompt + answer gives the auxiliary states, one TTT forward gives every round's
proposals, and the rounds are walked with the engine's accounting (`replay_rounds` below). In float32
both sides compute the same numbers, so the per-round counts must be equal; in other precisions the
relative tau difference must stay within the tolerance, greedy and sampled. The sampled half's probability
gate (`probability_gate`, its statistics above Z_MAX) allows the tolerance as a relative band on p(d).

When they differ, the check names the layer, testing in this order:
  target outputs   the engine's answer is not our target's greedy continuation (teacher-forced argmax
                   at some position; compared up to the first round that disagrees)
  draft's inputs   replay with auxiliary states from other layers (capture points shifted by -1 / +1)
                   reproduces the engine's counts: the engine feeds the draft other layers
  accounting       the engine's rounds do not add up to its own answer (accepted + 1 per round + the
                   prefill token != answer length), or the number of rounds differs with every
                   shared round equal
  draft's outputs  otherwise: same inputs and tokens, other proposals (weights, d2t, norms, RoPE)

An engine that reports request totals only (SGLang: `spec_verify_ct`, the verify rounds, and
`completion_tokens`) is judged from its answers: at a chain with a one-hot draft (topk 1, the draft's
argmax) the committed token equals the draft token exactly when it was accepted (accepted: it is the draft;
rejected: the token is drawn with the draft taken out), so the rounds follow from the answer's tokens and
our draft's proposals along them (`answer_rounds`: accept while the proposal equals the next token, cut at
the answer's end, as SGLang cuts at the budget or an end of turn), greedy or sampled. Its verify count must
be that number of rounds, request by request; every draft judged along the answer feeds the probability
gate as the engine's reported rounds do.

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
    tolerance: float   # 0: exact (float32); else the largest relative tau difference allowed, greedy and
                       # sampled, and the probability gate's relative band on p(d)
    out: Path
    sampling: tuple = ()   # sd.SamplingParams per temperature > 0: the sampled check after the greedy one
    seed: int = 0          # 05b's --bench-seed: the per-request seeds (sampled.prompt_seed, stream "engine")

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

    def check_loadable(self) -> None:
        """Refuse, before any server starts, a target that replay cannot load here: transformers in float32 on
        this machine's CPU memory (models). A quantized checkpoint (Kimi-K2.5's INT4 compressed-tensors) is not
        loaded in float32 at all, and one whose float32 weights exceed the memory available cannot be: the check
        would fail after the servers have launched (the 1T Kimi target needs ~4 TB)."""
        import json

        cfg = json.loads((Path(self.target_dir) / "config.json").read_text())
        quant = next((c["quantization_config"].get("quant_method") for c in (cfg, cfg.get("text_config") or {})
                      if isinstance(c.get("quantization_config"), dict)), None)
        why = None
        if quant:
            why = f"its checkpoint is quantized ({quant}), which replay does not load in float32"
        else:
            need, have = float32_bytes(self.target_dir), available_memory()   # None: cannot be sized here
            if need is not None and have is not None and need > have:
                why = f"it needs {need / 2 ** 30:.1f} GiB in float32, and {have / 2 ** 30:.1f} GiB are available"
        if why:
            raise StageError(f"--agreement-prompts: the agreement check replays the target {self.target_dir} with "
                             f"transformers in float32 on this machine, but {why}: run it where the target fits "
                             "(scripts/box_smoke.sh judges SGLang on SmolLM2), or --agreement-prompts 0")

    @staticmethod
    def judges(setting) -> str | None:
        """Why the check cannot judge a server of `setting`, else None: its rounds follow from the answers only
        for a fixed chain (topk 1); a tree commits one of several candidates, an adaptive server changes k. Block
        verification (vLLM, one-hot drafts) is judged: a rejected draft is never the token committed in its place
        (the residual leaves it out), and its accepted-length law is token-wise verification's
        (vllm.block_fault), so the exact check and the probability gate both hold."""
        if len(setting) > 3 and setting[3] != "block":
            return "an adaptive setting changes the number of drafts from round to round"
        if setting[1] != 1:
            return "a tree (topk > 1) commits one of several candidates a round"
        return None

    def __call__(self, url: str, key: str, setting) -> dict:
        from common.io import write_json

        k = setting[0]
        start = self.engine.window_start(url)
        answers = with_ids(url, [self.engine.request(url, ids, self.max_new_tokens, self.timeout)
                                 for ids in self.prompts])
        window = self.engine.window_end(url, start)
        result = check_answers(self.models(), self.prompts, answers, k, self.tolerance)
        result["server_counters"] = window
        # exact lifetime counters (vLLM's /metrics) must be the per-request sums; SGLang's windowed average
        # holds decode iterations from outside the window (its server_tau_note): reported only
        counters_ok = None if "num_drafts" not in window else (
            window["num_drafts"] == result["engine"]["num_rounds"]
            and window["accepted_per_position"][:k] == result["engine"]["accepted_per_position"])
        result["counters_equal_per_request_sums"] = counters_ok
        write_json(self.out / "agreement" / f"{key.replace('/', '_')}.json", result)
        e, r = result["engine"], result["replay"]
        per_pos = "" if e["accepted_per_position"] is None else f", accepted per position {e['accepted_per_position']}"
        print(f"[05b] agreement {key}: {self.engine.label} tau {e['tau']:.4f} ({e['num_rounds']} rounds{per_pos}) "
              f"vs replay {r['tau']:.4f} ({r['num_rounds']} rounds, {r['accepted_per_position']}) on "
              f"{len(self.prompts)} prompts{'' if result['reports_per_round'] else ' (rounds from its answers)'}: "
              f"{'AGREE' if result['agree'] else 'DISAGREE'}")
        if counters_ok is False:
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
        no_probs = self.engine.engine_probabilities(url)   # None: its answers carry the verify's p(d)
        if no_probs:
            print(f"[05b] agreement {key}: {self.engine.label}'s own p(d) not compared with replay's: {no_probs}")
        for params in self.sampling:
            answers = with_ids(url, [self.engine.request(url, ids, self.max_new_tokens, self.timeout, sampling={
                "temperature": params.temperature, "top_p": params.top_p,
                "seed": smp.prompt_seed(self.seed, ids, params, "engine") % 2 ** 31},
                **({} if no_probs else {"logprobs": ENGINE_LOGPROBS})) for ids in self.prompts])
            res = check_sampled_answers(self.models(), self.prompts, answers, k, params, self.max_new_tokens,
                                        self.seed, self.tolerance)
            res["top_p"], res["engine_defect"] = params.top_p, defect
            if no_probs:
                res["engine_probabilities"] = {"why_not": no_probs}
            out[f"{params.temperature:g}"] = res
            write_json(self.out / "agreement" / f"{key.replace('/', '_')}_sampled.json", out)   # before any stop below
            x, g = res["expected"], res["expected"]["along_answers"]
            verdict = "agree" if x["agree"] else ("engine defect" if defect else "DISAGREE")
            gate = "pass" if g["agree"] else ("engine defect" if defect else "FAIL")
            print(f"[05b] agreement {key} T={params.temperature:g} top-p {params.top_p:g}: {res['exact_prompts']}/"
                  f"{len(self.prompts)} answers' rounds equal replay along them; {self.engine.label} tau "
                  f"{x['engine_tau']:.3f} vs sampled replay {x['replay_tau']:.3f}, difference {x['difference']:+.3f} "
                  f"[{x['ci'][0]:+.3f}, {x['ci'][1]:+.3f}] ({verdict}); along its answers {gate_summary(g)} ({gate})"
                  + probabilities_summary(res.get("engine_probabilities")))
            if not res["rounds_agree"]:
                bad = next(r for r in res["per_prompt"] if not r["equal"])
                within = "" if not self.tolerance else (
                    f", and its tau differs from replay's along its answers by {res['relative_tau_difference']:.1%}, "
                    f"more than --agreement-tolerance {self.tolerance:g}")
                raise StageError(f"agreement {key} T={params.temperature:g}: {self.engine.label}'s sampled rounds on "
                                 f"prompt {bad['prompt']} ({bad['engine']}) are not replay's along its own answer "
                                 f"({bad['replay']}){within}: the engine does not accept exactly the drafts equal to "
                                 "the tokens it commits (docs/design.md section 11; details in "
                                 f"{self.out / 'agreement'})")
            if not g["agree"] and not defect:   # a known defect is named above and voids the row instead
                raise StageError(f"agreement {key} T={params.temperature:g} top-p {params.top_p:g}: "
                                 f"{self.engine.label} {gate_summary(g)}: beyond {g['threshold']:g} standard "
                                 "deviations" + (f" outside the band of +-{g['band']:.0%} around it" if g["band"] else "")
                                 + probabilities_summary(res.get("engine_probabilities"))
                                 + ", it does not accept a draft d with the probability p(d) of the requested "
                                 "temperature and top-p "
                                 f"(docs/serving.md, 'The probability gate'; details in {self.out / 'agreement'})")
        return out


def float32_bytes(target_dir: Path) -> int | None:
    """Bytes of the target's weights in float32: 4 x the elements of every tensor its safetensors files hold
    (their headers only are read); None without any."""
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return 4 * total


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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


def engine_rounds(ans: dict) -> list[int] | None:
    """The engine's per-round accepted counts where it reports them (vLLM's `per_step_accepted`), else None."""
    eng = ans.get("per_step_accepted")
    return None if eng is None else [int(a) for a in eng]


def verify_count(ans: dict) -> int:
    """The verify rounds an engine that reports totals only counted for one answer (SGLang's spec_verify_ct)."""
    if ans.get("spec_verify_ct") is None:
        raise StageError("the engine returned neither per-round acceptance (per_step_accepted) nor its verify "
                         "count (spec_verify_ct): the agreement check cannot tell its rounds")
    return int(ans["spec_verify_ct"])


def reports_per_round(answers: list[dict]) -> bool:
    """Whether the engine reported per-round counts (every answer) or totals only (none); one line otherwise."""
    have = {engine_rounds(a) is not None for a in answers}
    if len(have) > 1:
        raise StageError("the engine returned per-round acceptance with some answers and not with others")
    return have == {True}


def answer_rounds(pred: list[list[int]], seq: list[int], num_prompt: int, k: int, eos_ids: set[int]) -> list[int]:
    """The rounds of a chain with a one-hot draft, from its answer alone (module doc): seq = prompt + the answer,
    nothing past it (an engine that cuts a round at the budget or an end of turn, as SGLang does). Its length is
    the number of verify rounds the engine ran."""
    return replay_rounds(pred, seq, num_prompt, len(seq) - num_prompt, k, eos_ids)


def rounds_from_answer(models, ids: list[int], answer: list[int], k: int, points: list[int] | None = None
                       ) -> list[int]:
    """answer_rounds of one answer with our draft (`points` overrides the capture points it reads)."""
    import torch

    from common.benchmark import replay as rp

    target, draft, eos, trained_points = models
    seq = list(ids) + list(answer)
    with torch.no_grad():
        aux, _ = rp.target_features(target, seq, points or trained_points)
    return answer_rounds(rp.draft_predictions(draft, aux, seq, k).tolist(), seq, len(ids), k, eos)


def count_totals(answers: list[dict], counts: list[int]) -> dict:
    """totals() of an engine that reports verify counts only: rounds and tau (without the prefill token)."""
    n = sum(counts)
    accepted = sum(len(a["output_ids"]) - 1 for a in answers) - n   # each round commits its accepted + 1
    return {"num_rounds": n, "accepted_per_position": None, "tau": 1 + accepted / n if n else None}


def check_answers(models, prompts: list[list[int]], answers: list[dict], k: int, tolerance: float) -> dict:
    """Replay every engine answer and compare round by round; on disagreement name the layer. An engine that
    reports totals only (SGLang) is compared request by request: its verify count against the rounds its
    answer gives with our draft (answer_rounds)."""
    if not reports_per_round(answers):
        return check_totals(models, prompts, answers, k, tolerance)
    per_prompt, engine_rounds_, our_rounds = [], [], []
    first_bad = None
    for i, (ids, ans) in enumerate(zip(prompts, answers)):
        ours, off = replay_prompt(models, ids, ans["output_ids"], k)
        eng = engine_rounds(ans)
        at = first_difference(eng, ours)
        per_prompt.append({"prompt": i, "engine": eng, "replay": ours, "first_disagreeing_round": at,
                           "answer_not_greedy_at": off, "answer_tokens": len(ans["output_ids"])})
        engine_rounds_.append(eng)
        our_rounds.append(ours)
        if at is not None and first_bad is None:
            first_bad = i
    e_tot, r_tot = totals(engine_rounds_, k), totals(our_rounds, k)
    rel = abs(e_tot["tau"] - r_tot["tau"]) / r_tot["tau"] if r_tot["tau"] else 0.0
    exact = first_bad is None
    result = {"num_draft_tokens": k, "reports_per_round": True, "engine": e_tot, "replay": r_tot,
              "relative_tau_difference": rel, "exact": exact, "tolerance": tolerance, "per_prompt": per_prompt,
              "agree": exact if tolerance == 0 else rel <= tolerance, "layer": None, "detail": None}
    if not result["agree"]:
        result["layer"], result["detail"] = diagnose(models, prompts, answers, per_prompt, k, first_bad)
    return result


def check_totals(models, prompts: list[list[int]], answers: list[dict], k: int, tolerance: float) -> dict:
    """check_answers for an engine that reports request totals only: each answer's verify count against the
    rounds of answer_rounds. The layers it can name: draft's inputs (capture points shifted by -1 / +1 give
    the engine's counts), else draft's outputs or accounting, which totals alone cannot tell apart."""
    per_prompt, counts, our_rounds = [], [], []
    for i, (ids, ans) in enumerate(zip(prompts, answers)):
        ours, count = rounds_from_answer(models, ids, ans["output_ids"], k), verify_count(ans)
        per_prompt.append({"prompt": i, "engine": count, "replay": ours, "equal": len(ours) == count,
                           "answer_tokens": len(ans["output_ids"])})
        counts.append(count)
        our_rounds.append(ours)
    e_tot, r_tot = count_totals(answers, counts), totals(our_rounds, k)
    rel = abs(e_tot["tau"] - r_tot["tau"]) / r_tot["tau"] if r_tot["tau"] else 0.0
    exact = all(r["equal"] for r in per_prompt)
    result = {"num_draft_tokens": k, "reports_per_round": False, "engine": e_tot, "replay": r_tot,
              "relative_tau_difference": rel, "exact": exact, "tolerance": tolerance, "per_prompt": per_prompt,
              "agree": exact if tolerance == 0 else rel <= tolerance, "layer": None, "detail": None}
    if not result["agree"]:
        bad = next(r for r in per_prompt if not r["equal"])
        target = models[0]
        num_hidden, points = int(target.config.num_hidden_layers), list(models[3])
        for shift in (-1, 1):
            moved = [q + shift for q in points]
            if all(1 <= q <= num_hidden - 1 for q in moved) and all(
                    len(rounds_from_answer(models, ids, a["output_ids"], k, moved)) == c
                    for ids, a, c in zip(prompts, answers, counts)):
                result["layer"], result["detail"] = ("draft's inputs", (
                    f"the engine's verify counts are those of a draft fed the inputs of layers {moved}, not the "
                    f"capture points {points} it was trained on"))
                return result
        result["layer"], result["detail"] = ("draft's outputs or accounting", (
            f"prompt {bad['prompt']}: the engine verified {bad['engine']} rounds for its {bad['answer_tokens']}-token "
            f"answer, where the answer and our draft give {len(bad['replay'])}: another draft's proposals, or "
            "rounds counted otherwise (its totals cannot tell which)"))
    return result


def check_sampled_answers(models, prompts: list[list[int]], answers: list[dict], k: int, params,
                          max_new_tokens: int, seed: int, tolerance: float = 0.0) -> dict:
    """A sampled engine against replay (docs/design.md section 11), two ways.

    exact: under the engines' rule (vLLM 0.32's default greedy draft, SGLang's topk 1; q one-hot) a draft is
      accepted iff the committed token equals it, so replay along the engine's OWN sampled answer must give its
      rounds. With per-round counts (vLLM) every round but the last is compared for equality; the last may run
      past the answer's end, where the engine judged its drafts on tokens it sampled and then cut (budget, end
      of turn), which replay cannot see, so there the engine's count must be >= replay's. With totals only
      (SGLang, which cuts the round at the answer's end) the answer's rounds (answer_rounds) must be as many as
      its verify count. `tolerance` > 0 (a bf16 engine, whose draft may pick another argmax at a near tie): the
      engine's tau and replay's along the same answers may differ by that relative amount instead.
    expected: the sampled replay's prediction (our target samples independent continuations of the same
      prompts, sampled.replay_prompt) against the engine's tau, both counted as 05's loop counts (tokens
      committed in rounds / rounds), with the paired bootstrap interval over prompts of the difference
      (reported); and, enforced, `along_answers`: every draft the engine judged on a token of its own
      answer against p(d), the probability the requested temperature and top-p give it (probability_gate, with
      `tolerance` as its band), with each prompt's own z in `per_prompt`.
      The exact half holds for ANY target distribution (accepted iff committed == draft); this one sees it."""
    from common.benchmark import replay as rp
    from common.benchmark import sampled as smp
    from common.benchmark import spec_decode as sd

    target, draft, eos, points = models
    per_round = reports_per_round(answers)
    per_prompt, engine_side, our_rounds, predicted, judged = [], [], [], [], []
    pairs, outside = [], []   # the engine's own p(d) where its answers carry them (engine_pairs)
    for i, (ids, ans) in enumerate(zip(prompts, answers)):
        seq = list(ids) + list(ans["output_ids"])
        aux, probs = smp.target_probs(target, seq, points, params)   # the one forward: aux and p at T / top-p
        pred = rp.draft_predictions(draft, aux, seq, k).tolist()
        ours = answer_rounds(pred, seq, len(ids), k, eos)
        if per_round:
            eng = engine_rounds(ans)
            equal = len(eng) == len(ours) and eng[:-1] == ours[:-1] and (not eng or eng[-1] >= ours[-1])
        else:   # the answer's own rounds stand for the engine's: its verify count checks them
            eng = verify_count(ans)
            equal = eng == len(ours)
        mine = judged_drafts(eng if per_round else ours, pred, probs, len(ids), len(seq))
        judged += mine
        if ans.get("logprobs") is not None:
            got, missed = engine_pairs(mine, ans["logprobs"], len(ids))
            pairs, outside = pairs + got, outside + missed
        per_prompt.append({"prompt": i, "engine": eng, "replay": ours, "equal": equal,
                           "answer_tokens": len(ans["output_ids"]), "z": gate_z(mine)})
        engine_side.append(eng)
        our_rounds.append(ours)
        g = smp.generator(target.device, smp.prompt_seed(seed, list(ids), params, "replay"))
        cont = sd.sample_decode(target, list(ids), max_new_tokens, eos, params, g)
        res, _ = smp.replay_prompt(target, {"d": draft}, list(ids) + cont, len(ids), points, params, [k],
                                   max_new_tokens, eos)
        predicted.append(res["d"][k])
    enum = [len(a["output_ids"]) - 1 for a in answers]
    eden = [len(r) for r in engine_side] if per_round else list(engine_side)
    pnum, pden = [p.emitted for p in predicted], [p.rounds for p in predicted]
    diff = rp.bootstrap_paired_difference(enum, eden, pnum, pden, seed=seed)
    exact_prompts = sum(r["equal"] for r in per_prompt)
    e_tot = totals(engine_side, k) if per_round else count_totals(answers, engine_side)
    r_tot = totals(our_rounds, k)
    rel = abs(e_tot["tau"] - r_tot["tau"]) / r_tot["tau"] if r_tot["tau"] else 0.0
    exact = exact_prompts == len(per_prompt)
    return {"temperature": params.temperature, "top_p": params.top_p, "num_draft_tokens": k,
            "reports_per_round": per_round, "engine": e_tot, "replay": r_tot,
            "exact": exact, "exact_prompts": exact_prompts, "relative_tau_difference": rel, "tolerance": tolerance,
            "rounds_agree": exact if tolerance == 0 else rel <= tolerance, "per_prompt": per_prompt,
            "expected": {"engine_tau": sum(enum) / sum(eden), "replay_tau": sum(pnum) / sum(pden),
                         "difference": diff["difference"], "ci": diff["ci"],
                         "agree": diff["ci"][0] <= 0 <= diff["ci"][1],
                         "along_answers": probability_gate(judged, k, tolerance)},
            "engine_probabilities": engine_probabilities(pairs, outside, k)
            if any(a.get("logprobs") is not None for a in answers) else None}


def judged_drafts(accepted: list[int], pred: list[list[int]], probs, num_prompt: int,
                  end: int) -> list[tuple[int, float, bool, int, int]]:
    """(draft position j, p(d), accepted, p row, d) of every draft the engine judged on a token of its own answer
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
            out.append((j, float(probs[t + 1 + j, pred[j][t]]), j < a, t + 1 + j, pred[j][t]))
        n_ctx += a + 1
    return out


# The probability gate (docs/serving.md, "The probability gate"). A = the drafts accepted, S = sum p(d), V =
# sum p(d)(1 - p(d)) over every judged draft. A correct engine accepts each draft with probability p(d) given
# everything before it, so A - S is a martingale with predictable variance V and z = (A - S) / sqrt(V) is
# standard normal (martingale CLT; a simulation gave z sd 0.96). An engine that computes p(d) with a numerical
# difference accepts with p'(d) = p(d)(1 + e_d), and A - S drifts by sum p e_d, which grows like the number of
# judged drafts while the noise grows like its square root: a fixed |z| bound fails such an engine once enough
# prompts are judged (a one-point gap from about 6,000 judged drafts). So the gate allows a stated relative band
# b around S (the agreement tolerance: the relative difference the check already allows in tau, read as one in
# p(d)): E[A] lies in [S(1 - b), S(1 + b)] for every engine within it, and z_band = (A - the nearest point of
# that band) / sqrt(V) exceeds Z_MAX with probability at most P(|N(0, 1)| > Z_MAX) = 6e-5 for it, whatever the
# number of prompts: the gate grows no stricter with more of them. It fails an engine whose relative deviation
# exceeds b + Z_MAX sqrt(V) / S (`resolution`, reported: 25% on the ~110 judged drafts of tests/units/benchmark/test_sampled.py,
# so a 1.2x temperature passes there; it shrinks like 1 / sqrt(n) down to b). Z_MAX = 4: 3 (2.7e-3) would stop a correct
# engine every few hundred checks (a sweep runs settings x temperatures of them), while an engine off by a
# factor in temperature lands far past 4 (tests/units/benchmark/test_sampled.py, 3x the temperature: z -11 to -17 over 20
# seeds, the right engine |z| <= 2.0). The normal law is worst where p is near 0 or 1 (the count is then
# Poisson-like and skewed): with V >= 10 a Poisson count still exceeds 4 standard deviations less than 3e-4 of
# the time, so below that the gate reports and does not judge.
Z_MAX = 4.0
MIN_VARIANCE = 10.0


def gate_sums(rows) -> tuple[int, float, float]:
    """(accepted, sum p, sum p(1 - p)) of judged drafts (judged_drafts' rows: position, p(d), accepted, ...)."""
    return (sum(r[2] for r in rows), sum(r[1] for r in rows), sum(r[1] * (1 - r[1]) for r in rows))


def gate_z(rows) -> float | None:
    """z = (A - S) / sqrt(V) of judged drafts; None without variance (nothing judged, or every p 0 or 1)."""
    a, total, var = gate_sums(rows)
    return (a - total) / var ** 0.5 if var > 0 else None


def probability_gate(judged: list[tuple], k: int, band: float = 0.0) -> dict:
    """judged_drafts of every answer -> per draft position and in all: judged, accepted, expected (sum p), z;
    z_band outside the relative `band` around the expected count, `resolution` (the smallest relative deviation
    of the acceptance the gate fails: band + Z_MAX sqrt(V) / S); `agree` False only when judged
    (V >= MIN_VARIANCE) and |z_band| > Z_MAX."""
    by_pos = [[r for r in judged if r[0] == j] for j in range(k)]
    accepted, expected, variance = gate_sums(judged)
    low, high = expected * (1 - band), expected * (1 + band)
    outside = accepted - min(max(accepted, low), high)
    z_band = outside / variance ** 0.5 if variance > 0 else None
    return {"judged": [len(r) for r in by_pos], "accepted": [gate_sums(r)[0] for r in by_pos],
            "expected": [gate_sums(r)[1] for r in by_pos], "z_by_position": [gate_z(r) for r in by_pos],
            "z": gate_z(judged), "z_band": z_band, "band": band, "variance": variance, "threshold": Z_MAX,
            "resolution": band + Z_MAX * variance ** 0.5 / expected if expected > 0 else None,
            "min_variance": MIN_VARIANCE, "enforced": variance >= MIN_VARIANCE,
            "agree": variance < MIN_VARIANCE or abs(z_band) <= Z_MAX}


ENGINE_LOGPROBS = 20   # top logprobs asked per answer token where the engine returns the verify's (vLLM's default cap)


def engine_pairs(judged: list[tuple], logprobs: list[dict], num_prompt: int) -> tuple[list[tuple], list[float]]:
    """(j, replay's p(d), accepted, the engine's p(d)) of every draft judged along one answer whose d is among the
    engine's returned logprobs (`logprobs[i]`: {token id: logprob} of answer token i, its top ENGINE_LOGPROBS and
    the token it committed), and replay's p(d) of those that were not. A draft judged by p row r is at answer
    token r + 1 - num_prompt."""
    import math

    pairs, outside = [], []
    for j, p, acc, row, d in judged:
        i = row + 1 - num_prompt
        top = logprobs[i] if 0 <= i < len(logprobs) else None
        if top is None:
            continue
        if d in top:
            pairs.append((j, p, acc, math.exp(top[d])))
        else:
            outside.append(p)
    return pairs, outside


def engine_probabilities(pairs: list[tuple], outside: list[float], k: int) -> dict:
    """The engine's own p(d) against replay's over engine_pairs of every answer, where the engine returns the
    distribution it verified against (vLLM's processed logprobs: after temperature and top-p): sums, differences,
    and the gate's z with each. `z_engine` near 0 while `z_replay` is far from it: the acceptance follows the
    engine's own probabilities and the gap is in computing p(d) (numerics); both far: the acceptance itself."""
    left = {"outside_top": len(outside), "outside_top_replay_sum": sum(outside)}   # drafts below the engine's top
    if not pairs:
        return {"compared": 0, **left}
    engine_rows, replay_rows = [(j, pe, acc) for j, _, acc, pe in pairs], [(j, p, acc) for j, p, acc, _ in pairs]
    diffs = [pe - p for _, p, _, pe in pairs]
    e_sum, r_sum = gate_sums(engine_rows)[1], gate_sums(replay_rows)[1]
    return {"compared": len(pairs), **left, "replay_sum": r_sum, "engine_sum": e_sum,
            "relative_difference": e_sum / r_sum - 1 if r_sum else None,
            "mean_abs_difference": sum(abs(x) for x in diffs) / len(diffs), "max_abs_difference": max(map(abs, diffs)),
            "by_position": [{"engine_sum": gate_sums([r for r in engine_rows if r[0] == j])[1],
                             "replay_sum": gate_sums([r for r in replay_rows if r[0] == j])[1]} for j in range(k)],
            "z_engine": gate_z(engine_rows), "z_replay": gate_z(replay_rows)}


def probabilities_summary(x: dict | None) -> str:
    """The engine's own p(d) against replay's (engine_probabilities), as a clause of the sampled line."""
    if not x or x.get("why_not") or not x.get("compared"):
        return ""
    return (f"; its own p(d) sum {x['engine_sum']:.1f} vs replay's {x['replay_sum']:.1f} ({x['relative_difference']:+.2%}) "
            f"over {x['compared']} drafts ({x['outside_top']} below its top {ENGINE_LOGPROBS}, replay's p(d) "
            f"{x['outside_top_replay_sum']:.2f} there), mean |difference| {x['mean_abs_difference']:.2g}, z with its own p(d) "
            f"{x['z_engine']:+.1f} (with replay's {x['z_replay']:+.1f})")


def gate_summary(g: dict) -> str:
    """One line of probability_gate's result: in all and per draft position (1-based), accepted of judged
    against the expected count; z, and outside the band; the deviation the gate resolves."""
    per = ", ".join(f"{j + 1}: {a}/{n} vs {e:.1f}" for j, (n, a, e) in enumerate(zip(g["judged"], g["accepted"],
                                                                                      g["expected"])) if n)
    note = "" if g["enforced"] else f", too few to judge (sum p(1-p) {g['variance']:.1f} < {g['min_variance']:g})"
    fmt_z = lambda z: "-" if z is None else format(z, "+.1f")  # noqa: E731
    band = f", outside the +-{g['band']:.0%} band {fmt_z(g['z_band'])}" if g.get("band") else ""
    sees = "" if g.get("resolution") is None else f"; it sees deviations beyond +-{g['resolution']:.0%}"
    return (f"accepts {sum(g['accepted'])} of {sum(g['judged'])} judged drafts where p(d) expects "
            f"{sum(g['expected']):.1f} (z {fmt_z(g['z'])}{band}{sees}; by draft position {per or '-'}{note})")


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
