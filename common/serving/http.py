"""The engine-neutral client side of 05b: every request to a server, whichever engine serves it.

One parser for every answer (`parse_answer`: a 200 that is not the JSON 05b reads is one BadAnswer line naming
the server and the field, never a traceback), transient failures retried with backoff (`with_retries`:
connection refused/reset, a cut stream, 502/503/...), streamed requests (`sse_request`: server-sent events,
timed on the successful attempt alone) and plain JSON ones (`http_json`). Routes, documents and fields are the
engines' own: sglang.py and vllm.py.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from common.stage import StageError

# Connection refused/reset and these statuses are retried (a server restarting, a proxy in front of a
# busy one); anything else is an answer. Waits 1, 2, 4, 8, 16 s: about half a minute in all.
TRANSIENT_HTTP = {500, 502, 503, 504}
RETRY_ATTEMPTS = 6
RETRY_FIRST_WAIT_S = 1.0


class StreamCut(ConnectionError):
    """A response that ended early: half an SSE line, or no final chunk. Retried like a reset."""


class BadAnswer(StageError):
    """A 200 answer that is not what 05 reads: an HTML sign-in page of a proxy, half a JSON body, a document
    without a count 05 needs. The server answered, so asking again gives the same page: never retried, and
    one line naming the server and the field instead of a traceback from deep inside a parser."""


_MISSING = object()


def _field(doc, path: str):
    for name in path.split("."):
        doc = doc.get(name, _MISSING) if isinstance(doc, dict) else _MISSING
    return doc


def _head(text: str) -> str:
    """The start of an unexpected body, for the message (an HTML page is named as one)."""
    text = " ".join(text.split())
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    return f"an HTML page ({shown})" if text[:1] == "<" else shown


def parse_answer(body, where: str, counts: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                 obj: bool = True):
    """Every server answer 05 reads passes here: `body` (the bytes or text of a 200 answer, one streamed
    event's data, or a document already decoded) as JSON - an object unless `obj` is False - whose `counts`
    (dotted paths: "meta_info.completion_tokens") are whole numbers >= 0, as are `optional` ones that are
    present and not null. Returns the document; anything else is one BadAnswer line naming `where` (the
    server and its route) and what is wrong, never a KeyError or JSONDecodeError traceback."""
    doc = body
    if isinstance(body, (bytes, str)):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            doc = json.loads(text)
        except ValueError as e:
            # a body that ends inside a value or a string was cut short (half a body, a proxy's limit)
            cut = " (cut short)" if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated") else ""
            raise BadAnswer(f"{where}: the answer is {_head(text) if text.strip() else 'empty'}, not the JSON "
                            f"05 reads{cut}: {e.msg} at character {e.pos}") from None
    if obj and not isinstance(doc, dict):
        raise BadAnswer(f"{where}: the answer is {_head(json.dumps(doc))}, not a JSON object")
    for path in counts + optional:
        value = _field(doc, path)
        if path in optional and value in (_MISSING, None):
            continue
        if value is _MISSING:
            raise BadAnswer(f"{where}: the answer has no {path}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadAnswer(f"{where}: the answer's {path} is {value!r}, not a count (a whole number >= 0)")
    return doc


def with_retries(call, what: str, on_retry=None):
    """call(), retried on connection refused/reset, a cut response and transient 5xx with waits doubling
    from RETRY_FIRST_WAIT_S; after RETRY_ATTEMPTS tries one clear StageError instead of a traceback.

    Not retried, one line each: an unresolvable host or another network error (the address is wrong),
    and a timeout (the server took the connection and never answered: `what` names the server).
    `on_retry(reason)` is called before every retry, so callers can count them (a number measured
    under retries is marked as such). A non-transient HTTP status is raised as it is (callers read it).
    """
    import http.client
    import socket

    for attempt in range(RETRY_ATTEMPTS):
        try:
            return call()
        except urllib.error.HTTPError as e:  # an HTTP answer: only a transient status is retried
            if e.code not in TRANSIENT_HTTP:
                raise
            last = f"HTTP {e.code} {e.reason}"
        except urllib.error.URLError as e:  # no answer: retried when the connection was refused/reset
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise StageError(f"{what}: no answer before the timeout (the server accepted the connection "
                                 "and never answered)") from None
            if not isinstance(e.reason, ConnectionError):
                raise StageError(f"{what}: {e.reason} (is the address right?)") from None
            last = str(e.reason)
        except (TimeoutError, socket.timeout):
            raise StageError(f"{what}: no answer before the timeout (the server accepted the connection and "
                             "never answered)") from None
        except (ConnectionError, http.client.IncompleteRead) as e:  # reset, closed or cut mid-response
            last = str(e) or type(e).__name__
        if attempt + 1 < RETRY_ATTEMPTS:
            if on_retry is not None:
                on_retry(last)
            time.sleep(RETRY_FIRST_WAIT_S * 2 ** attempt)
    waited = RETRY_FIRST_WAIT_S * (2 ** (RETRY_ATTEMPTS - 1) - 1)
    raise StageError(f"{what}: {last} ({RETRY_ATTEMPTS} tries over {waited:.0f} s). Is the server running and "
                     "ready? For a launched server see its log under 05_benchmark/server/server_logs/.")


# The other lines an event stream may hold: a comment, or an event / id / retry field.
SSE_OTHER_LINE = re.compile(r"^(:|(event|id|retry)(:|$))")

def sse_request(url: str, payload: dict, timeout: float, what: str) -> dict:
    """POST `payload` and read its server-sent events (`data: {json}` lines up to `data: [DONE]`); the
    whole request is retried as with_retries says, a cut stream included. Returns {"chunks", "ttft_s",
    "latency_s", "retries"}: the times are those of the successful attempt alone (backoff waits are
    no part of a request's latency), and a chunk with "error" ends the stream for the caller to raise.
    A line the connection cut is a cut stream; a whole line that is no event, or an event that is not a
    JSON object, is the server's answer: BadAnswer (parse_answer), not retried."""
    retries = []

    def attempt() -> dict:
        t0 = time.perf_counter()
        ttft, chunks, done = None, [], False
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    if line and not SSE_OTHER_LINE.match(line):  # a page or a plain JSON body: no stream
                        raise BadAnswer(f"{what}: the answer is {_head(line)}, not an event stream "
                                        "(`data: {json}` lines)")
                    continue
                body = line[len("data:"):].strip()
                if body == "[DONE]":
                    done = True
                    break
                try:
                    chunk = parse_answer(body, what)
                except BadAnswer:
                    if raw.endswith(b"\n"):  # a whole event that is not JSON: the server's answer, not a cut
                        raise
                    raise StreamCut(f"the stream was cut inside an event ({body[:40]!r}...)") from None
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks.append(chunk)
                if "error" in chunk:
                    done = True
                    break
        if not done:
            raise StreamCut("the stream ended before `data: [DONE]`")
        return {"chunks": chunks, "ttft_s": ttft, "latency_s": time.perf_counter() - t0}

    out = with_retries(attempt, what, on_retry=retries.append)
    out["retries"] = len(retries)
    return out


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0, obj: bool = True):
    """GET (payload None) or POST JSON; returns the decoded document, a JSON object unless `obj` is False
    (transient failures retried; a 200 that is not JSON ends in parse_answer's one line)."""
    data = None if payload is None else json.dumps(payload).encode()
    what = f"{'POST' if payload is not None else 'GET'} {url}"

    def call():
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return parse_answer(r.read(), what, obj=obj)
    return with_retries(call, what)
