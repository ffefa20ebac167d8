"""Kimi-K2.5's tokenizer offline: ids, special table, template renders and TS tool declarations.

Golden values come from K2.5's own tokenizer (assets/kimi_k25/verification.txt) and from
13 schema -> declaration pairs produced by K2.5's tool_declaration_ts.py (assets/kimi_k25/).
"""
import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from common.text import chat_format as cf
from common.text.kimi_tokenizer import (ASSET_DIR, MAX_ENCODE_CHARS, SPECIAL_TOKEN_NAMES, TIKTOKEN_SHA256,
                                   KimiK25Tokenizer, encode_pieces, load_kimi_k25_tokenizer,
                                   may_have_long_run, split_run_lengths, write_kimi_k25_model_dir)
from common.text.kimi_tool_declaration import encode_tools_to_typescript
from common.stage import tokenizer_identity
from common.text.tokenizer import load_tokenizer, tokenizer_kind

FIXTURES = ASSET_DIR / "tool_declaration_fixtures"
FIXTURE_NAMES = sorted(p.stem for p in (FIXTURES / "schemas").glob("*.json"))
TOOLS = json.loads((FIXTURES / "schemas" / "01_simple_string.json").read_text(encoding="utf-8"))
TS_ECHO = (FIXTURES / "expected" / "01_simple_string.txt").read_text(encoding="utf-8")
CALL = {"id": "functions.echo:0", "type": "function", "function": {"name": "echo", "arguments": '{"text": "ping"}'}}
USER1 = {"role": "user", "content": "Echo 'ping' for me."}
TOOL_RESULT = {"role": "tool", "tool_call_id": "functions.echo:0", "name": "echo", "content": "ping"}
ANSWER = {"role": "assistant", "content": "The tool returned: ping"}
USER2 = {"role": "user", "content": "Thanks! Now say hi."}

# assets/kimi_k25/verification.txt, case A (110 ids).
CASE_A_IDS = [
    163594, 20960, 35556, 677, 163601, 2, 30391, 382, 798, 8271, 198, 6370, 8271, 440, 408, 65003, 261, 2204,
    1636, 308, 276, 25575, 341, 2217, 7814, 327, 9600, 25, 440, 220, 2913, 25, 2204, 198, 9483, 1318, 1178,
    303, 896, 163586, 163587, 2482, 163601, 101070, 542, 15203, 6, 395, 1019, 13, 163586, 163588, 69702,
    163601, 163606, 163607, 163595, 163597, 41937, 128527, 25, 15, 163598, 8264, 3501, 1289, 414, 15203,
    16934, 163599, 163596, 163586, 163594, 10884, 163601, 798, 6014, 318, 8271, 128527, 25, 15, 198, 15203,
    163586, 163588, 69702, 163601, 163606, 163607, 1008, 4453, 8835, 25, 47716, 163586, 163587, 2482,
    163601, 14658, 0, 7737, 3637, 20910, 13, 163586, 163588, 69702, 163601, 163606]
DECLARE_TS = "<|im_system|>tool_declare<|im_middle|>" + TS_ECHO + "<|im_end|>"
DECLARE_JSON = ('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"echo","description":'
                '"Echo a string back to the caller.","parameters":{"type":"object","properties":{"text":'
                '{"type":"string"}},"required":["text"]}}}]<|im_end|>')
TURN1 = "<|im_user|>user<|im_middle|>Echo 'ping' for me.<|im_end|>"
CALL_TEXT = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0<|tool_call_argument_begin|>'
             '{"text": "ping"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
RESULT_TEXT = "<|im_system|>echo<|im_middle|>## Return of functions.echo:0\nping<|im_end|>"
ANSWER_TEXT = "<|im_assistant|>assistant<|im_middle|><think></think>The tool returned: ping<|im_end|>"
TURN2 = "<|im_user|>user<|im_middle|>Thanks! Now say hi.<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
CASE_A = (DECLARE_TS + TURN1 + GEN + "<think></think>" + CALL_TEXT + RESULT_TEXT + ANSWER_TEXT + TURN2
          + GEN + "<think>")
CASE_B = (DECLARE_TS + TURN1 + GEN + "<think>User wants echo; call the tool.</think>" + CALL_TEXT + RESULT_TEXT
          + GEN + "<think>")
CASE_C = DECLARE_JSON + TURN1 + GEN + "<think></think>" + CALL_TEXT + RESULT_TEXT + ANSWER_TEXT
CASE_D = CASE_A[:-len("<think>")] + "<think></think>"


@pytest.fixture(scope="module")
def tok():
    return load_kimi_k25_tokenizer()


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_shipped_tiktoken_model_is_kimis():
    digest = hashlib.sha256((ASSET_DIR / "tiktoken.model").read_bytes()).hexdigest()
    assert digest == TIKTOKEN_SHA256


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tool_declaration_fixture_byte_for_byte(name):
    schema = json.loads((FIXTURES / "schemas" / f"{name}.json").read_text(encoding="utf-8"))
    expected = (FIXTURES / "expected" / f"{name}.txt").read_bytes()
    assert encode_tools_to_typescript(schema).encode("utf-8") == expected


def test_all_thirteen_fixtures_present():
    assert len(FIXTURE_NAMES) == 13
    assert sorted(p.stem for p in (FIXTURES / "expected").glob("*.txt")) == FIXTURE_NAMES


def test_tool_declaration_rules_beyond_fixtures():
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"b": {"type": "string", "maxLength": 5, "default": "x"},
                       "a": {"type": "array", "items": {"type": "integer", "description": "n"}, "minItems": 1},
                       "c": {"type": "boolean"}},
        "required": ["c"]}}}, {"type": "_plugin"}]
    assert encode_tools_to_typescript(tools) == (
        "# Tools\n\n## functions\nnamespace functions {\n// d\ntype f = (_: {\n  c: boolean,\n"
        "  // minItems: 1\n  a?: Array<\n    // n\n    number\n  >,\n"
        '  // maxLength: 5\n  // Default: "x"\n  b?: string,\n  [k: string]: never\n}) => any;\n}\n')
    assert encode_tools_to_typescript([]) == "" and encode_tools_to_typescript([{"type": "_plugin"}]) == ""
    with pytest.raises(ValueError):
        encode_tools_to_typescript([{"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}}])


def test_special_ids_match_table(tok):
    assert len(tok) == 163840 and tok.vocab_size == 163840
    for i, name in SPECIAL_TOKEN_NAMES.items():
        assert tok.convert_tokens_to_ids(name) == i, name
        assert ids_of(tok, name) == [i], name
        assert tok.decode([i]) == name
    # Unnamed slots are reserved tokens with their id in the name.
    assert ids_of(tok, "<|reserved_token_163589|>") == [163589]
    assert tok.convert_ids_to_tokens(163600) == "<|reserved_token_163600|>"
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("[EOS]", 163585, "[PAD]", 163839)
    assert {163586, 163601, 163606, 163607} <= set(tok.all_special_ids)
    assert all(t.special for t in tok.added_tokens_decoder.values()) and len(tok.added_tokens_decoder) == 256


def test_reference_ids(tok):
    assert ids_of(tok, "<|im_user|>user<|im_middle|>hi<|im_end|>") == [163587, 2482, 163601, 9663, 163586]
    text = "Hello, world! 你好，世界！ It's 2025-07-15; x=12345."
    expected = [19180, 11, 2695, 0, 220, 33845, 378, 2243, 856, 8629, 220, 2975, 20, 12, 5435, 12, 1308, 26,
                1288, 28, 6694, 2899, 13]
    assert ids_of(tok, text) == expected
    assert tok([text, "<|im_user|>user<|im_middle|>hi<|im_end|>"], add_special_tokens=False)["input_ids"] == [
        expected, [163587, 2482, 163601, 9663, 163586]]
    # transformers' generic path (split on added tokens, then _tokenize) gives the same ids.
    assert tok.convert_tokens_to_ids(tok.tokenize(text + "<think>")) == expected + [163606]
    assert tok(text, add_special_tokens=True)["input_ids"] == expected  # Kimi adds no BOS/EOS


def test_case_a_render_and_ids(tok):
    msgs = [USER1, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_RESULT, ANSWER, USER2]
    text = cf.render_prompt(tok, msgs, tools=TOOLS)
    assert text == CASE_A
    assert ids_of(tok, text) == CASE_A_IDS
    assert tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=False) == CASE_A_IDS
    assert tok.decode(CASE_A_IDS, skip_special_tokens=False) == CASE_A


def test_case_b_c_d_renders(tok):
    from transformers import PreTrainedTokenizer

    msgs_b = [USER1, {"role": "assistant", "content": "", "reasoning_content": "User wants echo; call the tool.",
                      "tool_calls": [CALL]}, TOOL_RESULT]
    msgs_a = [USER1, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_RESULT, ANSWER, USER2]
    rendered = {
        "B": cf.render_prompt(tok, msgs_b, tools=TOOLS),
        # Case C is the template's own JSON fallback (no tools_ts_str): transformers' plain render.
        "C": PreTrainedTokenizer.apply_chat_template(tok, msgs_a[:4], tools=TOOLS, tokenize=False,
                                                     add_generation_prompt=False),
        "D": cf.render_prompt(tok, msgs_a, tools=TOOLS, thinking=False),
    }
    for case, expected, num_ids in (("B", CASE_B, 97), ("C", CASE_C, 105), ("D", CASE_D, 111)):
        assert rendered[case] == expected, case
        ids = ids_of(tok, expected)
        assert len(ids) == num_ids and tok.decode(ids) == expected, case
    # B's ids are A's up to the first tool result, then the generation prompt.
    assert ids_of(tok, CASE_B)[-4:] == [163588, 69702, 163601, 163606]
    assert ids_of(tok, CASE_D) == CASE_A_IDS + [163607]  # D = A ending in <think></think>


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_declarations_reach_the_template(tok, name):
    schema = json.loads((FIXTURES / "schemas" / f"{name}.json").read_text(encoding="utf-8"))
    expected = (FIXTURES / "expected" / f"{name}.txt").read_text(encoding="utf-8")
    text = cf.render_prompt(tok, [{"role": "user", "content": "hi"}], tools=schema)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + expected + "<|im_end|><|im_user|>")


def test_unsupported_schema_falls_back_to_sorted_json(tok):
    tools = [{"type": "function", "function": {"parameters": {"type": "object", "properties": {
        "x": {"type": ["string", "date"]}}}, "name": "h"}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    # K2.5 sorts tool keys before rendering; the JSON fallback shows it.
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"h","parameters":'
                           '{"properties":{"x":{"type":["string","date"]}},"type":"object"}},"type":"function"}]')


def reference_split(s: str, max_run: int) -> list[str]:
    """Kimi's run splitter, written out plainly."""
    out, start, count, prev = [], 0, 0, None
    for i, ch in enumerate(s):
        if prev is not None and ch.isspace() == prev:
            count += 1
            if count > max_run:
                out.append(s[start:i])
                start, count = i, 1
        else:
            count = 1
        prev = ch.isspace()
    out.append(s[start:])
    return out


def test_long_run_split_matches_kimis_cut_points(tok):
    rng = random.Random(0)
    for _ in range(300):
        s = "".join(rng.choice("ab \n\t\u3000x") for _ in range(rng.randint(0, 40)))
        assert split_run_lengths(s, 3) == reference_split(s, 3), repr(s)
        for k in range(1, 7):  # the shortcut never misses a long run
            assert may_have_long_run(s, k) or reference_split(s, k) == [s], (s, k)
    assert split_run_lengths("y" * 25_001) == ["y" * 25_000, "y"]
    long_text = "a" * 30_000 + " " * 26_000 + "end"
    pieces = encode_pieces(long_text)
    assert [len(p) for p in pieces] == [25_000, 30_000, 1_003] == [len(p) for p in reference_split(long_text, 25_000)]
    assert ids_of(tok, long_text) == [i for p in pieces for i in tok._tiktoken.encode(p, allowed_special="all")]
    assert len(encode_pieces("word " * (MAX_ENCODE_CHARS // 5 + 2))) == 2  # cut at 400k chars


def test_decode_round_trip(tok):
    texts = ["Hello, world! 你好，世界！ It's 2025-07-15; x=12345.", CASE_A, "tabs\t\tand\r\nCRLF  ", "emoji 🙂🚀",
             "<think>r</think>x<|reserved_token_163700|>"]
    batch = tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    assert tok.decode(batch) == texts
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(batch[3])) == texts[3]
    assert tok.decode(ids_of(tok, "a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_scrub_pattern_covers_all_kimi_controls(tok):
    pat = cf.special_token_pattern(tok)
    text, n = cf.scrub_text("a<|im_end|>b<|tool_call_begin|>c<|reserved_token_163700|>d</think>", pat)
    assert (text, n) == ("abcd", 4)


def test_model_dir_loading_and_identity(tmp_path):
    d = write_kimi_k25_model_dir(tmp_path / "kimi")
    assert tokenizer_kind(d) == "kimi_tiktoken"
    loaded = load_tokenizer(d)
    assert isinstance(loaded, KimiK25Tokenizer)
    assert cf.render_prompt(loaded, [USER1, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                     TOOL_RESULT, ANSWER, USER2], tools=TOOLS) == CASE_A
    ident = tokenizer_identity(d)
    assert {"tiktoken.model", "tokenizer_config.json", "chat_template.jinja"} <= set(ident["files"])
    assert tokenizer_identity(write_kimi_k25_model_dir(tmp_path / "again"))["sha256"] == ident["sha256"]
    # A folder that ships tokenizer code or a tokenizer.json is loaded through it, never through ours.
    (d / "tokenizer.json").write_text("{}")
    assert tokenizer_kind(d) == "auto"
    (d / "tokenizer.json").unlink()
    (d / "tokenization_kimi.py").write_text("# the model's own code\n")
    assert tokenizer_kind(d) == "auto"
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenization_kimi.py").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert tokenizer_kind(d) == "auto"


REAL_DIR = os.environ.get("KIMI_K25_MODEL_DIR")


@pytest.mark.skipif(not REAL_DIR, reason="set KIMI_K25_MODEL_DIR to a real Kimi-K2.5 folder (with its own "
                    "tokenization_kimi.py) to compare it with the offline tokenizer; no hub access here")
def test_model_folder_code_gives_same_ids():
    real_dir = Path(REAL_DIR)
    assert tokenizer_kind(real_dir) == "auto"
    real = load_tokenizer(real_dir)
    ours = load_kimi_k25_tokenizer()
    assert not isinstance(real, KimiK25Tokenizer)
    msgs = [USER1, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_RESULT, ANSWER, USER2]
    for name in FIXTURE_NAMES:
        schema = json.loads((FIXTURES / "schemas" / f"{name}.json").read_text(encoding="utf-8"))
        for thinking in (True, False):
            texts = [cf.render_prompt(t, msgs, tools=schema, thinking=thinking) for t in (real, ours)]
            assert texts[0] == texts[1], name
            assert real.encode(texts[0], add_special_tokens=False) == ids_of(ours, texts[1]), name
    plain = "Hello, world! 你好，世界！ It's 2025-07-15; x=12345.\n\tdef f(x):\n        return x  # 🙂"
    assert real.encode(plain, add_special_tokens=False) == ids_of(ours, plain)
