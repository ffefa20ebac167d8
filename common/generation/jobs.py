"""01b's bookkeeping of one dataset: the jobs made from its records, and the counts its manifest reports.

  make_jobs(records, ...)     render every record's prompt with the target's template and split the
                              records into jobs to generate, rows passed through (a dataset's own
                              `complete` answer, a benchmark-only prompt) and context overflows.
  dataset_counts(...)         what the dataset folder holds: records, origins, failures by reason,
                              finish reasons, partitions, prompt and completion tokens.
  this_run_counts(...)        what this run did: requests, rates, attempt errors, latency and answer
                              length percentiles, client CPU per request, and from the server pool the
                              work lost to timeouts, each server's capacity and the in-flight limit.
"""
from __future__ import annotations

from collections import Counter

from common.generation.progress import percentiles
from common.stage import StageError

PARTITIONS = ("normal", "long")


def make_jobs(records: list[dict], tok, text_format, *, max_new_tokens: int, max_context: int, long_context: int | None,
              benchmark_only: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """Render prompts; split into (to generate, passed through, context overflows). A job's response
    budget is what its partition's context leaves after the prompt (at most `max_new_tokens`): the long
    partition's records get `long_context` (when given), the others `max_context` (tokens).
    Records of a benchmark-only dataset are all passed through as prompts (origin "prompt", no answer)."""
    from common.text.chat_format import render_prompt
    from common.text.target_format import FormatError, render_final_turn

    prompts = []
    for r in records:
        msgs = r["messages"][:-1] if r["complete"] else r["messages"]
        prompts.append(render_prompt(tok, msgs, r.get("tools"), thinking=r["thinking"]))
    lengths = [len(x) for x in tok(prompts, add_special_tokens=False)["input_ids"]] if prompts else []
    completions = {}
    for r in records:
        if r["complete"] and not benchmark_only:
            try:
                completions[r["id"]] = render_final_turn(tok, text_format, r["messages"], r.get("tools"), r["thinking"])
            except FormatError as e:  # 01 skips these; records from elsewhere may still hold one
                raise StageError(f"record {r['id']}: the target's template cannot render its answer ({e}); "
                                 "re-run 01_prepare_datasets.py --overwrite for this target") from None
    n_completion = dict(zip(completions, (len(x) for x in tok(list(completions.values()), add_special_tokens=False)
                                          ["input_ids"]))) if completions else {}
    todo, passed, overflow = [], [], []
    for r, prompt, n in zip(records, prompts, lengths):
        base = {"id": r["id"], "source": r["source"], "prompt": prompt}
        part = r.get("partition", "normal")
        limit, flag = ((long_context, "--long-context") if part == "long" and long_context
                       else (max_context, "--max-context"))
        if benchmark_only:
            passed.append({**base, "completion": None, "completion_ids": None, "finish_reason": None,
                           "num_prompt_tokens": n, "num_completion_tokens": None, "origin": "prompt",
                           "engine": None})
        elif r["complete"]:
            passed.append({**base, "completion": completions[r["id"]], "completion_ids": None, "finish_reason": "stop",
                           "num_prompt_tokens": n, "num_completion_tokens": n_completion[r["id"]],
                           "origin": "dataset", "engine": None})
        elif n >= limit:
            overflow.append({"id": r["id"], "reason": "context_overflow",
                             "detail": f"prompt has {n} tokens, {flag} is {limit} ({part} partition)"})
        else:
            todo.append({**base, "n_prompt": n, "max_new": min(max_new_tokens, limit - n), "partition": part})
    return todo, passed, overflow


def dataset_counts(records: list[dict], rows: list[dict], failures: list[dict], benchmark_only: bool) -> dict:
    """The manifest's counts of what the dataset folder holds: `rows` of generated.jsonl, `failures` of
    failures.jsonl, for the dataset's 01 `records`."""
    return {
        "num_records": len(records), "generated": sum(r["origin"] == "target" for r in rows),
        "passed_through": sum(r["origin"] in ("dataset", "prompt") for r in rows),
        "from_cache": sum(r["origin"] == "cache" for r in rows),
        "benchmark_only": benchmark_only,
        "failed": dict(Counter(f["reason"] for f in failures)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
        "partitions": dict(Counter(r.get("partition", "normal") for r in records)),
        "prompt_tokens": sum(r["num_prompt_tokens"] or 0 for r in rows),
        "completion_tokens": sum(r["num_completion_tokens"] or 0 for r in rows)}


def this_run_counts(bars: dict, new_rows: list[dict], seconds: float, cpu_s: float,
                    requests_per_server: dict | None, response_cache: dict | None, server_side: dict | None = None
                    ) -> dict:
    """The manifest's `this_run`: `bars` are the run's common.generation.progress.Progress per partition,
    `new_rows` the records the target generated in this run, `seconds` its wall time and `cpu_s` the
    client's CPU time; `response_cache` is {"hits", "misses"} when a cache was given; `server_side` what
    the server pool adds (`lost_work`, `server_capacity`, `in_flight_limit`; 01b's generate_with_servers)."""
    n_done = sum(b.done for b in bars.values())
    new_tokens = sum(b.tokens for b in bars.values())
    return {"requests": n_done, "seconds": round(seconds, 2),
            "requests_per_s": round(n_done / max(seconds, 1e-9), 3),
            "completion_tokens": new_tokens,
            "completion_tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1),
            "errors": dict(sum((b.errors for b in bars.values()), Counter())),
            "latency_s": percentiles([x for b in bars.values() for x in b.latencies]),
            "completion_tokens_per_request": percentiles([r["num_completion_tokens"] or 0 for r in new_rows]),
            "client_cpu_ms_per_request": round(1000 * cpu_s / max(n_done, 1), 3),
            "requests_per_server": requests_per_server or None,
            "response_cache": response_cache, **(server_side or {})}
