"""01b's two run loops, over the jobs of common/generation/jobs.make_jobs.

  run_openai(pool, ...)   the server pool (common/generation/server_pool.py) after its start-up checks
                          (common/generation/server_checks.py, probe prompts below) and the capacity line of
                          each server: one worker per request in flight and partition (the pool's in-flight
                          limit may hold some back), the partitions at once or one after the other, a
                          summary log line every `summary_interval` s. SIGINT/SIGTERM stop new requests
                          and let those in flight finish for `shutdown_grace` s; a second signal stops
                          at once. Returns the name of the signal that stopped it, if any.
  run_hf(engine, ...)    in-process batches of common/generation/hf_engine.HFEngine, similar prompt
                          lengths together.
Each finished job goes to `write(job, result)`, each failed one to `fail(job, reason, detail)`.

Fault policy of 01b. Faults cost seconds, not the run: timeouts, dropped connections, 429 and 5xx are
retried with backoff and jitter, a server that stops answering is waited for (health polling;
server_pool.py), a queue wait is not a timeout (requests are streamed) and a timeout from a server
that is up lowers the in-flight limit (common/generation/capacity.py), input errors go to failures.jsonl
with their reason (context_overflow, http_4xx), and `finish_reason` "length" is recorded (01c trains on
them by default). Durable: each result is appended as one whole, flushed line as it arrives
(common/io.JsonlAppender); a re-run after a kill at any moment
skips the ids already written (a torn last line is cut), so every id lands exactly once (run_state.py).
Transient failures are retried by the next run; `--retry-failed` re-runs only the ids in failures.jsonl
(context overflows included). A resume with another model, --max-new-tokens, --temperature or tokenizer
is refused unless --allow-mixed-settings.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from common.generation.progress import Progress
from common.generation.jobs import PARTITIONS
from common.stage import StageError

# A server that answers, but wrongly (200s that are not completions: truncated JSON, a sign-in page, null
# text) is not "down": after this many records in a row failed so, with no answer between, the run stops.
BAD_ANSWERS_IN_A_ROW = 8

# Tokenizer probe: specials, a tool call, code, and non-ASCII text, through the target's own template.
PROBE_MESSAGES = [
    {"role": "system", "content": "You are Kimi. Réponds brièvement; 日本語も可. Tabs\tand  spaces."},
    {"role": "user", "content": "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # naïve café ✓ 🙂\n"},
    {"role": "assistant", "content": "Sure.", "reasoning_content": "Check the dict.",
     "tool_calls": [{"id": "functions.run:0", "type": "function",
                     "function": {"name": "run", "arguments": "{\"cmd\": \"ls -la /tmp\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.run:0", "name": "run", "content": "total 0\r\n\u00a0ok"},
]


async def run_openai(pool, tok, jobs: dict, write, fail, bars: dict, *, concurrency: int, long_concurrency: int,
                     long_after_normal: bool, shutdown_grace: float, summary_interval: float, gate=None,
                     on_ready=None) -> str | None:
    """Run every job through the server pool; returns the name of the signal that stopped it, if any.
    `gate`: the target health gate (common/generation/server_checks.HealthGate); `on_ready(found)` runs after
    the start-up checks, before any work (it may refuse)."""
    import signal

    from common.text.chat_format import render_prompt
    from common.generation.progress import log
    from common.generation.server_checks import StartupCheckFailed, startup_checks
    from common.generation.server_pool import AnswersWrong, RequestFailed, ServersDown, Stopping

    loop = asyncio.get_running_loop()
    stop, stopped_by, main, starting = asyncio.Event(), [], None, None
    bad_in_a_row = [0, ""]   # records failed with bad_response since the last answer, the last detail

    def on_signal(name):
        if starting is not None and not starting.done():  # still in start-up checks: nothing in flight
            stopped_by.append(name)
            starting.cancel()
        elif not stopped_by:
            stopped_by.append(name)
            stop.set()
            n = sum(b.in_flight for b in bars.values())
            log(f"[01b] {name}: no new requests; {n} in flight may finish within {shutdown_grace:.0f} s "
                "(send it again to stop now)")
            loop.call_later(shutdown_grace, lambda: main and main.cancel())
        elif main is not None:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)

    async def worker(queue, bar):
        while queue and not stop.is_set():
            job = queue.popleft()
            t0 = time.monotonic()
            try:
                result = await pool.generate(job["prompt"], job["max_new"], bar.errors, progress=bar)
            except Stopping:  # never sent: the next run does it
                return
            except RequestFailed as e:
                fail(job, e.kind, e.detail)
                bar.update(failed=True)
                if e.kind == "bad_response":
                    bad_in_a_row[:] = [bad_in_a_row[0] + 1, e.detail]
                    if bad_in_a_row[0] >= BAD_ANSWERS_IN_A_ROW:
                        raise AnswersWrong(f"the servers answer, but not with completions: {bad_in_a_row[0]} "
                                           f"records in a row failed as bad_response (last: {e.detail[:160]})")
            else:
                bad_in_a_row[0] = 0
                write(job, result)
                bar.update(tokens=result["num_completion_tokens"] or 0, latency=time.monotonic() - t0)

    async def partition(part, limit):
        queue = deque(jobs[part])
        async with asyncio.TaskGroup() as group:
            for _ in range(min(limit, len(queue))):
                group.create_task(worker(queue, bars[part]))

    async def everything():
        limits = {"normal": concurrency, "long": long_concurrency}
        if long_after_normal:
            for part in PARTITIONS:
                await partition(part, limits[part])
        else:
            async with asyncio.TaskGroup() as group:
                for part in PARTITIONS:
                    group.create_task(partition(part, limits[part]))

    async def ticker():
        while True:
            await asyncio.sleep(summary_interval)
            for bar in bars.values():
                if bar.total:
                    log(bar.line(pool.limit.limit if pool.limit is not None else None))

    need = max([j["n_prompt"] + j["max_new"] for part in PARTITIONS for j in jobs[part]] or [0])
    probes = [render_prompt(tok, PROBE_MESSAGES, None, thinking=True),
              next(j["prompt"] for part in PARTITIONS for j in jobs[part])]
    tick = None
    try:
        async with pool:
            starting = asyncio.ensure_future(startup_checks(pool, tok, probes, need, gate))
            try:
                found = await starting
            except asyncio.CancelledError:
                if not stopped_by:
                    raise
                return stopped_by[0]
            except (StartupCheckFailed, AnswersWrong) as e:
                raise StageError(f"start-up check failed, nothing sent: {e}") from None
            for url, info in found.items():
                log(f"[01b] server {url}: model {info['model']!r}, context {info['max_model_len']}, "
                    f"tokenizer agrees ({info['tokenizer_check']})"
                    + (f", health gate passed ({info['health']})" if "health" in info else ""))
            in_flight = [min(n, len(jobs[part])) for part, n in zip(PARTITIONS, (concurrency, long_concurrency))]
            workers = max(in_flight) if long_after_normal else sum(in_flight)   # the most ever in flight
            if pool.limit is not None:
                pool.limit.set_ceiling(workers)
            size_to_servers(pool, found, jobs, workers)
            if on_ready is not None:
                on_ready(found)
            pool.stopping = stop
            tick = asyncio.ensure_future(ticker())
            main = asyncio.ensure_future(everything())
            try:
                await main
            except asyncio.CancelledError:
                if not stopped_by:
                    raise
            except BaseExceptionGroup as eg:  # a worker's exception, from the TaskGroups
                down = eg.subgroup((ServersDown, AnswersWrong))
                if down is None:
                    raise
                while isinstance(down, BaseExceptionGroup):
                    down = down.exceptions[0]
                raise StageError(f"{down}; results so far are kept, re-run to resume") from None
    finally:
        if tick is not None:
            tick.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return stopped_by[0] if stopped_by else None


def size_to_servers(pool, found: dict, jobs: dict, in_flight: int) -> None:
    """Print what each server runs at once of its share of the `in_flight` requests
    (common/generation/capacity.py), keep it in `pool.capacity`, and floor the pool's in-flight limit
    there: below what the servers run at once nothing queues, so halving further would only idle them."""
    from common.generation.capacity import capacity_line, runs_at_once
    from common.generation.progress import log

    needs = [j["n_prompt"] + j["max_new"] for part in PARTITIONS for j in jobs[part]]
    mean_need = sum(needs) / max(len(needs), 1)
    share = -(-in_flight // max(len(found), 1))  # requests go to the least busy server: an even share
    fits = []
    for url, info in found.items():
        cap = info.get("capacity")
        log(capacity_line(url, cap, share, mean_need))
        fits.append(runs_at_once(cap, share, mean_need))
        pool.capacity[url] = {**cap, "runs_at_once": fits[-1], "in_flight": share,
                              "mean_request_tokens": round(mean_need)} if cap else None
    if pool.limit is not None and all(fits):
        pool.limit.set_floor(sum(fits))


def run_hf(engine, todo, write, batch_size: int, progress: Progress):
    """Generate every job in batches of `batch_size` prompts through `engine.generate_batch`."""
    # Similar lengths batch together: less padding, fewer wasted positions.
    todo = sorted(todo, key=lambda j: (j["n_prompt"], j["id"]))
    for i in range(0, len(todo), batch_size):
        batch = todo[i:i + batch_size]
        results = engine.generate_batch([j["prompt"] for j in batch], [j["max_new"] for j in batch])
        for job, result in zip(batch, results):
            write(job, result)
        progress.update(len(batch), sum(r["num_completion_tokens"] for r in results))
