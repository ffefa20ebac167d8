"""01b's run state: one 01b per dataset (a second is refused naming the
holder, also while a SIGTERM'd run finishes its requests), duplicate ids repaired on resume, a resume
with other generation settings refused unless --allow-mixed-settings, and totals over all runs."""
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.generation.run_state import dataset_lock
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, PREPARE, StageError, stage_dir, stage_script
from tests.openai_server import OpenAICompletionsServer
from tests.paths import REPO

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
NUM_ROWS = 12
FAST = ["--generation-engine", "openai", "--max-new-tokens", "40", "--max-context", "200", "--request-timeout", "5",
        "--retry-base-delay", "0.01", "--retry-max-delay", "0.05", "--health-interval", "0.05",
        "--health-timeout", "2", "--summary-interval", "0.5", "--concurrency", "2"]


@pytest.fixture(scope="module")
def prepared(micro_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("run_state")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"u{i:02d}", "messages": [
        {"role": "user", "content": f"[r{i:02d}] Write function number {i}."}]}) + "\n" for i in range(NUM_ROWS)))
    work = root / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--max-new-tokens", "40",
               "--max-context", "200", "--datasets", json.dumps([{"name": "d", "adapter": "messages", "path": str(data)}])])
    return work


def fresh(prepared, tmp_path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    return work


def args(work, server, *extra):
    return ["--work-dir", str(work), *FAST, "--server-url", server.base_url, *extra]


def folder(work) -> Path:
    return stage_dir(work, GENERATE, "d")


def rows(work) -> list[dict]:
    path = folder(work) / "generated.jsonl"
    return list(iter_jsonl(path)) if path.exists() else []


def reopen(work, keep: int) -> None:
    """Make a complete dataset look like one whose run stopped after `keep` records."""
    (folder(work) / "manifest.json").unlink()
    (stage_dir(work, GENERATE) / "manifest.json").unlink()
    lines = (folder(work) / "generated.jsonl").read_text().splitlines(keepends=True)
    (folder(work) / "generated.jsonl").write_text("".join(lines[:keep]))


def test_a_second_01b_on_a_dataset_is_refused(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    host = socket.gethostname()
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target, delay_s=1.5) as server:
        # Held by this very process (another open file): refused, the holder named.
        with dataset_lock(folder(work)):
            with pytest.raises(StageError, match=f"another 01b is working on d \\(pid {os.getpid()} on host {host}"):
                gen.main(args(work, server))
        assert server.requests == []
        # The realistic case: a restart while a SIGTERM'd run still finishes its requests in flight.
        proc = subprocess.Popen([sys.executable, stage_script(GENERATE), *args(work, server, "--shutdown-grace", "30")],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 60
        while time.time() < deadline and not rows(work):
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        assert proc.poll() is None, "the SIGTERM'd run ended before the second one could meet it"
        try:
            with pytest.raises(StageError, match=f"another 01b is working on d \\(pid {proc.pid} on host {host}"):
                gen.main(args(work, server))
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 1 and "stopped by SIGTERM" in err, err[-2000:]
        server.delay_s = 0.0
        gen.main(args(work, server))  # the lock went with the process: the resume runs
    ids = [r["id"] for r in rows(work)]
    assert len(ids) == len(set(ids)) == NUM_ROWS


def test_duplicate_ids_are_repaired_on_resume(prepared, micro_target, tmp_path):
    """A file left with an id twice (two unlocked runs at once) used to stop every later run at an
    assert; now the first record of each id wins and the count is reported."""
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        gen.main(args(work, server))
        first = rows(work)
        reopen(work, 6)
        with open(folder(work) / "generated.jsonl", "a") as f:
            for r in first[:3]:  # the second writer's copies of three ids (another text)
                f.write(json.dumps({**r, "completion": "DUPLICATE"}) + "\n")
        n = len(server.requests)
        gen.main(args(work, server))
        assert len(server.requests) - n == NUM_ROWS - 6 + 3  # only the missing ids, plus the 3 health probes
    out = rows(work)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in first)
    assert {r["id"]: r["completion"] for r in out} == {r["id"]: r["completion"] for r in first}  # first record won
    counts = read_json(folder(work) / "manifest.json")["counts"]
    assert counts["all_runs"]["duplicate_ids_removed"] == 3


def test_resume_with_other_settings_is_refused(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server, \
            OpenAICompletionsServer(None, tokenizer_dir=micro_target, served_model_name="other-model") as other:
        gen.main(args(work, server))
        tok_sha = read_json(stage_dir(work, PREPARE) / "manifest.json")["tokenizer"]["sha256"]
        settings = {"engine": "openai", "model": "micro-target", "max_new_tokens": 40, "temperature": 0.0,
                    "seed": None, "top_p": None, "tokenizer_sha256": tok_sha, "stop": ["<|im_end|>"],
                    "max_context": 200, "long_context": 0}
        assert all(r["settings"] == settings for r in rows(work))  # in every record...
        assert read_json(folder(work) / "manifest.json")["settings"] == [settings]  # ...and the manifest
        reopen(work, 8)
        n = len(server.requests)
        for extra, message in [(["--max-new-tokens", "30"], r"max_new_tokens 40 \(now 30\)"),
                               (["--temperature", "0.7"], r"temperature 0.0 \(now 0.7\)"),
                               # the cap is min(max_new_tokens, context - prompt): a resume must not move it
                               (["--max-context", "300"], r"max_context 200 \(now 300\)")]:
            with pytest.raises(StageError, match=message):
                gen.main(args(work, server, *extra))
        assert len(server.requests) == n  # refused before any request
        with pytest.raises(StageError, match=r"model 'micro-target' \(now 'other-model'\)"):
            gen.main(args(work, other))  # the model name is the one the server reports
        assert all(b["max_tokens"] != 40 for b in other.requests)  # start-up checks only, no work sent
        assert len(rows(work)) == 8
        gen.main(args(work, server, "--max-new-tokens", "30", "--allow-mixed-settings"))
    out = rows(work)
    assert len(out) == NUM_ROWS and {r["settings"]["max_new_tokens"] for r in out} == {40, 30}
    assert [s["max_new_tokens"] for s in read_json(folder(work) / "manifest.json")["settings"]] == [40, 30]


def test_manifest_keeps_totals_over_all_runs(prepared, micro_target, tmp_path):
    work = fresh(prepared, tmp_path)
    with OpenAICompletionsServer(None, tokenizer_dir=micro_target) as server:
        server.faults.update({"[r03]": ["422"], "[r07]": ["500", "422"]})  # two ids fail in the first run
        with pytest.raises(StageError, match="2 requests failed"):
            gen.main(args(work, server))
        gen.main(args(work, server))  # the second run retries only those two
    counts = read_json(folder(work) / "manifest.json")["counts"]
    assert counts["this_run"]["requests"] == 2 and counts["this_run"]["errors"] == {}
    assert counts["all_runs"]["runs"] == 2 and counts["all_runs"]["requests"] == NUM_ROWS + 2
    assert counts["all_runs"]["errors"] == {"http_422": 2, "http_500": 1}
    assert counts["all_runs"]["completion_tokens"] == counts["completion_tokens"]
    assert len(list(iter_jsonl(folder(work) / "runs.jsonl"))) == 2


def test_settings_conflicts_unit():
    from common.generation.run_state import settings_conflicts

    now = {"engine": "openai", "model": "k2.5", "max_new_tokens": 4096, "temperature": 0.0, "seed": None,
           "tokenizer_sha256": "t", "stop": ["<|im_end|>"]}
    assert settings_conflicts([now, {"tokenizer_sha256": "t"}], now) == []  # a passed-through row: tokenizer only
    assert settings_conflicts([{**now, "model": None}], now) == []  # written before the model was known
    assert settings_conflicts([{**now, "model": "k2", "max_new_tokens": 50}], now) == [
        "max_new_tokens 50 (now 4096)", "model 'k2' (now 'k2.5')"]
    assert settings_conflicts([{**now, "model": "k2"}], now, skip=("model",)) == []
    assert settings_conflicts([{"tokenizer_sha256": "u"}], now) == ["tokenizer_sha256 'u' (now 't')"]
    assert settings_conflicts([None], now) == ["records without settings (written by an older 01b)"]
    # records of an older 01b name the engine "backend": still compared
    assert settings_conflicts([{"backend": "hf", "tokenizer_sha256": "t"}], now) == ["engine 'hf' (now 'openai')"]


def test_sampled_requests_pin_top_p_and_seed():
    """A sampled request names its top-p (a server's generation_config default would apply otherwise);
    a greedy one sends neither top-p nor seed."""
    from common.generation.server_pool import ServerPool

    pool = ServerPool(["http://127.0.0.1:9/v1"], "m", temperature=1.0, seed=7, top_p=0.95)
    body = pool.completion_body("hi", 8)
    assert (body["temperature"], body["top_p"], body["seed"]) == (1.0, 0.95, 7)
    greedy = pool.completion_body("hi", 8, temperature=0.0)
    assert "top_p" not in greedy and "seed" not in greedy
