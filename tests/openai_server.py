"""A real local HTTP server speaking the OpenAI completions API, generating with a transformers model.

It behaves like SGLang/vLLM where 01b depends on it: the prompt text is tokenized by the server,
`skip_special_tokens` defaults to True (special tokens vanish from the text unless the client asks),
a matched stop is trimmed from the text unless the client asks to keep it (`no_stop_trim` SGLang,
`include_stop_str_in_output` vLLM), `matched_stop` names what stopped it, usage counts tokens, and an
unknown model name is a 404. Requests run in parallel threads; the model runs one request at a time
and `delay_s` adds latency per request (so concurrency and kill-midway tests have something to overlap).
Every request body is kept in `requests` for tests to inspect.

Use in tests:  `with OpenAICompletionsServer(model_dir) as server: ... server.base_url ...`
By hand:       python tests/openai_server.py --model-dir build/tiny-kimi/target --port 30000
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OpenAICompletionsServer:
    def __init__(self, model_dir: str | Path, served_model_name: str = "micro-target", host: str = "127.0.0.1",
                 port: int = 0, delay_s: float = 0.0, honor_keep_stop: bool = True):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.model_name, self.delay_s, self.honor_keep_stop = served_model_name, delay_s, honor_keep_stop
        self.requests: list[dict] = []
        self._model_lock, self._log_lock = threading.Lock(), threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self.httpd.daemon_threads = True
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
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "test"}]}

    def completion(self, body: dict) -> dict:
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
        input_ids = self.tok(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        time.sleep(self.delay_s)
        out = self._generate(input_ids, max_tokens, float(body.get("temperature", 1.0)), body.get("seed"),
                             list(stop_ids))
        finish, matched = "length", None
        if out and out[-1] in stop_ids:
            finish, matched = "stop", stop_ids[out[-1]]
        keep_stop = self.honor_keep_stop and (body.get("no_stop_trim") or body.get("include_stop_str_in_output"))
        shown = out[:-1] if finish == "stop" and not keep_stop else out
        text = self.tok.decode(shown, skip_special_tokens=body.get("skip_special_tokens", True))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "matched_stop": matched}],
                "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(out),
                          "total_tokens": len(input_ids) + len(out)}}

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

            def _send(self, status: int, obj: dict):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str):
                self._send(status, {"error": {"message": message, "type": "invalid_request_error",
                                              "code": status}})

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, server.models())
                else:
                    self._error(404, f"no route {self.path}")

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if self.path.rstrip("/") != "/v1/completions":
                        raise HTTPError(404, f"no route {self.path}")
                    self._send(200, server.completion(body))
                except HTTPError as e:
                    self._error(e.status, str(e))
                except json.JSONDecodeError as e:
                    self._error(400, f"bad JSON: {e}")

        return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="HF model folder with its tokenizer")
    p.add_argument("--served-model-name", default="micro-target")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--delay-s", type=float, default=0.0, help="added latency per request (s)")
    args = p.parse_args()
    server = OpenAICompletionsServer(args.model_dir, args.served_model_name, args.host, args.port, args.delay_s)
    print(f"serving {args.model_dir} as {args.served_model_name!r} at {server.base_url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
