"""Tests of 01b_generate_synthetic: hf and openai engines agree token for token, resume after SIGKILL, refusals."""
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.text.chat_format import IM_END, render_prompt
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, PREPARE, StageError, stage_dir, stage_script
from tests.openai_server import OpenAICompletionsServer
from tests.paths import REPO, FIXTURES

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
DATASETS = [{"name": "msg", "adapter": "messages", "path": str(FIXTURES / "messages_rows.jsonl")},
            {"name": "comp", "adapter": "messages", "path": str(FIXTURES / "complete_rows.jsonl"), "complete": True}]
NEW = "12"  # --max-new-tokens
# The micro targets are random models: their greedy answers loop, so the target health gate (tested
# in test_01b_faults.py) would rightly refuse them.
NO_GATE = ["--health-probes", "0"]


@pytest.fixture(scope="module")
def stopping_target(micro_target, tmp_path_factory):
    """The micro target with <|im_end|> made likely (its lm_head row = 1.5 x a token the model often
    emits), so that some responses stop and others hit the cap: both finish paths get exercised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("stopping_target")
    for f in Path(micro_target).iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.tensor([tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")])
    ids = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)[0, -8:]
    im_end = tok.convert_tokens_to_ids(IM_END)
    with torch.no_grad():
        model.lm_head.weight[im_end] = 1.5 * model.lm_head.weight[int(ids[3])]
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def prepared(stopping_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("prepared") / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(stopping_target), "--datasets", json.dumps(DATASETS)])
    return work


@pytest.fixture(scope="module")
def hf_run(prepared, tmp_path_factory):
    """A complete, uninterrupted hf-engine run: the reference the other runs must equal."""
    work = tmp_path_factory.mktemp("hf") / "work"
    shutil.copytree(prepared, work)
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", NEW,
              "--hf-batch-size", "4", "--device", "cpu"])
    return work


def rows(work, name="msg", file="generated.jsonl"):
    return list(iter_jsonl(stage_dir(work, GENERATE, name) / file))


def copy_prepared(prepared, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    return work


def test_hf_engine(hf_run, stopping_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stopping_target))
    recs = {r["id"]: r for r in iter_jsonl(stage_dir(hf_run, PREPARE, "msg") / "records.jsonl")}
    out = rows(hf_run)
    assert sorted(r["id"] for r in out) == sorted(recs)  # every id exactly once
    finish = {r["finish_reason"] for r in out}
    assert finish == {"stop", "length"}, finish  # the stopping target exercises both paths
    for r in out:
        rec = recs[r["id"]]
        assert r["prompt"] == render_prompt(tok, rec["messages"], rec.get("tools"), thinking=True)
        assert r["prompt"].endswith("<|im_assistant|>assistant<|im_middle|><think>")
        assert r["origin"] == "target" and r["engine"] == "hf"
        assert r["num_prompt_tokens"] == len(tok(r["prompt"], add_special_tokens=False)["input_ids"])
        if r["finish_reason"] == "stop":
            assert r["completion"].endswith(IM_END) and r["completion"].count(IM_END) == 1
        else:
            assert r["num_completion_tokens"] == int(NEW) and IM_END not in r["completion"]
    comp = rows(hf_run, "comp")
    assert len(comp) == 6 and all(r["origin"] == "dataset" and r["completion"].endswith(IM_END) for r in comp)
    m = read_json(stage_dir(hf_run, GENERATE, "msg") / "manifest.json")
    assert m["counts"]["generated"] == 9 and m["counts"]["failed"] == {}
    assert m["counts"]["completion_tokens"] == sum(r["num_completion_tokens"] for r in out)
    top = read_json(stage_dir(hf_run, GENERATE) / "manifest.json")
    assert top["datasets"] == ["msg", "comp"] and top["tokenizer"] == read_json(
        stage_dir(hf_run, PREPARE) / "manifest.json")["tokenizer"]


def test_openai_engine_equals_hf_even_when_server_trims_stop(hf_run, prepared, stopping_target, tmp_path, capsys):
    work = copy_prepared(prepared, tmp_path)
    # honor_keep_stop=False: the server trims <|im_end|> like older SGLang/vLLM; 01b must restore it.
    with OpenAICompletionsServer(stopping_target, honor_keep_stop=False) as server:
        gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url", server.base_url,
                  "--max-new-tokens", NEW, "--concurrency", "4", *NO_GATE])
        body = server.requests[0]
        # Second run: complete, so a no-op that sends nothing.
        n_requests = len(server.requests)
        gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url", server.base_url, *NO_GATE])
        assert len(server.requests) == n_requests and "nothing to do" in capsys.readouterr().out
    assert n_requests == 9
    assert body["model"] == "micro-target"  # discovered through GET /v1/models
    assert body["skip_special_tokens"] is False and body["stop"] == [IM_END] and body["temperature"] == 0
    assert body["max_tokens"] == int(NEW) and body["prompt"].endswith("<think>")
    ref = {r["id"]: r for r in rows(hf_run)}
    got = {r["id"]: r for r in rows(work)}
    assert got.keys() == ref.keys()
    for k, r in got.items():
        assert r["engine"] == "openai"
        for field in ("prompt", "completion", "finish_reason", "num_prompt_tokens", "num_completion_tokens"):
            assert r[field] == ref[k][field], (k, field)
    assert read_json(stage_dir(work, GENERATE, "msg") / "manifest.json")["counts"]["prompt_token_count_mismatch"] == 0


def test_resume_after_sigkill(hf_run, prepared, stopping_target, tmp_path):
    work = copy_prepared(prepared, tmp_path)
    gen_path = stage_dir(work, GENERATE, "msg") / "generated.jsonl"
    with OpenAICompletionsServer(stopping_target, delay_s=0.4) as server:
        cmd = [sys.executable, stage_script(GENERATE), "--work-dir", str(work), "--generation-engine",
               "openai", "--server-url", server.base_url, "--max-new-tokens", NEW, "--concurrency", "2", *NO_GATE]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if gen_path.exists() and len(gen_path.read_bytes().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "01b finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done_before = {r["id"] for r in iter_jsonl(gen_path)}
        assert 3 <= len(done_before) < 9
        assert not (stage_dir(work, GENERATE, "msg") / "manifest.json").exists()
        with open(gen_path, "a") as f:  # and a torn last line, as a kill inside write() leaves
            f.write('{"id": "msg/m0", "source": "msg", "prompt": "<|im_us')
        n_requests = len(server.requests)
        gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url", server.base_url,
                  "--max-new-tokens", NEW, "--concurrency", "2", *NO_GATE])
        resumed = [b["prompt"] for b in server.requests[n_requests:]]
    out = rows(work)
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)) == 9  # every id exactly once
    assert len(resumed) == 9 - len(done_before)  # only what was missing was asked for
    ref = {r["id"]: r for r in rows(hf_run)}
    assert all(r["completion"] == ref[r["id"]]["completion"] for r in out)  # resumed == uninterrupted
    assert read_json(stage_dir(work, GENERATE) / "manifest.json")["counts"]["msg"]["generated"] == 9


def test_context_overflow_and_cap(prepared, tmp_path):
    work = copy_prepared(prepared, tmp_path)
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", NEW,
              "--max-context", "45", "--device", "cpu", "--datasets-only", "msg"])
    fails = {f["id"]: f for f in rows(work, file="failures.jsonl")}
    out = {r["id"]: r for r in rows(work)}
    assert all(f["reason"] == "context_overflow" for f in fails.values())
    assert {"msg/m2", "msg/m3", "msg/uc5"} <= set(fails) and not set(fails) & set(out)
    assert len(fails) + len(out) == 9
    for r in out.values():  # the response budget shrinks so prompt + response fits the context
        assert r["num_prompt_tokens"] + r["num_completion_tokens"] <= 45
    assert read_json(stage_dir(work, GENERATE, "msg") / "manifest.json")["counts"]["failed"] == {
        "context_overflow": len(fails)}
    # --datasets-only: the other dataset waits, so the stage is not complete yet.
    assert not (stage_dir(work, GENERATE) / "manifest.json").exists()
    assert not stage_dir(work, GENERATE, "comp").exists()


def test_refusals(prepared, other_micro_target, tmp_path):
    with pytest.raises(StageError, match=PREPARE):
        gen.main(["--work-dir", str(tmp_path / "empty"), "--generation-engine", "hf"])
    work = copy_prepared(prepared, tmp_path)
    with pytest.raises(StageError, match="tokenizer"):
        gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--target-path", str(other_micro_target)])
    with pytest.raises(StageError, match="not reachable or not healthy after 0 s"):
        gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url",
                  "http://127.0.0.1:9/v1", "--request-retries", "0", "--request-timeout", "2",
                  "--server-down-timeout", "0.2", "--health-interval", "0.05"])


def test_health_gate_refuses_the_random_micro_target(prepared, stopping_target, tmp_path):
    """A real model whose greedy answers loop (the random micro target: its <|im_end|> is likely, so
    it even ends its turns) is refused by the target health gate before any work is sent."""
    work = copy_prepared(prepared, tmp_path)
    with OpenAICompletionsServer(stopping_target) as server:
        with pytest.raises(StageError, match="target health gate: .* of 3 greedy probe prompts degenerately"):
            gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url", server.base_url,
                      "--max-new-tokens", NEW, "--health-max-new-tokens", "64"])
        assert {b["max_tokens"] for b in server.requests} == {64}  # the probes only
    assert not rows(work)


def test_failed_requests_keep_dataset_incomplete_then_retry(prepared, stopping_target, tmp_path):
    work = copy_prepared(prepared, tmp_path)
    base = ["--work-dir", str(work), "--generation-engine", "openai", "--max-new-tokens", "4",
            "--datasets-only", "msg", *NO_GATE]
    with OpenAICompletionsServer(stopping_target) as server:
        server.default_fault = "422"  # an input error: recorded at once, never retried
        with pytest.raises(StageError, match="9 requests failed"):
            gen.main(base + ["--server-url", server.base_url])
        assert len(server.requests) == 9
        assert {f["reason"] for f in rows(work, file="failures.jsonl")} == {"http_422"}
        assert not (stage_dir(work, GENERATE, "msg") / "manifest.json").exists()
        server.default_fault = "ok"
        gen.main(base + ["--server-url", server.base_url])  # fixed: only the failed ones are retried
        assert len(server.requests) == 18
    assert len(rows(work)) == 9 and rows(work, file="failures.jsonl") == []
    assert (stage_dir(work, GENERATE, "msg") / "manifest.json").exists()
