"""01b against a fault-injecting instant server: start-up refusals, start-up during an outage, the
target health gate, each fault class retried or recorded, a server that goes down is waited for,
several servers, --retry-failed, the dataset lock, resume identity, totals over runs, and random
kill -9 / SIGTERM then resume with every id exactly once and identical text."""
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from common.text.chat_format import IM_END
from common.generation.server_checks import HEALTH_PROBES
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, PREPARE, StageError, stage_dir, stage_script
from tests.openai_server import OpenAICompletionsServer, canned_completion
from tests.paths import REPO

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
NUM_ROWS = 60
# Short timeouts and backoffs: every fault costs milliseconds here.
FAST = ["--generation-engine", "openai", "--max-new-tokens", "40", "--request-timeout", "1", "--stall-timeout", "1",
        "--retry-base-delay", "0.01", "--retry-max-delay", "0.05", "--health-interval", "0.05",
        "--health-timeout", "1", "--summary-interval", "0.5", "--concurrency", "8", "--long-concurrency", "2"]


def tag(i: int) -> str:
    return f"[t{i:02d}]"


@pytest.fixture(scope="module")
def prepared(micro_target, tmp_path_factory):
    """60 prompts; every 10th is long (the long partition: --max-context 120, --long-context 600)."""
    root = tmp_path_factory.mktemp("faults")
    rows = []
    for i in range(NUM_ROWS):
        text = f"{tag(i)} Write a function number {i} that adds two numbers."
        if i % 10 == 9:
            text += " Explain every step of the return value in detail." * 8
        rows.append({"id": f"u{i:02d}", "messages": [{"role": "user", "content": text}]})
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = root / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--max-new-tokens", "8",
               "--max-context", "120", "--long-context", "600",
               "--datasets", json.dumps([{"name": "d", "adapter": "messages", "path": str(data)}])])
    parts = Counter(r["partition"] for r in iter_jsonl(stage_dir(work, PREPARE, "d") / "records.jsonl"))
    assert parts == {"normal": 54, "long": 6}, parts
    return work


def fresh(prepared, tmp_path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    return work


def args(work, *servers, extra=()):
    urls = [x for s in servers for x in ("--server-url", s.base_url)]
    return ["--work-dir", str(work), *FAST, "--max-context", "120", "--long-context", "600", *urls, *extra]


def rows(work, file="generated.jsonl"):
    path = stage_dir(work, GENERATE, "d") / file
    return list(iter_jsonl(path)) if path.exists() else []


def work_requests(server) -> list[dict]:
    """Completion request bodies without the health gate's."""
    return [b for b in server.requests if not is_probe(b["prompt"])]


def expected(row) -> str:
    return canned_completion(row["prompt"]) + IM_END


def is_probe(prompt: str) -> bool:
    """A target health gate request (its prompts are fixed questions, not dataset rows)."""
    return any(q[:20] in prompt for q in HEALTH_PROBES)


def work_log(server) -> list:
    """The server's fault log without the health gate's requests."""
    return [(head, action) for head, action in server.fault_log if not is_probe(head)]


def attempts(server) -> Counter:
    """Completion requests per prompt tag (health gate requests left out)."""
    return Counter(head.split("<|im_middle|>", 2)[1][:5] for head, _ in work_log(server))


def test_startup_checks_refuse_before_any_work(prepared, micro_target, other_micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    cases = [  # (server settings, extra flags, message)
        ({"served_model_name": "other-model"}, ["--served-model-name", "micro-target"],
         r"serves \['other-model'\], not the model 'micro-target'"),
        ({"tokenizer_dir": other_micro_target}, [], "tokenizer of .* differs .* first difference at token"),
        ({"tokenizer_dir": other_micro_target, "tokenize_route": False}, [], "it counts \\d+ prompt tokens, we count"),
        ({"health_status": 503}, ["--server-down-timeout", "0.2"],
         "not reachable or not healthy after 0 s .*: GET .*/health: http_503"),
        ({"max_model_len": 100}, [], r"context of 100 tokens, less than the \d+ this run needs"),
    ]
    for settings, extra, message in cases:
        tokenize_route = settings.pop("tokenize_route", True)
        health = settings.pop("health_status", 200)
        settings.setdefault("tokenizer_dir", micro_target)
        with OpenAICompletionsServer(None, **settings) as server:
            server.tokenize_route, server.health_status = tokenize_route, health
            with pytest.raises(StageError, match=message):
                gen.main(args(work, server, extra=extra))
            # The fallback probe is a 1-token completion; real work is never sent.
            assert all(b["max_tokens"] == 1 for b in server.requests)
        assert rows(work) == [] and rows(work, "failures.jsonl") == []
    # The same checks pass on a matching server, with /tokenize or without it (usage count fallback).
    # --long-after-normal: the long partition starts when the normal one is done.
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.tokenize_route = False
        gen.main(args(work, server, extra=["--long-after-normal"]))
        order = [b["prompt"].split("<|im_middle|>", 2)[1][:5] for b in server.requests
                 if b["max_tokens"] > 1 and not is_probe(b["prompt"])]
    assert len(rows(work)) == NUM_ROWS
    long_tags = {tag(i) for i in range(9, NUM_ROWS, 10)}
    assert len(order) == NUM_ROWS and set(order[-6:]) == long_tags, order


def test_each_fault_is_retried_or_recorded(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, stall_s=1.5) as server:
        server.faults.update({
            tag(3): ["500", "ok"], tag(4): ["503", "503", "ok"], tag(5): ["429", "ok"],
            tag(6): ["drop", "ok"], tag(7): ["stall", "ok"], tag(19): ["503", "ok"],  # a long one
            tag(8): ["500"] * 10,       # more than the retry budget: fails as http_500
            tag(10): ["400"],           # context length exceeded: recorded, never retried
            tag(11): ["422"],           # another input error: recorded, never retried
            tag(12): ["length"]})       # finish_reason "length": kept and counted
        gen.main(args(work, server, extra=["--request-retries", "2", "--max-transient-failures", "2",
                                           "--max-timeouts", "1"]))  # the stall: work thrown away, accepted
        n = attempts(server)
        assert (n[tag(3)], n[tag(4)], n[tag(5)], n[tag(6)], n[tag(7)], n[tag(19)]) == (2, 3, 2, 2, 2, 2)
        assert (n[tag(8)], n[tag(10)], n[tag(11)], n[tag(12)]) == (3, 1, 1, 1)
        assert n[tag(0)] == 1 and sum(n.values()) == NUM_ROWS + 1 + 2 + 1 + 1 + 1 + 1 + 2
        fails = {f["id"]: f["reason"] for f in rows(work, "failures.jsonl")}
        assert fails == {"d/u08": "http_500", "d/u10": "context_overflow", "d/u11": "http_422"}
        out = {r["id"]: r for r in rows(work)}
        assert len(out) == NUM_ROWS - 3 and not set(out) & set(fails)
        assert out["d/u12"]["finish_reason"] == "length" and not out["d/u12"]["completion"].endswith(IM_END)
        assert all(r["completion"] == expected(r) for k, r in out.items() if k != "d/u12")
        m = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]
        assert m["failed"] == {"http_500": 1, "context_overflow": 1, "http_422": 1}
        assert m["finish_reasons"] == {"stop": NUM_ROWS - 4, "length": 1}
        assert m["this_run"]["errors"] == {"http_500": 4, "http_503": 3, "http_429": 1, "connection_error": 1,
                                           "timeout": 1, "context_overflow": 1, "http_422": 1}
        lost = m["this_run"]["lost_work"]  # the stall came after the first token: its tokens were thrown away
        assert (lost["timeouts"], lost["stall_timeouts"], lost["queue_timeouts"]) == (1, 1, 0)
        assert lost["abandoned_tokens"] >= 1 and m["all_runs"]["lost_work"] == lost
        assert m["this_run"]["latency_s"]["num"] == NUM_ROWS - 3 and m["this_run"]["latency_s"]["p99"] > 0
        assert m["partitions"] == {"normal": 54, "long": 6}
        # --retry-failed re-runs exactly the three failed ids, the complete stage is reopened for them.
        server.faults.clear()  # the cause is fixed
        before = len(work_log(server))
        gen.main(args(work, server, extra=["--retry-failed"]))
        assert sorted(attempts(server) - n) == [tag(8), tag(10), tag(11)] and len(work_log(server)) == before + 3
    assert len(rows(work)) == NUM_ROWS and rows(work, "failures.jsonl") == []
    assert read_json(stage_dir(work, GENERATE) / "manifest.json")["counts"]["d"]["generated"] == NUM_ROWS


def test_server_down_is_waited_for_not_charged(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=0.05) as server:
        def outage():
            while len(server.fault_log) < 15:
                time.sleep(0.01)
            server.down = True   # in-flight requests are dropped, /health stops answering
            time.sleep(1.0)
            server.down = False
        t = threading.Thread(target=outage)
        t.start()
        # --request-retries 0: had the outage been charged, every request in flight would fail.
        gen.main(args(work, server, extra=["--request-retries", "0"]))
        t.join()
        assert server.num_health >= 5  # it was polled while down (every 0.05 s for 1 s)
    assert len(rows(work)) == NUM_ROWS and rows(work, "failures.jsonl") == []
    errors = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]["errors"]
    assert errors.get("connection_error", 0) >= 1
    # A server that never comes back stops the run (results kept) after --server-down-timeout.
    work2 = fresh(prepared, tmp_path / "b")
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=0.05) as server:
        server.faults[tag(20)] = ["drop"]

        def crash():
            while not any(tag(20) in h for h, _ in server.fault_log):
                time.sleep(0.005)
            server.down = True
        threading.Thread(target=crash, daemon=True).start()
        with pytest.raises(StageError, match="no server healthy for 0 s"):
            gen.main(args(work2, server, extra=["--server-down-timeout", "0.3"]))
    done = rows(work2)
    assert 0 < len(done) < NUM_ROWS and len({r["id"] for r in done}) == len(done)


def test_several_servers_share_work_and_fail_over(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=0.02) as a, \
            OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=0.02) as b:
        def crash_b():
            while len(work_log(b)) < 10:
                time.sleep(0.005)
            b.down = True  # b dies for good: a takes the rest
        threading.Thread(target=crash_b, daemon=True).start()
        gen.main(args(work, a, b, extra=["--request-retries", "0", "--server-down-timeout", "30"]))
        assert len(work_log(a)) >= NUM_ROWS // 2 and len(work_log(b)) >= 10
    out = rows(work)
    assert len(out) == NUM_ROWS and all(r["completion"] == expected(r) for r in out)
    this_run = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]
    per_server = this_run["requests_per_server"]
    assert sorted(per_server) == sorted([a.base_url, b.base_url]) and min(per_server.values()) >= 10


def test_config_server_url_list_or_string(tmp_path):
    for value, cli, want in [("http://h1/v1", [], ["http://h1/v1"]),
                             (["http://h1/v1", "http://h2/v1"], [], ["http://h1/v1", "http://h2/v1"]),
                             (["http://h1/v1", "http://h2/v1"], ["--server-url", "http://h3/v1"], ["http://h3/v1"])]:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(json.dumps({"server-url": value}))
        parsed = gen.parse_args(gen.build_parser(), ["--config", str(cfg), "--work-dir", "w", *cli])
        got = [parsed.server_url] if isinstance(parsed.server_url, str) else parsed.server_url
        assert got == want


def test_random_kills_then_resume_exactly_once(prepared, micro_target, tmp_path):
    """SIGKILL twice and SIGTERM once at seeded random moments, then finish: every id once, and the
    text of every id written before a kill is unchanged (identical to the uninterrupted answer)."""
    work = fresh(prepared, tmp_path)
    gen_path = stage_dir(work, GENERATE, "d") / "generated.jsonl"
    rng = random.Random(1234)
    snapshots = []
    for sig in (signal.SIGKILL, signal.SIGKILL, signal.SIGTERM):
        # A server per run: a request that a killed run sent reaches its own server, however late the server
        # reads it (a loaded box), so the SIGTERM run's server counts that run's requests alone.
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=0.2) as server:
            cmd = [sys.executable, stage_script(GENERATE), *args(work, server, extra=[
                "--concurrency", "2", "--long-concurrency", "1", "--shutdown-grace", "10"])]
            n_rows = len(gen_path.read_bytes().splitlines()) if gen_path.exists() else 0
            wait_rows = n_rows + rng.randint(0 if sig == signal.SIGKILL else 2, 6)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                if gen_path.exists() and len(gen_path.read_bytes().splitlines()) >= wait_rows:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.2))
            assert proc.poll() is None, "01b finished before it could be stopped"
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
            done = {r["id"]: r["completion"] for r in iter_jsonl(gen_path)} if gen_path.exists() else {}
            snapshots.append(done)
            if sig == signal.SIGTERM:
                # Graceful: exit status 1 with a message, and every request it sent was answered and kept.
                assert proc.returncode == 1 and "stopped by SIGTERM" in err, err[-2000:]
                assert len(done) - len(snapshots[-2]) == len(work_requests(server))
                assert gen_path.read_bytes().endswith(b"\n")
            else:
                assert proc.returncode == -signal.SIGKILL
    assert 0 < len(snapshots[-1]) < NUM_ROWS
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        gen.main(args(work, server))
    out = rows(work)
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)) == NUM_ROWS  # every id exactly once
    final = {r["id"]: r["completion"] for r in out}
    for snap in snapshots:
        assert all(final[k] == v for k, v in snap.items())  # complete before a kill == final
    assert all(r["completion"] == expected(r) for r in out)  # == the uninterrupted answer
    assert read_json(stage_dir(work, GENERATE) / "manifest.json")["counts"]["d"]["generated"] == NUM_ROWS


def test_startup_waits_out_transient_errors(prepared, micro_target, tmp_path):
    """Start-up during an outage is waited out like one in mid-run (health polling, retries
    with backoff up to --server-down-timeout); a permanent mismatch still fails at once."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.down = True  # restarting: nothing answers, /health included
        server.route_faults.update({"/v1/models": ["503", "drop"], "/tokenize": ["502"]})

        def come_back():
            while server.num_health < 3:
                time.sleep(0.01)
            server.down = False
        threading.Thread(target=come_back, daemon=True).start()
        gen.main(args(work, server, extra=["--server-down-timeout", "30"]))
        assert server.route_faults == {"/v1/models": [], "/tokenize": []}  # each fault met and retried
    assert len(rows(work)) == NUM_ROWS and rows(work, "failures.jsonl") == []
    work2 = fresh(prepared, tmp_path / "b")
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, served_model_name="other-model") as server:
        t0 = time.monotonic()
        with pytest.raises(StageError, match="serves \\['other-model'\\]"):
            gen.main(args(work2, server, extra=["--served-model-name", "micro-target", "--server-down-timeout", "30"]))
        assert time.monotonic() - t0 < 10  # not the 30 s of --server-down-timeout
        server.route_faults["/v1/models"] = ["503"] * 1000  # never recovers: stops after the timeout
        with pytest.raises(StageError, match="GET .*/models still fails after 1 s \\(--server-down-timeout\\): http_503"):
            gen.main(args(work2, server, extra=["--server-down-timeout", "1"]))
    assert rows(work2) == []


def test_sigterm_during_startup_wait_stops_at_once(prepared, micro_target, tmp_path):
    """Start-up may now wait up to --server-down-timeout: SIGTERM must end that wait at once."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.down = True

        def terminate():  # in-process: 01b's asyncio handler is installed while its start-up polls /health
            while server.num_health < 3:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=terminate, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(StageError, match="stopped by SIGTERM after 0 requests"):
            gen.main(args(work, server, extra=["--server-down-timeout", "15"]))
        assert time.monotonic() - t0 < 10 and server.requests == []


def test_health_gate_refuses_a_degenerate_target(prepared, micro_target, tmp_path):
    """A target that loops or never ends its turn (the SM12x INT4 MoE failure) is refused
    after a few short greedy probes, before any work; the threshold is a flag."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        for fault, extra, message in [
                ("loop", [], r"answers 3 of 3 greedy probe prompts degenerately .*of its 4-grams repeat.*23264"),
                ("ramble", ["--health-max-new-tokens", "32"], "no end-of-turn within 32 tokens"),
                ("loop_stop", [], r"probe 0: \d+% of its 4-grams repeat \(--health-max-repeat-share 0.5\)")]:
            server.default_fault = fault
            with pytest.raises(StageError, match=message):
                gen.main(args(work, server, extra=extra))
            assert server.requests and all(is_probe(b["prompt"]) for b in server.requests)  # no work was sent
            assert all(b["temperature"] == 0 and b["stop"] == [IM_END] for b in server.requests)
            assert {b["max_tokens"] for b in server.requests} == {int(extra[1]) if extra else 256}
            server.requests.clear()
        assert rows(work) == []
        # A looser threshold lets a short repeated phrase pass; --health-probes 0 skips the gate.
        gen.main(args(work, server, extra=["--health-max-repeat-share", "0.99"]))
        assert sum(is_probe(b["prompt"]) for b in server.requests) == 3
        reopened = fresh(prepared, tmp_path / "b")
        server.default_fault, n = "loop", len(server.requests)
        gen.main(args(reopened, server, extra=["--health-probes", "0"]))
        assert not any(is_probe(b["prompt"]) for b in server.requests[n:])
    assert len(rows(work)) == NUM_ROWS


def test_health_gate_unit():
    from common.generation.server_checks import HealthGate, degenerate, repeated_ngram_share

    assert repeated_ngram_share([1, 2, 3]) == 0 and repeated_ngram_share(list(range(50))) == 0
    assert repeated_ngram_share([7] * 100) == pytest.approx(96 / 97)
    assert repeated_ngram_share([1, 2, 3, 4, 5] * 20) == pytest.approx(1 - 5 / 97)  # a loop of period 5

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}
    gate = HealthGate([], max_new_tokens=64, max_repeat_share=0.5)
    assert degenerate({"completion": "42<|im_end|>", "finish_reason": "stop"}, Tok(), gate) is None
    assert "repeat" in degenerate({"completion": "!" * 64, "finish_reason": "length"}, Tok(), gate)
    assert "no end-of-turn" in degenerate({"completion": "abcdefgh", "finish_reason": "length"}, Tok(), gate)


def test_startup_backoff_stays_near_the_health_interval():
    """Start-up retries wait at most twice --health-interval: a server that is back is seen soon."""
    from common.generation.server_checks import startup_delay
    from common.generation.server_pool import ServerPool

    pool = ServerPool(["http://127.0.0.1:1/v1"], retry_base_delay=2.0, retry_max_delay=120.0, health_interval=10.0)
    waits = [startup_delay(pool, a, None) for a in range(1, 12)]
    assert max(waits) <= 20.0 and waits[0] <= 3.0
    assert max(pool.backoff(a) for a in range(1, 12)) > 20.0  # mid-run backoff (requests in flight) is not capped


def test_bad_answers_are_counted_and_a_wrongly_answering_server_stops_the_run(prepared, micro_target, tmp_path):
    """A 200 whose text is null is a bad answer for that record (retried, then recorded) and the run goes
    on; a server whose every answer is truncated JSON stops the run in one line within seconds, not
    after an hour of retries: it answers, so it is not down."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.faults[tag(2)] = ["null_text"] * 3
        gen.main(args(work, server, extra=["--request-retries", "2", "--max-transient-failures", "1"]))
        assert {f["id"]: f["reason"] for f in rows(work, "failures.jsonl")} == {"d/u02": "bad_response"}
        assert len(rows(work)) == NUM_ROWS - 1
    for where, message in (("start-up", "the server answers, but not as asked"),
                           ("mid-run", "answer, but not with completions")):
        work = fresh(prepared, tmp_path / where)
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
            if where == "start-up":      # the health probes too
                server.default_fault = "truncated"
            else:                        # the dataset's prompts only: the start-up checks pass
                server.faults.update({tag(i): ["truncated"] * 10 for i in range(NUM_ROWS)})
            t0 = time.monotonic()
            with pytest.raises(StageError) as e:
                gen.main(args(work, server, extra=["--request-retries", "1"]))
            assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
            assert time.monotonic() - t0 < 60 and not rows(work)


def test_adding_long_context_on_a_resume_is_refused(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    plain = [a for a in args(work) if a not in ("--long-context", "600")]
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.faults[tag(1)] = ["500"] * 3   # one record left for a resume
        with pytest.raises(StageError, match="1 requests failed"):
            gen.main([*plain, "--server-url", server.base_url, "--request-retries", "1"])
        with pytest.raises(StageError, match=r"long_context 0 \(now 600\)"):
            gen.main(args(work, server, extra=["--retry-failed"]))


def test_a_queueing_server_far_below_the_concurrency_loses_no_work(prepared, micro_target, tmp_path, capsys):
    """An engine runs N = 3 requests at once and holds the rest, sending nothing. At C = 30 the
    back of its queue waits longer than --stall-timeout (a total-time timeout would have abandoned it and
    made the engine abort it); streamed, a queue wait is no timeout: the server aborts nothing and the
    records equal those of C = N."""
    out = {}
    for normal, long in ((2, 1), (28, 2)):  # C = normal + long requests in flight
        c = normal + long
        work = fresh(prepared, tmp_path / f"c{c}")
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target, max_running=3, token_delay_s=0.01) as server:
            gen.main(args(work, server, extra=["--concurrency", str(normal), "--long-concurrency", str(long)]))
            assert server.aborted == 0 and server.peak_running == 3
            if c == 30:  # the queue was there, and its back waited longer than --stall-timeout (1 s)
                assert server.peak_queued >= 20 and server.peak_wait_s > 1, (server.peak_queued, server.peak_wait_s)
        out[c] = {r["id"]: (r["completion"], r["completion_ids"], r["finish_reason"], r["num_prompt_tokens"],
                            r["num_completion_tokens"]) for r in rows(work)}
        run = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]
        assert run["errors"] == {} and set(run["lost_work"].values()) == {0}
        cap = run["server_capacity"][server.base_url]
        assert (cap["engine"], cap["max_running_requests"], cap["runs_at_once"]) == ("sglang", 3, 3)
        assert run["in_flight_limit"] == {"ceiling": c, "floor": 3, "final": c, "lowest": c, "changes": 0}
        assert read_json(stage_dir(work, GENERATE) / "manifest.json")["server_capacity"] == run["server_capacity"]
        assert f"server {server.base_url} (sglang /get_server_info): runs at most 3 requests at once" in \
            capsys.readouterr().out
    assert len(out[3]) == NUM_ROWS and out[30] == out[3] and all(r["completion"] == expected(r) for r in rows(work))


def test_a_timeout_from_a_healthy_server_halves_the_in_flight_limit_and_is_not_quiet(
        prepared, micro_target, tmp_path, capsys):
    """Two answers stall after their first token on a server that is up: each attempt is given up after
    --stall-timeout and retried, the in-flight limit halves (once for the burst) and says so, the
    manifests count the work thrown away, and the run, complete, still ends with an error line."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, max_running=4, token_delay_s=0.005,
                                 stall_s=1.5) as server:
        server.faults.update({tag(2): ["stall", "ok"], tag(3): ["stall", "ok"]})
        with pytest.raises(StageError, match=r"^2 request attempts timed out in this run \(0 waiting for their first "
                                             r"token, 2 stalled after it\) and \d+ tokens .* --max-timeouts"):
            gen.main(args(work, server, extra=["--concurrency", "16", "--long-concurrency", "2",
                                               "--stall-timeout", "0.6"]))
        deadline = time.monotonic() + 10
        while server.aborted < 2 and time.monotonic() < deadline:  # the stalled handlers notice when they wake
            time.sleep(0.02)
        assert server.aborted == 2  # the engine aborted exactly the two given-up attempts
        assert attempts(server)[tag(2)] == attempts(server)[tag(3)] == 2
    log = capsys.readouterr().out
    assert "[01b] in-flight limit 18 -> 9: a request timed out on http" in log and "which is up (stall:" in log, \
        log[-3000:]
    out = rows(work)
    assert len(out) == NUM_ROWS and all(r["completion"] == expected(r) for r in out)
    m = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]
    lost = m["this_run"]["lost_work"]
    assert (lost["timeouts"], lost["stall_timeouts"], lost["queue_timeouts"]) == (2, 2, 0)
    assert lost["abandoned_tokens"] >= 2  # at least the first token of each
    assert m["this_run"]["in_flight_limit"]["lowest"] <= 9 and m["all_runs"]["lost_work"] == lost
    assert (stage_dir(work, GENERATE) / "manifest.json").exists()  # complete: a re-run has nothing to redo
    gen.main(args(work, server))


def test_queue_timeouts_count_as_overload(prepared, micro_target, tmp_path):
    """--queue-timeout bounds the wait for the first token; on a server that is up it is overload too:
    the limit falls toward what the server runs (1 here) and every record still arrives once."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, max_running=1, token_delay_s=0.005) as server:
        gen.main(args(work, server, extra=["--concurrency", "8", "--long-concurrency", "2", "--queue-timeout", "0.2",
                                           "--request-retries", "30", "--max-timeouts", "1000"]))
        assert server.aborted >= 1  # given up while queued: the engine drops them, no tokens lost
    run = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]
    lost, limit = run["lost_work"], run["in_flight_limit"]
    assert lost["queue_timeouts"] >= 1 and lost["stall_timeouts"] == 0 and lost["abandoned_tokens"] == 0
    assert limit["floor"] == 1 and limit["lowest"] < 10
    out = rows(work)
    assert len({r["id"] for r in out}) == len(out) == NUM_ROWS and all(r["completion"] == expected(r) for r in out)


def test_token_ids_that_are_not_the_texts_are_bad_answers_and_a_server_sending_them_is_stopped(
        prepared, micro_target, tmp_path):
    """The text decides, the ids are checked (common/generation/answers.py). An answer whose ids are another
    tokenizer's (the right text, its bytes as ids), the right count of wrong ids, or a doubled
    usage.completion_tokens is a bad answer: retried, counted by its reason, and the record that is kept
    has ids that decode to its text and as many as the server counted. A server (a proxy) that sends other
    ids in most answers stops the run in one line naming it: mid-run, and at start-up when the health
    probes' answers carry them too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(micro_target))
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.vllm_token_ids = True
        server.faults.update({tag(2): ["foreign_ids", "ok"], tag(3): ["shifted_ids", "ok"],
                              tag(4): ["usage_x2", "ok"]})
        gen.main(args(work, server))
        assert (attempts(server)[tag(2)], attempts(server)[tag(3)], attempts(server)[tag(4)]) == (2, 2, 2)
    out = rows(work)
    assert len(out) == NUM_ROWS and all(r["completion"] == expected(r) for r in out)
    assert all(tok.decode(r["completion_ids"], skip_special_tokens=False) == r["completion"]
               and r["num_completion_tokens"] == len(r["completion_ids"]) for r in out)
    assert read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]["errors"] == \
        {"bad_ids": 3}
    for where in ("mid-run", "start-up"):
        work = fresh(prepared, tmp_path / where)
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
            server.vllm_token_ids = True
            if where == "mid-run":   # the dataset's prompts only: the health probes pass
                server.faults.update({tag(i): ["foreign_ids"] * 10 for i in range(NUM_ROWS)})
            else:
                server.default_fault = "foreign_ids"
            with pytest.raises(StageError) as e:
                gen.main(args(work, server))
        msg = str(e.value)
        assert "\n" not in msg and re.search(rf"the server {server.base_url[:-3]} sends token ids that disagree "
                                             r"with its own answer in \d+ of \d+ answers \(last: usage.completion_"
                                             r"tokens \d+, but \d+ token ids came back\)", msg), msg
        assert ("start-up check failed, nothing sent" in msg) == (where == "start-up") and not rows(work)


def test_the_progress_line_counts_requests_sent_and_the_ceiling_is_the_workers(prepared, micro_target, tmp_path,
                                                                                capsys):
    """The progress line said "in flight 200" while the in-flight limit was 28 (it counted workers waiting for a
    place), and the limit's ceiling was --concurrency + --long-concurrency (216 at 200) even where the long
    partition runs after the normal one or has no jobs. Now `in flight` counts requests with a server, never
    more than the limit lets out; the ceiling is the most workers the run has at once."""
    from common.generation.capacity import InFlightLimit
    from common.generation.progress import Progress
    from common.generation.server_pool import ServerPool

    async def sent_at_most(limit: int) -> tuple[int, int]:
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target, token_delay_s=0.01) as server:
            pool = ServerPool([server.base_url], "micro-target", limit=InFlightLimit(limit))
            bar, seen = Progress(6, "t"), []
            async with pool:
                async def watch():
                    while True:
                        seen.append(bar.in_flight)
                        await asyncio.sleep(0.002)
                watcher = asyncio.ensure_future(watch())
                await asyncio.gather(*(pool.generate(f"{tag(i)} hello", 8, progress=bar) for i in range(6)))
                watcher.cancel()
            bar.close()
            return max(seen), bar.in_flight

    import asyncio
    assert asyncio.run(sent_at_most(2)) == (2, 0)   # six workers, two places: two in flight, none left over
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, token_delay_s=0.005) as server:
        gen.main(args(work, server, extra=["--concurrency", "16", "--long-concurrency", "2", "--long-after-normal"]))
    limit = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]["in_flight_limit"]
    assert limit["ceiling"] == 16 and limit["final"] == 16, limit   # the long partition runs after the normal one
    lines = re.findall(r"\| in flight (\d+) \(limit (\d+), all partitions\) \|", capsys.readouterr().out)
    assert lines and all(int(n) <= int(cap) == 16 for n, cap in lines), lines


def test_a_request_the_server_retracts_mid_answer_is_timed_by_the_stall_timeout(prepared, micro_target, tmp_path,
                                                                                 capsys):
    """SGLang pulls a running request back into its queue when its KV pool runs out (a retraction): the answer
    stops mid-stream until it is admitted again, then goes on where it stopped. For 01b that wait comes after the
    first token, so --stall-timeout bounds it, not --queue-timeout. Shorter than the stall timeout: the answer
    arrives whole, nothing is lost or retried. Longer: the attempt is given up as a stall (its tokens counted as
    thrown away, the in-flight limit halved: the server holds more than its KV pool), retried, and the record is
    still exact and written once; the run then ends with the lost-work line."""
    for pause, stall in ((0.3, 2.0), (1.2, 0.5)):
        work = fresh(prepared, tmp_path / f"p{pause}")
        with OpenAICompletionsServer(None, tokenizer_dir=micro_target, max_running=4, token_delay_s=0.005,
                                     retract_s=pause) as server:
            server.faults.update({tag(2): ["retract", "ok"], tag(3): ["retract", "ok"]})
            run = args(work, server, extra=["--concurrency", "8", "--long-concurrency", "2",
                                            "--stall-timeout", str(stall)])
            if pause < stall:
                gen.main(run)
            else:
                with pytest.raises(StageError, match=r"^2 request attempts timed out in this run \(0 waiting for "
                                                     r"their first token, 2 stalled after it\)"):
                    gen.main(run)
            assert server.retracted == 2 and attempts(server)[tag(2)] == attempts(server)[tag(3)] == \
                (1 if pause < stall else 2)
        out = rows(work)
        assert len(out) == NUM_ROWS and all(r["completion"] == expected(r) for r in out)
        m = read_json(stage_dir(work, GENERATE, "d") / "manifest.json")["counts"]["this_run"]
        lost = m["lost_work"]
        if pause < stall:
            assert m["errors"] == {} and set(lost.values()) == {0}
        else:
            assert (lost["timeouts"], lost["stall_timeouts"], lost["queue_timeouts"]) == (2, 2, 0)
            assert lost["abandoned_tokens"] >= 2 and m["in_flight_limit"]["lowest"] == 5
            assert "[01b] in-flight limit 10 -> 5: a request timed out on http" in capsys.readouterr().out
