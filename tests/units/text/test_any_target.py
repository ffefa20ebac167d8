"""The data stages on HF chat targets that are not Kimi: the text format is derived from the
target (end of turn, stop ids, thinking, tools, tool calls), tools a template drops are refused or
counted, `complete` answers go through the target's own template, and servers stop on the target's
end of turn and hand back its ids where they can."""
import importlib
import json
from pathlib import Path

import pytest

from common.text.target_format import FormatError, describe_target, render_final_turn
from common.text.tokenizer import load_tokenizer
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, MERGE, PREPARE, StageError, stage_dir
from tests.openai_server import OpenAICompletionsServer
from tests.paths import FIXTURES

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
merge = importlib.import_module(MERGE)
COMPLETE_ROWS = [  # answers the target itself wrote
    {"id": "plain", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi there"}]},
    {"id": "reason", "messages": [{"role": "user", "content": "Say bye."},
                                  {"role": "assistant", "reasoning_content": "Farewell.", "content": "bye"}]},
    {"id": "tool", "messages": [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]}]},
]


def read(work, stage, name, file):
    return list(iter_jsonl(stage_dir(work, stage, name) / file))


def test_describe_target(micro_target, micro_chatml_target, micro_llama3_target, tmp_path):
    from common.text.kimi_tokenizer import write_kimi_k25_model_dir

    chatml = describe_target(load_tokenizer(micro_chatml_target), micro_chatml_target)
    assert (chatml.kimi, chatml.end_of_turn, chatml.stop_ids) == (False, "<|im_end|>", (2,))
    assert not (chatml.renders_thinking or chatml.renders_tools or chatml.renders_tool_calls)
    llama3 = describe_target(load_tokenizer(micro_llama3_target), micro_llama3_target)
    # End of turn from the template, then generation_config's eos ids.
    assert (llama3.kimi, llama3.end_of_turn, llama3.stop_ids) == (False, "<|eot_id|>", (4, 1))
    assert llama3.stop_strings == ("<|eot_id|>", "<|end_of_text|>")
    tiny = describe_target(load_tokenizer(micro_target), micro_target)
    assert tiny.kimi and tiny.renders_thinking and tiny.renders_tools and tiny.renders_tool_calls
    k25_dir = write_kimi_k25_model_dir(tmp_path / "k25")
    k25 = describe_target(load_tokenizer(k25_dir), k25_dir)
    assert k25.kimi and k25.stop_ids == (163586, 163585) and k25.renders_tools and k25.renders_tool_calls


def test_final_turn_through_the_template(micro_chatml_target, micro_target):
    tok = load_tokenizer(micro_chatml_target)
    fmt = describe_target(tok, micro_chatml_target)
    msgs = COMPLETE_ROWS[0]["messages"]
    answer = render_final_turn(tok, fmt, msgs, None, thinking=False)
    assert answer == "hi there<|im_end|>"  # ChatML writes `<|im_end|>\n`; the model stops at <|im_end|>
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert (prompt + answer + "\n") == tok.apply_chat_template(msgs, tokenize=False)
    with pytest.raises(FormatError) as e:
        render_final_turn(tok, fmt, COMPLETE_ROWS[1]["messages"], None, thinking=False)
    assert e.value.reason == "reasoning_not_rendered"
    kimi_tok = load_tokenizer(micro_target)  # Kimi keeps its exact completion rendering
    kimi = describe_target(kimi_tok, micro_target)
    answer = render_final_turn(kimi_tok, kimi, COMPLETE_ROWS[1]["messages"], None, True)
    assert answer == "Farewell.</think>bye<|im_end|>"


def test_01_on_chatml_drops_or_keeps_unrendered_tools(micro_chatml_target, tmp_path):
    comp_rows = tmp_path / "complete.jsonl"
    comp_rows.write_text("".join(json.dumps(r) + "\n" for r in COMPLETE_ROWS))
    datasets = [{"name": "msg", "adapter": "messages", "path": str(FIXTURES / "messages_rows.jsonl")},
                {"name": "comp", "adapter": "messages", "path": str(comp_rows), "complete": True}]
    base = ["--target-path", str(micro_chatml_target), "--datasets", json.dumps(datasets)]

    work = tmp_path / "drop"
    prep.main(["--work-dir", str(work)] + base)  # default: drop, counted
    counts = read_json(stage_dir(work, PREPARE) / "manifest.json")["counts"]
    msg = read(work, PREPARE, "msg", "records.jsonl")
    assert counts["msg"]["skipped"]["tool_calls_not_rendered"] == 2  # m2, m3 (m3 also declares tools)
    assert counts["msg"]["with_tools"] == 0 and counts["msg"]["thinking"] == 0
    assert not any(r.get("tools") or r["thinking"] or any(m.get("tool_calls") for m in r["messages"]) for r in msg)
    assert counts["comp"]["skipped"] == {"reasoning_not_rendered": 1, "tool_calls_not_rendered": 1}
    assert read_json(stage_dir(work, PREPARE) / "manifest.json")["target_format"]["renders_tools"] is False

    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "4", "--device", "cpu"])
    comp = read(work, GENERATE, "comp", "generated.jsonl")
    assert [(r["completion"], r["origin"]) for r in comp] == [("hi there<|im_end|>", "dataset")]
    assert "<think>" not in comp[0]["prompt"] and comp[0]["prompt"].endswith("<|im_start|>assistant\n")
    merge.main(["--work-dir", str(work), "--benchmark-size", "1"])
    tok = load_tokenizer(micro_chatml_target)
    sample = next(s for s in iter_jsonl(stage_dir(work, MERGE) / "tokenized_data.jsonl") if s["source"] == "comp")
    assert sample["input_ids"][-1] == 2 and sample["loss_mask"][-1] == 1
    assert tok.decode(sample["input_ids"][sample["n_prompt_tokens"]:]) == "hi there<|im_end|>"

    work = tmp_path / "keep"
    prep.main(["--work-dir", str(work), "--tools-not-rendered", "keep"] + base)
    counts = read_json(stage_dir(work, PREPARE) / "manifest.json")["counts"]["msg"]
    assert counts["kept_tool_calls_not_rendered"] == 2 and counts["with_tools"] == 0
    calls = [c["id"] for r in read(work, PREPARE, "msg", "records.jsonl")
             for m in r["messages"] for c in m.get("tool_calls") or []]
    assert calls and "call_1" in calls and not any(c.startswith("functions.") for c in calls)  # dataset ids kept

    with pytest.raises(StageError, match="--tools-not-rendered"):
        prep.main(["--work-dir", str(tmp_path / "refuse"), "--tools-not-rendered", "refuse"] + base)


def test_servers_stop_on_the_targets_end_of_turn_and_return_ids(micro_llama3_target, chat_prompts_file, tmp_path):
    datasets = json.dumps([{"name": "chat", "adapter": "messages", "path": str(chat_prompts_file)}])
    hf = tmp_path / "hf"
    prep.main(["--work-dir", str(hf), "--target-path", str(micro_llama3_target), "--datasets", datasets])
    gen.main(["--work-dir", str(hf), "--generation-engine", "hf", "--max-new-tokens", "12", "--device", "cpu",
              "--hf-batch-size", "1"])
    ref = {r["id"]: r for r in read(hf, GENERATE, "chat", "generated.jsonl")}
    assert {r["finish_reason"] for r in ref.values()} == {"stop", "length"}
    assert all(r["completion_ids"][-1] == 4 for r in ref.values() if r["finish_reason"] == "stop")
    for vllm in (False, True):  # SGLang 0.5.14's /v1/completions returns text only; vLLM can return ids
        work = tmp_path / f"openai_{vllm}"
        prep.main(["--work-dir", str(work), "--target-path", str(micro_llama3_target), "--datasets", datasets])
        with OpenAICompletionsServer(micro_llama3_target, honor_keep_stop=False) as server:
            server.vllm_token_ids = vllm
            gen.main(["--work-dir", str(work), "--generation-engine", "openai", "--server-url", server.base_url,
                      "--max-new-tokens", "12", "--concurrency", "2"])
            body = server.requests[-1]
        assert body["stop"] == ["<|eot_id|>", "<|end_of_text|>"] and body["return_token_ids"] is True
        for r in read(work, GENERATE, "chat", "generated.jsonl"):
            assert r["completion"] == ref[r["id"]]["completion"]  # the trimmed <|eot_id|> is restored
            assert r["completion_ids"] == (ref[r["id"]]["completion_ids"] if vllm else None)
