"""01b's start-up checks: before any work, every server is healthy, serves the model, has the context
the run needs, tokenizes like the target and answers sanely, so a day-long run never starts against
the wrong server or a broken target.

Transient errors are waited out as they are in mid-run (common/generation/server_pool.py): a server that is
not healthy yet is polled every --health-interval s, and a timeout, dropped connection, 429, 5xx or
malformed answer of /v1/models, /tokenize or a probe completion is retried with backoff, all within
--server-down-timeout s of the start. A permanent mismatch (another model, another tokenizer, a
context too short, degenerate answers) fails at once.

The target health gate (`HealthGate`): a few fixed prompts answered greedily by every server. A known
failure of INT4 MoE kernels on SM12x GPUs makes Kimi-K2.5 emit repeated-token garbage ("The capital of
France is" -> "foss foss foss ...") while /health is 200 and /v1/models lists the model
(https://github.com/sgl-project/sglang/issues/23264, https://github.com/vllm-project/vllm/issues/40357);
a day of such answers is a day lost. An answer is degenerate when it never ends its turn within
--health-max-new-tokens or when more than --health-max-repeat-share of its 4-grams repeat an earlier
4-gram of the same answer (a loop of any period p <= n/2 repeats ~1 - p/n of them; plain short answers
repeat almost none).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.generation.capacity import read_capacity
from common.generation.progress import log
from common.generation.server_pool import RequestFailed, Server, ServerPool

# Short questions any chat model answers in a few tokens, so a healthy answer ends its turn well
# within the budget. Rendered with thinking off (an instant answer, no reasoning to wait for).
HEALTH_PROBES = [
    "What is 17 + 25? Reply with the number only.",
    "What is the capital of France? Answer in one word.",
    "Write a Python function `square(x)` that returns x squared. Reply with the code only.",
    "Translate 'good morning' into German. Reply with the translation only.",
]
REPEAT_NGRAM = 4  # n of the repeated n-gram share


class StartupCheckFailed(Exception):
    """A server is unreachable or unhealthy, serves another model, tokenizes differently or answers
    degenerately."""


@dataclass
class HealthGate:
    """The target health gate's settings and the servers that passed it in this run (checked once)."""
    prompts: list[str]
    max_new_tokens: int = 256
    max_repeat_share: float = 0.5
    passed: set[str] = field(default_factory=set)


def health_gate(tok, num_probes: int, max_new_tokens: int, max_repeat_share: float) -> HealthGate | None:
    """The gate of `num_probes` probe prompts rendered by the target's own template; None when 0."""
    from common.text.chat_format import render_prompt

    if not 0 <= num_probes <= len(HEALTH_PROBES):
        raise ValueError(f"--health-probes {num_probes}: 0 (off) to {len(HEALTH_PROBES)}")
    if num_probes == 0:
        return None
    prompts = [render_prompt(tok, [{"role": "user", "content": q}], None, thinking=False)
               for q in HEALTH_PROBES[:num_probes]]
    return HealthGate(prompts, max_new_tokens, max_repeat_share)


def repeated_ngram_share(ids: list[int], n: int = REPEAT_NGRAM) -> float:
    """Share of the n-grams of `ids` that repeat an earlier n-gram of `ids` (0 for fewer than n ids)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def degenerate(result: dict, tok, gate: HealthGate) -> str | None:
    """What is wrong with one probe answer (a ServerPool result), or None when it looks sane."""
    ids = tok(result["completion"], add_special_tokens=False)["input_ids"]
    share = repeated_ngram_share(ids)
    problems = []
    if share > gate.max_repeat_share:
        problems.append(f"{share:.0%} of its {REPEAT_NGRAM}-grams repeat (--health-max-repeat-share "
                        f"{gate.max_repeat_share})")
    if result["finish_reason"] != "stop":
        problems.append(f"no end-of-turn within {gate.max_new_tokens} tokens (--health-max-new-tokens)")
    return "; ".join(problems) + f": {result['completion'][:80]!r}" if problems else None


def startup_delay(pool: ServerPool, attempt: int, retry_after: float | None) -> float:
    """The wait before start-up retry `attempt`: the pool's backoff, capped at twice the health
    interval. Nothing is in flight yet, so a long wait only delays noticing that the server is back
    (uncapped, a 12 s outage cost ~30 s: the last wait had grown to 19.5 s)."""
    return min(pool.backoff(attempt, retry_after), 2 * pool.health_interval)


# A server that answers 200 with something that is not the answer asked for (truncated JSON, a sign-in
# page) is up, not starting: this many such answers in a row end the start-up checks in one line.
BAD_ANSWERS_AT_STARTUP = 4
BAD_ANSWER_KINDS = ("bad_response", "bad_ids")  # a 200 that is no completion; ids that are not its text's


async def _retrying(pool: ServerPool, deadline: float, what: str, call):
    """`await call()`, retried with backoff on transient errors until `deadline`; a permanent error,
    a transient one that outlives the deadline, or BAD_ANSWERS_AT_STARTUP malformed answers in a row
    raise StartupCheckFailed."""
    attempt = bad = 0
    while True:
        try:
            return await call()
        except RequestFailed as e:
            if not e.retryable:
                raise
            bad = bad + 1 if e.kind in BAD_ANSWER_KINDS else 0
            if bad >= BAD_ANSWERS_AT_STARTUP:
                raise StartupCheckFailed(f"{what}: the server answers, but not as asked ({bad} malformed answers "
                                         f"in a row): {str(e)[:200]}") from None
            attempt += 1
            delay = startup_delay(pool, attempt, e.retry_after)
            if time.monotonic() + delay > deadline:
                raise StartupCheckFailed(f"{what} still fails after {pool.server_down_timeout:.0f} s "
                                         f"(--server-down-timeout): {e}") from None
            log(f"[01b] start-up: {what}: {e}; retry in {delay:.1f} s")
            await asyncio.sleep(delay)


async def _wait_healthy(pool: ServerPool, s: Server, deadline: float) -> None:
    """Poll /health like a server that went down in mid-run, until it is healthy or `deadline`."""
    problem = await pool.health(s)
    if problem is not None and time.monotonic() < deadline:
        log(f"[01b] start-up: server {s.root} is not healthy yet ({problem}); polling /health every "
            f"{pool.health_interval} s for up to {pool.server_down_timeout:.0f} s (--server-down-timeout)")
    while problem is not None:
        if time.monotonic() + pool.health_interval > deadline:
            raise StartupCheckFailed(f"server {s.url} is not reachable or not healthy after "
                                     f"{pool.server_down_timeout:.0f} s (--server-down-timeout): {problem}")
        await asyncio.sleep(pool.health_interval)
        problem = await pool.health(s)


async def startup_checks(pool: ServerPool, tok, probes: list[str], max_context: int,
                         gate: HealthGate | None = None) -> dict:
    """Before any work: every server is healthy, serves the model (the named one, or one model
    the same on all), has context for `max_context`, tokenizes `probes` as `tok` does and, with a
    `gate`, answers its probe prompts sanely. Returns what was found (with what each says it runs at
    once, common/generation/capacity.py); raises StartupCheckFailed saying what differs."""
    deadline = time.monotonic() + pool.server_down_timeout
    found = {}
    for s in pool.servers:
        await _wait_healthy(pool, s, deadline)
        try:
            listing = await _retrying(pool, deadline, f"GET {s.url}/models", lambda url=s.url: pool.request(
                "GET", url + "/models", None, pool.health_timeout))
            cards = listing["data"]
            names = [c.get("id") for c in cards]
        except (RequestFailed, KeyError, TypeError, AttributeError) as e:
            raise StartupCheckFailed(f"cannot list the models of {s.url}: {e}") from None
        if pool.model is None:
            if len(names) != 1:
                raise StartupCheckFailed(f"{s.url} serves {names}; name one with --served-model-name")
            pool.model = names[0]
        if pool.model not in names:
            raise StartupCheckFailed(f"{s.url} serves {names}, not the model {pool.model!r} named by "
                                     "--served-model-name (or served by the first server)")
        card = cards[names.index(pool.model)]
        ctx = card.get("max_model_len")
        if isinstance(ctx, int) and ctx < max_context:
            raise StartupCheckFailed(f"{s.url} serves {pool.model!r} with a context of {ctx} tokens, "
                                     f"less than the {max_context} this run needs (--max-context/--long-context)")
        found[s.url] = {"model": pool.model, "max_model_len": ctx,
                        "tokenizer_check": await check_tokenizer(pool, s, tok, probes, deadline),
                        "capacity": await read_capacity(pool, s)}  # best effort: None when it does not say
        if gate is not None and s.url not in gate.passed:
            found[s.url]["health"] = await check_health(pool, s, tok, gate, deadline)
            gate.passed.add(s.url)
    return found


async def check_health(pool: ServerPool, s: Server, tok, gate: HealthGate, deadline: float) -> str:
    """The target health gate on one server (module doc); StartupCheckFailed names the likely cause."""

    async def answer(prompt: str) -> dict:
        body = pool.completion_body(prompt, gate.max_new_tokens, temperature=0.0)

        async def once():
            return pool._parse(await pool.request("POST", s.url + "/completions", body, pool.request_timeout), s)
        try:
            return await _retrying(pool, deadline, f"health probe on {s.url}", once)
        except RequestFailed as e:
            raise StartupCheckFailed(f"health probe on {s.url} failed: {e}") from None

    results = await asyncio.gather(*(answer(p) for p in gate.prompts))
    bad = [(i, why) for i, why in enumerate(degenerate(r, tok, gate) for r in results) if why]
    if bad:
        lines = "; ".join(f"probe {i}: {why}" for i, why in bad)
        raise StartupCheckFailed(
            f"target health gate: {s.url} answers {len(bad)} of {len(results)} greedy probe prompts "
            f"degenerately ({lines}). A target that loops or never ends its turn while /health is fine is "
            "the known failure of INT4 MoE kernels on SM12x GPUs (RTX PRO 6000 Blackwell, GB10) emitting "
            "repeated-token garbage (sglang issue 23264, vllm issue 40357): check the server's MoE and "
            "attention backends against a known-good answer before generating. --health-max-repeat-share "
            "and --health-max-new-tokens tune the gate; --health-probes 0 skips it")
    return f"{len(results)} greedy probes answered sanely"


async def check_tokenizer(pool: ServerPool, s: Server, tok, probes: list[str], deadline: float) -> str:
    for i, text in enumerate(probes):
        ours = tok(text, add_special_tokens=False)["input_ids"]
        try:
            theirs = (await _retrying(pool, deadline, f"POST {s.root}/tokenize", lambda text=text: pool.request(
                "POST", s.root + "/tokenize", {"model": pool.model, "prompt": text, "add_special_tokens": False},
                pool.health_timeout)))["tokens"]
            how = "POST /tokenize"
        except RequestFailed as e:
            if e.kind not in ("http_404", "http_405"):
                raise StartupCheckFailed(f"{s.root}/tokenize failed: {e}") from None
            theirs, how = None, "usage.prompt_tokens"
        except (KeyError, TypeError):
            raise StartupCheckFailed(f"{s.root}/tokenize answered without `tokens`") from None
        if theirs is not None:
            if theirs != ours:
                k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise StartupCheckFailed(
                    f"the tokenizer of {s.root} differs from ours (the target's) on probe {i}: "
                    f"{len(theirs)} vs {len(ours)} tokens, first difference at token {k}: server "
                    f"{theirs[k:k + 5]} vs ours {ours[k:k + 5]}. Serve the same model/tokenizer as --target-path")
            continue
        # No /tokenize route: a 1-token completion reports how many tokens the server saw.
        try:
            data = await _retrying(pool, deadline, f"probe completion on {s.url}", lambda text=text: pool.request(
                "POST", s.url + "/completions", {"model": pool.model, "prompt": text, "max_tokens": 1,
                                                 "temperature": 0.0, "add_special_tokens": False},
                pool.request_timeout))
        except RequestFailed as e:
            raise StartupCheckFailed(f"probe completion on {s.url} failed: {e}") from None
        n = (data.get("usage") or {}).get("prompt_tokens")
        if n is None:
            raise StartupCheckFailed(f"{s.url} has no /tokenize and reports no usage: cannot check "
                                     "that it tokenizes like the target")
        if n != len(ours):
            raise StartupCheckFailed(f"the tokenizer of {s.root} differs from ours (the target's) on probe "
                                     f"{i}: it counts {n} prompt tokens, we count {len(ours)}. Serve the "
                                     "same model/tokenizer as --target-path")
    return how
