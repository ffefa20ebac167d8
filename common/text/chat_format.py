"""Kimi-K2.5 text format: prompts through the target's chat template, completions as the target emits them.

Why two halves: the K2.5 template renders every assistant turn up to the last one without tool calls
with an empty `<think></think>` (reasoning dropped), so rendering a whole conversation does NOT give
the text the model produced for its final turn. The training text of a sample is therefore
`render_prompt(history)` (ending in the generation prompt `...<|im_middle|><think>`) followed by
`render_completion(final assistant turn)` (`reasoning</think>content[tool calls]<|im_end|>`), which
is exactly what the model emits after that prompt (docs/design.md section 6).
"""
from __future__ import annotations

import json
import re

IM_END = "<|im_end|>"
THINK_END = "</think>"
TOOL_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARG = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
TOOL_CALL_ID = re.compile(r"^functions\.(?P<name>[\w.\-]+):(?P<index>\d+)$")


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                  thinking: bool = True) -> str:
    """The target's own rendering of `messages` plus the generation prompt.

    Ends with `<|im_assistant|>assistant<|im_middle|><think>` (thinking) or `...<think></think>`.
    """
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                         tokenize=False, thinking=thinking)


def _arguments_text(arguments) -> str:
    # The template writes string arguments verbatim and dicts with tojson; keep the model's text.
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def render_tool_calls(tool_calls: list[dict]) -> str:
    parts = [TOOL_SECTION_BEGIN]
    for call in tool_calls:
        parts += [TOOL_CALL_BEGIN, call["id"], TOOL_CALL_ARG,
                  _arguments_text(call["function"]["arguments"]), TOOL_CALL_END]
    parts.append(TOOL_SECTION_END)
    return "".join(parts)


def render_completion(message: dict, thinking: bool = True) -> str:
    """The text the target generates for assistant `message` after `render_prompt(..., thinking)`.

    With thinking on the prompt already holds `<think>`, so the completion starts with the reasoning.
    """
    assert message["role"] == "assistant", message["role"]
    text = ((message.get("reasoning_content") or "") + THINK_END) if thinking else ""
    text += message.get("content") or ""
    if message.get("tool_calls"):
        text += render_tool_calls(message["tool_calls"])
    return text + IM_END


def normalize_tool_call_ids(messages: list[dict], kimi_ids: bool = True) -> list[dict]:
    """Rewrite tool-call ids to Kimi's `functions.NAME:IDX` (IDX counts calls over the whole
    conversation) and point each tool message's `tool_call_id` at the new id. With `kimi_ids=False`
    (a target of another format, common/text/target_format.py) the dataset's ids are kept and only a
    missing one becomes `call_IDX`.

    Raises ValueError when a tool message answers an id that no earlier call made.
    """
    out, renamed, count = [], {}, 0
    for msg in messages:
        msg = dict(msg)
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                name = call["function"]["name"]
                new_id = f"functions.{name}:{count}" if kimi_ids else (call.get("id") or f"call_{count}")
                count += 1
                if call.get("id") is not None:
                    renamed[call["id"]] = new_id
                renamed.setdefault(new_id, new_id)
                calls.append({**call, "id": new_id, "type": "function"})
            msg["tool_calls"] = calls
        elif msg["role"] == "tool":
            old = msg.get("tool_call_id")
            if old not in renamed:
                raise ValueError(f"tool message answers unknown tool_call_id {old!r}")
            msg["tool_call_id"] = renamed[old]
        out.append(msg)
    return out


def special_token_pattern(tokenizer) -> re.Pattern:
    """A regex matching every special-token string of `tokenizer` (longest first)."""
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def scrub_text(text: str, pattern: re.Pattern) -> tuple[str, int]:
    """Remove literal special-token strings from dataset text (they would become control tokens).

    Repeated until none is left: deleting one can join the pieces of another, so a single pass turns
    `<|im_<|im_end|>end|>` into a real `<|im_end|>` inside user text.
    """
    removed = 0
    while True:
        text, n = pattern.subn("", text)
        if not n:
            return text, removed
        removed += n


def scrub_value(value, pattern: re.Pattern):
    """Scrub every string inside a JSON-like value (dict keys and values, list items); returns
    (value, removed). Tool schemas go through this: their names, descriptions and enums are rendered."""
    if isinstance(value, str):
        return scrub_text(value, pattern)
    if isinstance(value, list):
        items = [scrub_value(v, pattern) for v in value]
        return [v for v, _ in items], sum(n for _, n in items)
    if isinstance(value, dict):
        out, removed = {}, 0
        for k, v in value.items():
            k, n_key = scrub_text(k, pattern) if isinstance(k, str) else (k, 0)
            out[k], n = scrub_value(v, pattern)
            removed += n_key + n
        return out, removed
    return value, 0


def scrub_messages(messages: list[dict], pattern: re.Pattern) -> tuple[list[dict], int]:
    """Scrub every text field of all messages (content, reasoning, names, tool-call names, ids and
    arguments); returns (messages, removed). A tool-call id and the `tool_call_id` answering it are
    the same string, so they stay equal."""
    removed, out = 0, []
    for msg in messages:
        msg, n = scrub_value(msg, pattern)
        out.append(msg)
        removed += n
    return out, removed
