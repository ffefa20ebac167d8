"""A real local HTTP server speaking the OpenAI completions API: a transformers model or instant canned
text, with injectable faults.

It behaves like SGLang/vLLM where 01b depends on it: the prompt text is tokenized by the server,
`skip_special_tokens` defaults to True (special tokens vanish from the text unless the client asks),
a matched stop is trimmed from the text unless the client asks to keep it (`no_stop_trim` SGLang,
`include_stop_str_in_output` vLLM), `matched_stop` names what stopped it, usage counts tokens, an
unknown model name is a 404, a prompt over `max_model_len` is SGLang's context-length 400, and
`GET /health`, `GET /v1/models` (with max_model_len) and `POST /tokenize` answer like SGLang's.
Requests run in parallel threads; the model runs one request at a time and `delay_s` adds latency
per request. Every completion request body is kept in `requests` for tests to inspect.
`stream: true` is answered as SGLang/vLLM stream a completion: server-sent events `data: {chunk}`, one
per completion token (a slice of the text, its id where ids are returned; the last one with
finish_reason and matched_stop), a usage chunk with no choices when `stream_options.include_usage`,
then `data: [DONE]`; joined, the pieces are the non-streamed answer.

An engine's queue (`max_running=N`): like SGLang, the server runs N requests at once and holds the
rest, sending nothing (no headers) until one is admitted; a running request then takes `token_delay_s`
per completion token. A client that goes away while its request is queued or running is counted in
`aborted` (the engine aborts it: its work is lost); `peak_running`, `peak_queued` and `peak_wait_s`
(the longest a request waited for its slot) show the queue was there. `GET /get_server_info` then
answers SGLang's capacity fields (`max_running_requests`, `max_total_num_tokens` = `kv_tokens`,
`internal_states[0].effective_max_running_requests_per_dp`); without `max_running` it is a 404, as on a
server that does not say.

Modes:
  model    `OpenAICompletionsServer(model_dir)`: greedy/sampled tokens of the model (exactness tests).
  instant  `OpenAICompletionsServer(None, tokenizer_dir=...)`: a canned answer that is a pure function
           of the prompt (`canned_completion`), at once; for fault tests and the client benchmark.
Faults (both modes), set on a running server:
  `server.faults[substring] = ["503", "ok"]`  the next requests whose prompt contains `substring` take
      these actions in order, then behave normally. Actions: ok, 500, 503, 429, 400 (context length),
      422, drop (close the connection without an answer), stall (answer after `stall_s`; streamed:
      after the first token, nothing for `stall_s`, then the rest), length
      (finish by the token cap), and garbage like a broken target's (instant mode): loop (one token
      repeated up to the cap, finish "length"), loop_stop (a short phrase repeated, then the end of
      turn), ramble (text that never repeats a 4-gram, up to the cap, finish "length"), and a 200 that is
      no completion: null_text (choices[0].text null), truncated (the first half of the JSON body;
      streamed: of the first event); and answers whose counts lie (with `vllm_token_ids`, instant mode too):
      foreign_ids (the right text with another tokenizer's ids: its bytes), shifted_ids (as many ids as
      tokens, each moved to the next id), usage_x2 (usage.completion_tokens doubled); and retract (streamed:
      halfway through its answer the request gives its running slot back, as SGLang retracts a running request
      into its queue when the KV pool runs out, waits `retract_s` and queues for a slot again, sending nothing
      until it has one; then the rest of the answer, nothing repeated; counted in `retracted`).
  `server.default_fault = "500"`   the action of every other request.
  `server.route_faults["/v1/models"] = ["503", "drop"]`  the next requests to that route (/health,
      /v1/models, /tokenize) take these actions (500, 503, 429, drop), then it answers normally.
  `server.down = True`             stop answering anything (health included; connections are dropped,
      also those of requests in flight when they would answer), like a crashed/restarting server.
  `server.health_status = 503`     /health answers this.
  `server.tokenize_route = False`  no /tokenize (clients fall back to usage.prompt_tokens).

Use in tests:  `with OpenAICompletionsServer(model_dir) as server: ... server.base_url ...`
By hand:       python tests/openai_server.py --model-dir build/tiny-kimi/target --port 30000
               python tests/openai_server.py --instant --tokenizer-dir build/tiny-kimi/target --port 30000
"""
from __future__ import annotations

import argparse
import hashlib
import json
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

IM_END = "<|im_end|>"


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Drop(Exception):
    """Close the connection without answering."""


class Truncated(Exception):
    """Answer 200 with the first half of this JSON body."""

    def __init__(self, body: dict):
        super().__init__("truncated")
        self.body = body


def canned_completion(prompt: str) -> str:
    """The instant mode's answer: a pure function of the prompt (so resumed == uninterrupted)."""
    h = hashlib.sha256(prompt.encode()).hexdigest()
    return f"{h[:6]}</think>ok {len(prompt)}"


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # listen backlog: C=200 clients connect at once (default 5 drops SYNs)

    def handle_error(self, request, client_address):
        pass  # a client that timed out or a dropped connection: expected here, not worth a traceback


class OpenAICompletionsServer:
    def __init__(self, model_dir: str | Path | None, served_model_name: str = "micro-target",
                 host: str = "127.0.0.1", port: int = 0, delay_s: float = 0.0, honor_keep_stop: bool = True,
                 tokenizer_dir: str | Path | None = None, max_model_len: int = 32768, stall_s: float = 30.0,
                 keep_requests: bool = True, max_running: int | None = None, token_delay_s: float = 0.0,
                 kv_tokens: int | None = None, retract_s: float = 1.0):
        self.model = self.tok = None
        if model_dir is not None:
            import torch
            from transformers import AutoModelForCausalLM

            self.torch = torch
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            tokenizer_dir = tokenizer_dir or model_dir
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.model_name, self.delay_s, self.honor_keep_stop = served_model_name, delay_s, honor_keep_stop
        self.max_model_len, self.stall_s, self.keep_requests = max_model_len, stall_s, keep_requests
        self.requests: list[dict] = []
        self.faults: dict[str, list[str]] = {}
        self.route_faults: dict[str, list[str]] = {}
        self.fault_log: list[tuple[str, str]] = []   # (prompt head, action) of every completion request
        self.default_fault = "ok"
        self.vllm_token_ids = False  # True: answer `return_token_ids` with choices[0].token_ids, as vLLM does
        self.down, self.health_status, self.tokenize_route = False, 200, True
        self.num_health = 0
        # The engine's queue (module doc): None runs every request at once.
        self.max_running, self.token_delay_s, self.kv_tokens = max_running, token_delay_s, kv_tokens
        self.retract_s, self.retracted = retract_s, 0
        self._slots = threading.Semaphore(max_running) if max_running else None
        self.running = self.queued = self.peak_running = self.peak_queued = self.aborted = 0
        self.peak_wait_s = 0.0
        self._model_lock, self._log_lock = threading.Lock(), threading.Lock()
        self.httpd = _HTTPServer((host, port), self._handler_class())
        self._thread = None

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "OpenAICompletionsServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # --- the API ---------------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "test",
                                            "root": self.model_name, "max_model_len": self.max_model_len}]}

    def tokenize(self, body: dict) -> dict:
        if not self.tokenize_route or self.tok is None:
            raise HTTPError(404, "Not Found")
        ids = self.tok.encode(body.get("prompt", ""), add_special_tokens=body.get("add_special_tokens", True))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def _fault(self, prompt: str) -> str:
        with self._log_lock:
            action = self.default_fault
            for key, actions in self.faults.items():
                if key in prompt and actions:
                    action = actions.pop(0)
                    break
            self.fault_log.append((prompt[:80], action))
        return action

    def server_info(self) -> dict:
        """SGLang's capacity fields of GET /get_server_info (module doc)."""
        if not self.max_running:
            raise HTTPError(404, "Not Found")
        return {"max_running_requests": self.max_running, "dp_size": 1,
                "max_total_num_tokens": self.kv_tokens or self.max_running * self.max_model_len,
                "internal_states": [{"effective_max_running_requests_per_dp": self.max_running}]}

    def completion(self, body: dict) -> tuple[dict, str]:
        """The answer of one completion request and the fault action it drew."""
        if self.keep_requests:
            with self._log_lock:
                self.requests.append(body)
        if body.get("model") != self.model_name:
            raise HTTPError(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPError(400, "this server takes one text prompt")
        max_tokens = int(body.get("max_tokens", 16))
        if max_tokens <= 0:
            raise HTTPError(400, "max_tokens must be positive")
        action = self._fault(prompt)
        if self.delay_s:
            time.sleep(self.delay_s)
        if action == "stall" and not body.get("stream"):  # a stream stalls after its first token
            time.sleep(self.stall_s)
        if self.down or action == "drop":
            raise Drop()
        if action in ("500", "503", "429", "422"):
            raise HTTPError(int(action), f"injected {action}")
        input_ids = (self.tok(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                     if self.tok is not None else None)
        n_prompt = len(input_ids) if input_ids is not None else len(prompt) // 4
        if action == "400" or n_prompt + max_tokens > self.max_model_len:
            raise HTTPError(400, f"The input ({n_prompt + max_tokens} tokens) is longer than the model's "
                                 f"context length ({self.max_model_len} tokens).")
        if action in ("loop", "loop_stop", "ramble"):
            return self._garbage(action, max_tokens), action
        answer = (self._instant(body, prompt, n_prompt, max_tokens, action == "length") if self.model is None
                  else self._model_completion(body, input_ids, max_tokens))
        if action == "null_text":
            answer["choices"][0]["text"] = None
        if action in ("foreign_ids", "shifted_ids") and answer["choices"][0].get("token_ids") is not None:
            answer["choices"][0]["token_ids"] = self._other_ids(answer["choices"][0], action)
        if action == "usage_x2":
            answer["usage"]["completion_tokens"] *= 2
        if action == "truncated" and not body.get("stream"):
            raise Truncated(answer)
        return answer, action

    def _garbage(self, action: str, max_tokens: int) -> dict:
        """What a broken target answers (the SM12x INT4 MoE failure): loops, or no end of turn."""
        if action == "loop":
            return self._answer(" foss" * max_tokens, "length", None, 1, max_tokens)
        if action == "loop_stop":
            return self._answer("I think that " * 8 + IM_END, "stop", IM_END, 1, 8 * 3 + 1)
        words = [f"w{i}" for i in range(max_tokens)]  # never repeats a 4-gram
        return self._answer(" ".join(words), "length", None, 1, max_tokens)

    def _instant(self, body, prompt, n_prompt, max_tokens, force_length) -> dict:
        text = canned_completion(prompt)
        n_out = len(self.tok.encode(text, add_special_tokens=False)) if self.tok is not None else len(text) // 4
        ids = self.tok.encode(text, add_special_tokens=False) if self.tok is not None else None
        if force_length or n_out + 1 > max_tokens:
            finish, matched, n_out = "length", None, min(n_out, max_tokens)
            if ids is not None and self.vllm_token_ids:  # the text of the tokens it emitted
                ids = ids[:n_out]
                text = self.tok.decode(ids, skip_special_tokens=False)
        else:
            keep = self.honor_keep_stop and (body.get("no_stop_trim") or body.get("include_stop_str_in_output"))
            finish, matched, n_out = "stop", IM_END, n_out + 1
            ids = ids + [self.tok.convert_tokens_to_ids(IM_END)] if ids is not None else None
            if keep and body.get("skip_special_tokens") is False:
                text += IM_END
        answer = self._answer(text, finish, matched, n_prompt, n_out)
        if self.vllm_token_ids and body.get("return_token_ids") and ids is not None:
            answer["choices"][0]["token_ids"] = ids
        return answer

    def _other_ids(self, choice: dict, action: str) -> list[int]:
        """Ids that are not the text's: a byte-level tokenizer's (another tokenizer: other ids, another
        count) or the right ones each moved to the next id (the same count, other tokens)."""
        if action == "foreign_ids":
            return list(self.tok.decode(choice["token_ids"], skip_special_tokens=False).encode("utf-8"))
        return [(i + 1) % len(self.tok) for i in choice["token_ids"]]

    def _answer(self, text, finish, matched, n_prompt, n_out) -> dict:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "matched_stop": matched}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    def stream_events(self, answer: dict, include_usage: bool) -> list[dict]:
        """The streamed form of `answer`: one chunk per completion token (module doc)."""
        choice, usage = answer["choices"][0], answer["usage"]
        n = max(1, usage["completion_tokens"])
        text, ids = choice["text"], choice.get("token_ids")
        cuts = [len(text) * k // n for k in range(n + 1)] if isinstance(text, str) else None
        events = []
        for k in range(n):
            piece = {"index": 0, "text": text[cuts[k]:cuts[k + 1]] if cuts else None, "logprobs": None,
                     "finish_reason": None, "matched_stop": None}
            if ids is not None:
                piece["token_ids"] = ids[k:k + 1] if k < n - 1 else ids[k:]
            events.append({**{key: answer[key] for key in ("id", "object", "created", "model")}, "choices": [piece]})
        events[-1]["choices"][0].update(finish_reason=choice["finish_reason"], matched_stop=choice["matched_stop"])
        if include_usage:
            events.append({**{key: answer[key] for key in ("id", "object", "created", "model")}, "choices": [],
                           "usage": usage})
        return events

    # --- the engine's queue ----------------------------------------------------------------------
    def admit(self, gone) -> bool:
        """Wait for a running slot (at once without `max_running`), sending nothing meanwhile; False when
        the client went away first (`gone()`): an abort."""
        if self._slots is None:
            return True
        with self._log_lock:
            self.queued += 1
            self.peak_queued = max(self.peak_queued, self.queued)
        t0 = time.monotonic()
        try:
            while not self._slots.acquire(timeout=0.005):
                if gone():
                    self.count_abort()
                    return False
        finally:
            with self._log_lock:
                self.queued -= 1
        with self._log_lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self.peak_wait_s = max(self.peak_wait_s, time.monotonic() - t0)
        return True

    def finish(self) -> None:
        """Free the running slot `admit` gave."""
        if self._slots is not None:
            with self._log_lock:
                self.running -= 1
            self._slots.release()

    def retract(self, gone) -> bool:
        """A running request pulled back into the queue (module doc): its slot freed, `retract_s` waited, a slot
        queued for again; False when the client went away meanwhile (an abort: it holds no slot then)."""
        with self._log_lock:
            self.retracted += 1
        self.finish()
        until = time.monotonic() + self.retract_s
        while time.monotonic() < until:
            if gone():
                self.count_abort()
                return False
            time.sleep(0.005)
        return self.admit(gone)

    def count_abort(self) -> None:
        with self._log_lock:
            self.aborted += 1

    def _model_completion(self, body, input_ids, max_tokens) -> dict:
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        stop_ids = {}
        for s in stops:
            ids = self.tok.encode(s, add_special_tokens=False)
            if len(ids) != 1:
                raise HTTPError(400, f"this server supports single-token stops only, got {s!r}")
            stop_ids[ids[0]] = s
        eos = self.model.generation_config.eos_token_id
        for e in ([eos] if isinstance(eos, int) else (eos or [])):
            stop_ids.setdefault(e, e)  # eos token: matched_stop is its id, like SGLang
        out = self._generate(input_ids, max_tokens, float(body.get("temperature", 1.0)), body.get("seed"),
                             list(stop_ids))
        finish, matched = "length", None
        if out and out[-1] in stop_ids:
            finish, matched = "stop", stop_ids[out[-1]]
        keep_stop = self.honor_keep_stop and (body.get("no_stop_trim") or body.get("include_stop_str_in_output"))
        shown = out[:-1] if finish == "stop" and not keep_stop else out
        text = self.tok.decode(shown, skip_special_tokens=body.get("skip_special_tokens", True))
        answer = self._answer(text, finish, matched, len(input_ids), len(out))
        if self.vllm_token_ids and body.get("return_token_ids"):  # vLLM >= 0.10.2; SGLang 0.5.14 has none
            answer["choices"][0]["token_ids"] = out
        return answer

    def _generate(self, input_ids: list[int], max_tokens: int, temperature: float, seed, stop_ids) -> list[int]:
        torch = self.torch
        with self._model_lock, torch.no_grad():
            if temperature > 0 and seed is not None:
                torch.manual_seed(int(seed))
            x = torch.tensor([input_ids])                                            # [1, T]
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                      do_sample=temperature > 0, temperature=temperature or None,
                                      top_p=None, top_k=None, eos_token_id=stop_ids,
                                      pad_token_id=self.tok.pad_token_id)
        return out[0, len(input_ids):].tolist()

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, status: int, obj: dict | None):
                self._send_raw(status, json.dumps(obj).encode() if obj is not None else b"")

            def _send_raw(self, status: int, data: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str):
                self._send(status, {"object": "error", "message": message, "type": "invalid_request_error",
                                    "code": status})

            def _drop(self):
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _gone(self) -> bool:
                """The client closed its end (readable, nothing to read): how an engine sees a disconnect."""
                try:
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _completion(self, body: dict):
                """Faults and input errors answer at once; the answer itself waits for a running slot."""
                answer, action = server.completion(body)
                if not server.admit(self._gone):
                    return self._drop()
                self.holds_slot = True
                try:
                    if body.get("stream"):
                        usage = bool((body.get("stream_options") or {}).get("include_usage"))
                        return self._stream(answer, action, usage)
                    for _ in range(answer["usage"]["completion_tokens"] if server.token_delay_s else 0):
                        time.sleep(server.token_delay_s)
                        if self._gone():
                            server.count_abort()
                            return self._drop()
                    self._send(200, answer)
                except (BrokenPipeError, ConnectionResetError):  # it went away while we answered
                    server.count_abort()
                    self.close_connection = True
                finally:
                    if self.holds_slot:
                        server.finish()

            def _stream(self, answer: dict, action: str, include_usage: bool):
                """Server-sent events, chunked; headers go with the first token, as SGLang sends them."""
                events = server.stream_events(answer, include_usage)
                for k, event in enumerate(events):
                    if event["choices"]:
                        time.sleep(server.token_delay_s)
                    if k == 1 and action == "stall":
                        time.sleep(server.stall_s)
                    if k == max(1, len(events) // 2) and action == "retract":
                        self.holds_slot = False
                        if not server.retract(self._gone):
                            return self._drop()
                        self.holds_slot = True
                    if server.down:
                        raise Drop()
                    if self._gone():
                        server.count_abort()
                        return self._drop()
                    data = json.dumps(event).encode()
                    if action == "truncated":
                        data = data[:len(data) // 2]
                    if k == 0:
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                    self._chunk(b"data: " + data + b"\n\n")
                    if action == "truncated":
                        break
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")  # the last chunk: the body is complete

            def _chunk(self, data: bytes):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

            def _route_fault(self, path: str) -> bool:
                """Apply the next injected fault of this route; True when it answered (or dropped)."""
                with server._log_lock:
                    actions = server.route_faults.get(path)
                    action = actions.pop(0) if actions else None
                if action is None:
                    return False
                if action == "drop":
                    self._drop()
                else:
                    self._error(int(action), f"injected {action}")
                return True

            def do_GET(self):
                path = self.path.rstrip("/")
                server.num_health += path == "/health"  # asked, answered or not
                if server.down:
                    return self._drop()
                if self._route_fault(path):
                    return
                if path == "/health":
                    self._send(server.health_status, None)
                elif path == "/v1/models":
                    self._send(200, server.models())
                elif path == "/get_server_info" and server.max_running:
                    self._send(200, server.server_info())
                else:
                    self._error(404, f"no route {self.path}")

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if server.down:
                        raise Drop()
                    path = self.path.rstrip("/")
                    if self._route_fault(path):
                        return
                    if path == "/v1/completions":
                        self._completion(body)
                    elif path in ("/tokenize", "/v1/tokenize"):
                        self._send(200, server.tokenize(body))
                    else:
                        raise HTTPError(404, f"no route {self.path}")
                except Drop:
                    self._drop()
                except Truncated as t:
                    data = json.dumps(t.body).encode()
                    self._send_raw(200, data[:len(data) // 2])
                except HTTPError as e:
                    self._error(e.status, str(e))
                except json.JSONDecodeError as e:
                    self._error(400, f"bad JSON: {e}")

        return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="HF model folder with its tokenizer (model mode)")
    p.add_argument("--instant", action="store_true", help="canned answers at once (no model)")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer for /tokenize and usage counts")
    p.add_argument("--served-model-name", default="micro-target")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--delay-s", type=float, default=0.0, help="added latency per request (s)")
    p.add_argument("--max-model-len", type=int, default=32768, help="context length reported and enforced (tokens)")
    args = p.parse_args()
    if (args.model_dir is None) != args.instant:
        p.error("give exactly one of --model-dir or --instant")
    server = OpenAICompletionsServer(args.model_dir, args.served_model_name, args.host, args.port, args.delay_s,
                                     tokenizer_dir=args.tokenizer_dir, max_model_len=args.max_model_len,
                                     keep_requests=False)
    print(f"serving {args.model_dir or 'canned answers'} as {args.served_model_name!r} at {server.base_url}",
          flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
