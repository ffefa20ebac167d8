"""Acceptance under sampling: replay the draft along continuations the target SAMPLES (temperature T, top-p,
seeded per prompt), and check it against the real sampled speculative loop (spec_decode.speculative_decode
with `sampling`). docs/design.md section 11 states what is exact and what is estimated.

Why replay along one sampled continuation is right (chain drafts, k per round). In the loop every committed
token is distributed as target sampling given its prefix, whatever the draft does; so the committed output x
of a sampled speculative run IS a target sample. What the rule decides is only where the rounds fall:
  engine rule (vLLM 0.32, SGLang 0.5.14: the draft proposes its argmax d, q one-hot): draft d is accepted
    w.p. p(d) and a rejection is resampled from p without d, so "accepted" is EXACTLY the event x = d.
    Given x the rounds are a deterministic walk: replay.replay on prompt + x (accept while the draft's
    prediction equals the sampled token). Sampling x from the target and walking it has the loop's joint
    distribution of output and rounds - not an approximation.
  textbook rule (the draft samples from q = softmax(draft logits / T)): P(accepted, x) = min(p(x), q(x)), so
    given x each judged draft is accepted independently w.p. min(1, q(x)/p(x)), and an accepted draft IS
    x - the draft's chain inputs equal the teacher-forced inputs of the TTT unroll. Given x, the expected
    round statistics follow exactly from a walk over positions weighted by those probabilities
    (expected_rounds).
So tau is the expectation over sampled continuations, estimated by one continuation per prompt; the
bootstrap over prompts covers that sampling noise too. The per-position acceptance is reported twice:
as counted along the walk, and as its conditional expectation given the prefix (engine: p(d); textbook:
sum_v min(p, q) = 1 - TV(p, q)), the exact acceptance probability of each judged draft, read from the same
one target forward; the second has less noise, and both estimate the same number.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.benchmark import replay as rp
from common.benchmark import spec_decode as sd
from common.io import iter_jsonl, write_jsonl
from common.parallel import ordered_map


def prompt_seed(seed: int, prompt_ids: list[int], params: sd.SamplingParams, stream: str) -> int:
    """The seed of one prompt's random draws: a function of 05's and 05b's --bench-seed, the prompt's ids, T, top-p and the
    stream ("replay": the continuation replay walks; "loop/k5": the sampled loop at k = 5), never of the
    prompt's place in the list, so --num-prompts subsets and reruns draw the same numbers."""
    key = json.dumps([seed, prompt_ids, params.temperature, params.top_p, stream]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# How the cached answers were sampled: part of the cache's name. Bump it whenever a change could change the
# tokens drawn for the same (target, prompt, budget, eos, T, top-p, seed). "batched1": sd.sample_decode_batch
# (2026-12-05; the one-at-a-time sample_decode's files, named without it, are not read).
SAMPLER_VERSION = "batched1"
DEFAULT_SAMPLE_BATCH_SIZE = 32   # benchmarks/bench_batch_sampling.py on SmolLM2 (README): 32 beat 8 and 16


def sampled_cache_file(greedy_cache_file: Path, params: sd.SamplingParams, seed: int) -> Path:
    """Beside the greedy answers (reference.replay_cache_file: same weights / budget / eos key), named by
    T, top-p, seed and SAMPLER_VERSION. Not by the batch size: a row's draws do not depend on its batch
    (sd.sample_decode_batch); the batch changes only float noise in the logits."""
    stem = greedy_cache_file.name.removesuffix("_greedy.jsonl")
    return greedy_cache_file.parent / (f"{stem}_T{params.temperature:g}_topp{params.top_p:g}_seed{seed}_"
                                       f"{SAMPLER_VERSION}.jsonl")


def sampled_continuations(target, rows: list[dict], max_new_tokens: int, eos: set[int], params: sd.SamplingParams,
                          seed: int, cache_file: Path, batch_size: int = DEFAULT_SAMPLE_BATCH_SIZE,
                          workers: int = 1) -> list[list[int]]:
    """One target-only sampled answer per row, cached: the prompts not in the cache, by length, in batches of
    `batch_size` (sd.sample_decode_batch), each answer drawn with its own generator seeded
    prompt_seed(..., "replay"), so it is the answer sd.sample_decode would draw with that seed alone (up
    to float near-ties) whatever the batch. The batches run in `workers` processes (common/parallel.py; the
    same batches, so the same answers); the cache is rewritten after every batch."""
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")

    def key(ids):
        return hashlib.sha256(json.dumps(ids).encode()).hexdigest()

    cached = {r["prompt_sha256"]: r["continuation"] for r in iter_jsonl(cache_file)} if cache_file.is_file() else {}
    missing = list({key(r["prompt_ids"]): r["prompt_ids"] for r in rows if key(r["prompt_ids"]) not in cached}.values())
    missing.sort(key=len)                        # less padding in each batch
    with tqdm(total=len(missing), desc=f"[05] target samples T={params.temperature:g} (batch {batch_size})",
              unit="prompt", disable=not missing) as bar:
        def draw(batch: list[list[int]]) -> list[list[int]]:
            gens = [generator(target.device, prompt_seed(seed, ids, params, "replay")) for ids in batch]
            return sd.sample_decode_batch(target, batch, max_new_tokens, eos, params, gens)

        batches = [missing[start:start + batch_size] for start in range(0, len(missing), batch_size)]
        for batch, conts in zip(batches, ordered_map(draw, batches, workers)):
            for ids, cont in zip(batch, conts):
                cached[key(ids)] = cont
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_jsonl(cache_file, ({"prompt_sha256": k, "continuation": v} for k, v in cached.items()))
            bar.update(len(batch))
    return [cached[key(r["prompt_ids"])] for r in rows]


@torch.no_grad()
def target_probs(target, seq: list[int], points: list[int], params: sd.SamplingParams):
    """One teacher-forced target forward over `seq`: (aux [1, L, 3H], p [L, V]: row r = the tempered,
    top-p-cut distribution of token r+1 given seq[..r])."""
    logits, aux = sd.target_forward(target, torch.tensor([seq], device=target.device), None, points)
    return aux, sd.sampling_probs(logits[0], params.temperature, params.top_p)


@torch.no_grad()
def acceptance_tables(draft, aux: torch.Tensor, seq: list[int], probs: torch.Tensor, params: sd.SamplingParams,
                      num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft step j and anchor t (the draft's chain step j at anchor t proposes token t+2+j, judged by
    p row t+1+j), given the continuation x = seq:
      accept [K, L]  P(draft accepted | x): engine 1{argmax == x[t+2+j]}; textbook min(1, q(x)/p(x))
      alpha  [K, L]  P(draft accepted | the prefix x[..t+1+j]): engine p(argmax); textbook sum min(p, q)
    Columns past the sequence stay 0. A sampled token outside this forward's top-p set (p(x) = 0, see
    off_support) is judged accepted under the textbook rule, as min(1, q/0) says."""
    L = len(seq)
    x = torch.tensor(seq, device=aux.device)
    outs = draft(aux, x[None], num_steps)                                   # K x [1, L, H]
    accept = torch.zeros(num_steps, L, device=aux.device)
    alpha = torch.zeros(num_steps, L, device=aux.device)
    for j, h in enumerate(outs):
        n = L - 2 - j                                                       # anchors t = 0..n-1 have a token
        if n <= 0:
            continue
        logits = draft.logits(h)[0, :n].float()                            # [n, Dv]
        rows = torch.arange(n, device=x.device) + 1 + j                     # p rows judging step j
        xs = x[2 + j:2 + j + n]                                             # the sampled tokens they judge
        px = probs[rows, xs]                                                # [n]
        if params.rule == "engine":
            d = draft.draft_to_target(logits.argmax(-1))                     # [n] target ids
            accept[j, :n] = (d == xs).float()
            alpha[j, :n] = probs[rows, d]
        else:
            q = torch.softmax(logits / params.temperature, dim=-1)         # [n, Dv]
            vocab = draft.draft_to_target(torch.arange(q.shape[-1], device=x.device))   # [Dv] target ids
            alpha[j, :n] = torch.minimum(probs[rows][:, vocab], q).sum(-1)
            to_draft = torch.full((probs.shape[-1],), -1, dtype=torch.long, device=x.device)
            to_draft[vocab] = torch.arange(vocab.numel(), device=x.device)
            di = to_draft[xs]                                               # -1: x not in the draft vocab, q(x) = 0
            qx = torch.where(di >= 0, q[torch.arange(n, device=x.device), di.clamp_min(0)], torch.zeros_like(px))
            accept[j, :n] = torch.where(px > 0, (qx / px.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(px))
    return accept, alpha


def off_support(probs: torch.Tensor, seq: list[int], num_prompt: int) -> int:
    """Continuation tokens outside this forward's top-p set (p = 0): only where the incremental forward
    that sampled them and this whole-sequence one differ in float at the nucleus' edge."""
    rows = torch.arange(num_prompt - 1, len(seq) - 1, device=probs.device)
    return int((probs[rows, torch.tensor(seq[num_prompt:], device=probs.device)] == 0).sum())


@dataclass
class Expected:
    """One prompt's round statistics in expectation given its continuation (float counts; with 0/1
    acceptance they are the integer counts of replay.replay)."""
    rounds: float = 0.0
    emitted: float = 0.0
    reached: list[float] = field(default_factory=list)    # per draft position j: rounds that judged it
    hit: list[float] = field(default_factory=list)        # ... and accepted it
    alpha: list[float] = field(default_factory=list)      # ... sum of its acceptance probability given the prefix
    histogram: list[float] = field(default_factory=list)  # rounds that accepted exactly a drafts


def expected_rounds(accept: list[list[float]], alpha: list[list[float]], seq: list[int], num_prompt: int,
                    k: int, max_new_tokens: int, eos_ids: set[int]) -> Expected:
    """The rounds of spec_decode.speculative_decode along the fixed continuation seq[num_prompt:], in
    expectation over the acceptances (independent given the continuation, accept[j][t] each), counted
    exactly as replay.replay / commit_round count them (budget, end-of-turn, correction/bonus).

    A round is determined by where it starts (n_ctx: pending = seq[n_ctx]; the tokens committed so far
    are n_ctx - num_prompt + 1), so the walk carries the probability that a round starts at each position,
    left to right - one pass over positions, at most k + 1 outcomes each."""
    out = Expected(reached=[0.0] * k, hit=[0.0] * k, alpha=[0.0] * k, histogram=[0.0] * (k + 1))
    start = {num_prompt: 1.0}
    for n in range(num_prompt, len(seq)):
        w = start.pop(n, 0.0)
        if w == 0.0:
            continue
        tokens = n - num_prompt + 1
        if seq[n] in eos_ids or tokens >= max_new_tokens:    # only the prefill's token can end it here
            continue
        k_eff = min(k, max_new_tokens - tokens - 1)
        t = n - 1
        at_least = w                              # P(this round accepts >= a drafts)
        for a in range(k_eff + 1):
            stop = a == k_eff or (a > 0 and seq[t + 1 + a] in eos_ids)   # replay's break at an accepted eos
            more = 0.0 if stop else at_least * accept[a][t]
            mass = at_least - more                 # P(exactly a accepted)
            if mass > 0.0:
                emitted = _commit(out, mass, seq[n + 1:n + 2 + a], a, k_eff, alpha, t, eos_ids)
                if seq[n + emitted] not in eos_ids and tokens + emitted < max_new_tokens:
                    start[n + a + 1] = start.get(n + a + 1, 0.0) + mass
            if stop or more == 0.0:
                break
            at_least = more
    return out


def _commit(out: Expected, mass: float, new: list[int], accepted: int, judged: int, alpha, t: int,
            eos_ids: set[int]) -> int:
    """commit_round's accounting, weighted by `mass`; returns the tokens the round commits."""
    eos_at = next((i for i, x in enumerate(new) if x in eos_ids), None)
    if eos_at is not None and eos_at < accepted:
        new = new[:eos_at + 1]
        accepted = judged = eos_at + 1
    out.rounds += mass
    out.emitted += mass * len(new)
    out.histogram[accepted] += mass
    for j in range(min(judged, accepted + 1)):
        out.reached[j] += mass
        out.hit[j] += mass * (j < accepted)
        out.alpha[j] += mass * alpha[j][t]
    return len(new)


def expected_stats(results: list[Expected], k: int) -> dict:
    """sd.acceptance_stats for expected counts: tau = sum emitted / sum rounds over prompts."""
    rounds, emitted = sum(r.rounds for r in results), sum(r.emitted for r in results)
    reached = [sum(r.reached[j] for r in results) for j in range(k)]
    hit = [sum(r.hit[j] for r in results) for j in range(k)]
    alpha = [sum(r.alpha[j] for r in results) for j in range(k)]
    return {"tau": emitted / rounds if rounds else None,
            "per_position_acceptance": [h / n if n else None for h, n in zip(hit, reached)],
            "per_position_acceptance_given_prefix": [a / n if n else None for a, n in zip(alpha, reached)],
            "per_position_reached": reached,
            "accept_length_histogram": [sum(r.histogram[a] for r in results) for a in range(k + 1)],
            "num_rounds": rounds, "num_emitted_in_rounds": emitted}


def replay_prompt(target, drafts: dict, seq: list[int], num_prompt: int, points: list[int],
                  params: sd.SamplingParams, ks: list[int], max_new_tokens: int, eos: set[int],
                  draft_points: dict | None = None):
    """({draft name: {k: Expected}}, off-support tokens) for one prompt + continuation: one target forward
    (at the union of `points` and `draft_points`), one TTT forward per draft (fed its own points from
    draft_points, else `points`)."""
    draft_points = draft_points or {}
    union = rp.union_points(points, draft_points)
    aux, probs = target_probs(target, seq, union, params)
    out = {}
    for name, draft in drafts.items():
        own = rp.select_points(aux, union, draft_points.get(name, points))
        accept, alpha = acceptance_tables(draft, own, seq, probs, params, max(ks))
        accept, alpha = accept.tolist(), alpha.tolist()
        out[name] = {k: expected_rounds(accept, alpha, seq, num_prompt, k, max_new_tokens, eos) for k in ks}
    return out, off_support(probs, seq, num_prompt)


def run_sampled(args, target, drafts: dict, rows: list[dict], points: list[int], eos: set[int],
                greedy_cache_file: Path, draft_points: dict | None = None) -> dict:
    """05's reference block for every temperature > 0 in --acceptance-temperatures: replay tau (trained,
    untrained) with a bootstrap interval over prompts, and the sampled loop on the first
    --acceptance-loop-prompts prompts against the replay's prediction on the same prompts. Every draft in
    `drafts` is replayed (draft_points: see replay_prompt; the loop runs trained at `points`); each
    temperature's "prompt_totals" holds {name: {k: (per-prompt emitted, per-prompt rounds)}} of all."""
    from tqdm import tqdm

    ks = sorted(set(args.num_draft_tokens))
    max_new = args.benchmark_max_new_tokens
    n_loop = args.loop_prompts if args.acceptance_loop_prompts is None else args.acceptance_loop_prompts
    loop_rows = rows if n_loop is None else rows[:n_loop]
    out = {"rule": args.acceptance_rule, "top_p": args.acceptance_top_p, "loop_prompts": len(loop_rows),
           "by_temperature": {}}
    for temp in sorted({float(t) for t in args.acceptance_temperatures if float(t) > 0}):
        params = sd.SamplingParams(temp, args.acceptance_top_p, args.acceptance_rule)
        conts = sampled_continuations(target, rows, max_new, eos, params, args.bench_seed,
                                      sampled_cache_file(greedy_cache_file, params, args.bench_seed),
                                      args.sample_batch_size, args.benchmark_workers)
        per = {name: {k: [] for k in ks} for name in drafts}
        off_support = 0

        def replay_one(row_cont):
            row, cont = row_cont
            return replay_prompt(target, drafts, row["prompt_ids"] + cont, len(row["prompt_ids"]), points,
                                 params, ks, max_new, eos, draft_points)

        for res, off in tqdm(ordered_map(replay_one, zip(rows, conts), args.benchmark_workers), total=len(rows),
                             desc=f"[05] sampled replay T={temp:g}", unit="prompt"):
            off_support += off
            for name in drafts:
                for k in ks:
                    per[name][k].append(res[name][k])
        totals = {name: {k: ([r.emitted for r in per[name][k]], [r.rounds for r in per[name][k]]) for k in ks}
                  for name in drafts}
        by_k = {}
        for k in ks:
            t, u = expected_stats(per["trained"][k], k), expected_stats(per["untrained"][k], k)
            (num, den), (unum, uden) = totals["trained"][k], totals["untrained"][k]
            by_k[str(k)] = {"tau": t["tau"], "tau_ci95": list(rp.bootstrap_ratio(num, den, seed=args.bench_seed)),
                            "untrained_tau": u["tau"],
                            "untrained_tau_ci95": list(rp.bootstrap_ratio(unum, uden, seed=args.bench_seed)),
                            "per_position_acceptance": t["per_position_acceptance"],
                            "per_position_acceptance_given_prefix": t["per_position_acceptance_given_prefix"],
                            "accept_length_histogram": t["accept_length_histogram"], "num_rounds": t["num_rounds"],
                            "per_prompt_emitted": num, "per_prompt_rounds": den}
            if loop_rows:
                predicted = per["trained"][k][:len(loop_rows)]
                by_k[str(k)].update(loop_check(target, drafts["trained"], loop_rows, predicted, params, k, points,
                                               max_new, eos, args.bench_seed, args.benchmark_workers))
        out["by_temperature"][f"{temp:g}"] = {
            "num_continuation_tokens": sum(len(c) for c in conts),
            "continuation_tokens_off_replay_top_p": off_support, "by_num_draft_tokens": by_k,
            "prompt_totals": totals}
    return out


def loop_check(target, draft, rows: list[dict], predicted: list[Expected], params: sd.SamplingParams, k: int,
               points: list[int], max_new: int, eos: set[int], seed: int, workers: int = 1) -> dict:
    """The real sampled loop (seed prompt_seed(..., "loop/k<k>"), independent of the replay's samples) on
    `rows`, against the replay's prediction for the same prompts: the paired bootstrap interval of
    loop tau - replay tau over prompts (both sides are random; agreement = the interval holds 0). Under the
    engine rule also the exact check: replay along the loop's OWN output must give its rounds, round for
    round (the coupling in the module docstring; float near-ties of the draft aside). Prompts run in
    `workers` processes (common/parallel.py): each draws from its own seeded generator, so the loops are
    those of one process."""
    from tqdm import tqdm

    def loop_one(row) -> tuple[sd.SpecResult, bool]:
        ids = row["prompt_ids"]
        g = generator(target.device, prompt_seed(seed, ids, params, f"loop/k{k}"))
        res = sd.speculative_decode(target, draft, ids, k, max_new, eos, points, params, g)
        if params.rule != "engine":
            return res, False
        seq = ids + res.tokens
        aux, _ = rp.target_features(target, seq, points)
        walk = rp.replay(rp.draft_predictions(draft, aux, seq, k), seq, len(ids), k, max_new, eos)
        return res, (walk.accepted, walk.emitted) == (res.accepted, res.emitted)

    loop, same = [], 0
    for res, equal in tqdm(ordered_map(loop_one, rows, workers), total=len(rows),
                           desc=f"[05] sampled loop T={params.temperature:g} k={k}", unit="prompt"):
        loop.append(res)
        same += equal
    lnum, lden = rp.prompt_totals(loop)
    pnum, pden = [r.emitted for r in predicted], [r.rounds for r in predicted]
    diff = rp.bootstrap_paired_difference(lnum, lden, pnum, pden, seed=seed)
    stats = sd.acceptance_stats(loop, k)
    return {"loop_tau": stats["tau"], "loop_tau_ci95": list(rp.bootstrap_ratio(lnum, lden, seed=seed)),
            "loop_per_position_acceptance": stats["per_position_acceptance"],
            "replay_tau_on_loop_prompts": sum(pnum) / sum(pden),
            "loop_minus_replay": diff["difference"], "loop_minus_replay_ci95": diff["ci"],
            "loop_agrees": diff["ci"][0] <= 0 <= diff["ci"][1],
            "loop_equals_replay_along_its_output": same if params.rule == "engine" else None}


def report_lines(m: dict) -> list[str]:
    """report.md's block: tau greedy and at every sampled temperature side by side, then the loop check."""
    def f(x, d=2):
        return "-" if x is None else f"{x:.{d}f}"

    def ci(c):
        return "-" if not c or c[0] is None else f"[{c[0]:.2f}, {c[1]:.2f}]"

    s = m["sampled"]
    temps = list(s["by_temperature"])
    rule = {"engine": "the engines' rule (the draft proposes its argmax, accepted w.p. p(d): vLLM 0.32, SGLang "
                      "0.5.14)", "textbook": "the textbook rule (the draft samples from q at T, accepted w.p. "
                      "min(1, p/q))"}[s["rule"]]
    lines = [f"## tau under sampling (top-p {s['top_p']:g}, {rule})", "",
             "T = 0 is the greedy table above. At T > 0 the target samples one continuation per prompt (seeded per "
             "prompt) and replay walks the rounds along it: exact in distribution, one sample per prompt; the "
             "95% bootstrap interval over prompts covers that sampling too (docs/design.md section 11).", "",
             "| k | tau T=0 | 95% CI | " + " | ".join(f"tau T={t} | 95% CI | untrained T={t}" for t in temps) + " |",
             "|---|---|---|" + "---|---|---|" * len(temps)]
    for k, e in m["by_num_draft_tokens"].items():
        cells = [f"{f(s['by_temperature'][t]['by_num_draft_tokens'][k]['tau'])} | "
                 f"{ci(s['by_temperature'][t]['by_num_draft_tokens'][k]['tau_ci95'])} | "
                 f"{f(s['by_temperature'][t]['by_num_draft_tokens'][k]['untrained_tau'])}" for t in temps]
        lines.append(f"| {k} | {f(e['tau'])} | {ci(e['tau_ci95'])} | " + " | ".join(cells) + " |")
    lines.append("")
    for t in temps:
        bt = s["by_temperature"][t]
        for k, e in bt["by_num_draft_tokens"].items():
            counted = ", ".join(f(p) for p in e["per_position_acceptance"])
            given = ", ".join(f(p) for p in e["per_position_acceptance_given_prefix"])
            lines.append(f"- T={t}, k={k}: per-position acceptance [{counted}] counted along the walk, [{given}] "
                         "given the prefix (p(d), resp. sum min(p, q))")
        if bt["continuation_tokens_off_replay_top_p"]:
            lines.append(f"  - {bt['continuation_tokens_off_replay_top_p']} of {bt['num_continuation_tokens']} sampled "
                         "tokens fall outside the replay forward's top-p set (float differences at the nucleus edge)")
    lines.append("")
    if s["loop_prompts"]:
        lines += [f"The real sampled loop (KV caches, rollback, chain speculative sampling, seeded independently of "
                  f"the replay's samples) on the first {s['loop_prompts']} prompts against the replay's prediction "
                  "on the same prompts; the interval is a paired bootstrap over prompts of loop tau - replay tau:", "",
                  "| T | k | loop tau | 95% CI | replay tau | loop - replay | 95% CI | agree | replay along the loop's "
                  "output = its rounds |", "|---|---|---|---|---|---|---|---|---|"]
        for t in temps:
            for k, e in s["by_temperature"][t]["by_num_draft_tokens"].items():
                same = e["loop_equals_replay_along_its_output"]
                same = "-" if same is None else f"{same}/{s['loop_prompts']}"
                lines.append(f"| {t} | {k} | {f(e['loop_tau'])} | {ci(e['loop_tau_ci95'])} | "
                             f"{f(e['replay_tau_on_loop_prompts'])} | {f(e['loop_minus_replay'], 3)} | "
                             f"{ci(e['loop_minus_replay_ci95'])} | {'yes' if e['loop_agrees'] else 'NO'} | "
                             f"{same} |")
        lines.append("")
    return lines


def engine_sampling(args) -> tuple:
    """05's --acceptance-temperatures > 0 and --acceptance-top-p as the engines' rule (what a served engine
    does, whatever --acceptance-rule the reference models): the sampled agreement check's settings."""
    return tuple(sd.SamplingParams(float(t), args.acceptance_top_p, "engine")
                 for t in sorted({float(t) for t in args.acceptance_temperatures}) if t > 0)
