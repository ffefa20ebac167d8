"""05 against SGLang: one streamed request to its native /generate, greedy or sampled.

SGLang's side: requests go to its native POST /generate with token ids (`input_ids`, `stream: true`) and
every sampling parameter set (request_params.pinned; the seed as `sampling_seed`):
the time to the first streamed chunk is the TTFT; the final chunk's `meta_info` carries
`completion_tokens` and, on a speculative server, `spec_verify_ct` (verify rounds), so per-request
tau = completion_tokens / spec_verify_ct (bonus token included; SGLang's definition, tokenizer_manager).
spec_verify_ct counts verify rounds whatever the sampling: a sampled request's tau is read the same way.
Chunks are SSE lines `data: {json}` ending with `data: [DONE]`; a failed request streams
`data: {"error": {"message", ...}}` before `[DONE]` (sglang 0.5.14 srt/entrypoints/http_server.py).
Each chunk's `output_ids` are the answer so far, or with --incremental-streaming-output only the chunk's
new ones (tokenizer_manager `_handle_batch_output`).
"""
from __future__ import annotations

from common.serving.request_params import pinned
from common.serving.sglang import parse_answer, sse_request
from common.stage import StageError


def sglang_sampling(sampling: dict | None, max_new_tokens: int) -> dict:
    """SGLang's `sampling_params` of one request: every parameter pinned (request_params), the seed under
    its SGLang name."""
    p = pinned(sampling)
    return {"max_new_tokens": int(max_new_tokens), **{k: v for k, v in p.items() if k != "seed"},
            "sampling_seed": p["seed"]}


def generate_stream(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float,
                    role: str = "SGLang", sampling: dict | None = None) -> dict:
    """One request to SGLang's /generate, greedy or sampled with `sampling` = {temperature, top_p, seed}
    (request_params.pinned fills in the rest); returns {ttft_s, latency_s, completion_tokens,
    spec_verify_ct, accept_length, output_ids, retries} (output_ids None when no chunk carried any).

    The whole request is retried on connection refused/reset, a cut stream and transient 5xx
    (server.sse_request), and timed on its successful attempt alone; an error chunk or an aborted
    request stops with the server's own message, and a final chunk without its counts with one line
    naming the field (server.parse_answer).
    """
    url = base_url.rstrip("/") + "/generate"
    what = f"{role} server {base_url}: POST /generate"
    payload = {"input_ids": input_ids, "stream": True, "sampling_params": sglang_sampling(sampling, max_new_tokens)}
    got = sse_request(url, payload, timeout, what)
    last = got["chunks"][-1] if got["chunks"] else None
    if last is not None and "error" in last:
        err = last["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        raise StageError(f"{url} answered a {len(input_ids)}-token prompt with an error: {message}")
    if last is None:
        raise StageError(f"{url} streamed no chunk for a {len(input_ids)}-token prompt")
    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise StageError(f"{url} aborted a {len(input_ids)}-token prompt: {finish.get('message', finish)}")
    parse_answer(last, what, counts=("meta_info.completion_tokens",), optional=("meta_info.spec_verify_ct",))
    return {"ttft_s": got["ttft_s"], "latency_s": got["latency_s"], **parse_meta(last["meta_info"]),
            "output_ids": answer_ids(got["chunks"]), "retries": got["retries"]}


def answer_ids(chunks: list[dict]) -> list[int] | None:
    """The answer's token ids as streamed: the last chunk's when each chunk's ids extend the previous
    chunk's (SGLang's default), else all chunks' joined (--incremental-streaming-output); None when no
    chunk carried any. 05 checks completion_tokens against them (server_bench.answer_fault)."""
    seen = [c["output_ids"] for c in chunks if isinstance(c.get("output_ids"), list)]
    if not seen:
        return None
    cumulative = all(b[:len(a)] == a for a, b in zip(seen, seen[1:]))
    return list(seen[-1]) if cumulative else [t for ids in seen for t in ids]


def parse_meta(meta: dict) -> dict:
    """completion_tokens, spec_verify_ct (None on a non-speculative server) and per-request tau."""
    n = int(meta["completion_tokens"])
    ct = meta.get("spec_verify_ct")
    ct = None if ct is None else int(ct)
    return {"completion_tokens": n, "spec_verify_ct": ct,
            "accept_length": (n / ct) if ct else None}
