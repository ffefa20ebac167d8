"""Generate synthetic responses: the target writes the answer to every prompt-only record.

Reads:  <work-dir>/01_prepared/<dataset>/records.jsonl (+ manifest.json)
Writes: <work-dir>/01b_generated/<dataset>/{generated.jsonl, failures.jsonl, manifest.json},
        <work-dir>/01b_generated/manifest.json
Real:   python 01b_generate_synthetic.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3 --server-url http://10.0.0.1:30000/v1 --server-url http://10.0.0.2:30000/v1
Tiny:   python 01b_generate_synthetic.py --config configs/tiny.yaml --work-dir runs/tiny

EAGLE-3 learns the target's own next-token distribution, so the target itself answers every prompt:
rendered with its chat template, completed through `openai` (SGLang/vLLM servers,
common/generation/server_pool.py) or `hf` (in-process, common/generation/hf_engine.py) until its own
end of turn (common/text/target_format.py). The answer is kept as raw text, special tokens included, and
as the ids the target emitted (`completion_ids`; SGLang's /v1/completions returns text only). Complete
records pass through (origin "dataset"), benchmark-only ones unanswered (origin "prompt");
--response-cache serves known greedy answers of the same target and cap (origin "cache").
Faults and resumes: start-up checks and the target health gate in common/generation/server_checks.py;
retries, shutdown and durable results in common/generation/loops.py; locks, settings and totals over
runs in common/generation/run_state.py. A re-run of the same command finishes the job.
Sized to the server (common/generation/capacity.py): streamed, a queue wait is no timeout; a timeout on a
server that is up halves the in-flight limit, and work thrown away ends the run with an error line.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common.config import base_parser, parse_args
from common.generation.capacity import InFlightLimit
from common.generation.hf_engine import HFEngine, hf_generator
from common.generation.jobs import PARTITIONS, dataset_counts, make_jobs, this_run_counts
from common.generation.loops import run_hf, run_openai
from common.generation.progress import Progress, log
from common.generation.response_cache import ResponseCache, cache_identity
from common.generation.run_state import (RunLog, check_unlocked, dataset_lock, distinct_settings, generation_settings,
                                         refuse_mixed_settings, resume_generated)
from common.generation.server_checks import health_gate
from common.generation.server_pool import ServerPool
from common.io import JsonlAppender, iter_jsonl, write_jsonl
from common.stage import (GENERATE, PREPARE, StageError, input_manifests, is_complete, read_manifest, require_complete,
                          resolve_target, stage_dir, start_stage, write_manifest)
from common.text.target_format import load_target_format
from common.text.tokenizer import load_tokenizer

STAGE, UPSTREAM = GENERATE, PREPARE
# Failures that a re-run would repeat identically (kept unless --retry-failed); others are retried.
PERMANENT_FAILURES = {"context_overflow"}


class ServerUrls(argparse.Action):
    """Repeatable --server-url: the command line's URLs replace a --config default (string or list)
    instead of adding to it."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = namespace.__dict__.setdefault("_server_url_given", False)
        setattr(namespace, self.dest, (list(getattr(namespace, self.dest)) if given else []) + [value])
        namespace._server_url_given = True


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("generate")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; default: the one 01 used (refused if its tokenizer differs)")
    g.add_argument("--generation-engine", choices=("hf", "openai"), default="openai",
                   help="openai: SGLang/vLLM server(s); hf: in-process transformers (tiny world)")
    g.add_argument("--max-new-tokens", type=int, default=4096, help="generation cap per response (tokens)")
    g.add_argument("--max-context", type=int, default=10240,
                   help="prompt + response limit of the normal partition (tokens); longer prompts fail "
                        "with context_overflow")
    g.add_argument("--long-context", type=int, default=None,
                   help="prompt + response limit of the long partition (tokens); none: --max-context")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass (0-1], with --temperature > 0 (Kimi-K2.5 is served at T 1.0, top-p 0.95)")
    g.add_argument("--generation-seed", type=int, default=0,
                   help="the requests' sampling seed (only used when temperature > 0)")
    g.add_argument("--datasets-only", nargs="+", default=None, metavar="NAME",
                   help="generate only these datasets of 01 (the stage manifest waits for the rest)")
    g.add_argument("--response-cache", type=Path, default=None,
                   help="gzip JSONL of known greedy answers (common/generation/response_cache.py): a prompt whose "
                        "answer it holds for this target, generator and max-new-tokens is not generated")
    g.add_argument("--retry-failed", action="store_true",
                   help="re-run only the ids in failures.jsonl (any reason), also of complete datasets")
    g.add_argument("--allow-mixed-settings", action="store_true",
                   help="resume a dataset whose records were made with another model, --max-new-tokens, "
                        "--temperature, --top-p, --generation-seed or tokenizer/template (refused by default)")
    g = p.add_argument_group("generate: openai engine")
    g.add_argument("--server-url", action=ServerUrls, default="http://127.0.0.1:30000/v1",
                   help="OpenAI-compatible base URL ending in /v1; repeat for several servers (requests go to "
                        "the healthy one with the fewest in flight); a YAML list in --config")
    g.add_argument("--served-model-name", default=None,
                   help="model name the servers must serve; default: the one model the first server lists")
    g.add_argument("--api-key", default="EMPTY", help="API key sent to the server")
    g.add_argument("--concurrency", type=int, default=150, help="requests in flight, normal partition")
    g.add_argument("--long-concurrency", type=int, default=16, help="requests in flight, long partition")
    g.add_argument("--long-after-normal", action="store_true",
                   help="run the long partition after the normal one (default: both at once, separate limits)")
    g.add_argument("--request-timeout", type=float, default=1800.0,
                   help="timeout of a start-up call that is not streamed: a probe completion (s). Generation "
                        "requests are streamed and time out by --stall-timeout and --queue-timeout")
    g.add_argument("--stall-timeout", type=float, default=600.0,
                   help="a request whose answer has started streaming and then sends nothing this long is "
                        "given up (s); the wait for its first token is queue time, not a stall. A request the "
                        "server pulls back into its queue mid-answer (SGLang retracts when its KV pool runs out) "
                        "is silent until readmitted: that wait counts here, and a timeout halves the in-flight "
                        "limit")
    g.add_argument("--queue-timeout", type=float, default=14400.0,
                   help="longest wait for a request's first token: the server's queue and the prompt's prefill "
                        "(s). Timed out on a server that is up, it counts as overload (the in-flight limit halves)")
    g.add_argument("--max-timeouts", type=int, default=0,
                   help="request attempts that may time out in a run (their work is thrown away and retried) "
                        "with 01b still exiting 0; above it 01b writes its results and manifests, then ends "
                        "with an error line naming the counts (count)")
    g.add_argument("--request-retries", type=int, default=3,
                   help="retries of a request after a timeout, connection error, 429, 5xx (count; attempts "
                        "while its server is down are not counted)")
    g.add_argument("--retry-base-delay", type=float, default=2.0,
                   help="first retry backoff (s); doubles per retry, x[0.5, 1.5) jitter")
    g.add_argument("--retry-max-delay", type=float, default=120.0, help="backoff cap (s)")
    g.add_argument("--health-interval", type=float, default=10.0, help="health polling period of a down server (s)")
    g.add_argument("--health-timeout", type=float, default=30.0,
                   help="timeout of a health/models/tokenize call (s; SGLang's /health may take 20 s)")
    g.add_argument("--server-down-timeout", type=float, default=3600.0,
                   help="stop the run when no server has been healthy this long; start-up checks wait out "
                        "transient errors this long too (s)")
    g.add_argument("--health-probes", type=int, default=3,
                   help="target health gate: greedy probe prompts every server answers before any work "
                        "(count, at most 4; 0 skips the gate)")
    g.add_argument("--health-max-new-tokens", type=int, default=256,
                   help="budget of a probe answer; one without end-of-turn within it is degenerate (tokens)")
    g.add_argument("--health-max-repeat-share", type=float, default=0.5,
                   help="largest share of a probe answer's 4-grams that may repeat an earlier one; above it "
                        "the answer is a token loop (0-1)")
    g.add_argument("--shutdown-grace", type=float, default=120.0,
                   help="after SIGINT/SIGTERM, how long requests in flight may finish (s)")
    g.add_argument("--summary-interval", type=float, default=60.0, help="period of the summary log line (s)")
    g.add_argument("--max-transient-failures", type=int, default=0,
                   help="requests that may fail for good (after retries) with the dataset still counted "
                        "complete; above it the dataset stays incomplete and a re-run retries them (count)")
    g = p.add_argument_group("generate: hf engine")
    g.add_argument("--hf-batch-size", type=int, default=32,
                   help="prompts per generate() call (count; 32 doubles CPU throughput over 8)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device of the hf engine (default: cuda if available)")
    return p


def redacted(args):
    """The flags as recorded in manifests: never a real API key."""
    return argparse.Namespace(**{**vars(args), "api_key": "EMPTY" if args.api_key == "EMPTY" else "<redacted>"})


def hf_device(args) -> str:
    return args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")


def open_response_cache(args, target: Path, tok, text_format):
    """The --response-cache entries that fit this run (same target, generator, stops; greedy), or None."""
    if args.response_cache is None:
        return None
    if args.temperature != 0:
        raise StageError(f"--response-cache holds greedy answers; --temperature is {args.temperature}, not 0")
    generator = hf_generator(hf_device(args)) if args.generation_engine == "hf" else "openai"
    cache = ResponseCache.load(args.response_cache, cache_identity(target, text_format, generator), tok)
    if cache.mismatch:
        log(f"[01b] WARNING --response-cache {args.response_cache} was made for another target or generator "
            f"({', '.join(cache.mismatch)} differ): every answer is generated")
    else:
        log(f"[01b] --response-cache {args.response_cache}: {len(cache.entries)} answers")
    return cache


@dataclass
class ResumeState:
    """Where one dataset stands: ids already generated, failures kept, records still to run."""
    done: set[str]
    earlier: object        # resume_generated's record of the settings already written
    kept: list[dict]       # failures kept (permanent ones; none with --retry-failed)
    pending: list[dict]    # records to run now
    unattempted: int       # records --retry-failed leaves for a later plain run

    @property
    def settled(self) -> set[str]:
        return self.done | {f["id"] for f in self.kept}


def resume_state(name: str, records: list[dict], gen_path: Path, fail_path: Path, settings: dict, args,
                 run_log) -> ResumeState:
    """Read what earlier runs wrote (repairing duplicate ids of an unlocked older 01b) and pick what to
    run: everything not generated and not failed permanently; with --retry-failed only the failures."""
    done, earlier = resume_generated(gen_path, settings, args.allow_mixed_settings, run_log)
    failed = [f for f in iter_jsonl(fail_path)] if fail_path.exists() else []
    if args.retry_failed:
        kept, retry = [], {f["id"] for f in failed} - done
    else:  # transient failures of an earlier run are retried now, permanent ones kept
        kept, retry = [f for f in failed if f["reason"] in PERMANENT_FAILURES and f["id"] not in done], None
    if len(kept) != len(failed):
        write_jsonl(fail_path, kept)
    state = ResumeState(done, earlier, kept, [], 0)
    pending = [r for r in records if r["id"] not in state.settled]
    if retry is not None:
        state.unattempted = sum(r["id"] not in retry for r in pending)
        pending = [r for r in pending if r["id"] in retry]
    state.pending = pending
    if state.settled or retry is not None:
        print(f"[01b] {name}: resuming, {len(done)} generated and {len(kept)} failed before, "
              f"{len(pending)} to go" + (f" (--retry-failed; {state.unattempted} never tried are left)"
                                         if retry is not None else ""))
    return state


def generate_with_servers(jobs: dict, write, fail, bars: dict, args, tok, text_format, shared: dict,
                          on_ready) -> tuple[str | None, dict]:
    """Run the jobs against the OpenAI-compatible servers (common/generation/loops.run_openai), behind the
    health gate (one for all datasets: each server is probed once) and one in-flight limit (it keeps
    what it learned from dataset to dataset). `on_ready(model)` gets the model name the servers report.
    Returns (what stopped the run or None, the manifest's server-side counts of this run)."""
    specials = {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}
    limit = shared.setdefault("in_flight", InFlightLimit(args.concurrency + args.long_concurrency))
    pool = ServerPool(args.server_url, args.served_model_name, args.api_key, args.temperature,
                      args.generation_seed if args.temperature > 0 else None, specials, args.request_timeout,
                      args.request_retries, args.retry_base_delay, args.retry_max_delay,
                      args.health_interval, args.health_timeout, args.server_down_timeout,
                      stop=list(text_format.stop_strings), top_p=args.top_p, stall_timeout=args.stall_timeout,
                      queue_timeout=args.queue_timeout, limit=limit, tokenizer=tok)
    if "health_gate" not in shared:
        shared["health_gate"] = health_gate(tok, args.health_probes, args.health_max_new_tokens,
                                              args.health_max_repeat_share)
    stopped_by = asyncio.run(run_openai(
        pool, tok, jobs, write, fail, bars, concurrency=args.concurrency,
        long_concurrency=args.long_concurrency, long_after_normal=args.long_after_normal,
        shutdown_grace=args.shutdown_grace, summary_interval=args.summary_interval,
        gate=shared["health_gate"], on_ready=lambda found: on_ready(pool.model)))
    shared.setdefault("lost", Counter()).update(pool.lost)
    if pool.capacity:
        shared["capacity"] = pool.capacity
    return stopped_by, {"requests_per_server": {s.url: s.num_requests for s in pool.servers},
                        "lost_work": dict(pool.lost), "server_capacity": pool.capacity or None,
                        "in_flight_limit": limit.summary()}


def generate_dataset(name: str, args, tok, target: Path, out: Path, upstream_dir: Path, ids: dict,
                     shared: dict, text_format=None, cache=None) -> dict | None:
    """Generate what is missing of one dataset; its counts when complete, None when not yet.

    `text_format`: the target's TargetFormat (common/text/target_format.py); `cache`: a ResponseCache whose hits
    are written at once (origin "cache") instead of being generated."""
    records = list(iter_jsonl(upstream_dir / "records.jsonl"))
    benchmark_only = bool(read_manifest(upstream_dir).get("dataset", {}).get("benchmark-only", False))
    gen_path, fail_path = out / "generated.jsonl", out / "failures.jsonl"
    # What decides the text (the server's model name is known after its start-up checks), checked
    # against the records already written; duplicate ids (an unlocked older 01b) are repaired.
    settings = generation_settings(args.generation_engine, str(target) if args.generation_engine == "hf" else None,
                                   args.max_new_tokens, args.temperature, args.generation_seed, ids["tokenizer"]["sha256"],
                                   text_format.stop_strings if text_format is not None else (), args.max_context, args.long_context,
                                   args.top_p)
    prompt_settings = {"tokenizer_sha256": settings["tokenizer_sha256"]}  # rows the target did not write
    run_log = RunLog(out)
    state = resume_state(name, records, gen_path, fail_path, settings, args, run_log)
    settled, earlier, unattempted = state.settled, state.earlier, state.unattempted
    todo, passed, overflow = make_jobs(state.pending, tok, text_format, max_new_tokens=args.max_new_tokens,
                                       max_context=args.max_context, long_context=args.long_context,
                                       benchmark_only=benchmark_only)
    counts, server_side = Counter(), {}
    hits = []
    if cache is not None:  # a known greedy answer to the same prompt under the same cap: no request
        looked_up = [(job, cache.lookup(job["prompt"], job["max_new"])) for job in todo]
        hits = [(job, found) for job, found in looked_up if found is not None]
        todo = [job for job, found in looked_up if found is None]
    with JsonlAppender(gen_path) as gen_out, JsonlAppender(fail_path) as fail_out:
        def write(job, result, origin="target"):
            if result["num_prompt_tokens"] is not None and result["num_prompt_tokens"] != job["n_prompt"]:
                counts["prompt_token_count_mismatch"] += 1  # the server tokenized our prompt differently
            # completion_ids: what the target emitted (None where a server returned only text);
            # max_new_tokens: this request's effective cap (the response cache's key).
            gen_out.write({"id": job["id"], "source": job["source"], "prompt": job["prompt"], "completion_ids": None,
                           **result, "max_new_tokens": job["max_new"], "origin": origin,
                           "engine": args.generation_engine if origin == "target" else None,
                           # a cached answer is the one these settings give (the cache's identity matched)
                           "settings": settings if origin in ("target", "cache") else prompt_settings})

        def fail(job, reason, detail):
            fail_out.write({"id": job["id"], "reason": reason, "detail": detail})

        for row in passed:
            gen_out.write({**row, "settings": prompt_settings})
        for job, found in hits:
            write(job, {"completion": found["completion"], "completion_ids": found["completion_ids"],
                        "finish_reason": found["finish_reason"], "num_prompt_tokens": job["n_prompt"],
                        "num_completion_tokens": found["num_completion_tokens"]}, origin="cache")
        for row in overflow:
            fail_out.write(row)
        jobs = {part: [j for j in todo if j["partition"] == part] for part in PARTITIONS}
        if args.generation_engine == "hf":  # one in-process model: the partitions run as one
            bars = {"normal": Progress(len(todo), name)}
        else:
            bars = {part: Progress(len(jobs[part]), f"{name}/{part}", i) for i, part in enumerate(PARTITIONS)
                    if jobs[part] or part == "normal"}
        cpu0, stopped_by = time.process_time(), None
        try:
            if todo and args.generation_engine == "openai":
                def on_ready(model: str) -> None:
                    settings["model"] = model  # as the server reported it
                    refuse_mixed_settings(gen_path, earlier, settings, args.allow_mixed_settings, keys=("model",))

                stopped_by, server_side = generate_with_servers(
                    jobs, write, fail, bars, args, tok, text_format, shared, on_ready)
            elif todo:
                if "hf" not in shared:  # one model load for all datasets of this run
                    shared["hf"] = HFEngine(target, tok, text_format.stop_ids, hf_device(args), args.temperature,
                                               args.generation_seed, args.top_p)
                run_hf(shared["hf"], todo, write, args.hf_batch_size, bars["normal"])
        finally:
            cpu = time.process_time() - cpu0
            seconds = max(bar.close() for bar in bars.values())
            run_log.append({"requests": sum(b.done for b in bars.values()), "seconds": round(seconds, 2),
                            "completion_tokens": sum(b.tokens for b in bars.values()),
                            "errors": dict(sum((b.errors for b in bars.values()), Counter())),
                            "lost_work": server_side.get("lost_work"), "stopped_by": stopped_by, "settings": settings})
    cache_counts = None if cache is None else {"hits": len(hits), "misses": len(todo)}
    return settle_dataset(name, args, out, upstream_dir, ids, records, benchmark_only, settled, unattempted,
                          stopped_by, bars=bars, seconds=seconds, cpu=cpu, server_side=server_side,
                          mismatches=counts["prompt_token_count_mismatch"], cache_counts=cache_counts)


def settle_dataset(name: str, args, out: Path, upstream_dir: Path, ids: dict, records: list, benchmark_only: bool,
                   settled, unattempted: int, stopped_by, *, bars, seconds, cpu, server_side, mismatches,
                   cache_counts) -> dict | None:
    """After a run over one dataset: stop where it was stopped, count what is on disk, and write the manifest
    once every record is generated or failed for good (its counts), else None (resume later)."""
    gen_path, fail_path = out / "generated.jsonl", out / "failures.jsonl"
    n_done = sum(b.done for b in bars.values())
    if stopped_by:
        raise StageError(f"stopped by {stopped_by} after {n_done} requests; everything finished is saved. "
                         "Re-run the same command to resume")
    rows = list(iter_jsonl(gen_path))
    failures = list(iter_jsonl(fail_path))
    assert len({r["id"] for r in rows}) == len(rows), f"duplicate ids in {gen_path}"
    new_rows = [r for r in rows if r["origin"] == "target" and r["id"] not in settled]
    result = {**dataset_counts(records, rows, failures, benchmark_only),
              "prompt_token_count_mismatch": mismatches,
              "this_run": this_run_counts(bars, new_rows, seconds, cpu, server_side.pop("requests_per_server", None),
                                          cache_counts, server_side),
              "all_runs": RunLog(out).totals()}
    transient = [f for f in failures if f["reason"] not in PERMANENT_FAILURES]
    if len(transient) > args.max_transient_failures:
        # Leave the dataset incomplete: a re-run keeps every result and retries only these.
        raise StageError(f"{out}: {len(transient)} requests failed ({dict(Counter(f['reason'] for f in transient))}; "
                         f"see failures.jsonl). Fix the cause and re-run the same command: it retries only them "
                         "(or raise --max-transient-failures to accept them)")
    if unattempted:
        print(f"[01b] {name}: {unattempted} records never tried; run without --retry-failed to finish it")
        return None
    if len(rows) + len(failures) != len(records):
        # Only a failure of this process itself gets here (every job ends in write() or fail()).
        raise StageError(f"{out}: {len(records) - len(rows) - len(failures)} records neither generated nor "
                         "failed; re-run to resume")
    write_manifest(out, STAGE, redacted(args), dataset=name, engine=args.generation_engine,
                   inputs=input_manifests(args.work_dir, upstream_dir), **ids, settings=distinct_settings(rows),
                   counts=result)
    print(f"[01b] {name}: {result['generated']} generated, {result['passed_through']} passed through, "
          f"failed {result['failed'] or 0}, finish {result['finish_reasons']}, {seconds:.1f} s, "
          f"attempt errors {result['this_run']['errors'] or 0}")
    return result


def main(argv=None):
    args = parse_args(build_parser(), argv)
    vars(args).pop("_server_url_given", None)
    urls = [args.server_url] if isinstance(args.server_url, str) else list(args.server_url or [])
    args.server_url = urls
    up_dir = stage_dir(args.work_dir, UPSTREAM)
    upstream = require_complete(up_dir, UPSTREAM)
    target = resolve_target(args.target_path, upstream, up_dir, UPSTREAM)
    names = upstream["datasets"]
    unknown = sorted(set(args.datasets_only or []) - set(names))
    if unknown:
        raise StageError(f"--datasets-only {unknown}: not prepared by 01 (it has {names})")
    if args.generation_engine == "openai" and not urls:
        raise StageError("--server-url: give at least one server")
    out = stage_dir(args.work_dir, STAGE)
    if args.overwrite:  # never delete a dataset folder another 01b is writing
        check_unlocked(stage_dir(args.work_dir, STAGE, n) for n in names)
    if args.retry_failed:  # reopen the datasets (and the stage) that have failures to retry
        for name in names:
            sub = stage_dir(args.work_dir, STAGE, name)
            if (sub / "failures.jsonl").exists() and next(iter_jsonl(sub / "failures.jsonl"), None):
                for folder in (sub, out):
                    if is_complete(folder):
                        (folder / "manifest.json").unlink()
    if not start_stage(out, args.overwrite, STAGE):
        return
    tok = load_tokenizer(target)
    text_format = load_target_format(target, tok)
    print(f"[01b] target {target} | engine {args.generation_engine} | datasets {names}"
          + (f" | servers {urls}" if args.generation_engine == "openai" else "")
          + f" | stops on {list(text_format.stop_strings)}")
    cache = open_response_cache(args, target, tok, text_format)
    ids = {"tokenizer": upstream["tokenizer"], "target": upstream["target"]}
    summary, shared = {}, {}
    for name in names:
        sub = stage_dir(args.work_dir, STAGE, name)
        if is_complete(sub):
            summary[name] = require_complete(sub, STAGE)["counts"]
            continue
        if args.datasets_only and name not in args.datasets_only:
            continue
        sub.mkdir(parents=True, exist_ok=True)
        with dataset_lock(sub):  # one 01b per dataset: a second is refused, naming the holder
            result = generate_dataset(name, args, tok, target, sub, stage_dir(args.work_dir, UPSTREAM, name),
                                      ids, shared, text_format, cache)
        if result is not None:
            summary[name] = result
    missing = [n for n in names if n not in summary]
    if missing:
        print(f"[01b] not done yet: {missing}; the stage manifest is written when every dataset is")
    else:
        write_manifest(out, STAGE, redacted(args), datasets=names, inputs=input_manifests(args.work_dir, up_dir),
                       **ids, target_format=text_format.as_dict(), counts=summary,
                       server_capacity=shared.get("capacity"))
    refuse_lost_work(shared.get("lost"), args.max_timeouts)


def refuse_lost_work(lost: Counter | None, max_timeouts: int) -> None:
    """End with an error line when this run threw away more work to timeouts than --max-timeouts allows.
    Its records are complete and right (a timed-out attempt is retried; one that failed for good is in
    failures.jsonl), so the manifests are written first: a re-run has nothing to redo. But the GPUs
    spent that time on answers nobody kept, which a run must never pass over with status 0."""
    if not lost or lost["timeouts"] <= max_timeouts:
        return
    raise StageError(f"{lost['timeouts']} request attempts timed out in this run ({lost['queue_timeouts']} waiting "
                     f"for their first token, {lost['stall_timeouts']} stalled after it) and "
                     f"{lost['abandoned_tokens']} tokens streamed to abandoned attempts were thrown away; the results "
                     "and manifests are complete (`lost_work` in the dataset manifests). The servers were sent more "
                     "than they serve: lower --concurrency toward what the start-up line says they run at once, or "
                     "raise --max-timeouts to accept this")


if __name__ == "__main__":
    main()
