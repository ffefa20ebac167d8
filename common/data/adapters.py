"""Dataset adapters: one small function per dataset family, turning a raw row into unified messages.

An adapter takes `(row: dict, index: int)` and returns `(key, messages, tools, meta)`, or raises
`BadRow(reason)` so that 01 can skip the row and count the reason. Adapters only map fields; what is
common to every family (cutting to a prompt, tool-call id rewriting, special-token scrubbing,
validation) happens in `unify()`. Families (schemas: research/kimi_and_datasets.md Part B):
  messages       {"id"|"prompt_id"|"uuid"|..., "messages": [OpenAI messages] (list or JSON text),
                  "tools"?: [OpenAI tool schemas] (list or JSON text)}   (ultrachat, SWE traces, demo)
  conversations  {"id"?, "system"?, "conversations": [{"from": human|gpt|system|tool|..., "value"}]}
                  (ShareGPT, perfectblend, OpenThoughts)
  instruction    {"instruction"|"problem"|"input", "input"?, "output"|"response"|"solution"?}
                  (Magicoder, opc-sft, OpenCodeInstruct)
"""
from __future__ import annotations

import json
import re

from common.data.chat_format import normalize_tool_call_ids, scrub_messages

ROLES = ("system", "user", "assistant", "tool")
ID_FIELDS = ("id", "prompt_id", "uuid", "trajectory_id", "conversation_id")
# ShareGPT speakers (SpecForge's mapping); anything else is dropped as an unknown role.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool", "observation": "tool"}


class BadRow(ValueError):
    """A row that cannot become a record; `reason` is a short counter key for the manifest."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _maybe_json(value, reason: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(reason, str(e)) from None
    return value


def _drop_none(obj):
    """Remove None-valued keys recursively. Arrow-backed rows (parquet, hub datasets) unify nested
    struct fields across rows and fill the missing ones with None; those keys were never in the data."""
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def row_key(row: dict, index: int) -> str:
    for field in ID_FIELDS:
        if row.get(field) not in (None, ""):
            return str(row[field])
    return f"{index:08d}"


def _content_text(content) -> str:
    """Content as text: a string, or OpenAI content parts of which only text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (None, "text"):
                raise BadRow("non_text_content", str(part)[:80])
            parts.append(part.get("text") or "")
        return "".join(parts)
    raise BadRow("bad_content", type(content).__name__)


def _tool_call(call) -> dict:
    call = _maybe_json(call, "bad_tool_call_json")
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise BadRow("bad_tool_call", str(call)[:80])
    args = fn.get("arguments")
    # Keep argument text as written (the model's own text); structured arguments become JSON text.
    args = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def clean_message(msg: dict) -> dict:
    """Keep only the unified fields of one OpenAI-style message."""
    role = msg.get("role")
    if role not in ROLES:
        raise BadRow("unknown_role", str(role))
    out = {"role": role, "content": _content_text(msg.get("content"))}
    if role == "assistant":
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            out["reasoning_content"] = str(reasoning)
        if msg.get("tool_calls"):
            out["tool_calls"] = [_tool_call(c) for c in msg["tool_calls"]]
    if role == "tool":
        if msg.get("tool_call_id") is None:
            raise BadRow("tool_message_without_id")
        out["tool_call_id"] = str(msg["tool_call_id"])
    if msg.get("name") and role == "tool":
        out["name"] = str(msg["name"])
    return out


def _tools(value) -> list[dict] | None:
    tools = _maybe_json(value, "bad_tools_json")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRow("bad_tools", type(tools).__name__)
    out = []
    for tool in tools:
        tool = _drop_none(_maybe_json(tool, "bad_tools_json"))
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}  # flat {name, description, parameters}
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise BadRow("bad_tools", str(tool)[:80])
        out.append(tool)
    return out


def adapt_messages(row: dict, index: int):
    messages = _maybe_json(row.get("messages"), "bad_messages_json")
    if not isinstance(messages, list) or not messages:
        raise BadRow("no_messages")
    messages = [clean_message(_drop_none(m)) for m in messages]
    meta = {k: row[k] for k in ("category", "language", "repo", "instance_id") if row.get(k) is not None}
    return row_key(row, index), messages, _tools(row.get("tools")), meta


def adapt_conversations(row: dict, index: int):
    turns = _maybe_json(row.get("conversations"), "bad_conversations_json")
    if not isinstance(turns, list) or not turns:
        raise BadRow("no_messages")
    messages = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    dropped = 0
    for turn in turns:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            dropped += 1
            continue
        if role == "tool":
            raise BadRow("unsupported_tool_format")  # ShareGPT tool turns carry no call ids
        messages.append({"role": role, "content": _content_text(turn.get("value"))})
    return row_key(row, index), messages, None, {"dropped_turns": dropped} if dropped else {}


INSTRUCTION_FIELDS = ("instruction", "problem", "question", "prompt")


def adapt_instruction(row: dict, index: int):
    field = next((f for f in INSTRUCTION_FIELDS if isinstance(row.get(f), str) and row[f].strip()), None)
    if field is None:
        # OpenCodeInstruct keeps the task in `input` alone.
        if not (isinstance(row.get("input"), str) and row["input"].strip()):
            raise BadRow("no_instruction")
        text = row["input"]
    else:
        text = row[field]
        if isinstance(row.get("input"), str) and row["input"].strip():
            text = f"{text}\n\n{row['input']}"
    # The original answer (output/response/solution) is not the target's: it is dropped here.
    return row_key(row, index), [{"role": "user", "content": text}], None, {}


ADAPTERS = {"messages": adapt_messages, "conversations": adapt_conversations,
            "instruction": adapt_instruction}


def unify(row: dict, index: int, adapter: str, source: str, scrub: re.Pattern, thinking: bool,
          complete: bool = False) -> tuple[dict, int]:
    """Raw row -> unified record (docs/formats.md) and the number of special-token strings scrubbed.

    Prompt-only (`complete=False`): trailing assistant turns (not written by the target) are cut so
    the record ends with a user or tool message. `complete=True` keeps a final assistant turn (data
    the target itself wrote) and requires it.
    """
    key, messages, tools, meta = ADAPTERS[adapter](row, index)
    return finish_record(key, messages, tools, meta, source, scrub, thinking, complete)


def finish_record(key: str, messages: list[dict], tools: list[dict] | None, meta: dict, source: str,
                  scrub: re.Pattern, thinking: bool, complete: bool = False) -> tuple[dict, int]:
    """The family-independent half of `unify`: an adapter's output -> record and scrub count."""
    if not complete:
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            raise BadRow("no_prompt")
    elif messages[-1]["role"] != "assistant":
        raise BadRow("no_final_assistant")
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise BadRow("no_prompt")
    try:
        messages = normalize_tool_call_ids(messages)
    except ValueError as e:
        raise BadRow("unknown_tool_call_id", str(e)) from None
    messages, n_scrubbed = scrub_messages(messages, scrub)
    if tools:
        text, n = scrub.subn("", json.dumps(tools, ensure_ascii=False))
        tools, n_scrubbed = json.loads(text), n_scrubbed + n
    for msg in messages:
        if msg["role"] == "user" and not msg["content"].strip():
            raise BadRow("empty_user_message")
    last = messages[-1]
    if complete and not (last["content"].strip() or last.get("tool_calls") or last.get("reasoning_content")):
        raise BadRow("empty_final_assistant")
    record = {"id": f"{source}/{key}", "source": source, "messages": messages}
    if tools:
        record["tools"] = tools
    record.update(thinking=thinking, complete=complete, meta=meta)
    return record, n_scrubbed
