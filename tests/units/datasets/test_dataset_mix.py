"""The mix's adapters on hand-written rows in each dataset's real schema; cut modes, thinking ratio, partitions;
and 01 -> 01b -> 01c on every fixture with the real Kimi-K2.5 tokenizer and template (golden strings)."""
import importlib
import json
from collections import Counter
from pathlib import Path

import pytest

from common.datasets.mix import (ADAPTERS, GENERIC_ADAPTERS, BadRow, FilteredRow, check_mix_spec, cut_trajectory,
                                expand_row, length_partition, thinking_for)
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, MERGE, PREPARE, stage_dir
from tests import paths
from tests.paths import REPO

FIX = paths.FIXTURES / "mix"
MIX = sorted(set(ADAPTERS) - set(GENERIC_ADAPTERS))   # one adapter per dataset of the mix
IM_END, THINK, THINK_END = 163586, 163606, 163607


@pytest.fixture(scope="module")
def scrub():
    from common.text.chat_format import special_token_pattern
    from common.text.kimi_tokenizer import load_kimi_k25_tokenizer

    return special_token_pattern(load_kimi_k25_tokenizer())


def run(name, scrub, **spec):
    """All fixture rows of `name` through expand_row: ({id: record}, broken reasons, filtered reasons, scrubbed)."""
    spec = {"name": name, "adapter": name, **spec}
    recs, broken, filtered, scrubbed = {}, Counter(), Counter(), 0
    for i, line in enumerate((FIX / f"{name}.jsonl").read_text().splitlines()):
        try:
            for rec, n in expand_row(json.loads(line), i, spec, scrub, seed=0):
                recs[rec["id"]] = rec
                scrubbed += n
        except json.JSONDecodeError:
            broken["bad_json_line"] += 1
        except FilteredRow as e:
            filtered[e.reason] += 1
        except BadRow as e:
            broken[e.reason] += 1
    return recs, dict(broken), dict(filtered), scrubbed


# adapter -> (record ids, broken rows by reason, filtered rows by reason), cut "last".
EXPECTED = {
    "swe_rebench": (["r0"], {"bad_messages_json": 1, "missing_trajectory": 1, "unknown_tool_call_id": 1, "bad_field_type": 1},
                    {"filtered_unresolved": 1}),
    "open_swe": (["s0"], {"unknown_role": 1, "bad_tools_json": 1},
                 {"filtered_resolved_unknown": 1, "filtered_unresolved": 1}),
    "swe_smith": (["x__y.abc.1.t0", "x__y.abc.2.t0", "x__y.abc.6.t0"], {"non_text_content": 1, "bad_tool_call": 1},
                  {"filtered_unresolved": 1}),
    "toucan": (["u0", "u1"], {"unmatched_tool_result": 1, "unparseable_tool_call": 1, "bad_messages_json": 1}, {}),
    "hermes_fc": (["h0", "h1"], {"unparseable_tool_call": 1, "tool_result_mismatch": 1, "bad_field_type": 1,
                                 "missing_conversations": 1}, {}),
    "toolace": (["00000000", "t1"], {"unparseable_tool_call": 1, "no_tools_in_system": 1, "tool_result_mismatch": 1}, {}),
    "xlam": (["0", "1"], {"bad_answers_json": 1, "missing_query": 1, "bad_tools": 1}, {}),
    "opencodeinstruct": (["oci0", "oci4"], {"bad_field_type": 1, "empty_input": 1}, {"filtered_test_score": 1}),
    "magicoder_oss": (["00000000"], {"bad_field_type": 1, "missing_problem": 1}, {}),
    "magicoder_evol": (["00000000"], {"empty_instruction": 1, "bad_json_line": 1}, {}),
    "opc_sft": (["00000000", "00000002"], {"missing_instruction": 1}, {}),
    "opencodereasoning": (["ocr0"], {"external_input": 1, "missing_input": 1}, {}),
    "openthoughts": (["00000000"], {"bad_thought_markers": 1, "unknown_role": 1, "empty_conversations": 1}, {}),
    "ultrachat": (["pid0", "pid1"], {"unknown_role": 1, "empty_user_message": 1, "bad_messages_json": 1}, {}),
    "sharegpt": (["sg0", "sg1"], {"no_prompt": 1, "missing_turn_value": 1}, {}),
    "wildchat": (["wc0", "wc1"], {"bad_field_type": 1, "non_text_content": 1},
                 {"filtered_toxic": 1, "filtered_redacted": 1, "filtered_language": 1}),
}


# Per-dataset mix keys of the end-to-end run: Kimi-K2 data kept as complete instant-mode samples, one
# trajectory cut at every turn with half the cuts thinking.
CHAIN_SPECS = {"toucan": {"complete": True, "thinking-ratio": 0.0}, "swe_rebench": {"cut": "every", "thinking-ratio": 0.5}}
# Length flags of the end-to-end run, chosen from the fixture prompts' token counts so that all
# three partition outcomes occur: prompt + 3 <= 160 normal, <= 330 long, the 802-token SWE-smith
# prompt dropped.
CHAIN_LENGTHS = ["--max-new-tokens", "3", "--max-context", "160", "--long-context", "330"]
CHAIN_LONG = {"swe_rebench": ["r0#turn3"], "swe_smith": ["x__y.abc.1.t0", "x__y.abc.2.t0"],
              "toolace": ["00000000", "t1"], "toucan": ["u0"]}


def test_every_adapter_is_registered_and_covered():
    assert sorted(EXPECTED) == MIX and len(MIX) >= 12
    assert sorted(p.stem for p in FIX.glob("*.jsonl")) == MIX


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_adapter_on_fixture_rows(name, scrub):
    recs, broken, filtered, _ = run(name, scrub)
    ids, want_broken, want_filtered = EXPECTED[name]
    assert sorted(recs) == sorted(f"{name}/{i}" for i in ids)
    assert broken == want_broken and filtered == want_filtered
    for r in recs.values():
        assert r["messages"][-1]["role"] in ("user", "tool") and r["complete"] is False
        calls = {c["id"]: c["function"]["name"] for m in r["messages"] for c in m.get("tool_calls", [])}
        assert list(calls) == [f"functions.{n}:{k}" for k, n in enumerate(calls.values())]
        assert all(m["tool_call_id"] in calls for m in r["messages"] if m["role"] == "tool")


def test_text_encoded_calls_are_parsed(scrub):
    h = run("hermes_fc", scrub)[0]["hermes_fc/h1"]["messages"]
    assert [m["role"] for m in h] == ["user", "assistant", "tool", "tool", "assistant", "user"]  # <tools> system dropped
    assert [c["function"]["arguments"] for c in h[1]["tool_calls"]] == ['{"symbol": "AAPL"}', '{"symbol": "MSFT"}']
    assert [(m["tool_call_id"], m["content"]) for m in h[2:4]] == [
        ("functions.get_stock_price:0", '{"price": 190}'), ("functions.get_stock_price:1", '{"price": 410}')]
    h0 = run("hermes_fc", scrub)[0]["hermes_fc/h0"]["messages"]  # python-dict call text
    assert h0[1]["tool_calls"][0]["function"]["arguments"] == '{"symbol": "TSLA"}' and h0[1]["content"] == ""
    recs = run("toolace", scrub)[0]
    t = recs["toolace/00000000"]
    assert [c["function"] for c in t["messages"][1]["tool_calls"]] == [
        {"name": "Market Trends API", "arguments": '{"trend_type": "gainers", "limit": 5.0}'},
        {"name": "get_time", "arguments": "{}"}]
    assert json.loads(t["messages"][3]["content"]) == {"name": "get_time", "results": {"time": "10:00"}}
    params = t["tools"][0]["function"]["parameters"]  # BFCL "dict"/"float" -> JSON Schema
    assert params["type"] == "object" and params["properties"]["limit"]["type"] == "number"
    x = run("xlam", scrub)[0]["xlam/1"]["tools"][1]["function"]["parameters"]
    assert x == {"type": "object", "required": ["nums"], "properties": {
        "nums": {"type": "array", "items": {"type": "integer"}, "description": "Numbers"},
        "strict": {"type": "boolean", "description": "Fail on junk"}}}


def test_agent_formats(scrub):
    u0 = run("toucan", scrub, complete=True)[0]["toucan/u0"]["messages"]  # Qwen-Agent parallel calls merged
    assert [m["role"] for m in u0] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert u0[2]["content"] == "I will check both." and len(u0[2]["tool_calls"]) == 2
    recs, _, _, scrubbed = run("toucan", scrub)
    assert recs["toucan/u1"]["messages"][4]["content"] == "Thanks! And tomorrow?" and scrubbed == 1
    assert recs["toucan/u1"]["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "days": 2}'
    smith = run("swe_smith", scrub)[0]
    for key in ("x__y.abc.1.t0", "x__y.abc.2.t0"):  # tool_call_ids list and tool_call_id both understood
        m = smith[f"swe_smith/{key}"]
        assert m["messages"][3]["tool_call_id"] == "functions.bash:0" and m["messages"][3]["content"] == "OBSERVATION:\nfile.py"
        assert [t["function"]["name"] for t in m["tools"]] == ["bash", "str_replace_editor", "submit"]
    r0 = run("swe_rebench", scrub)[0]["swe_rebench/r0"]
    assert r0["messages"][0]["content"] == "You are OpenHands agent." and r0["meta"]["repo"] == "a/b"
    assert [t["function"]["name"] for t in r0["tools"]] == ["execute_bash", "finish"]


def test_reasoning_chat_and_filters(scrub):
    ot = run("openthoughts", scrub, complete=True, **{"thinking-ratio": 1.0})[0]["openthoughts/00000000"]
    assert ot["messages"] == [{"role": "user", "content": "Return your final response within \\boxed{}. What is 2+3?"},
                              {"role": "assistant", "content": "\\boxed{5}", "reasoning_content": "Add them: 5."}]
    assert run("openthoughts", scrub)[0]["openthoughts/00000000"]["messages"] == ot["messages"][:1]
    assert run("opc_sft", scrub)[3] == 2  # "<think>" and "<|im_end|>" scrubbed from the instruction
    # Filters are options: off, the filtered rows come back (and a threshold can be raised).
    assert len(run("wildchat", scrub, filters={"languages": None, "drop-toxic": False, "drop-redacted": False})[0]) == 5
    assert len(run("opencodeinstruct", scrub, filters={"min-test-score": 0.3})[0]) == 3
    assert len(run("opencodeinstruct", scrub, filters={"min-test-score": 0.99})[0]) == 1
    assert sorted(run("open_swe", scrub, filters={"allow-unknown-resolved": True})[0]) == ["open_swe/s0", "open_swe/s1"]
    assert len(run("swe_rebench", scrub, filters={"resolved-only": False})[0]) == 3  # r5's bad flag unread


def test_cut_modes(scrub):
    every = run("swe_rebench", scrub, cut="every")[0]
    assert sorted(every) == ["swe_rebench/r0#turn1", "swe_rebench/r0#turn2", "swe_rebench/r0#turn3"]
    assert [len(every[f"swe_rebench/r0#turn{n}"]["messages"]) for n in (1, 2, 3)] == [2, 4, 6]
    assert every["swe_rebench/r0#turn3"]["meta"]["cut_turn"] == 3
    # complete + every: each record ends with the assistant turn it trains on.
    comp = run("toucan", scrub, cut="every", complete=True)[0]
    assert sorted(comp) == ["toucan/u0#turn1", "toucan/u0#turn2", "toucan/u1#turn1", "toucan/u1#turn2", "toucan/u1#turn3"]
    assert all(r["messages"][-1]["role"] == "assistant" and r["complete"] for r in comp.values())
    # random: one cut per row, the same on every run, keyed by seed and row key (not file position).
    msgs = [{"role": "user", "content": "q"}] + [m for k in range(6) for m in (
        {"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": f"u{k}"})]
    picks = {s: [len(cut_trajectory(f"k{i}", msgs, "random", s)[0][1]) for i in range(12)] for s in (0, 1)}
    assert picks[0] == [len(cut_trajectory(f"k{i}", msgs, "random", 0)[0][1]) for i in range(12)]
    assert picks[0] != picks[1] and len(set(picks[0])) > 2
    assert cut_trajectory("k", msgs, "last")[0][1] == msgs  # ends with a user turn: that turn is next
    with pytest.raises(BadRow, match="no_final_assistant"):
        cut_trajectory("k", msgs[:1], "last", complete=True)


def test_thinking_ratio_and_partition(scrub):
    ids = [f"d/{i}" for i in range(2000)]
    share = sum(thinking_for(i, 0.7) for i in ids) / len(ids)
    assert 0.66 < share < 0.74 and [thinking_for(i, 0.7) for i in ids[:50]] == [thinking_for(i, 0.7) for i in ids[:50]]
    assert not any(thinking_for(i, 0.0) for i in ids[:50]) and all(thinking_for(i, 1.0) for i in ids[:50])
    th = {r["id"]: r["thinking"] for r in run("toucan", scrub, cut="every", **{"thinking-ratio": 0.5})[0].values()}
    assert th == {r["id"]: r["thinking"] for r in run("toucan", scrub, cut="every", **{"thinking-ratio": 0.5})[0].values()}
    assert set(th.values()) == {True, False}
    assert [length_partition(n, 4096, 10240, 32768) for n in (6144, 6145, 28672, 28673)] == ["normal", "long", "long", None]
    assert length_partition(7000, 4096, 10240, None) is None


def test_stage_thinking_ratio_flag(tmp_path):
    """01's --thinking-ratio applies to entries without their own ratio; an entry's own wins."""
    from common.io import iter_jsonl as rows
    from common.text.kimi_tokenizer import write_kimi_k25_model_dir
    from common.stage import StageError

    target = write_kimi_k25_model_dir(tmp_path / "kimi")
    specs = [{"name": "uc", "adapter": "ultrachat", "path": str(FIX / "ultrachat.jsonl"), "cut": "every"},
             {"name": "sg", "adapter": "sharegpt", "path": str(FIX / "sharegpt.jsonl"), "thinking-ratio": 1.0}]
    prep = importlib.import_module(PREPARE)
    prep.main(["--work-dir", str(tmp_path / "w"), "--target-path", str(target), "--datasets", json.dumps(specs),
               "--thinking-ratio", "0"])
    assert not any(r["thinking"] for r in rows(stage_dir(tmp_path / "w", PREPARE, "uc") / "records.jsonl"))
    assert all(r["thinking"] for r in rows(stage_dir(tmp_path / "w", PREPARE, "sg") / "records.jsonl"))
    with pytest.raises(StageError, match="thinking-ratio"):
        prep.main(["--work-dir", str(tmp_path / "w2"), "--target-path", str(target), "--datasets",
                   json.dumps(specs), "--thinking-ratio", "1.5"])


def test_spec_errors():
    check_mix_spec({"name": "a", "adapter": "wildchat", "cut": "every", "thinking-ratio": 0.3,
                   "filters": {"languages": ["English"], "drop-toxic": True}})
    for bad, msg in (({"cut": "middle"}, "cut"), ({"thinking-ratio": 1.5}, "thinking-ratio"),
                     ({"filters": {"min-test-score": 1}}, "no filter")):
        with pytest.raises(ValueError, match=msg):
            check_mix_spec({"name": "a", "adapter": "wildchat", **bad})
    with pytest.raises(ValueError, match="adapter messages has no filter.*it takes none"):
        check_mix_spec({"name": "a", "adapter": "messages", "filters": {"languages": ["English"]}})


# ---- end to end: 01 -> 01b -> 01c with the real Kimi-K2.5 tokenizer and chat template ----------------

HERMES_H0_PROMPT = (
    "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n// Get the stock price\n"
    "type get_stock_price = (_: {\n  // ticker\n  symbol: string\n}) => any;\n}\n<|im_end|>"
    "<|im_user|>user<|im_middle|>What is TSLA at?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
    "functions.get_stock_price:0<|tool_call_argument_begin|>{\"symbol\": \"TSLA\"}<|tool_call_end|>"
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>get_stock_price<|im_middle|>## Return of functions.get_stock_price:0\n"
    "{\"name\": \"get_stock_price\", \"content\": {\"price\": 250}}<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>")
TOUCAN_U0_TEXT = (
    "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n// Forecast for a city.\n"
    "type weather-get_forecast = (_: {\n  // City name\n  city: string,\n  days?: number\n}) => any;\n}\n<|im_end|>"
    "<|im_system|>system<|im_middle|>You are a helpful assistant with access to tools.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>I will check both.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.weather-get_forecast:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
    "<|tool_call_begin|>functions.weather-get_forecast:1<|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|>"
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>weather-get_forecast<|im_middle|>## Return of functions.weather-get_forecast:0\n{\"temp\": 12}<|im_end|>"
    "<|im_system|>weather-get_forecast<|im_middle|>## Return of functions.weather-get_forecast:1\n{\"temp\": 18}<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>"
    "Paris is 12 C and Rome is 18 C.<|im_end|>")


@pytest.fixture(scope="module")
def kimi_chain(tmp_path_factory):
    """The bundled K2.5 tokenizer folder plus a random 2-layer DeepseekV3 over its 163,840 ids (so the
    hf engine can write completions), then 01 -> 01b -> 01c on every mix fixture."""
    import torch  # noqa: F401  (the model below)

    from common.text.kimi_tokenizer import write_kimi_k25_model_dir
    from common.worlds.tiny_target import deepseek_v3_config
    from common.text.tokenizer import load_tokenizer
    from transformers import DeepseekV3ForCausalLM

    tmp = tmp_path_factory.mktemp("kimi_chain")
    target = write_kimi_k25_model_dir(tmp / "kimi")
    tok = load_tokenizer(target)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(deepseek_v3_config(tok, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                             n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                                             intermediate_size=32)).save_pretrained(str(target))
    specs = [{"name": n, "adapter": n, "path": str(FIX / f"{n}.jsonl"), **CHAIN_SPECS.get(n, {})}
             for n in MIX]
    work = tmp / "work"
    importlib.import_module(PREPARE).main(
        ["--work-dir", str(work), "--target-path", str(target), "--datasets", json.dumps(specs), *CHAIN_LENGTHS])
    # 01b gets the long limit so that it writes the long partition too (it knows no partitions yet).
    importlib.import_module(GENERATE).main(
        ["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "3", "--max-context", "330",
         "--hf-batch-size", "8", "--device", "cpu"])
    importlib.import_module(MERGE).main(
        ["--work-dir", str(work), "--benchmark-size", "0", "--no-drop-length-finished", "--max-seq-len", "10240"])
    return work, tok


def test_chain_counts(kimi_chain):
    work, _ = kimi_chain
    m01 = read_json(stage_dir(work, PREPARE) / "manifest.json")["counts"]
    recs = {n: {r["id"].split("/", 1)[1]: r for r in iter_jsonl(stage_dir(work, PREPARE, n) / "records.jsonl")}
            for n in MIX}
    for name, (ids, broken, filtered) in EXPECTED.items():
        want = {"swe_rebench": ["r0#turn1", "r0#turn2", "r0#turn3"], "swe_smith": ids[:2]}.get(name, ids)
        assert sorted(recs[name]) == sorted(want), name
        assert m01[name]["skipped"] == {**broken, **({"too_long": 1} if name == "swe_smith" else {})}, name
        assert m01[name]["filtered"] == filtered, name
        long = sorted(k for k, r in recs[name].items() if r["partition"] == "long")
        assert long == sorted(CHAIN_LONG.get(name, [])), name
        assert m01[name]["partitions"] == {"normal": len(want) - len(long), "long": len(long)}, name
        for r in recs[name].values():  # the mark agrees with the prompt's own rendered length
            assert r["complete"] or (r["num_prompt_tokens"] + 3 <= 160) == (r["partition"] == "normal")
    assert not any(r["thinking"] for r in recs["toucan"].values())
    assert {r["thinking"] for r in recs["swe_rebench"].values()} == {True, False}
    stats = read_json(stage_dir(work, MERGE) / "stats.json")
    # Exact duplicates (same prompt, same greedy completion) are kept once: the two SWE-smith rows
    # differ only in how the observation names its call, and open_swe/s0 is the same trajectory as
    # swe_rebench/r0#turn2 (both thinking).
    assert stats["totals"]["dropped"] == {"duplicate": 2}
    assert stats["totals"]["num_samples"] == sum(len(r) for r in recs.values()) - 2 == 26
    assert set(stats["per_source"]) == set(MIX)


def test_chain_golden_text_and_masks(kimi_chain):
    work, tok = kimi_chain
    gen = {r["id"]: r for n in MIX for r in iter_jsonl(stage_dir(work, GENERATE, n) / "generated.jsonl")}
    data = {r["id"]: r for r in iter_jsonl(stage_dir(work, MERGE) / "tokenized_data.jsonl")}
    assert gen["hermes_fc/h0"]["prompt"] == HERMES_H0_PROMPT and gen["hermes_fc/h0"]["origin"] == "target"
    u0 = gen["toucan/u0"]
    assert u0["prompt"] + u0["completion"] == TOUCAN_U0_TEXT and u0["origin"] == "dataset"
    s = data["toucan/u0"]
    assert s["input_ids"] == tok(TOUCAN_U0_TEXT, add_special_tokens=False)["input_ids"]
    first = s["loss_mask"].index(1)
    # Instant mode (Kimi-K2 data kept as is): the mask starts right after `<think></think>` and ends
    # with <|im_end|>.
    assert tok.decode(s["input_ids"][first - 5:first]) == "<|im_assistant|>assistant<|im_middle|><think></think>"
    assert s["input_ids"][-1] == IM_END and s["loss_mask"] == [0] * first + [1] * (len(s["input_ids"]) - first)
    assert tok.decode(s["input_ids"][first:]) == "Paris is 12 C and Rome is 18 C.<|im_end|>"
    # Thinking mode: right after `<|im_assistant|>assistant<|im_middle|><think>`.
    h = data["hermes_fc/h0"]
    first = h["loss_mask"].index(1)
    assert tok.decode(h["input_ids"][first - 4:first]) == "<|im_assistant|>assistant<|im_middle|><think>"
    assert h["input_ids"][:first] == tok(HERMES_H0_PROMPT, add_special_tokens=False)["input_ids"]
    assert len(data) == 26
    recs = {r["id"]: r for n in MIX for r in iter_jsonl(stage_dir(work, PREPARE, n) / "records.jsonl")}
    for sid, s in data.items():  # every sample: prompt masked, the generated suffix supervised
        n_p = s["n_prompt_tokens"]
        opening = [THINK] if recs[sid]["thinking"] else [THINK, THINK_END]
        assert s["input_ids"][n_p - len(opening):n_p] == opening, sid
        assert s["loss_mask"] == [0] * n_p + [1] * s["n_response_tokens"], sid
        assert tok.decode(s["input_ids"][:n_p]) == gen[sid]["prompt"], sid
    sw = gen["swe_smith/x__y.abc.1.t0"]["prompt"]
    assert sw.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n// runs the")
    assert "<|im_system|>bash<|im_middle|>## Return of functions.bash:0\nOBSERVATION:\nfile.py<|im_end|>" in sw
    assert data["opc_sft/00000002"]["input_ids"].count(THINK) == 1  # the scrubbed literal <think> did not survive


def test_the_mix_preset():
    """The mix preset (configs/datasets_v4.yaml): keys are stage flags, entries valid, caps sum to 100K and each has a source."""
    import yaml

    from common.config import all_stage_flags

    cfg = yaml.safe_load((REPO / "configs" / "datasets_v4.yaml").read_text())
    assert set(cfg) <= all_stage_flags()
    prep = importlib.import_module(PREPARE)
    allowed = prep.SPEC_KEYS | {"cut", "thinking-ratio", "filters", "max-records"}
    names = [d["name"] for d in cfg["datasets"]]
    for d in cfg["datasets"]:
        assert set(d) <= allowed and d["adapter"] in MIX, d["name"]
        check_mix_spec(d)
        assert d["max-records"] >= cfg["dataset-caps"][d["name"]] and d["max-rows"] >= d["max-records"] / 2
    assert set(cfg["dataset-caps"]) == set(names) and sum(cfg["dataset-caps"].values()) == 100_000
    assert {d["adapter"] for d in cfg["datasets"]} == set(MIX)  # every adapter is used
    share = sum(cfg["dataset-caps"][d["name"]] * d["thinking-ratio"] for d in cfg["datasets"]) / 100_000
    assert round(share, 2) == 0.64  # the share train_plan_v4.md states


def test_plan_calculator_runs_on_pipeline_outputs(kimi_chain, tmp_path):
    """train_plan_v4.md's calculator (scripts/plan_v4_calc.py), run as the plan runs it, on the end-to-end
    work dir."""
    import subprocess
    import sys

    repo = REPO
    script = repo / "scripts" / "plan_v4_calc.py"
    assert "python scripts/plan_v4_calc.py --work-dir" in (repo / "train_plan_v4.md").read_text()
    work, _ = kimi_chain
    out = subprocess.run([sys.executable, str(script), "--work-dir", str(work), "--config",
                          str(REPO / "configs" / "datasets_v4.yaml"),
                          "--decode-tok-s", "3000", "--prefill-tok-s", "30000", "--train-tok-s", "4000",
                          "--kv-tokens", "200000"],
                         capture_output=True, text=True, check=True).stdout
    assert "| swe_rebench | 10,000 |" in out and "| **total** | 99,000 |" in out
    assert "57,353 B/token" in out and "generation:" in out and "training: 10 epochs" in out
    assert "server capacity: 200,000 KV tokens" in out and "of --concurrency 160 run at once" in out


def test_plan_capacity_arithmetic():
    """Section 2.4's requests-at-once come from the calculator's rule on the projection's totals (280.3 M
    prefill and 127.4 M decode tokens over 110,000 records): ~59 of 160 at a 185K-token pool, and a pool
    larger than C's needs runs all of C."""
    import importlib.util

    repo = REPO
    spec = importlib.util.spec_from_file_location("plan_v4_calc", repo / "scripts" / "plan_v4_calc.py")
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    tot = {"pre": 280.3e6, "dec": 127.4e6, "records": 110_000}
    assert "3,127 tokens held per request = about 59 of --concurrency 160 run at once, 101 queue" in \
        calc.running_line(tot, 185_000, 160)
    assert "about 160 of --concurrency 160 run at once, 0 queue" in calc.running_line(tot, 1e6, 160)
    assert "p + r/2 = **3,127**" in (repo / "train_plan_v4.md").read_text()


def test_complete_without_reasoning_is_instant_mode(scrub):
    """Kimi-K2 answers kept as they are have no reasoning: they are never rendered as `<think></think>` answers."""
    recs = run("toucan", scrub, complete=True, cut="every", **{"thinking-ratio": 1.0})[0]
    assert recs and not any(r["thinking"] for r in recs.values())
    ot = run("openthoughts", scrub, complete=True, **{"thinking-ratio": 1.0})[0]
    assert all(r["thinking"] for r in ot.values())


# ---- one rule for tool-call arguments, leading turns, episode ends, ToolACE results, repairs ----

BASH = {"type": "function", "function": {"name": "execute_bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
FINISH = {"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}}


def call(cid, name, arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def openhands_row(key, arguments='{"command": "ls"}', end_with_finish_result=True):
    """An OpenHands trajectory: two bash turns, then `finish` (and, optionally, finish's own result)."""
    traj = [{"role": "system", "content": "You are OpenHands agent."},
            {"role": "user", "content": f"Fix bug {key}"},
            {"role": "assistant", "content": "", "tool_calls": [call("c0", "execute_bash", arguments)]},
            {"role": "tool", "content": "out 0", "tool_call_id": "c0"},
            {"role": "assistant", "content": "Next.", "tool_calls": [call("c1", "execute_bash", '{"command": "pytest"}')]},
            {"role": "tool", "content": "1 passed", "tool_call_id": "c1"},
            {"role": "assistant", "content": "Done.", "tool_calls": [call("c2", "finish", "{}")]}]
    if end_with_finish_result:
        traj.append({"role": "tool", "content": "diff --git a/x b/x", "tool_call_id": "c2"})
    return {"trajectory_id": key, "resolved": True, "trajectory": json.dumps(traj), "tools": json.dumps([BASH, FINISH])}


def expand(adapter, row, scrub, **spec):
    from collections import Counter

    repairs = Counter()
    recs = expand_row(row, 0, {"name": adapter, "adapter": adapter, **spec}, scrub, repairs=repairs)
    return {r["id"].split("/", 1)[1]: r for r, _ in recs}, dict(repairs)


def test_tool_call_arguments_must_be_json_in_every_adapter(scrub):
    """A truncated JSON text or a Python-repr dict is skipped as unparseable_tool_call by every adapter
    (they used to be kept verbatim by SWE-rebench, SWE-smith and Toucan); valid text is kept as written."""
    truncated, python_repr = '{"command": "pytest -q', "{'command': 'ls'}"
    smith = [{"role": "system", "content": "s"}, {"role": "user", "content": "Fix it"},
             {"role": "assistant", "content": "", "tool_calls": [call("q", "bash", python_repr)]},
             {"role": "tool", "content": "ok", "tool_call_ids": ["q"]}]
    toucan_fc = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": truncated}},
                 {"role": "function", "name": "f", "content": "{}"}]
    toucan_sft = [{"role": "user", "content": "x"},
                  {"role": "tool_call", "content": json.dumps({"name": "f", "arguments": python_repr})},
                  {"role": "tool_response", "content": "{}"}]
    bad = [("swe_rebench", openhands_row("t", truncated)), ("swe_rebench", openhands_row("p", python_repr)),
           ("swe_rebench", openhands_row("n", '{"command": NaN}')), ("swe_rebench", openhands_row("l", "[1, 2]")),
           ("swe_smith", {"traj_id": "s", "resolved": True, "messages": json.dumps(smith)}),
           ("toucan", {"uuid": "u", "messages": json.dumps(toucan_fc)}),
           ("toucan", {"uuid": "v", "messages": json.dumps(toucan_sft)}),
           ("hermes_fc", {"id": "h", "conversations": [
               {"from": "human", "value": "q"},
               {"from": "gpt", "value": '<tool_call>{"name": "f", "arguments": "{\'a\': 1}"}</tool_call>'}]}),
           ("messages", {"id": "m", "messages": [{"role": "user", "content": "q"},
                                                 {"role": "assistant", "tool_calls": [call("k", "f", truncated)]},
                                                 {"role": "tool", "tool_call_id": "k", "content": "r"}]})]
    for adapter, row in bad:
        with pytest.raises(BadRow) as e:
            expand(adapter, row, scrub)
        assert e.value.reason == "unparseable_tool_call", (adapter, e.value)
    spaced = '{"command":   "ls -la"}'  # valid JSON text: the dataset's exact text is kept
    recs, _ = expand("swe_rebench", openhands_row("ok", spaced), scrub)
    assert recs["ok"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == spaced
    none_args = openhands_row("e", "")  # blank text means no arguments: `{}`
    assert expand("swe_rebench", none_args, scrub)[0]["e"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_leading_non_user_turns_dropped_and_counted(scrub):
    row = {"id": "split", "conversations": [{"from": "gpt", "value": "...and that is how it ends."},
                                            {"from": "system", "value": "Be brief."},
                                            {"from": "gpt", "value": "Anything else?"},
                                            {"from": "human", "value": "Yes: sort a list."},
                                            {"from": "gpt", "value": "sorted(x)"}]}
    recs, repairs = expand("sharegpt", row, scrub)
    assert recs["split"]["messages"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Yes: sort a list."}]
    assert repairs == {"leading_turns_dropped": 2} and recs["split"]["meta"]["repairs"] == repairs
    legacy = {"id": "l", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"}]}
    recs, repairs = expand("conversations", legacy, scrub)
    assert [m["role"] for m in recs["l"]["messages"]] == ["user"] and repairs == {"leading_turns_dropped": 1}
    with pytest.raises(BadRow, match="no_prompt"):  # nothing but bot turns: no prompt, nothing counted
        expand("sharegpt", {"id": "b", "conversations": [{"from": "gpt", "value": "Hello"}]}, scrub)


def test_no_cut_after_the_episode_ending_tool_result(scrub):
    recs, _ = expand("swe_rebench", openhands_row("f"), scrub)
    last = recs["f"]["messages"]  # cut at the turn that calls finish, not after finish's output
    assert last[-1] == {"role": "tool", "content": "1 passed", "tool_call_id": "functions.execute_bash:1",
                        "name": "execute_bash"} and recs["f"]["meta"]["cut_turn"] == 3
    every, _ = expand("swe_rebench", openhands_row("f"), scrub, cut="every")
    assert sorted(every) == ["f#turn1", "f#turn2", "f#turn3"]
    # Another tool's result at the end is still a turn the target is waiting for.
    open_end = openhands_row("g")
    traj = json.loads(open_end["trajectory"])[:6]
    open_end["trajectory"] = json.dumps(traj)
    assert sorted(expand("swe_rebench", open_end, scrub, cut="every")[0]) == ["g#turn1", "g#turn2", "g#turn3"]
    assert len(expand("swe_rebench", open_end, scrub)[0]["g"]["messages"]) == 6
    # SWE-smith ends with `submit`; a trajectory with nothing but the finished episode has no cut left.
    msgs = [{"role": "assistant", "content": "", "tool_calls": [call("s", "submit", "{}")]},
            {"role": "tool", "content": "diff", "tool_call_id": "s", "name": "submit"}]
    with pytest.raises(BadRow, match="episode_over"):
        cut_trajectory("k", msgs, "last", end_tools=frozenset({"submit"}))
    assert cut_trajectory("k", msgs, "last")[0][1] == msgs  # without the rule: the old end cut


def test_toolace_results_have_one_form(scrub):
    recs = run("toolace", scrub)[0]
    one = recs["toolace/t1"]["messages"][2]  # one call: its own object, like each of two calls
    two = recs["toolace/00000000"]["messages"][2:4]
    assert json.loads(one["content"]) == {"name": "Market Trends API", "results": {"top": ["ZZZ"]}}
    assert [json.loads(m["content"])["name"] for m in two] == ["Market Trends API", "get_time"]


def test_reasons_kept_apart_and_fallbacks_counted(scrub):
    cases = [({"id": "a"}, "missing_messages"), ({"id": "b", "messages": []}, "empty_messages"),
             ({"id": "c", "messages": {"role": "user"}}, "bad_field_type"),
             ({"id": "d", "messages": [{"role": "user"}]}, "missing_user_content"),
             ({"id": "e", "messages": [{"role": "user", "content": " "}]}, "empty_user_message"),
             ({"id": "f", "messages": [{"content": "x"}]}, "missing_role")]
    for row, reason in cases:
        with pytest.raises(BadRow) as e:
            expand("messages", row, scrub)
        assert e.value.reason == reason, row
    for row, reason in [({"id": "g"}, "missing_conversations"), ({"id": "h", "conversations": []}, "empty_conversations"),
                        ({"id": "i", "conversations": "{}"}, "bad_field_type"),
                        ({"id": "j", "conversations": [{"from": "human"}]}, "missing_turn_value"),
                        ({"id": "k", "conversations": [{"from": "human", "value": 3}]}, "bad_field_type")]:
        with pytest.raises(BadRow) as e:
            expand("sharegpt", row, scrub)
        assert e.value.reason == reason, row
    recs, repairs = expand("ultrachat", {"prompt_id": "uc", "prompt": "Explain tuples.", "messages": []}, scrub)
    assert recs["uc"]["messages"] == [{"role": "user", "content": "Explain tuples."}]
    assert repairs == {"prompt_field_fallback": 1}
    h0 = json.loads((FIX / "hermes_fc.jsonl").read_text().splitlines()[0])  # a Python-dict call envelope
    assert expand("hermes_fc", h0, scrub)[1] == {"python_literal_tool_calls": 1}
