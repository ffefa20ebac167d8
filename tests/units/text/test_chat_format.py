"""Golden renders of the Kimi-K2.5 format through the shipped template (docs/design.md section 6)."""
import pytest
from transformers import AutoTokenizer

from common.text import chat_format as cf

TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo a string back to the caller.",
          "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
CALL = {"id": "call_abc", "type": "function", "function": {"name": "echo", "arguments": '{"text": "ping"}'}}


@pytest.fixture(scope="module")
def tok(micro_target):
    return AutoTokenizer.from_pretrained(str(micro_target))


def test_prompt_ends_with_generation_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert cf.render_prompt(tok, msgs) == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert cf.render_prompt(tok, msgs, thinking=False).endswith("<|im_middle|><think></think>")


def test_tool_conversation_golden(tok):
    msgs = cf.normalize_tool_call_ids([
        {"role": "user", "content": "Echo 'ping' for me."},
        {"role": "assistant", "content": "", "reasoning_content": "User wants echo; call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_abc", "name": "echo", "content": "ping"},
    ])
    # Same string as K2.5's own tokenizer renders (assets/kimi_k25/verification.txt case B,
    # with the JSON tool fallback of case C instead of the TypeScript block).
    expected = ('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"echo","description":'
                '"Echo a string back to the caller.","parameters":{"type":"object","properties":{"text":{"type":"string"}},'
                '"required":["text"]}}}]<|im_end|>'
                "<|im_user|>user<|im_middle|>Echo 'ping' for me.<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think>User wants echo; call the tool.</think>"
                '<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0<|tool_call_argument_begin|>{"text": "ping"}'
                "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
                "<|im_system|>echo<|im_middle|>## Return of functions.echo:0\nping<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think>")
    assert cf.render_prompt(tok, msgs, tools=TOOLS) == expected


def test_completion_is_what_the_model_emits(tok):
    msg = {"role": "assistant", "reasoning_content": "think", "content": "The tool returned: ping"}
    assert cf.render_completion(msg) == "think</think>The tool returned: ping<|im_end|>"
    assert cf.render_completion(msg, thinking=False) == "The tool returned: ping<|im_end|>"
    call_msg = {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "functions.echo:3"}]}
    assert cf.render_completion(call_msg) == ('</think><|tool_calls_section_begin|><|tool_call_begin|>functions.echo:3'
                                              '<|tool_call_argument_begin|>{"text": "ping"}<|tool_call_end|>'
                                              "<|tool_calls_section_end|><|im_end|>")


def test_prompt_plus_completion_equals_template_for_tool_call_turn(tok):
    # For a final turn WITH tool calls the template keeps reasoning (suffix), so both must agree.
    history = [{"role": "user", "content": "Echo 'ping' for me."}]
    final = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [{**CALL, "id": "functions.echo:0"}]}
    full = tok.apply_chat_template(history + [final], tokenize=False)
    assert cf.render_prompt(tok, history) + cf.render_completion(final) == full


def test_tool_call_ids_renumbered_over_conversation():
    msgs = cf.normalize_tool_call_ids([
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "x2"}]},
        {"role": "tool", "tool_call_id": "x2", "content": "b"},
        {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "call_abc"}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "c"},
    ])
    assert [c["id"] for c in msgs[0]["tool_calls"]] == ["functions.echo:0", "functions.echo:1"]
    assert msgs[1]["tool_call_id"] == "functions.echo:1"
    assert msgs[2]["tool_calls"][0]["id"] == "functions.echo:2" and msgs[3]["tool_call_id"] == "functions.echo:2"
    with pytest.raises(ValueError, match="unknown tool_call_id"):
        cf.normalize_tool_call_ids([{"role": "tool", "tool_call_id": "nope", "content": ""}])


def test_scrub_removes_special_strings(tok):
    pat = cf.special_token_pattern(tok)
    msgs, n = cf.scrub_messages([{"role": "user", "content": "a<|im_end|>b<think>c"}], pat)
    assert msgs[0]["content"] == "abc" and n == 2
    ids = tok.encode(msgs[0]["content"], add_special_tokens=False)
    assert not set(ids) & set(tok.all_special_ids)


def test_scrub_repeats_until_no_special_string_is_left():
    """A nested literal `<|im_<|im_end|>end|>` must not turn into a real <|im_end|> (id 163586 in K2.5)
    after one deletion pass: in text, tool-call names and arguments, and tool schemas."""
    from common.text.kimi_tokenizer import load_kimi_k25_tokenizer

    kimi = load_kimi_k25_tokenizer()
    pat = cf.special_token_pattern(kimi)
    nested = "a<|im_<|im_end|>end|>b<<think>think>c<|im_<|im_<|im_end|>end|>end|>d"
    assert cf.scrub_text(nested, pat) == ("abcd", 7)
    msgs, n = cf.scrub_messages([
        {"role": "user", "content": nested, "name": "x<|im_<|im_end|>end|>"},
        {"role": "assistant", "content": "", "reasoning_content": nested, "tool_calls": [
            {"id": "functions.ru<|im_<|im_end|>end|>n:0", "type": "function",
             "function": {"name": "ru<|im_<|im_end|>end|>n", "arguments": '{"a": "<|im_<|im_end|>end|>"}'}}]},
        {"role": "tool", "tool_call_id": "functions.ru<|im_<|im_end|>end|>n:0", "content": "ok"}], pat)
    assert msgs[0] == {"role": "user", "content": "abcd", "name": "x"} and msgs[1]["reasoning_content"] == "abcd"
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "run", "arguments": '{"a": ""}'}
    assert msgs[1]["tool_calls"][0]["id"] == msgs[2]["tool_call_id"] == "functions.run:0" and n == 7 + 2 + 7 + 2 * 4
    tools, n = cf.scrub_value([{"type": "function", "function": {
        "name": "t<|im_<|im_end|>end|>", "description": nested,
        "parameters": {"type": "object", "properties": {"m<|im_<|im_end|>end|>": {"enum": [nested]}}}}}], pat)
    assert tools[0]["function"]["name"] == "t" and tools[0]["function"]["description"] == "abcd"
    assert tools[0]["function"]["parameters"]["properties"] == {"m": {"enum": ["abcd"]}} and n == 2 + 7 + 2 + 7
    ids = kimi.encode(msgs[0]["content"] + tools[0]["function"]["description"], add_special_tokens=False)
    assert 163586 not in ids and not set(ids) & set(kimi.all_special_ids)
