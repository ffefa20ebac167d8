"""01b's client for OpenAI-compatible servers (SGLang, vLLM): raw completions of prompts we render.

`ServerPool.generate(prompt_text, max_new_tokens)` returns `{"completion", "completion_ids",
"finish_reason", "num_prompt_tokens", "num_completion_tokens"}` where `completion` is exactly the
target's tokens as text, special tokens kept, ending with `<|im_end|>` when finish_reason is "stop".
Retries with backoff and jitter, health polling of a server that stops answering, an in-flight limit
that halves when a healthy server lets a request time out (common/generation/capacity.py); the start-up
checks that run before any work are in common/generation/server_checks.py.

Generation requests are streamed (`stream: true`, `stream_options.include_usage`): an engine runs what
its KV cache holds and queues the rest without sending a byte, so a total-time timeout would abandon
(and make the engine abort) work merely queued, then retry it at the back of the queue. Streamed, the
wait for the first token is queue time, bounded only by `queue_timeout`; after it a request times out
when the server sends nothing for `stall_timeout` s. The pieces are joined back into the document a
non-streamed request returns (text, token ids where the server sends them, finish_reason, matched_stop,
usage) and parsed by the same `_parse`, so a record is the same either way. Start-up probes and health
checks are not streamed (nothing queues before the work starts) and keep `request_timeout`.

Server endpoints relied on (checked against SGLang python/sglang/srt/entrypoints/http_server.py,
openai/serving_tokenize.py and openai/protocol.py; vLLM's OpenAI server exposes the same shapes):
  GET  <root>/health          200 when the server can generate (SGLang runs a 1-token request, up to
                              20 s; 503 while starting or shutting down); vLLM: 200 when the engine is alive
  GET  <base>/models          {"data": [{"id": served name, "max_model_len": context length}]}
  POST <root>/tokenize        {"model", "prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}
  POST <base>/completions     the generation itself
where <base> is the --server-url (ending in /v1) and <root> is it without the /v1.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter

from common.text.chat_format import IM_END
from common.generation.progress import log

# Attempt outcomes that say "this server may be down": before charging the request a retry, the
# server's health is probed; if it is down the request waits for it (or another server) instead.
SERVER_DOWN_KINDS = {"connection_error", "timeout", "http_502", "http_503", "http_504"}
# A 400 whose message says the prompt does not fit (SGLang: "The input (N tokens) is longer than the
# model's context length (M tokens)" / "... exceeds the model's maximum context length"; vLLM:
# "This model's maximum context length is M tokens. However, you requested N tokens").
CONTEXT_OVERFLOW_RE = re.compile(r"context length|context window|maximum context|prompt is too long", re.I)
# What `ServerPool.lost` counts (the manifest's `lost_work`).
LOST_WORK = ("timeouts", "queue_timeouts", "stall_timeouts", "abandoned_tokens")


class RequestFailed(Exception):
    """One attempt (or, re-raised, the whole request) failed; `kind` is the failures.jsonl reason.
    A streamed attempt also says how many tokens it had received (`tokens`: work thrown away) and, for a
    timeout, whether it came before the first token (`phase` "queue") or after it ("stall")."""

    def __init__(self, kind: str, detail: str, retryable: bool, retry_after: float | None = None,
                 tokens: int = 0, phase: str | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.retryable, self.retry_after = kind, detail[:500], retryable, retry_after
        self.tokens, self.phase = tokens, phase


def http_failure(status: int, raw: bytes, retry_after: str | None) -> RequestFailed:
    """The classified failure of a non-200 answer (or of an error event inside a stream)."""
    text = raw.decode("utf-8", "replace")
    delay = float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None
    if status == 429 or status >= 500:
        return RequestFailed(f"http_{status}", text, True, delay)
    if status == 400 and CONTEXT_OVERFLOW_RE.search(text):
        return RequestFailed("context_overflow", text, False)
    return RequestFailed(f"http_{status}", text, False)


class ServersDown(Exception):
    """No server has been healthy for --server-down-timeout seconds: the run stops (and resumes later)."""


class Stopping(Exception):
    """The run is stopping (SIGINT/SIGTERM): a request not yet sent is not sent; the next run does it."""


class AnswersWrong(Exception):
    """The servers keep answering 200 with something that is not a completion, or one server's token ids
    disagree with its own text or counts in most answers (common/generation/answers.py)."""


class Server:
    def __init__(self, url: str):
        self.url = url.rstrip("/")                                          # .../v1
        self.root = self.url[:-3] if self.url.endswith("/v1") else self.url  # health, tokenize
        self.up = asyncio.Event()
        self.up.set()
        self.in_flight, self.num_requests = 0, 0
        self.ids_checked, self.ids_bad = 0, 0  # answers whose ids were checked, and those that disagreed
        self.probe: asyncio.Task | None = None  # the running health probe, shared by all requests
        self.poller: asyncio.Task | None = None  # polls /health while the server is down


class ServerPool:
    """Raw completions from OpenAI-compatible servers, prompt rendered by us.

    Request fields, checked against SGLang `python/sglang/srt/entrypoints/openai/protocol.py`
    (CompletionRequest) and vLLM's CompletionRequest:
      skip_special_tokens=False          both: keep <think>, </think>, tool-call markers, <|im_end|>
      spaces_between_special_tokens=False  vLLM (default True would insert spaces around specials)
      no_stop_trim=True                  SGLang: keep the matched stop in the text
      include_stop_str_in_output=True    vLLM: same
      add_special_tokens=False           vLLM (default True may prepend BOS to our rendered prompt)
    Each server ignores the others' fields. Even so a server may trim the stop: both SGLang and vLLM
    cut a matched stop string / eos token from the text by default, and older versions lack the
    keep-stop fields. The model DID emit `<|im_end|>` (that is what "stop" on that string means), and
    the draft must learn to predict it, so when finish_reason is "stop" and the text lacks it we append it.

    Faults: a streamed attempt times out after `queue_timeout` s without its first token or
    `stall_timeout` s without a byte after it (module doc); timeouts, connection errors, 429, 5xx and
    malformed answers are retried up to `max_retries` times with exponential backoff and jitter (a
    Retry-After header is honoured); other 4xx are input errors, never retried (a context-length 400 is
    `context_overflow`). A connection error, timeout or 502/503/504 first probes the server's health:
    if it is down, the attempt is not charged, the server leaves the rotation and is polled every
    `health_interval` s, and the request waits for a healthy server (at most `server_down_timeout` s,
    then ServersDown stops the run). A timeout from a server that is up is overload: `limit` (an
    InFlightLimit) halves and the retry waits for a place under it. Requests go to the healthy server
    with the fewest in flight. `lost` counts the work thrown away: timeouts by phase and the tokens the
    abandoned attempts had received.
    """

    def __init__(self, urls: list[str], model: str | None = None, api_key: str = "EMPTY",
                 temperature: float = 0.0, seed: int | None = None, special_tokens: dict[int, str] | None = None,
                 request_timeout: float = 1800.0, max_retries: int = 3, retry_base_delay: float = 1.0,
                 retry_max_delay: float = 60.0, health_interval: float = 5.0, health_timeout: float = 30.0,
                 server_down_timeout: float = 3600.0, stop: list[str] | None = None, top_p: float = 1.0,
                 stall_timeout: float = 600.0, queue_timeout: float = 14400.0, limit=None, tokenizer=None):
        self.servers = [Server(u) for u in urls]
        self.tokenizer = tokenizer     # the target's: answers with ids are checked against it (check_ids)
        # The target's end-of-turn string(s) (common/text/target_format.py); Kimi's <|im_end|> by default.
        self.stop = list(stop) if stop else [IM_END]
        self.model, self.api_key, self.temperature, self.seed = model, api_key, temperature, seed
        self.top_p = top_p
        self.special_tokens = special_tokens or {}
        self.request_timeout, self.max_retries = request_timeout, max_retries
        self.retry_base_delay, self.retry_max_delay = retry_base_delay, retry_max_delay
        self.health_interval, self.health_timeout = health_interval, health_timeout
        self.server_down_timeout = server_down_timeout
        self.stall_timeout, self.queue_timeout = stall_timeout, queue_timeout
        self.limit = limit             # common/generation/capacity.InFlightLimit, or None: no limit
        self.stopping = None           # asyncio.Event set when the run stops: nothing new is sent
        self.capacity: dict = {}       # url -> what the server said it runs at once (set at start-up)
        self.lost = Counter({k: 0 for k in LOST_WORK})
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.session = None
        self._any_up = None  # asyncio.Event: set whenever some server is up
        self._rng = random.Random()
        self._next = 0

    async def __aenter__(self):
        import aiohttp

        # limit=0: the caller's worker count bounds the connections; keep-alive reuses them.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                             headers=self.headers)
        self._any_up = asyncio.Event()
        self._any_up.set()
        return self

    async def __aexit__(self, *exc):
        for s in self.servers:
            for task in (s.probe, s.poller):
                if task is not None:
                    task.cancel()
        await self.session.close()

    # --- one HTTP exchange ---------------------------------------------------------------------
    async def request(self, method: str, url: str, body: dict | None, timeout: float) -> dict:
        """JSON answer of one request; RequestFailed (classified) otherwise."""
        import aiohttp

        try:
            async with self.session.request(method, url, json=body,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = await r.read()
                status, retry_after = r.status, r.headers.get("Retry-After")
        except asyncio.TimeoutError:
            raise RequestFailed("timeout", f"no answer within {timeout} s from {url}", True) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise RequestFailed("connection_error", f"{type(e).__name__}: {e} ({url})", True) from None
        if status != 200:
            raise http_failure(status, raw, retry_after)
        try:
            return json.loads(raw)
        except ValueError:
            raise RequestFailed("bad_response", f"not JSON: {raw[:200]!r}", True) from None

    # --- health --------------------------------------------------------------------------------
    async def health(self, server: Server) -> str | None:
        """None when healthy, else what is wrong. A server without /health (404) counts as healthy
        when it lists its models."""
        try:
            await self.request("GET", server.root + "/health", None, self.health_timeout)
            return None
        except RequestFailed as e:
            if e.kind == "bad_response":
                return None  # 200 with a non-JSON body (SGLang answers an empty 200)
            if e.kind != "http_404":
                return f"GET {server.root}/health: {e}"
        try:
            await self.request("GET", server.url + "/models", None, self.health_timeout)
            return None
        except RequestFailed as e:
            return f"GET {server.url}/models: {e}"

    async def _is_up(self, server: Server) -> bool:
        """Probe once (concurrent callers share the probe); mark the server down if it fails."""
        if not server.up.is_set():
            return False
        if server.probe is None or server.probe.done():
            server.probe = asyncio.ensure_future(self.health(server))
        problem = await asyncio.shield(server.probe)
        if problem is not None and server.up.is_set():
            server.up.clear()
            if not any(s.up.is_set() for s in self.servers):
                self._any_up.clear()
            log(f"[01b] server {server.root} is down ({problem}); polling /health every "
                f"{self.health_interval} s, its requests wait")
            server.poller = asyncio.ensure_future(self._poll_until_up(server))
        return problem is None

    async def _poll_until_up(self, server: Server):
        t0 = time.monotonic()
        while await self.health(server) is not None:
            await asyncio.sleep(self.health_interval)
        server.up.set()
        self._any_up.set()
        log(f"[01b] server {server.root} is back after {time.monotonic() - t0:.0f} s")

    async def _acquire(self) -> Server:
        """The healthy server with the fewest requests in flight (round robin among equals)."""
        deadline = time.monotonic() + self.server_down_timeout
        while True:
            up = [s for s in self.servers if s.up.is_set()]
            if up:
                self._next += 1
                n = len(up)
                return min((up[(self._next + i) % n] for i in range(n)), key=lambda s: s.in_flight)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServersDown(f"no server healthy for {self.server_down_timeout:.0f} s "
                                  f"({', '.join(s.root for s in self.servers)})")
            try:
                await asyncio.wait_for(self._any_up.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Exponential backoff with full jitter in [0.5, 1.5) x base x 2^(attempt-1), capped."""
        delay = min(self.retry_max_delay, self.retry_base_delay * 2.0 ** min(attempt - 1, 60))  # no overflow
        delay *= 0.5 + self._rng.random()
        return max(delay, min(retry_after, self.retry_max_delay)) if retry_after else delay

    # --- generation ----------------------------------------------------------------------------
    def completion_body(self, prompt_text: str, max_new_tokens: int, temperature: float | None = None,
                        stream: bool = False) -> dict:
        """The /completions request of one prompt (`temperature` None: the pool's own)."""
        temperature = self.temperature if temperature is None else temperature
        body = {"model": self.model, "prompt": prompt_text, "max_tokens": max_new_tokens,
                "temperature": temperature, "stop": self.stop, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "no_stop_trim": True,
                "include_stop_str_in_output": True, "add_special_tokens": False,
                # vLLM (>= 0.10.2): also return the emitted ids as choices[0].token_ids. SGLang 0.5.14's
                # /v1/completions has no such field (only its native /generate returns output_ids).
                "return_token_ids": True}
        if stream:  # usage (token counts) comes in a last chunk only when asked for
            body.update(stream=True, stream_options={"include_usage": True})
        if temperature > 0:   # pinned: a server's generation_config default would apply otherwise
            body["top_p"] = self.top_p
            if self.seed is not None:
                body["seed"] = self.seed
        return body

    def _slot(self):
        """A place in flight under the in-flight limit (none without a limit); yields its epoch."""
        return self.limit.slot() if self.limit is not None else contextlib.nullcontext()

    async def generate(self, prompt_text: str, max_new_tokens: int, errors: Counter | None = None,
                       progress=None) -> dict:
        """One completion, retried as the class doc says. Attempt errors are counted in `errors`
        by kind; the final failure is raised as RequestFailed (kind = the failures.jsonl reason);
        Stopping when the run stops before it is sent. `progress.in_flight` (a Progress) counts the request
        while an attempt of it is with a server: not while it waits for a place under the in-flight limit,
        a healthy server or its backoff."""
        body = self.completion_body(prompt_text, max_new_tokens, stream=True)
        charged = 0
        while True:
            async with self._slot() as epoch:
                if self.stopping is not None and self.stopping.is_set():
                    raise Stopping()
                server = await self._acquire()
                server.in_flight += 1
                server.num_requests += 1
                if progress is not None:
                    progress.in_flight += 1
                try:
                    result = await self.stream(server, body)
                    self._report(self.limit.answered() if self.limit is not None else None)
                    return result
                except RequestFailed as e:
                    if errors is not None:
                        errors[e.kind] += 1
                    self._count_lost(e)
                    if not e.retryable:
                        raise
                    failed = e
                finally:
                    server.in_flight -= 1
                    if progress is not None:
                        progress.in_flight -= 1
            if failed.kind in SERVER_DOWN_KINDS and not await self._is_up(server):
                continue  # the server is down: wait for one that is up, do not charge this request
            if failed.kind == "timeout" and self.limit is not None:
                # Up, yet it let the request time out: more is in flight than it serves. The retry
                # waits for a place under the lowered limit instead of joining the back of its queue.
                self._report(self.limit.overload(epoch), f"a request timed out on {server.root}, which is up "
                                                         f"({failed.detail})")
            charged += 1
            if charged > self.max_retries:
                raise failed
            await asyncio.sleep(self.backoff(charged, failed.retry_after))

    def _count_lost(self, e: RequestFailed) -> None:
        if e.kind == "timeout":
            self.lost["timeouts"] += 1
            self.lost[f"{e.phase}_timeouts"] += 1
        self.lost["abandoned_tokens"] += e.tokens

    def _report(self, change: str | None, why: str = "") -> None:
        if change is not None:
            limit = self.limit
            log(f"[01b] {change}" + (f": {why}; it grows back by 1 per {limit.limit} answers, up to "
                                     f"{limit.ceiling} (floor {limit.floor})" if why else ""))

    async def stream(self, server: Server, body: dict) -> dict:
        """One streamed attempt (module doc): the joined pieces through `_parse`; RequestFailed otherwise."""
        import aiohttp

        loop, got = asyncio.get_running_loop(), Streamed()
        try:
            async with asyncio.timeout(self.queue_timeout) as deadline:
                async with self.session.post(server.url + "/completions", json=body,
                                             timeout=aiohttp.ClientTimeout(total=None)) as r:
                    if r.status != 200:
                        raise http_failure(r.status, await r.read(), r.headers.get("Retry-After"))
                    async for data in r.content.iter_any():
                        if got.feed(data):
                            break
                        if got.events:  # the first token has come: from now on a silence is a stall
                            deadline.reschedule(loop.time() + self.stall_timeout)
        except TimeoutError:
            phase = "stall" if got.events else "queue"
            limit = self.stall_timeout if got.events else self.queue_timeout
            raise RequestFailed("timeout", f"{phase}: no {'byte' if got.events else 'first token'} within "
                                           f"{limit} s from {server.url} ({got.tokens} tokens received)",
                                True, tokens=got.tokens, phase=phase) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise RequestFailed("connection_error", f"{type(e).__name__}: {e} ({server.url}, {got.tokens} tokens "
                                                    "received)", True, tokens=got.tokens) from None
        except RequestFailed as e:
            e.tokens = got.tokens
            raise
        if not got.done:
            raise RequestFailed("connection_error", f"the stream from {server.url} ended before `data: [DONE]` "
                                                    f"({got.tokens} tokens received)", True, tokens=got.tokens)
        return self._parse(got.document(), server)

    def _parse(self, data: dict, server: Server | None = None) -> dict:
        try:
            choice = data["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        except (KeyError, IndexError, TypeError):
            raise RequestFailed("bad_response", f"no choices[0].text/finish_reason in {str(data)[:200]}",
                                True) from None
        if not isinstance(text, str):  # a 200 whose text is null: a bad answer, not a crash of the run
            raise RequestFailed("bad_response", f"choices[0].text is {text!r}", True)
        if finish not in ("stop", "length"):  # e.g. SGLang "abort" when the server shuts down
            raise RequestFailed("bad_response", f"finish_reason {finish!r}", True)
        if finish == "stop":
            # SGLang reports what stopped it in `matched_stop` (a stop string or an eos token id).
            matched = choice.get("matched_stop")
            default = self.stop[0]
            stop_text = self.special_tokens.get(matched, default) if isinstance(matched, int) else (matched or default)
            if not text.endswith(stop_text):
                text += stop_text
        usage = data.get("usage") or {}
        ids = choice.get("token_ids")
        result = {"completion": text, "completion_ids": [int(i) for i in ids] if isinstance(ids, list) else None,
                  "finish_reason": finish, "num_prompt_tokens": usage.get("prompt_tokens"),
                  "num_completion_tokens": usage.get("completion_tokens")}
        if server is not None and result["completion_ids"] is not None and self.tokenizer is not None:
            self.check_ids(server, result)
        return result

    def check_ids(self, server: Server, result: dict) -> None:
        """The text decides, the ids are checked (common/generation/answers.py): ids that are not the tokens
        of the text, or not as many as the server counted, make the answer a bad one (`bad_ids`: retried,
        then recorded); when most of a server's answers disagree, AnswersWrong stops the run naming it."""
        from common.generation.answers import ids_fault, most_disagree

        why = ids_fault(self.tokenizer, result["completion"], result["completion_ids"],
                        result["num_completion_tokens"])
        server.ids_checked += 1
        server.ids_bad += why is not None
        if why is None:
            return
        if most_disagree(server.ids_bad, server.ids_checked):
            raise AnswersWrong(f"the server {server.root} sends token ids that disagree with its own answer in "
                               f"{server.ids_bad} of {server.ids_checked} answers (last: {why}), and 01c trains on "
                               "the ids: serve the target with its own tokenizer, without a proxy that rewrites them")
        raise RequestFailed("bad_ids", f"{server.url}: {why}", True)


class Streamed:
    """The events of one streamed completion, joined into the document a non-streamed request returns:
    text pieces in order, token ids where every chunk carries them (vLLM, newer SGLang), the last
    finish_reason and matched_stop, the last usage (the include_usage chunk, or continuous stats)."""

    def __init__(self):
        self.text: list = []
        self.ids: list[int] | None = []
        self.finish = self.matched = self.usage = None
        self.events = self.tokens = 0
        self.done = False
        self._partial = b""  # a line not complete yet

    def feed(self, data: bytes) -> bool:
        """Take bytes as they arrive (lines split here: a first chunk carrying a long prompt's ids can
        outgrow a stream reader's line limit); True at `data: [DONE]`."""
        *lines, self._partial = (self._partial + data).split(b"\n")
        return any(self.add(line) for line in lines)

    def add(self, line: bytes) -> bool:
        """Take one line of the event stream; True at `data: [DONE]`. An error event raises its
        classified RequestFailed, a data line that is not JSON a bad_response."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return False  # blank separators, comments, `event:` lines
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(payload)
        except ValueError:
            raise RequestFailed("bad_response", f"stream event is not JSON: {payload[:200]!r}", True) from None
        if not isinstance(event, dict):
            raise RequestFailed("bad_response", f"stream event is not an object: {payload[:200]!r}", True)
        self.events += 1
        error = event.get("error") if "error" in event else (event if event.get("object") == "error" else None)
        if error is not None:  # vLLM and SGLang send a failure after the 200 as an error event
            code = error.get("code") if isinstance(error, dict) else None
            raise http_failure(code if isinstance(code, int) else 500, json.dumps(error).encode(), None)
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._add_choice(choice)
        return False

    def _add_choice(self, choice: dict) -> None:
        self.text.append(choice.get("text"))
        ids = choice.get("token_ids")
        if isinstance(ids, list) and self.ids is not None:
            self.ids += ids
        else:
            self.ids = None  # a chunk without ids: the server does not send them
        self.tokens += len(ids) if isinstance(ids, list) else 1
        if choice.get("finish_reason") is not None:
            self.finish, self.matched = choice["finish_reason"], choice.get("matched_stop")

    def document(self) -> dict:
        text = "".join(self.text) if all(isinstance(t, str) for t in self.text) else None
        choice = {"text": text, "finish_reason": self.finish, "matched_stop": self.matched}
        if self.ids:
            choice["token_ids"] = self.ids
        return {"choices": [choice], "usage": self.usage}
