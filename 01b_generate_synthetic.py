"""Generate synthetic responses: the target writes the answer to every prompt-only record.

Each record's prompt is rendered with the target's own chat template (generation prompt included)
and completed by the target through a backend (common/generation.py): `openai` (an SGLang/vLLM
server, `--concurrency` requests in flight) or `hf` (in-process transformers, the tiny world).
The completion is kept as raw text, special tokens included, so prompt + completion is exactly what
the target emits. Records that already end with the target's own assistant turn (`complete`) are
passed through (origin "dataset"). Resumable: results are appended as they arrive; a re-run skips
ids already in generated.jsonl (a torn last line is cut) and never duplicates one.
Reads:  <work-dir>/01_prepared/<dataset>/records.jsonl (+ manifest.json)
Writes: <work-dir>/01b_generated/<dataset>/{generated.jsonl, failures.jsonl, manifest.json},
        <work-dir>/01b_generated/manifest.json
Real:   python 01b_generate_synthetic.py --config configs/kimi-k2.5.yaml --work-dir /data/eagle3 \
            --generation-backend openai --server-url http://127.0.0.1:30000/v1 --concurrency 150
Tiny:   python 01b_generate_synthetic.py --config configs/tiny.yaml --work-dir runs/tiny
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from common.config import base_parser, parse_args
from common.io import JsonlAppender, iter_jsonl, write_jsonl
from common.stage import (StageError, is_complete, manifest_sha256, require_complete,
                          resolve_target, stage_dir, start_stage, write_manifest)

STAGE, UPSTREAM = "01b_generate_synthetic", "01_prepare_datasets"
# Failures that a re-run would repeat identically; others (timeouts, server errors) are retried.
PERMANENT_FAILURES = {"context_overflow"}


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("generate")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; default: the one 01 used (refused if its tokenizer differs)")
    g.add_argument("--generation-backend", choices=("hf", "openai"), default="openai",
                   help="openai: an SGLang/vLLM server; hf: in-process transformers (tiny world)")
    g.add_argument("--max-new-tokens", type=int, default=4096, help="generation cap per response (tokens)")
    g.add_argument("--max-context", type=int, default=10240,
                   help="prompt + response limit (tokens); longer prompts fail with context_overflow")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (only used when temperature > 0)")
    g.add_argument("--datasets-only", nargs="+", default=None, metavar="NAME",
                   help="generate only these datasets of 01 (the stage manifest waits for the rest)")
    g = p.add_argument_group("generate: openai backend")
    g.add_argument("--server-url", default="http://127.0.0.1:30000/v1", help="OpenAI-compatible base URL")
    g.add_argument("--served-model-name", default=None,
                   help="model name the server serves; default: ask the server (GET /v1/models)")
    g.add_argument("--api-key", default="EMPTY", help="API key sent to the server")
    g.add_argument("--concurrency", type=int, default=150, help="requests in flight")
    g.add_argument("--request-timeout", type=float, default=1800.0, help="per-request timeout (s)")
    g.add_argument("--request-retries", type=int, default=3,
                   help="client retries of a request on connection errors, timeouts, 429, 5xx")
    g.add_argument("--max-transient-failures", type=int, default=0,
                   help="requests that may fail for good (after retries) with the dataset still counted "
                        "complete; above it the dataset stays incomplete and a re-run retries them (count)")
    g = p.add_argument_group("generate: hf backend")
    g.add_argument("--hf-batch-size", type=int, default=32,
                   help="prompts per generate() call (count; 32 doubles CPU throughput over 8)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device of the hf backend (default: cuda if available)")
    return p




def redacted(args):
    """The flags as recorded in manifests: never a real API key."""
    import argparse

    return argparse.Namespace(**{**vars(args), "api_key": "EMPTY" if args.api_key == "EMPTY" else "<redacted>"})


def make_jobs(records: list[dict], tok, args) -> tuple[list[dict], list[dict], list[dict]]:
    """Render prompts; split into (to generate, passed through, context overflows)."""
    from common.chat_format import render_completion, render_prompt

    prompts = []
    for r in records:
        msgs = r["messages"][:-1] if r["complete"] else r["messages"]
        prompts.append(render_prompt(tok, msgs, r.get("tools"), thinking=r["thinking"]))
    lengths = [len(x) for x in tok(prompts, add_special_tokens=False)["input_ids"]] if prompts else []
    completions = {r["id"]: render_completion(r["messages"][-1], thinking=r["thinking"])
                   for r in records if r["complete"]}
    n_completion = dict(zip(completions, (len(x) for x in tok(list(completions.values()), add_special_tokens=False)
                                          ["input_ids"]))) if completions else {}
    todo, passed, overflow = [], [], []
    for r, prompt, n in zip(records, prompts, lengths):
        base = {"id": r["id"], "source": r["source"], "prompt": prompt}
        if r["complete"]:
            passed.append({**base, "completion": completions[r["id"]], "finish_reason": "stop", "num_prompt_tokens": n,
                           "num_completion_tokens": n_completion[r["id"]], "origin": "dataset", "backend": None})
        elif n >= args.max_context:
            overflow.append({"id": r["id"], "reason": "context_overflow",
                             "detail": f"prompt has {n} tokens, --max-context is {args.max_context}"})
        else:
            todo.append({**base, "n_prompt": n, "max_new": min(args.max_new_tokens, args.max_context - n)})
    return todo, passed, overflow


class Progress:
    """tqdm bar over requests with tokens/s in the postfix (requests/s and ETA come from tqdm)."""

    def __init__(self, total: int, name: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"[01b] {name}", unit="req", smoothing=0.05)
        self.t0, self.tokens, self.done = time.time(), 0, 0

    def update(self, n_requests: int, n_tokens: int):
        self.tokens += n_tokens
        self.done += n_requests
        self.bar.update(n_requests)
        self.bar.set_postfix_str(f"{self.tokens / max(time.time() - self.t0, 1e-9):.1f} tok/s", refresh=False)

    def close(self) -> float:
        self.bar.close()
        return time.time() - self.t0


def failure_reason(exc: Exception) -> str:
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection_error"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    return "bad_response"


async def run_openai(backend, todo, write, fail, concurrency: int, progress: Progress):
    import asyncio

    import openai

    try:
        await backend.resolve_model()
    except (openai.APIError, ValueError) as e:
        await backend.close()
        raise StageError(f"cannot get the served model from {backend.client.base_url}: {e}. Start the server "
                         "(e.g. `python -m sglang.launch_server ...`) or fix --server-url/--served-model-name") from None
    queue = asyncio.Queue()
    for job in todo:
        queue.put_nowait(job)

    async def worker():
        while not queue.empty():
            job = queue.get_nowait()
            try:
                result = await backend.generate(job["prompt"], job["max_new"])
            except (openai.APIError, ValueError) as e:
                fail(job, failure_reason(e), str(e)[:500])
                progress.update(1, 0)
                continue
            write(job, result)
            progress.update(1, result["num_completion_tokens"] or 0)

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(todo)))))
    finally:
        await backend.close()


def run_hf(backend, todo, write, batch_size: int, progress: Progress):
    # Similar lengths batch together: less padding, fewer wasted positions.
    todo = sorted(todo, key=lambda j: (j["n_prompt"], j["id"]))
    for i in range(0, len(todo), batch_size):
        batch = todo[i:i + batch_size]
        results = backend.generate_batch([j["prompt"] for j in batch], [j["max_new"] for j in batch])
        for job, result in zip(batch, results):
            write(job, result)
        progress.update(len(batch), sum(r["num_completion_tokens"] for r in results))


def generate_dataset(name: str, args, tok, target: Path, out: Path, upstream_dir: Path, ids: dict,
                     backends: dict) -> dict:
    records = list(iter_jsonl(upstream_dir / "records.jsonl"))
    gen_path, fail_path = out / "generated.jsonl", out / "failures.jsonl"
    done = {r["id"] for r in iter_jsonl(gen_path)} if gen_path.exists() else set()
    failed = [f for f in iter_jsonl(fail_path)] if fail_path.exists() else []
    kept = [f for f in failed if f["reason"] in PERMANENT_FAILURES and f["id"] not in done]
    if len(kept) != len(failed):
        write_jsonl(fail_path, kept)  # transient failures of an earlier run are retried now
    settled = done | {f["id"] for f in kept}
    pending = [r for r in records if r["id"] not in settled]
    if settled:
        print(f"[01b] {name}: resuming, {len(done)} generated and {len(kept)} failed before, "
              f"{len(pending)} to go")
    todo, passed, overflow = make_jobs(pending, tok, args)
    counts = Counter()
    with JsonlAppender(gen_path) as gen_out, JsonlAppender(fail_path) as fail_out:
        def write(job, result):
            if result["num_prompt_tokens"] is not None and result["num_prompt_tokens"] != job["n_prompt"]:
                counts["prompt_token_count_mismatch"] += 1  # the server tokenized our prompt differently
            gen_out.write({"id": job["id"], "source": job["source"], "prompt": job["prompt"], **result,
                           "origin": "target", "backend": args.generation_backend})

        def fail(job, reason, detail):
            fail_out.write({"id": job["id"], "reason": reason, "detail": detail})

        for row in passed:
            gen_out.write(row)
        for row in overflow:
            fail_out.write(row)
        progress = Progress(len(todo), name)
        try:
            if todo and args.generation_backend == "openai":
                import asyncio

                from common.generation import OpenAIBackend

                specials = {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}
                backend = OpenAIBackend(args.server_url, args.served_model_name, args.api_key, args.temperature,
                                        args.request_timeout, args.request_retries,
                                        args.seed if args.temperature > 0 else None, specials)
                asyncio.run(run_openai(backend, todo, write, fail, args.concurrency, progress))
            elif todo:
                from common.generation import HFBackend

                if "hf" not in backends:  # one model load for all datasets of this run
                    device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
                    backends["hf"] = HFBackend(target, tok, device, args.temperature, args.seed)
                run_hf(backends["hf"], todo, write, args.hf_batch_size, progress)
        finally:
            seconds = progress.close()
    rows = list(iter_jsonl(gen_path))
    failures = list(iter_jsonl(fail_path))
    assert len({r["id"] for r in rows}) == len(rows), f"duplicate ids in {gen_path}"
    generated = [r for r in rows if r["origin"] == "target"]
    new_tokens = sum(r["num_completion_tokens"] or 0 for r in generated if r["id"] not in settled)
    result = {
        "num_records": len(records), "generated": len(generated), "passed_through": len(rows) - len(generated),
        "failed": dict(Counter(f["reason"] for f in failures)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
        "prompt_tokens": sum(r["num_prompt_tokens"] or 0 for r in rows),
        "completion_tokens": sum(r["num_completion_tokens"] or 0 for r in rows),
        "prompt_token_count_mismatch": counts["prompt_token_count_mismatch"],
        "this_run": {"requests": progress.done, "seconds": round(seconds, 2),
                     "requests_per_s": round(progress.done / max(seconds, 1e-9), 3),
                     "completion_tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1)}}
    transient = [f for f in failures if f["reason"] not in PERMANENT_FAILURES]
    if len(transient) > args.max_transient_failures:
        # Leave the dataset incomplete: a re-run keeps every result and retries only these.
        raise StageError(f"{out}: {len(transient)} requests failed ({dict(Counter(f['reason'] for f in transient))}; "
                         f"see failures.jsonl). Fix the cause and re-run the same command: it retries only them "
                         "(or raise --max-transient-failures to accept them)")
    if len(rows) + len(failures) != len(records):
        # Only a failure of this process itself gets here (every job ends in write() or fail()).
        raise StageError(f"{out}: {len(records) - len(rows) - len(failures)} records neither generated nor "
                         "failed; re-run to resume")
    write_manifest(out, STAGE, redacted(args), dataset=name, backend=args.generation_backend,
                   input_manifest_sha256=manifest_sha256(upstream_dir), **ids, counts=result)
    print(f"[01b] {name}: {result['generated']} generated, {result['passed_through']} passed through, "
          f"failed {result['failed'] or 0}, finish {result['finish_reasons']}, {seconds:.1f} s")
    return result


def main(argv=None):
    args = parse_args(build_parser(), argv)
    up_dir = stage_dir(args.work_dir, UPSTREAM)
    upstream = require_complete(up_dir, UPSTREAM)
    target = resolve_target(args.target_path, upstream, up_dir, UPSTREAM)
    names = upstream["datasets"]
    unknown = sorted(set(args.datasets_only or []) - set(names))
    if unknown:
        raise StageError(f"--datasets-only {unknown}: not prepared by 01 (it has {names})")
    out = stage_dir(args.work_dir, STAGE)
    if not start_stage(out, args.overwrite, "01b"):
        return
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    print(f"[01b] target {target} | backend {args.generation_backend} | datasets {names}")
    ids = {"tokenizer": upstream["tokenizer"], "target": upstream["target"]}
    summary, backends = {}, {}
    for name in names:
        sub = stage_dir(args.work_dir, STAGE, name)
        if is_complete(sub):
            summary[name] = require_complete(sub, STAGE)["counts"]
            continue
        if args.datasets_only and name not in args.datasets_only:
            continue
        sub.mkdir(parents=True, exist_ok=True)
        summary[name] = generate_dataset(name, args, tok, target, sub, stage_dir(args.work_dir, UPSTREAM, name),
                                         ids, backends)
    missing = [n for n in names if n not in summary]
    if missing:
        print(f"[01b] not done yet: {missing}; the stage manifest is written when every dataset is")
        return
    write_manifest(out, STAGE, redacted(args), datasets=names, input_manifest_sha256=manifest_sha256(up_dir),
                   **ids, counts=summary)


if __name__ == "__main__":
    main()
