"""01b's start-up checks: before any work, every server is healthy, serves the model, has the context
the run needs and tokenizes like the target, so a day-long run never starts against the wrong server."""
from __future__ import annotations

from common.data.server_pool import RequestFailed, Server, ServerPool


class StartupCheckFailed(Exception):
    """A server is unreachable or unhealthy, serves another model, or tokenizes differently."""


async def startup_checks(pool: ServerPool, tok, probes: list[str], max_context: int) -> dict:
    """Before any work: every server is healthy, serves the model (the named one, or one model
    the same on all), has context for `max_context`, and tokenizes `probes` as `tok` does.
    Returns what was found; raises StartupCheckFailed saying what differs."""
    found = {}
    for s in pool.servers:
        problem = await pool.health(s)
        if problem is not None:
            raise StartupCheckFailed(f"server {s.url} is not reachable or not healthy: {problem}")
        try:
            cards = (await pool.request("GET", s.url + "/models", None, pool.health_timeout))["data"]
        except (RequestFailed, KeyError, TypeError) as e:
            raise StartupCheckFailed(f"cannot list the models of {s.url}: {e}") from None
        names = [c.get("id") for c in cards]
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
                        "tokenizer_check": await check_tokenizer(pool, s, tok, probes)}
    return found

async def check_tokenizer(pool: ServerPool, s: Server, tok, probes: list[str]) -> str:
    for i, text in enumerate(probes):
        ours = tok(text, add_special_tokens=False)["input_ids"]
        try:
            theirs = (await pool.request("POST", s.root + "/tokenize", {
                "model": pool.model, "prompt": text, "add_special_tokens": False},
                pool.health_timeout))["tokens"]
            how = "POST /tokenize"
        except RequestFailed as e:
            if e.kind not in ("http_404", "http_405"):
                raise StartupCheckFailed(f"{s.root}/tokenize failed: {e}") from None
            theirs, how = None, "usage.prompt_tokens"
        except KeyError:
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
            data = await pool.request("POST", s.url + "/completions", {
                "model": pool.model, "prompt": text, "max_tokens": 1, "temperature": 0.0,
                "add_special_tokens": False}, pool.request_timeout)
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
