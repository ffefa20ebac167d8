"""A fake SGLang HTTP server on localhost returning SGLang's real document shapes (a test fixture).

GET /health -> 200. GET /get_server_info -> {**ServerArgs fields (with `cuda_graph_config`
{"decode": {"backend"}, "prefill": {"backend"}}), **scheduler_info, "internal_states":
[{..., "avg_spec_accept_length"}], "version"} (srt/entrypoints/http_server.py); /server_info is 404
unless `new_info_path` (older releases). avg_spec_accept_length comes from lifetime counters that POST
/set_internal_state resets. POST /generate with `input_ids` + `stream: true` -> SSE
`data: {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
"cached_tokens", "spec_verify_ct"?, "e2e_latency"}}` lines, then `data: [DONE]`; with `error_message`
set, `data: {"error": {"message", "type", "code", "retryable"}}` then `data: [DONE]` (as 0.5.14 streams a
ValueError). `fail_first` answers the first N requests with 503. A speculative server verifies
`accept_length` tokens per round, so completion_tokens / spec_verify_ct = accept_length.

An engine behind the documents (`answer_fn`): `answer_fn(input_ids, sampling_params) -> (output_ids,
spec_verify_ct)` answers /generate instead of the deterministic stand-in (tests/units/serving/test_agreement_engines.py runs
the speculative loop of a real micro target and draft there, counted as SGLang counts: one verify a round, the
round cut at the budget); its answer streams in chunks of up to 4 tokens with the final meta_info.

Simulated acceptance (`simulate` L, what SGLANG_SIMULATE_ACC_LEN = L does to a real server): the first token comes
from the prefill, every later one from a verify round committing L tokens (ceil((n - 1) / L) rounds), and every
verified token is id 100 (sglang 0.5.14 spec_utils.py generate_simulated_accept_index). A cost model for the
break-even map's tests: `step_s` seconds a plain decode step (the baseline), `round_s` a verify round, slept before
the answer streams, so tok/s = 1 / step_s on the baseline and L / round_s simulated.

Started as 05 launches its servers, with the radix cache off (`disable_radix_cache`; False = SGLang's own
default). Every /generate request is kept (`requests`) with its place in one count shared by all stubs of
the process (`arrivals`), so a test can tell in which order several servers were asked.

Bad answers, each a 200: `count_scale` multiplies the completion_tokens it reports (the tokens it streams,
its spec_verify_ct and its own avg_spec_accept_length stay true), from its request `honest_first` on; `bad_answer` answers POST /generate with
"html" (a proxy's sign-in page), "truncated" (a whole event holding the first half of its JSON) or
"no_count" (a final meta_info without completion_tokens); `bad_info` answers the info document with "html"
or "truncated" (the first half of the JSON body, Content-Length and all).
"""
from __future__ import annotations

import itertools
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


ARRIVALS = itertools.count()  # one order over every stub server of the process


class StubState:
    def __init__(self, algorithm=None, draft_path=None, model_path="/models/target", accept_length=3.0,
                 setting=(3, 1, 4), new_info_path=False, disable_cuda_graph=False, decode_graph="full",
                 error_message=None, fail_first=0, adaptive=False, count_scale=1, bad_answer=None, bad_info=None,
                 disable_radix_cache=True, honest_first=0, answer_fn=None, simulate=None, step_s=0.0, round_s=0.0):
        self.server_args = {
            "model_path": model_path, "tokenizer_path": model_path, "tp_size": 1, "pp_size": 1,
            "dp_size": 1, "mem_fraction_static": 0.85, "disable_radix_cache": disable_radix_cache,
            "disable_cuda_graph": disable_cuda_graph, "enable_two_batch_overlap": False,
            "cuda_graph_config": {"decode": {"backend": "disabled" if disable_cuda_graph else decode_graph,
                                             "max_bs": None, "bs": None, "tc_compiler": "eager"},
                                  "prefill": {"backend": "disabled" if disable_cuda_graph else "tc_piecewise",
                                              "max_bs": None, "bs": None, "tc_compiler": "eager"}},
            "speculative_algorithm": algorithm, "speculative_draft_model_path": draft_path,
            "speculative_num_steps": setting[0] if algorithm else None,
            "speculative_eagle_topk": setting[1] if algorithm else None,
            "speculative_num_draft_tokens": setting[2] if algorithm else None,
            "speculative_adaptive": adaptive,  # as SGLang resolved it (False when it turned the flag off)
        }
        self.accept_length = accept_length
        self.internal_state = {}  # more fields of internal_states[0] (the scheduler's own server args)
        self.new_info_path = new_info_path
        self.error_message = error_message
        self.fail_first = fail_first
        self.count_scale, self.bad_answer, self.bad_info = count_scale, bad_answer, bad_info
        self.honest_first = honest_first
        self.answer_fn = answer_fn
        self.simulate, self.step_s, self.round_s = simulate, step_s, round_s
        self.resets = 0
        self.tokens = 0
        self.verify = 0
        self.requests = []
        self.arrivals = []
        self.lock = threading.Lock()

    def info(self) -> dict:
        state = {"last_gen_throughput": 0.0, "memory_usage": {"kvcache": 1.0}, **self.internal_state}
        if self.server_args["speculative_algorithm"] and self.verify:
            state["avg_spec_accept_length"] = self.tokens / self.verify
        return {**self.server_args, "max_total_num_tokens": 100000, "internal_states": [state],
                "version": "0.5.6"}


SIGN_IN_PAGE = ("<!DOCTYPE html>\n<html><head><title>Sign in - Cluster Gateway</title></head>\n"
                "<body><form action=\"/oauth2/start\">Sign in to continue</form></body></html>\n")


def make_handler(state: StubState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, code, doc, cut=False):
            body = json.dumps(doc).encode()
            body = body[:len(body) // 2] if cut else body
            self._raw(code, body, "application/json")

        def _raw(self, code, body: bytes, kind: str):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {})
            if self.path == "/get_server_info" or (self.path == "/server_info" and state.new_info_path):
                if state.bad_info == "html":
                    return self._raw(200, SIGN_IN_PAGE.encode(), "text/html")
                return self._json(200, state.info(), cut=state.bad_info == "truncated")
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/set_internal_state":  # scheduler.set_internal_state zeroes the counters
                with state.lock:
                    state.tokens = state.verify = 0
                    state.resets += 1
                return self._json(200, [True])
            if self.path != "/generate":
                return self._json(404, {"detail": "Not Found"})
            with state.lock:
                failing = state.fail_first > 0
                state.fail_first -= failing
            if failing:
                return self._json(503, {"detail": "Service Unavailable"})
            if state.error_message is not None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                err = {"message": state.error_message, "type": "invalid_request_error", "code": 400,
                       "retryable": False}
                self.wfile.write(f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode())
                return
            if state.bad_answer == "html":
                return self._raw(200, SIGN_IN_PAGE.encode(), "text/html")
            ids, sp = req["input_ids"], req["sampling_params"]
            if state.answer_fn is not None:
                with state.lock:
                    state.requests.append(req)
                    state.arrivals.append(next(ARRIVALS))
                return self._engine_answer(ids, sp)
            n = int(sp["max_new_tokens"])
            spec = bool(state.server_args["speculative_algorithm"])
            rounds = math.ceil(n / state.accept_length) if spec else n
            if spec and state.simulate:
                rounds = max(1, math.ceil((n - 1) / state.simulate))
            time.sleep(rounds * state.round_s if spec else n * state.step_s)
            with state.lock:
                state.requests.append(req)
                state.arrivals.append(next(ARRIVALS))
                scale = state.count_scale if len(state.requests) > state.honest_first else 1
                state.tokens += n if spec else 0
                state.verify += rounds if spec else 0
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            out = [(sum(ids) + k) % 97 for k in range(n)]  # deterministic "greedy" output
            if spec and state.simulate:
                out = out[:1] + [100] * (n - 1)
            step = max(1, round(state.accept_length)) if spec else 1
            t0 = time.time()
            for k in range(step, n + step, step):
                done = k >= n
                meta = {"id": "r", "finish_reason": {"type": "length", "length": n} if done else None,
                        "prompt_tokens": len(ids), "completion_tokens": min(k, n) * scale,
                        "cached_tokens": 0, "e2e_latency": time.time() - t0}
                if spec:
                    meta["spec_verify_ct"] = rounds if done else math.ceil(min(k, n) / state.accept_length)
                    meta["spec_verify_ct"] = min(meta["spec_verify_ct"], rounds)
                if done and state.bad_answer == "no_count":
                    del meta["completion_tokens"]
                data = json.dumps({"text": "x" * min(k, n), "output_ids": out[:min(k, n)], "meta_info": meta})
                if done and state.bad_answer == "truncated":
                    data = data[:len(data) // 2]
                self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def _engine_answer(self, ids: list[int], sp: dict) -> None:
            out, rounds = state.answer_fn(ids, sp)
            with state.lock:
                state.tokens += len(out)
                state.verify += rounds
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(4, len(out) + 4, 4):
                done = k >= len(out)
                meta = {"id": "r", "finish_reason": {"type": "length", "length": len(out)} if done else None,
                        "prompt_tokens": len(ids), "completion_tokens": min(k, len(out)), "cached_tokens": 0}
                if done:
                    meta["spec_verify_ct"] = rounds
                data = json.dumps({"text": "x", "output_ids": out[:min(k, len(out))], "meta_info": meta})
                self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class StubServer:
    """`with StubServer(StubState(...)) as url:` serves on a free localhost port."""

    def __init__(self, state: StubState):
        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))

    def __enter__(self) -> str:
        # __exit__'s shutdown waits for serve_forever's next poll (0.5 s by default, per server)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
