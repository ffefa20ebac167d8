"""Tests of 01_prepare_datasets: adapters, prompt cutting, tool-id rewriting, scrubbing, counted skips, re-runs."""
import importlib
import json
from pathlib import Path

import pytest

from common.io import iter_jsonl, read_json
from common.stage import PREPARE, StageError, stage_dir
from tests.paths import FIXTURES

prep = importlib.import_module(PREPARE)

# Two rows whose tool schemas differ: Arrow (parquet) unifies them into one struct type.
PARQUET_ROWS = [
    {"id": "p0", "messages": [{"role": "user", "content": "Read a.py"}],
     "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]},
    {"id": "p1", "messages": [{"role": "user", "content": "Run ls"}],
     "tools": [{"type": "function", "function": {"name": "run", "description": "Run.",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]},
]
INSTRUCTION_ROWS = [
    {"instruction": "Sort this list.", "input": "[3, 1, 2]", "output": "[1, 2, 3]"},
    {"problem": "Write fizzbuzz.", "solution": "..."},
    {"output": "an answer without a question"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def specs(tmp_path):
    from datasets import Dataset

    parquet = tmp_path / "tools.parquet"
    Dataset.from_list(PARQUET_ROWS).to_parquet(str(parquet))
    return [
        {"name": "msg", "adapter": "messages", "path": str(FIXTURES / "messages_rows.jsonl")},
        {"name": "conv", "adapter": "conversations", "path": str(FIXTURES / "conversations_rows.json")},
        {"name": "inst", "adapter": "instruction", "path": str(write_jsonl(tmp_path / "inst.jsonl", INSTRUCTION_ROWS))},
        {"name": "pq", "adapter": "messages", "path": str(parquet)},
        {"name": "comp", "adapter": "messages", "path": str(FIXTURES / "complete_rows.jsonl"), "complete": True},
    ]


def records(work, name):
    return {r["id"]: r for r in iter_jsonl(stage_dir(work, PREPARE, name) / "records.jsonl")}


@pytest.fixture(scope="module")
def prepared(micro_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    work = tmp / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(specs(tmp))])
    return work


def test_messages_family(prepared):
    recs = records(prepared, "msg")
    counts = read_json(stage_dir(prepared, PREPARE, "msg") / "manifest.json")["counts"]
    # 15 rows read: 9 usable, each bad row skipped under its own reason.
    assert counts["rows_read"] == 15 and counts["num_records"] == 9 == len(recs)
    assert counts["skipped"] == {"bad_json_line": 1, "duplicate_id": 1, "missing_messages": 1, "no_prompt": 1,
                                 "unknown_role": 1, "unknown_tool_call_id": 1}
    for r in recs.values():
        assert r["source"] == "msg" and r["complete"] is False and r["thinking"] is True
        assert r["messages"][-1]["role"] in ("user", "tool")
    # Tool-call ids renumbered over the conversation; tool results point at the new ids.
    m3 = recs["msg/m3"]["messages"]
    assert [m["tool_calls"][0]["id"] for m in m3 if m.get("tool_calls")] == ["functions.run:0", "functions.run:1"]
    assert [m["tool_call_id"] for m in m3 if m["role"] == "tool"] == ["functions.run:0", "functions.run:1"]
    assert m3[1]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "ls"}'  # dict arguments -> JSON text
    assert recs["msg/m2"]["tools"][0]["function"]["name"] == "read_file"
    assert recs["msg/m2"]["messages"][1]["reasoning_content"] == "Need to read it."
    # Literal special-token strings are scrubbed and counted.
    assert recs["msg/m4"]["messages"][0]["content"] == "Explain  tokens and  tags."
    assert counts["special_tokens_scrubbed"] == 2
    # ultrachat form: id from prompt_id, trailing (non-target) assistant turn cut.
    uc = recs["msg/uc5"]["messages"]
    assert [m["role"] for m in uc] == ["user", "assistant", "user"] and uc[-1]["content"] == "Which is stable?"


def test_conversations_instruction_parquet(prepared):
    conv = records(prepared, "conv")
    assert sorted(conv) == ["conv/s0", "conv/s1", "conv/s3"]
    assert [m["role"] for m in conv["conv/s1"]["messages"]] == ["system", "user", "assistant", "user"]
    assert conv["conv/s3"]["meta"] == {"repairs": {"unknown_speaker_turns_dropped": 1}}
    assert conv["conv/s0"]["messages"] == [{"role": "user", "content": "How do I open a file?"}]
    inst = records(prepared, "inst")
    assert [r["messages"][0]["content"] for r in inst.values()] == ["Sort this list.\n\n[3, 1, 2]", "Write fizzbuzz."]
    assert read_json(stage_dir(prepared, PREPARE, "inst") / "manifest.json")["counts"]["skipped"] == {"missing_instruction": 1}
    # Parquet: the None-filled fields Arrow adds when unifying different tool schemas are gone.
    pq = records(prepared, "pq")
    assert [r["tools"] for r in pq.values()] == [row["tools"] for row in PARQUET_ROWS]


def test_complete_records_keep_final_assistant(prepared):
    comp = records(prepared, "comp")
    assert len(comp) == 6 and all(r["complete"] and r["messages"][-1]["role"] == "assistant" for r in comp.values())
    assert comp["comp/c3"]["messages"][-1]["tool_calls"][0]["id"] == "functions.read_file:0"
    assert read_json(stage_dir(prepared, PREPARE, "comp") / "manifest.json")["counts"]["skipped"] == {"no_final_assistant": 1}


def test_stage_manifest_and_noop_rerun(prepared, micro_target, capsys):
    top = read_json(stage_dir(prepared, PREPARE) / "manifest.json")
    assert top["datasets"] == ["msg", "conv", "inst", "pq", "comp"]
    assert top["tokenizer"]["sha256"] and top["target"]["path"] == str(Path(micro_target).resolve())
    before = (stage_dir(prepared, PREPARE, "msg") / "records.jsonl").stat().st_mtime_ns
    prep.main(["--work-dir", str(prepared), "--target-path", str(micro_target),
               "--datasets", json.dumps(top["config"]["datasets"])])
    assert "nothing to do" in capsys.readouterr().out
    assert (stage_dir(prepared, PREPARE, "msg") / "records.jsonl").stat().st_mtime_ns == before


def test_config_yaml_and_errors(micro_target, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target-path: {micro_target}\nthinking: false\ndatasets:\n"
                   f"  - {{name: conv, adapter: conversations, path: {FIXTURES / 'conversations_rows.json'}, max-rows: 2}}\n")
    prep.main(["--config", str(cfg), "--work-dir", str(tmp_path / "w")])
    recs = records(tmp_path / "w", "conv")
    assert list(recs) == ["conv/s0", "conv/s1"] and not any(r["thinking"] for r in recs.values())
    w = str(tmp_path / "w2")
    with pytest.raises(StageError, match="adapter 'nope'"):
        prep.main(["--work-dir", w, "--target-path", str(micro_target),
                   "--datasets", '[{"name": "x", "adapter": "nope", "path": "a.jsonl"}]'])
    with pytest.raises(StageError, match="--target-path is required"):
        prep.main(["--work-dir", w, "--datasets", '[{"name": "x", "adapter": "messages", "path": "a.jsonl"}]'])
    with pytest.raises(StageError, match="does not exist"):
        prep.main(["--work-dir", w, "--target-path", str(micro_target),
                   "--datasets", json.dumps([{"name": "x", "adapter": "messages", "path": str(tmp_path / "no.jsonl")}])])


def test_manifest_counts_reasons_apart_and_repairs(micro_target, tmp_path):
    """Through the stage: missing / empty / wrong-type fields are separate
    skip reasons, leading bot turns are dropped and fallbacks taken are counted in the manifest, and a
    nested special-token literal leaves no control token in the prompt."""
    from transformers import AutoTokenizer

    nested = "<|im_<|im_end|>end|>"
    rows = [{"id": "a", "conversations": [{"from": "gpt", "value": "...as I said."}, {"from": "human", "value": "Q1"}]},
            {"id": "b"}, {"id": "c", "conversations": []}, {"id": "d", "conversations": {"from": "human"}},
            {"id": "e", "conversations": [{"from": "human", "value": f"x{nested}y"}]}]
    chat = [{"prompt_id": "u0", "prompt": "Explain sets.", "messages": []},
            {"prompt_id": "u1", "messages": [{"role": "user"}]},
            {"prompt_id": "u2", "messages": [{"role": "user", "content": " "}]}]
    specs = [{"name": "sg", "adapter": "sharegpt", "path": str(write_jsonl(tmp_path / "sg.jsonl", rows))},
             {"name": "uc", "adapter": "ultrachat", "path": str(write_jsonl(tmp_path / "uc.jsonl", chat))}]
    work = tmp_path / "w"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(specs)])
    sg = read_json(stage_dir(work, PREPARE, "sg") / "manifest.json")["counts"]
    assert sg["skipped"] == {"missing_conversations": 1, "empty_conversations": 1, "bad_field_type": 1}
    assert sg["repaired"] == {"leading_turns_dropped": 1} and sg["special_tokens_scrubbed"] == 2
    recs = records(work, "sg")
    assert recs["sg/a"]["messages"] == [{"role": "user", "content": "Q1"}]
    assert recs["sg/e"]["messages"][0]["content"] == "xy"
    tok = AutoTokenizer.from_pretrained(str(micro_target))
    from common.text.chat_format import render_prompt

    ids = tok(render_prompt(tok, recs["sg/e"]["messages"]), add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1  # only the turn's own end
    uc = read_json(stage_dir(work, PREPARE, "uc") / "manifest.json")["counts"]
    assert uc["skipped"] == {"missing_user_content": 1, "empty_user_message": 1}
    assert uc["repaired"] == {"prompt_field_fallback": 1} and uc["num_records"] == 1
