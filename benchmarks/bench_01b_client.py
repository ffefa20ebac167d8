"""Benchmark the 01b client: requests/s it sustains and CPU ms per request at high concurrency.

Runs the real stage (`01b_generate_synthetic.main`) against the instant fault server of
tests/openai_server.py started as a separate process (so the server's CPU is not counted), with
`--concurrency` requests in flight over N prompt-only records prepared by 01. The client's cost is
what matters: a real SGLang server completes tens of Kimi-K2.5 requests per second, so the client
must sustain far more than that while spending little CPU per request.
Prints: requests/s over the request phase (a lower bound: on a small machine the Python test server
shares the cores), client CPU ms/request (the request phase: scheduling, HTTP, JSON, writing
results), and the whole stage's CPU ms/request (plus rendering and tokenizing the prompts).
Run:    python benchmarks/bench_01b_client.py --num-requests 20000 --concurrency 200
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.stage import GENERATE, PREPARE  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=20000, help="prompts to generate (count)")
    p.add_argument("--concurrency", type=int, default=200, help="requests in flight")
    p.add_argument("--target-path", type=Path, default=REPO / "build/tiny-kimi/target",
                   help="model folder whose tokenizer 01/01b use (default: the tiny world's; a micro one is "
                        "made when it is missing)")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench01b_"))
    target = args.target_path
    if not (target / "tokenizer_config.json").exists():
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import make_micro_target

        target = make_micro_target(work / "micro_target")
    rows = work / "rows.jsonl"
    with open(rows, "w") as f:
        for i in range(args.num_requests):
            f.write(json.dumps({"id": f"b{i}", "messages": [
                {"role": "user", "content": f"Request {i}: write a function that adds {i} and {i + 1}."}]}) + "\n")
    prep = importlib.import_module(PREPARE)
    gen = importlib.import_module(GENERATE)
    t = time.time()
    prep.main(["--work-dir", str(work / "w"), "--target-path", str(target), "--max-new-tokens", "64",
               "--datasets", json.dumps([{"name": "bench", "adapter": "messages", "path": str(rows)}])])
    print(f"[bench] prepared {args.num_requests} records in {time.time() - t:.1f} s")
    port = free_port()
    server = subprocess.Popen([sys.executable, str(REPO / "tests/openai_server.py"), "--instant", "--tokenizer-dir",
                               str(target), "--port", str(port)], stdout=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        cpu, wall = time.process_time(), time.time()
        gen.main(["--work-dir", str(work / "w"), "--generation-engine", "openai", "--server-url",
                  f"http://127.0.0.1:{port}/v1", "--concurrency", str(args.concurrency), "--max-new-tokens", "64",
                  "--summary-interval", "5"])
        cpu, wall = time.process_time() - cpu, time.time() - wall
    finally:
        server.terminate()
        server.wait()
    m = json.loads((work / "w/01b_generated/bench/manifest.json").read_text())["counts"]["this_run"]
    n = m["requests"]
    assert n == args.num_requests and not m["errors"], m
    print(f"[bench] C={args.concurrency}, {n} requests: {m['requests_per_s']:.0f} req/s over the request phase "
          f"({m['seconds']:.1f} s), client CPU {m['client_cpu_ms_per_request']:.2f} ms/request in it; whole stage "
          f"{wall:.1f} s wall, {1000 * cpu / n:.2f} CPU ms/request; latency p50 {m['latency_s']['p50'] * 1000:.0f} ms "
          f"p99 {m['latency_s']['p99'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
