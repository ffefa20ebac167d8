"""05b (05b_serve_benchmark.py): the same prompts against a baseline and EAGLE-3 servers of one engine
(common/serving/engine.py: SGLang or vLLM); tok/s, TTFT, tau, the agreement check's hook. What the sweep reads
of 05b's flags is one SweepPlan (sweep_plan), what it times one Workload; every answer comes through the engine's
own request. Its metrics become report.md and the plots in common/serving/report.py.

SGLang's side: requests in common/serving/sglang.py; the server-wide tau
(`avg_spec_accept_length`) is a ratio of lifetime counters, so two readings cannot be subtracted; each
run is windowed instead: the counters are reset (POST /set_internal_state) right
before it and read right after it. The reset does not clear the per-interval counters that SGLang
folds into the lifetime ones every 40 decode iterations, so the number may include up to 39 decode
iterations from before the run and miss up to 39 of its last ones; per-request tau is exact. vLLM's
side (requests, counters): common/serving/vllm.py.

A server's counts are checked before they are believed: each answer's completion_tokens against the token
ids that came back and against what its verify rounds can hold (answer_fault), the run's tau against the
server's own (server_tau_fault). A run that fails is refused by name in one line (`refused`): its numbers
are dropped, so no ratio, table, cost model or recommendation takes them (common/serving/deploy.py).

What makes the comparison fair, the same for every server (the baseline included):
- the same warm-up before any timed request: the preflight's short greedy requests and, with the agreement
  check on, the check's own requests (sent unjudged to a server the check does not judge: mirror_agreement);
- warm-up and agreement prompts are held-out prompts that are never timed (05 splits them once, metrics
  "prompt_split"), so no timed prompt reaches a server that has seen it before;
- prefix caching off on every server (launched with the engine's flag; an attached one refused unless its
  info document says off), since the timed passes answer the same prompts again;
- the same prompt-length buckets (--bench-context: common/serving/context.py), built once from held-out
  rows never used for warm-up, and timed on every server at every temperature and concurrency: the grid;
- timed passes at every temperature level (greedy, and each serving temperature of the preset, every request
  pinning every sampling parameter with a fixed seed: request_params), repeated --bench-repeats times: within
  one launched server's life the repeats are separate passes interleaved across temperatures and concurrency
  levels; attached servers take their passes in turn (baseline, EAGLE-3, baseline, ...). Each (setting, T,
  concurrency) ratio gets a 95% interval over the paired passes (deploy.pass_interval).

The break-even map (--simulate-accept-lengths, common/serving/breakeven.py) adds servers that simulate acceptance
(each confirmed simulated by the engine's own lossy test before launch, by its info document and its warm-up), and
the baseline's map passes (answers to the budget); the Sweep keeps their runs in metrics["map"], never in
metrics["runs"], which is all the measured tables, plots and deploy read.
"""
from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.benchmark.formatting import fmt
from common.serving import breakeven, deploy, process
from common.serving.context import SHORT, context_level, longest_bucket
from common.serving.engine import confirm_simulated, refuse_lossy
from common.serving.registry import engine_class, engine_from_args
from common.serving.request_params import request_seed, timed_sampling
from common.serving.settings import ADAPTIVE_STEPS, is_adaptive, simulated_length, timed_levels
from common.stage import StageError
from common.target.manifests import HiddenStatesManifest

# How far a run's tau may lie above the server's own count over the same requests before the run's
# counts are not believed. Honest servers stay far inside it: vLLM's counters also count drafts accepted
# past the token budget, so its tau is never below ours; SGLang's window holds iterations from outside
# the run (its server_tau_note), so it is compared only over runs many times longer than that slop.
SERVER_TAU_TOLERANCE = 0.25
# The numbers a refused run no longer has (None): everything derived from the counts not believed.
BELIEVED = ("completion_tokens", "output_tokens_per_s", "per_request_tokens_per_s", "accept_length_mean",
            "accept_length_pooled", "output_tokens_per_s_passes")
WARMUP_TOKENS = 64  # the preflight's warm-up requests: short, sequential, greedy


def run_prompts(base_url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                timeout: float, request_fn, tags: list[dict] | None = None,
                bound: int | None = None, sampling: list[dict] | None = None) -> dict:
    """All prompts at a given concurrency through `request_fn` (an engine's `request`); the summary over the
    wall time of the whole set, with one record per request in prompt order (`tags[i]`: prompt i's source /
    thinking; its temperature) for the deploy section. `sampling[i]`: prompt i's parameters
    (request_params.timed_sampling; None: greedy).
    Refused (`refused`) when an answer's counts are not believed (answer_fault; `bound`: tokens a verify
    round can commit on a speculative server, round_bound)."""
    sampling = sampling or [None] * len(prompts)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda i: request_fn(base_url, prompts[i], max_new_tokens, timeout,
                                                     sampling=sampling[i]), range(len(prompts))))
    summ = summarize(results, time.perf_counter() - t0, concurrency)
    summ["requests"] = [{**deploy.request_record(r, (tags or [None] * len(results))[i]),
                         "temperature": (sampling[i] or {}).get("temperature", 0.0)} for i, r in enumerate(results)]
    for i, r in enumerate(results):
        why = answer_fault(r, bound)
        if why:
            refuse(summ, f"{base_url}: request {i + 1} of {len(results)}: {why}")
            break
    return summ


def round_bound(setting) -> int:
    """The most tokens one verify round can commit: the deepest draft path (steps; an adaptive setting
    may move up to SGLang's largest candidate steps) and the bonus token."""
    steps = int(setting[0])
    return (max(steps, *ADAPTIVE_STEPS) if is_adaptive(setting) else steps) + 1


def answer_fault(r: dict, bound: int | None) -> str | None:
    """Why one answer's completion_tokens is not believed, else None. On a speculative server it must fit
    in `bound` tokens a verify round plus the prefill token, which no round verifies (tau =
    completion_tokens / spec_verify_ct <= bound + 1 / spec_verify_ct), and it must be the number of token
    ids that came back (a server without ids: at least the number of chunks that carried output)."""
    n, ids, rounds = r["completion_tokens"], r.get("output_ids"), r.get("spec_verify_ct")
    if bound and rounds and n > bound * rounds + 1:
        return (f"completion_tokens {n} over spec_verify_ct {rounds} is tau {n / rounds:.2f}, above the bound "
                f"{(bound * rounds + 1) / rounds:.2f} ({bound} tokens a verify round: {bound - 1} drafts and "
                "the bonus token; and the prefill token)")
    if ids is not None and n != len(ids):
        return f"completion_tokens {n}, but {len(ids)} token ids came back"
    if ids is None and n < r.get("token_chunks", 0):
        return f"completion_tokens {n}, but {r['token_chunks']} streamed chunks carried tokens"
    return None


def server_tau_fault(summ: dict, concurrency: int, slop: int) -> str | None:
    """Why a run's counts are not believed next to the server's own tau over the same window, else None.
    Both without the prefill token (the server's counts hold verify rounds alone); compared only over a
    run of at least 10 x `slop` decode iterations (Engine.server_tau_slop: what the server's window may
    hold from outside the run), rounds / concurrency being the fewest iterations the run can have taken."""
    server = summ.get("server_accept_length")
    reqs = [r for r in summ["requests"] if r["spec_verify_ct"]]
    rounds = sum(r["spec_verify_ct"] for r in reqs)
    if server is None or not rounds or rounds / concurrency < 10 * slop:
        return None
    ours = sum(r["completion_tokens"] - 1 for r in reqs) / rounds
    if ours <= server * (1 + SERVER_TAU_TOLERANCE):
        return None
    return (f"tau {ours:.2f} (completion_tokens without the prefill token, over spec_verify_ct) is more than "
            f"{SERVER_TAU_TOLERANCE:.0%} above the server's own {server:.2f} (server_accept_length)")


def refuse(summ: dict, why: str) -> None:
    """Mark a run whose counts are not believed: `refused` says why in one line, and every number taken
    from those counts is dropped (None), so that no table, ratio, cost model or plot shows it as measured.
    The per-request records stay as the server sent them, for a person to look at."""
    summ["refused"] = why
    summ.update(dict.fromkeys(BELIEVED))


def summarize(results: list[dict], wall_s: float, concurrency: int) -> dict:
    tokens = sum(r["completion_tokens"] for r in results)
    verify = [r["spec_verify_ct"] for r in results if r["spec_verify_ct"]]
    taus = [r["accept_length"] for r in results if r["accept_length"] is not None]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {
        "concurrency": concurrency, "num_requests": len(results), "completion_tokens": tokens,
        "wall_s": wall_s, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "per_request_tokens_per_s": statistics.mean(r["completion_tokens"] / r["latency_s"]
                                                    for r in results if r["latency_s"] > 0),
        "ttft_mean_s": statistics.mean(ttfts) if ttfts else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        # tau two ways: mean of per-request ratios, and pooled (sum tokens / sum verify rounds,
        # the SpecForge bench definition, weighting long answers more)
        "accept_length_mean": statistics.mean(taus) if taus else None,
        "accept_length_pooled": (sum(r["completion_tokens"] for r in results if r["spec_verify_ct"])
                                 / sum(verify)) if verify else None,
        # retried attempts (connection refused/reset, cut streams, 5xx): each request is timed on its
        # successful attempt alone, but the run's wall time holds the backoff waits
        "num_retries": sum(r.get("retries", 0) for r in results),
        "retried_requests": sum(bool(r.get("retries")) for r in results),
    }


def warm_up(base_url: str, prompts: list[list[int]], max_new_tokens: int, timeout: float,
            request_fn) -> list[dict]:
    """The warm-up every server gets before it is timed, the baseline included: each warm-up prompt alone,
    greedy (the preflight judges an EAGLE-3 server's acceptance on these answers: warmup)."""
    return [request_fn(base_url, ids, max_new_tokens, timeout) for ids in prompts]


def warmup(base_url: str, prompts: list[list[int]], max_new_tokens: int, timeout: float,
           request_fn, bound: int | None = None) -> float:
    """Pooled tau over the warm-up's answers (the preflight's acceptance probe). Each answer's counts are
    checked as a timed run's are (answer_fault; `bound`: round_bound of the server's setting): a tau the
    setting cannot reach, or a count that is not the ids that came back, stops the preflight in one line."""
    res = warm_up(base_url, prompts, max_new_tokens, timeout, request_fn)
    verify = sum(r["spec_verify_ct"] or 0 for r in res)
    if not verify:
        raise StageError(f"{base_url} returned no spec_verify_ct: not a speculative server")
    for i, r in enumerate(res):
        why = answer_fault(r, bound)
        if why:
            raise StageError(f"{base_url}: warm-up request {i + 1} of {len(res)}: {why}; the server's counts are not "
                             "believed, so neither is its acceptance")
    return sum(r["completion_tokens"] for r in res) / verify


def setting_name(setting, cuda_graph: bool) -> str:
    """'3-1-4/graph' style key (steps-topk-draft tokens / cuda graph on|off)."""
    base = "baseline" if setting is None else "-".join(str(x) for x in setting)
    return f"{base}/{'graph' if cuda_graph else 'nograph'}"


def run_key(setting, cuda_graph: bool, draft=None) -> str:
    """A run's key: setting_name, prefixed 'NAME/' for a declared --draft (04's and the baseline: bare)."""
    base = setting_name(setting, cuda_graph)
    return base if draft is None or draft.ours else f"{draft.name}/{base}"


def cells(entry: dict):
    """(temperature level, prompt bucket, concurrency, numbers) of every (T, context, c) a run measured."""
    for t, level in entry.get("by_temperature", {}).items():
        for ctx in [SHORT, *level.get("by_context", {})]:
            for c, summ in context_level(level, ctx).get("by_concurrency", {}).items():
                yield t, ctx, c, summ


def every_run_refused(metrics: dict) -> bool:
    """Every timed (run, T, prompt bucket, concurrency) of the sweep was refused (sweep.refuse): nothing it timed
    can be believed, whether or not a baseline ran (without one, deploy's grid is empty and cannot say so)."""
    timed = [summ for entry in metrics["runs"].values() for *_, summ in cells(entry)]
    return bool(timed) and all(summ.get("refused") for summ in timed)


def cell_of(entry: dict | None, t: str, ctx: str, c: str) -> dict | None:
    """One run's numbers at (T, prompt bucket, concurrency), None when it has none there."""
    level = (entry or {}).get("by_temperature", {}).get(t)
    return context_level(level, ctx).get("by_concurrency", {}).get(c) if level else None


def add_ratios(metrics: dict, max_retried: int = 0) -> None:
    """speed_ratio = EAGLE3 output tok/s / baseline output tok/s (means over the timed passes) at the same
    temperature, prompt bucket, concurrency and graph mode, with `speed_ratio_ci95` over the paired passes
    (deploy.pass_interval; None with one pass); refused (None, with `ratio_refused` saying why) when either
    run was refused for its answers, or retried more than `max_retried` requests: its wall time holds backoff
    waits, so the ratio would measure the faults."""
    for key, entry in metrics["runs"].items():
        base = metrics["runs"].get(setting_name(None, entry["cuda_graph"]))
        for t, ctx, c, summ in cells(entry):
            ref = cell_of(base, t, ctx, c)
            faulty = [why for why in (run_fault(summ, "this run", max_retried),
                                      None if ref is summ else run_fault(ref, "the baseline run", max_retried)) if why]
            if faulty:
                summ["speed_ratio"], summ["speed_ratio_ci95"] = None, None
                summ["ratio_refused"] = "; ".join(faulty)
                continue
            ratio, ci = deploy.pass_ratio(summ, ref) if ref else (None, None)
            summ["speed_ratio"], summ["speed_ratio_ci95"] = ratio, None if ref is summ else ci  # the baseline: 1


def merge_passes(passes: list[dict]) -> dict:
    """One (setting, T, concurrency)'s numbers over its timed passes: tok/s the passes' mean (each pass's
    kept, `output_tokens_per_s_passes`, for the interval), TTFT and tau over every request of every pass
    (each record names its pass), the server's tau the passes' mean, retries summed; refused when any pass
    was (its reason, with the pass)."""
    reqs = [{**r, "pass": i} for i, p in enumerate(passes) for r in p.pop("requests")]
    spec = [r for r in reqs if r["spec_verify_ct"]]
    ttfts = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    server = [p.get("server_accept_length") for p in passes]
    tps = [p["output_tokens_per_s"] for p in passes]
    cell = {"concurrency": passes[0]["concurrency"], "num_passes": len(passes),
            "num_requests": sum(p["num_requests"] for p in passes),
            "completion_tokens": sum(r["completion_tokens"] for r in reqs), "wall_s": sum(p["wall_s"] for p in passes),
            "output_tokens_per_s": statistics.mean(tps) if None not in tps else None, "output_tokens_per_s_passes": tps,
            "per_request_tokens_per_s": statistics.mean(p["per_request_tokens_per_s"] or 0 for p in passes),
            "ttft_mean_s": statistics.mean(ttfts) if ttfts else None,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "accept_length_mean": statistics.mean(r["completion_tokens"] / r["spec_verify_ct"] for r in spec)
            if spec else None,
            "accept_length_pooled": sum(r["completion_tokens"] for r in spec) / sum(r["spec_verify_ct"] for r in spec)
            if spec else None,
            "server_accept_length": statistics.mean(server) if None not in server else None,
            "num_retries": sum(p["num_retries"] for p in passes),
            "retried_requests": sum(p["retried_requests"] for p in passes), "passes": passes, "requests": reqs}
    bad = next((i for i, p in enumerate(passes) if p.get("refused")), None)
    if bad is not None:
        refuse(cell, f"pass {bad + 1} of {len(passes)}: {passes[bad]['refused']}")
    return cell


def run_fault(run: dict | None, name: str, max_retried: int) -> str | None:
    """Why a run's numbers cannot stand in a ratio (`name`: "this run" or "the baseline run"), else None."""
    if not run:
        return None
    if run.get("refused"):
        return f"{name} was refused: {run['refused']}"
    if run.get("retried_requests", 0) > max_retried:
        return (f"{name} retried more than {max_retried} requests (--max-retried-requests): a number taken "
                "under faults")
    return None



def serve_levels(acceptance_temperatures) -> list[float]:
    """The temperature levels every run is timed at: greedy, and each temperature above 0 of the preset's
    --acceptance-temperatures (the serving temperatures: Kimi-K2.5 is served at T 1.0, top-p 0.95)."""
    return [0.0] + sorted({float(t) for t in acceptance_temperatures if float(t) > 0})


def mirror_agreement(url: str, check, request_fn) -> None:
    """The agreement check's requests (agreement.AgreementCheck: each of its prompts alone at its budget,
    greedy, then at each sampled temperature with the seed it derives, stream "engine"), sent unjudged to
    a server the check does not judge (the baseline, a declared draft's): every server is warmed up alike."""
    for ids in check.prompts:
        request_fn(url, ids, check.max_new_tokens, check.timeout)
    for params in check.sampling:
        for ids in check.prompts:
            request_fn(url, ids, check.max_new_tokens, check.timeout, sampling={
                "temperature": params.temperature, "top_p": params.top_p,
                "seed": request_seed(check.seed, ids, params.temperature, params.top_p, "engine")})


def refuse_lossy_launches(engine, graph: bool, settings: list, port: int, simulations=()) -> None:
    """Refuse, before anything launches, an EAGLE-3 launch line or environment (this process's, which the
    servers inherit, with the engine's own on top) that makes the engine's verify lossy or simulated
    (Engine.lossy: --server-extra-args, SGLANG_SIMULATE_ACC_LEN and the like); each of `simulations` ((setting,
    draft) of the break-even map: breakeven.simulations) must be simulated by that same test, at its length, and be
    nothing else (engine.confirm_simulated)."""
    import os

    for draft in engine.drafts:
        for setting in settings:
            cmd, env = engine.command(port, graph, setting, draft)
            refuse_lossy(f"the {engine.label} server 05b would launch for {run_key(setting, graph, draft)}",
                         engine.lossy(cmd, {**os.environ, **env}))
    for setting, draft in simulations:
        cmd, env = engine.command(port, graph, setting, draft)
        confirm_simulated(engine, f"the {engine.label} server 05b would launch for {run_key(setting, graph, draft)}",
                          simulated_length(setting), cmd, {**os.environ, **env})


class Sweep:
    """One engine's servers timed alike (the module docstring): each is checked, warmed up, preflighted and timed
    pass by pass at its levels (settings.timed_levels), every prompt bucket and concurrency. Measured runs go to
    metrics["runs"]; with the break-even map on (`board`: breakeven.board's record of this engine), the simulated
    servers' runs and the baseline's map passes (every answer to the budget: ignore_eos) go to board["runs"] and
    nowhere else, so no tau table, ratio table or deploy choice of measured drafts ever reads them. `map_only`:
    an engine measured for the map alone (--map-engines): its baseline's map passes and its simulated servers."""

    def __init__(self, plan: SweepPlan, work: Workload, out: Path, engine, metrics: dict, request_fn, agreement,
                 board: dict | None = None, map_only: bool = False):
        self.plan, self.work, self.out, self.engine, self.metrics = plan, work, out, engine, metrics
        self.request_fn, self.agreement, self.board, self.map_only, self.collected = request_fn, agreement, board, \
            map_only, {}

    def check(self, url: str, speculative: bool, draft=None, simulated: float | None = None) -> tuple:
        if not speculative:
            return self.engine.check_baseline(url), None, None
        sim = {} if simulated is None else {"simulated": simulated}   # an engine without a map needs no such keyword
        return self.engine.check_eagle3(url, [draft] if draft else None, **sim)

    def warmup_fn(self, setting):
        """The preflight's warm-up probe: pooled tau, or for a simulated server its answers (check_simulated_tau)."""
        warm, timeout = self.work.warm_requests, self.plan.request_timeout
        if simulated_length(setting) is not None:
            return lambda u: warm_up(u, warm, WARMUP_TOKENS, timeout, self.request_fn)
        return lambda u: warmup(u, warm, WARMUP_TOKENS, timeout, self.request_fn, round_bound(setting))

    def prepare(self, url: str, key: str, graph: bool, setting, log: Path | None, draft) -> list[tuple[str, dict]]:
        """The server's checks and its warm-up, the same requests on every server, before any timed pass; the
        (key, entry) pairs to time: a measured run, the map's, or both (a baseline with the map on)."""
        engine, sim = self.engine, simulated_length(setting)
        entry = {"cuda_graph": graph, "setting": setting, "url": url, "sampling_defaults": engine.sampling_defaults(
                 url, log), "by_temperature": {}, "timed_levels": timed_levels(setting, self.plan.levels,
                                                                               self.plan.levels[-1])}
        print(f"[05b] {key}: the server's own sampling defaults {json.dumps(entry['sampling_defaults'])} (every request "
              "05 sends sets temperature, top-p, top-k, min-p, repetition penalty and seed itself)")
        if setting is None:
            warm_up(url, self.work.warm_requests, WARMUP_TOKENS, self.plan.request_timeout, self.request_fn)
        else:
            entry["draft"] = draft.name
            entry["preflight"] = engine.preflight(url, log, self.warmup_fn(setting), draft,
                                                  **({} if sim is None else {"simulated": sim}))
            if sim is None and (draft.ours or not self.metrics["preflight"]):  # the manifest's: 04's when it ran
                self.metrics["preflight"] = entry["preflight"]
        self.agree(url, key, setting, draft)
        served = []
        if sim is None and not self.map_only:
            self.metrics["runs"][key] = entry
            served.append((key, entry))
        if self.board is not None and (sim is not None or setting is None):
            mapped = {**entry, "by_temperature": {}, "timed_levels": [self.plan.levels[-1]], "map": True,
                      **({"simulated": {"accept_length": sim, "how": engine.simulates}} if sim is not None else {})}
            self.board["runs"][key] = mapped
            served.append((key, mapped))
        return served

    def agree(self, url: str, key: str, setting, draft) -> None:
        """The agreement check on 04's measured EAGLE-3 servers; its requests, unjudged, on every other server."""
        check = self.agreement
        if check is None:
            return
        judged = setting is not None and draft.ours and simulated_length(setting) is None and not self.map_only
        why_not = check.judges(setting) if judged else None
        if judged and not why_not:
            self.metrics["agreement"][key] = check(url, key, setting)
            return
        mirror_agreement(url, check, self.request_fn)
        if why_not:
            print(f"[05b] agreement {key}: not judged: {why_not} (its requests sent unjudged)")
            self.metrics["agreement"][key] = {"judged": False, "why": why_not, "prompts": len(check.prompts)}

    def timed_pass(self, key: str, entry: dict, level: float, ctx: str, c: int, r: int) -> None:
        engine, url, setting, t = self.engine, entry["url"], entry["setting"], f"{level:g}"
        start = engine.window_start(url) if setting is not None else None
        ps, ts = self.work.buckets[ctx]
        sampling = [{**x, "ignore_eos": True} for x in self.work.sampling[(level, ctx)]] if entry.get("map") \
            else self.work.sampling[(level, ctx)]
        s = run_prompts(url, ps, self.plan.benchmark_max_new_tokens, c, self.plan.request_timeout, self.request_fn, ts,
                        bound=round_bound(setting) if setting is not None else None, sampling=sampling)
        s.update(engine.window_end(url, start) if setting is not None else {"server_accept_length": None})
        why = None if "refused" in s else server_tau_fault(s, c, engine.server_tau_slop)
        if why:
            refuse(s, f"{url}: {why}")
        self.collected.setdefault((key, bool(entry.get("map")), t, ctx, str(c)), []).append(s)
        where = {"run": key, "temperature": t, "context": ctx, "concurrency": c, "pass": r}
        self.metrics["pass_order"].append({**where, **({"map": self.engine.name} if entry.get("map") else {})})
        said = (f"[05b] {'map ' + engine.name + ' ' if entry.get('map') else ''}{key} T={t}"
                f"{'' if ctx == SHORT else f' context {ctx}'} c={c} pass {r + 1}/{self.plan.repeats}")
        if "refused" in s:  # one line; the sweep goes on, and the report and deploy leave the run out
            print(f"{said}: REFUSED, its counts are not believed: {s['refused']}")
            return
        print(f"{said}: {fmt(s['output_tokens_per_s'], 1)} tok/s, TTFT {fmt(s['ttft_mean_s'], 3)} s, tau "
              f"{fmt(s['accept_length_pooled'])} (server {fmt(s['server_accept_length'])})"
              + (f"; UNDER FAULTS: {s['num_retries']} retries in {s['retried_requests']} requests"
                 if s["num_retries"] else ""))

    def time(self, served: list[tuple[str, dict]]) -> None:
        """Every timed pass of `served`: repeat by repeat, each server in turn, and within it every temperature
        level of its own (timed_levels), prompt bucket and concurrency level; then each (T, context, c)'s passes
        merged: the short prompts' under by_temperature[T].by_concurrency (where they always were), a prompt-length
        bucket's under by_temperature[T].by_context[L].by_concurrency."""
        for r in range(self.plan.repeats):
            for key, entry in served:
                for level in entry["timed_levels"]:
                    for ctx in self.work.buckets:
                        for c in self.plan.concurrency:
                            self.timed_pass(key, entry, level, ctx, c, r)
        for key, entry in served:
            for level in entry["timed_levels"]:
                t, cell = f"{level:g}", (key, bool(entry.get("map")))
                merged = {ctx: {"by_concurrency": {str(c): merge_passes(self.collected.pop((*cell, t, ctx, str(c))))
                                                   for c in self.plan.concurrency}} for ctx in self.work.buckets}
                entry["by_temperature"][t] = {**merged.pop(SHORT), **({"by_context": merged} if merged else {})}

    def launched(self, port: int, graph: bool, setting, draft=None) -> None:
        """A server started from the engine's command, checked for the graph mode and setting asked for (a
        simulated one: by the engine's own test, engine.confirm_simulated), timed and stopped."""
        key, sim = run_key(setting, graph, draft), simulated_length(setting)
        cmd, env = self.engine.command(port, graph, setting, draft)
        own = self.board is not None and (sim is not None or self.map_only)
        (self.board["commands"] if own else self.metrics["commands"])[key] = {"argv": cmd, "env": env} if env else cmd
        url = f"http://127.0.0.1:{port}"
        log = self.out / "server_logs" / ((f"map_{self.engine.name}_" if own else "") + key.replace("/", "_") + ".log")
        proc = process.launch_server(cmd, log, env)
        try:
            process.wait_ready(url, proc, self.plan.server_timeout, log_path=log)
            reported_graph, reported, _ = self.check(url, setting is not None, draft, sim)
            if reported_graph != graph:
                raise StageError(f"{url} reports decode CUDA graphs {'on' if reported_graph else 'off'}, "
                                 f"but 05 launched it with them {'on' if graph else 'off'}; see {log}")
            if setting is not None and tuple(reported) != tuple(setting):
                said = self.engine.setting_note(log)
                raise StageError(f"{url} runs setting {setting_name(reported, graph)}, but 05 launched "
                                 f"{setting_name(setting, graph)}" + (f" (its log: {said})" if said else "")
                                 + f"; see {log}")
            self.time(self.prepare(url, key, graph, setting, log, draft))
        finally:
            process.stop_server(proc)


@dataclass(frozen=True)
class SweepPlan:
    """What the sweep reads of 05b's flags, read once (sweep_plan) and handed down instead of the Namespace; the
    same for every engine (an engine's own flags are its own: Engine.from_args). A field named like a flag is
    that flag as given (lists as tuples); the break-even map's fields are breakeven.py's."""
    spec_settings: tuple[str, ...]
    graphs: tuple[bool, ...]               # --cuda-graph: the graph modes launched servers run in, in order
    levels: tuple[float, ...]              # serve_levels: greedy, then each --acceptance-temperatures above 0
    acceptance_temperatures: tuple[float, ...]
    acceptance_top_p: float
    instant_temperature: float | None
    bench_seed: int
    concurrency: tuple[int, ...]           # --bench-concurrency with batch 1, sorted
    repeats: int                           # --bench-repeats
    benchmark_max_new_tokens: int
    bench_context: tuple[str, ...]
    bench_context_prompts: int | None
    warmup_requests: int
    agreement_prompts: int
    agreement_tolerance: float
    request_timeout: float
    server_timeout: float
    max_retried_requests: int
    baseline_url: str | None
    eagle3_url: str | None
    baseline_port: int
    eagle3_port: int
    simulate_accept_lengths: tuple[float, ...]
    simulate_settings: tuple[str, ...] | None
    simulate_draft: str | None
    known_tau: tuple[str, ...]


def sweep_plan(args) -> SweepPlan:
    """05b's flags (checked by 05b's check_flags) -> the sweep's plan; the one place the sweep reads them."""
    return SweepPlan(
        spec_settings=tuple(args.spec_settings), graphs=tuple({"on": True, "off": False}[m] for m in args.cuda_graph),
        levels=tuple(serve_levels(args.acceptance_temperatures)),
        acceptance_temperatures=tuple(args.acceptance_temperatures), acceptance_top_p=args.acceptance_top_p,
        instant_temperature=args.instant_temperature, bench_seed=args.bench_seed,
        concurrency=tuple(sorted({1, *[int(c) for c in args.bench_concurrency]})),
        repeats=max(1, int(args.bench_repeats)), benchmark_max_new_tokens=args.benchmark_max_new_tokens,
        bench_context=tuple(args.bench_context), bench_context_prompts=args.bench_context_prompts,
        warmup_requests=args.warmup_requests, agreement_prompts=args.agreement_prompts or 0,
        agreement_tolerance=args.agreement_tolerance, request_timeout=args.request_timeout,
        server_timeout=args.server_timeout, max_retried_requests=args.max_retried_requests,
        baseline_url=args.baseline_url, eagle3_url=args.eagle3_url, baseline_port=args.baseline_port,
        eagle3_port=args.eagle3_port, simulate_accept_lengths=tuple(args.simulate_accept_lengths),
        simulate_settings=None if args.simulate_settings is None else tuple(args.simulate_settings),
        simulate_draft=args.simulate_draft,
        known_tau=tuple(args.known_tau))


@dataclass(frozen=True)
class Workload:
    """What every server of the sweep is timed on, the same for every engine (workload): the prompt buckets
    ({name: (prompts, tags)}, the short one first), each (level, bucket)'s pinned sampling per request, and the
    warm-up requests."""
    buckets: dict
    sampling: dict
    warm_requests: tuple


def workload(plan: SweepPlan, prompts, tags, warm, contexts) -> Workload:
    buckets = {SHORT: (prompts, tags or [None] * len(prompts)), **(contexts or {})}
    return Workload(buckets, {(t, ctx): timed_sampling(ps, ts, t, plan.acceptance_top_p, plan.instant_temperature,
                                                       plan.bench_seed)
                              for t in plan.levels for ctx, (ps, ts) in buckets.items()},
                    tuple(warm[:max(1, plan.warmup_requests)]))


def run_server_benchmark(plan: SweepPlan, out: Path, engine, prompts: list[list[int]], request_fn=None,
                         agreement=None, tags: list[dict] | None = None, warm: list[list[int]] = (),
                         contexts: dict | None = None, map_engines=()) -> dict:
    """The sweep: per CUDA-graph mode, a baseline server and one EAGLE-3 server per (draft, spec setting):
    04's draft and every declared --draft (engine.drafts), each with the same settings, prompts, warm-up,
    temperature levels, prompt buckets, passes and concurrency levels, all measured against the one baseline.
    `request_fn`: how the sweep asks a server for an answer (default: the engine's own request).

    `prompts` are timed (the short bucket), and so is each prompt-length bucket of `contexts` ({name:
    (prompts, tags)}, common/serving/context.py), at every temperature and concurrency; `warm` (held-out
    prompts never timed) warm every server up before its first timed request: the preflight's warm-up
    requests, and the agreement check's (`agreement(url, key, setting)`, 05's agreement check, vLLM; it judges
    04's draft, and the same requests go unjudged to every other server: mirror_agreement). Every EAGLE-3
    server passes the full preflight (the warm-up floor included).

    Attached servers (--baseline-url / --eagle3-url) are used as they are (their own setting, graph mode
    and draft - any of engine.drafts, identified by content - read from the info document), after ALL
    pass their checks (prefix caching off included), and timed in turn pass by pass; with an attached
    baseline alone, the EAGLE-3 servers are launched in the baseline's graph mode. Launched ones are
    started from the engine's command (prefix caching off), logged, polled until ready, checked the same
    way (for the graph mode asked for, and the draft launched), timed (their repeats as separate passes,
    interleaved across temperatures and concurrency levels) and shut down before the next one (one model in
    memory at a time).

    With --simulate-accept-lengths (common/serving/breakeven.py) the break-even map's servers follow in each
    graph mode: one per (map setting, simulated length), launched like any other and kept apart (Sweep); then
    each engine of `map_engines` (--map-engines) gets its own baseline and simulated servers on the same plan.
    """
    graphs, settings = list(plan.graphs), [engine.parse_setting(s) for s in plan.spec_settings]
    if not warm:
        raise StageError("05b warms every server up on held-out prompts it never times: none were given")
    sims = breakeven.simulations(plan, engine)
    if not plan.eagle3_url:  # every EAGLE-3 server 05b will launch, before the first server starts
        refuse_lossy_launches(engine, graphs[0], settings, plan.eagle3_port, sims)
    work = workload(plan, prompts, tags, warm, contexts)
    metrics = {"engine": engine.name, "engine_fixes": list(engine.fixes()),
               "target": str(engine.target_dir), "draft": None if engine.draft_dir is None else str(engine.draft_dir),
               "drafts": {d.name: str(d.path) for d in engine.drafts},
               "num_prompts": len(prompts), "num_warmup_prompts": len(warm),
               "max_new_tokens": plan.benchmark_max_new_tokens, "concurrency": list(plan.concurrency),
               "temperatures": [f"{t:g}" for t in plan.levels], "contexts": list(work.buckets),
               "top_p": plan.acceptance_top_p, "instant_temperature": plan.instant_temperature,
               "repeats": plan.repeats, "prefix_caching": "off",
               "runs": {}, "commands": {}, "preflight": {}, "agreement": {}, "pass_order": []}
    if any(t > 0 for t in plan.levels):  # a build that cannot verify sampled drafts times its defect, not the draft
        metrics["sampling_defect"] = engine.sampling_defect()
        if metrics["sampling_defect"]:
            print(f"[05b] {engine.label} cannot verify sampled drafts here: {metrics['sampling_defect']}. The sampled "
                  "levels are timed, but nothing is recommended from them")
    board = breakeven.board(metrics, plan, engine) if sims else None
    sweep = Sweep(plan, work, out, engine, metrics, request_fn or engine.request, agreement, board)
    attached = []  # every attached server is checked before any is warmed up or timed
    if plan.baseline_url:
        attached.append((plan.baseline_url, *sweep.check(plan.baseline_url, False)))
    if plan.eagle3_url:
        attached.append((plan.eagle3_url, *sweep.check(plan.eagle3_url, True)))
    sweep.time([x for url, graph, setting, draft in attached
                for x in sweep.prepare(url, run_key(setting, graph, draft), graph, setting, None, draft)])
    # the attached server(s) alone; a kept baseline: the EAGLE-3 servers are launched in its graph mode
    for graph in ([] if plan.eagle3_url else [attached[0][1]] if plan.baseline_url else graphs):
        if not plan.baseline_url:
            sweep.launched(plan.baseline_port, graph, None)
        for draft in engine.drafts:
            for setting in settings:
                sweep.launched(plan.eagle3_port, graph, setting, draft)
        for setting, draft in sims:
            sweep.launched(plan.eagle3_port, graph, setting, draft)
    for other in map_engines:   # --map-engines: another engine's baseline and simulated servers, same plan
        map_only(plan, work, out, other, metrics, agreement)
    add_ratios(metrics, plan.max_retried_requests)
    for b in (metrics.get("map") or {}).get("engines", {}).values():  # each engine's against its map baseline
        add_ratios(b, plan.max_retried_requests)
    return metrics


def map_only(plan: SweepPlan, work: Workload, out: Path, engine, metrics: dict, agreement) -> None:
    """The break-even map of another engine than the sweep's (--map-engines): its own baseline (map passes only)
    and simulated servers, on the sweep's plan and workload, with the same warm-up (the agreement's requests
    unjudged)."""
    sims = breakeven.simulations(plan, engine)
    refuse_lossy_launches(engine, plan.graphs[0], [], plan.eagle3_port, sims)
    sweep = Sweep(plan, work, out, engine, metrics, engine.request, agreement, breakeven.board(metrics, plan, engine),
                  map_only=True)
    for graph in plan.graphs:
        sweep.launched(plan.baseline_port, graph, None)
        for setting, draft in sims:
            sweep.launched(plan.eagle3_port, graph, setting, draft)


def same_draft_reference(work_dir: Path) -> Path | None:
    """05's folder (05_benchmark/reference) when 05 ran complete on THIS draft: its manifest's inputs hold
    the current 04 manifest's hash (stage.input_manifests). 05b's optional input: its per-depth tau feeds
    the cost model. None otherwise."""
    from common.io import read_json
    from common.stage import BENCH, TRAIN, input_manifests, is_complete, stage_dir, stage_folder

    ref = stage_dir(work_dir, BENCH)
    if not is_complete(ref):
        return None
    inputs = read_json(ref / "manifest.json").get("inputs", {})
    ((key, sha),) = input_manifests(work_dir, stage_dir(work_dir, TRAIN)).items()
    # 05 manifests written before 05b split off keyed 04's hash by its folder name: existing results still count
    return ref if inputs.get(key, inputs.get(stage_folder(TRAIN))) == sha else None


def warm_count(plan: SweepPlan) -> int:
    """Held-out prompts 05b keeps out of the timed set: enough for the preflight's warm-up requests
    and the agreement check's prompts (the same ones serve both)."""
    return max(1, plan.warmup_requests, plan.agreement_prompts)


def check_context_fits(engine, plan: SweepPlan, buckets: list[str], prompts: list[list[int]]) -> int:
    """Refuse, in one line and before any server starts, a sweep whose longest timed prompt (the longest
    --bench-context bucket, or a short prompt) plus --benchmark-max-new-tokens does not fit the context the
    launched servers admit (engine.context_length): they would answer it with an error mid-sweep. Servers
    05 only attaches to are not launched with its flags; they say so themselves. Returns the context length."""
    have, where = engine.context_length()
    longest = max([longest_bucket(buckets)] + [len(p) for p in prompts])
    need = longest + plan.benchmark_max_new_tokens
    if need > have:
        what = f"--bench-context {longest_bucket(buckets)}" if longest == longest_bucket(buckets) else \
            f"the longest timed prompt ({longest} tokens)"
        raise StageError(f"{what} + --benchmark-max-new-tokens {plan.benchmark_max_new_tokens} = {need} tokens, but "
                         f"the {engine.label} servers 05 launches admit {have} ({where}): give them a longer context, "
                         "or lower the bucket or --benchmark-max-new-tokens")
    return have


def context_buckets(plan: SweepPlan, pool: list[dict], n: int, target_dir: Path) -> dict[str, list[dict]]:
    """{bucket name: its timed prompt records} for every prompt-length bucket of --bench-context (the short
    bucket is 05's timed split itself), built from `pool` (held-out rows never used for warm-up) with the
    target's tokenizer and chat template (context.bucket_prompts), --bench-context-prompts each (default n)."""
    from common.serving import context

    names = [b for b in context.parse_buckets(list(plan.bench_context)) if b != SHORT]
    if not names:
        return {}
    from common.text.tokenizer import load_tokenizer

    encode = context.render_encoder(load_tokenizer(target_dir))
    count = plan.bench_context_prompts or n
    return {b: context.bucket_prompts(pool, int(b), count, encode) for b in names}


def server_main(args, plan: SweepPlan, out: Path, inputs, m02b: HiddenStatesManifest, target_dir: Path,
                foreign=(), reference: dict | None = None, map_foreign: dict | None = None) -> dict:
    """05b after its input checks: sweep (+ agreement), metrics.json (report.md and the plots: report.py).
    `plan`: the sweep's fields of 05b's flags (sweep_plan); `args`: the flags the engines are built from
    (Engine.from_args reads each one's own). Of `inputs` (common/benchmark/inputs.load_inputs), the rows are
    timed, the warm rows (held-out rows never timed) warm the servers up and feed the agreement check, and the
    --bench-context buckets are built from the pool (every held-out row but the warm-up ones). `foreign`: the
    declared drafts as registry.check_servable returned them, served next to 04's; `reference`: 05's metrics of
    the same draft (same_draft_reference), for the cost model's per-depth tau; `map_foreign`: {engine name: its
    declared drafts} of each --map-engines engine, on which the break-even map runs too (breakeven.py)."""
    from common.serving import context
    import shlex

    from common.io import write_json

    export_dir, m04, rows, warm_rows, pool = inputs[:5]
    if isinstance(args.server_extra_args, str):
        args.server_extra_args = shlex.split(args.server_extra_args)
    engine = engine_from_args(args, export_dir, m02b, m04, target_dir, args.work_dir, foreign)
    others = [engine_class(name).from_args(args, export_dir, m02b, m04, target_dir, args.work_dir, list(served))
              for name, served in (map_foreign or {}).items()]   # --map-engines: the map alone on each
    prompts = [list(r["prompt_ids"]) for r in rows]
    warm = [list(r["prompt_ids"]) for r in warm_rows]
    buckets = context.parse_buckets(list(plan.bench_context))
    admitted = check_context_fits(engine, plan, buckets, prompts) if not plan.eagle3_url else None
    for other in others:
        check_context_fits(other, plan, buckets, prompts)
    built = context_buckets(plan, list(pool), len(rows), target_dir)
    agreement = None
    if plan.agreement_prompts and export_dir is None:
        print("[05b] agreement: not run: without 04 there is no draft of ours to replay (--agreement-prompts ignored)")
    elif plan.agreement_prompts:
        from common.serving.agreement import AgreementCheck
        from common.benchmark.sampled import engine_sampling
        agreement = AgreementCheck(engine, target_dir, export_dir, m04, warm[:plan.agreement_prompts],
                                   plan.benchmark_max_new_tokens, plan.request_timeout,
                                   plan.agreement_tolerance, out, sampling=engine_sampling(plan), seed=plan.bench_seed)
        agreement.check_loadable()   # before any server starts: replay loads the target here
    tags = [{"source": r.get("source"), "thinking": r.get("thinking")} for r in rows]
    contexts = {b: ([p["prompt_ids"] for p in ps], [{"source": p["source"], "thinking": p["thinking"]} for p in ps])
                for b, ps in built.items()}
    metrics = run_server_benchmark(plan, out, engine, prompts, agreement=agreement, tags=tags, warm=warm,
                                   contexts=contexts, map_engines=others)
    metrics["prompt_split"] = {"timed": [r.get("id") for r in rows], "warmup": [r.get("id") for r in warm_rows]}
    metrics["context_length"] = admitted
    metrics["context_buckets"] = {SHORT: context.bucket_record(
        [{"id": r.get("id"), "tokens": len(r["prompt_ids"]), "made": "natural"} for r in rows], None),
        **{b: context.bucket_record(ps, int(b)) for b, ps in built.items()}}
    metrics["deploy"] = deploy.summary(metrics, reference)   # metrics["runs"] only: never the map's
    if "map" in metrics:
        metrics["map"]["breakeven"] = breakeven.summary(metrics, reference)
    write_json(out / "metrics.json", metrics)
    write_json(out / "commands.json", metrics["commands"])
    return metrics
