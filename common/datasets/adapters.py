"""Dataset adapters: one small function per dataset family, turning a raw row into unified messages.

An adapter takes `(row: dict, index: int)` and returns `(key, messages, tools, meta)`, or raises
`BadRow(reason)` so that 01 can skip the row and count the reason. Adapters only map fields; what is
common to every family (dropping turns before the first user turn, cutting to a prompt, tool-call id
rewriting, special-token scrubbing, validation) happens in `common.datasets.mix.expand_row` / `finish_record()`.
Families (schemas: docs/design.md section 8):
  messages       {"id"|"prompt_id"|"uuid"|..., "messages": [OpenAI messages] (list or JSON text),
                  "tools"?: [OpenAI tool schemas] (list or JSON text)}   (ultrachat, SWE traces, demo)
  conversations  {"id"?, "system"?, "conversations": [{"from": human|gpt|system|tool|..., "value"}]}
                  (ShareGPT, perfectblend, OpenThoughts)
  instruction    {"instruction"|"problem"|"input", "input"?, "output"|"response"|"solution"?}
                  (Magicoder, opc-sft, OpenCodeInstruct)
Skip reasons keep apart a field that is missing (`missing_<field>`), present but empty
(`empty_<field>`) and of the wrong type (`bad_field_type`). A row that is used after a repair or a
fallback (turns dropped, a secondary field read) says so in `meta["repairs"]` ({what: count}); 01
adds these up per dataset in its manifest.
"""
from __future__ import annotations

import json
import re

from common.text.chat_format import normalize_tool_call_ids, scrub_messages, scrub_value

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


def add_repair(meta: dict, what: str, n: int = 1) -> dict:
    """Note in `meta["repairs"]` that the row was used after a repair or fallback (`n` times)."""
    if n:
        repairs = meta.setdefault("repairs", {})
        repairs[what] = repairs.get(what, 0) + n
    return meta


def require_field(row: dict, field: str, types, reason: str | None = None):
    """row[field], of one of `types`; BadRow `missing_<field>` (or `reason`) / `bad_field_type`."""
    value = row.get(field)
    if value is None:
        raise BadRow(reason or f"missing_{field}")
    if not isinstance(value, types):
        raise BadRow("bad_field_type", f"{field}: {type(value).__name__}")
    return value


def require_list(row: dict, field: str, json_reason: str | None = None) -> list:
    """row[field] as a non-empty list (a list, or JSON text of one). Missing, unparseable, not a list
    and empty are four reasons: `missing_<field>`, `json_reason` (default `bad_<field>_json`),
    `bad_field_type`, `empty_<field>`."""
    value = require_field(row, field, (str, list))
    if isinstance(value, str) and not value.strip():
        raise BadRow(f"empty_{field}")
    value = _maybe_json(value, json_reason or f"bad_{field}_json")
    if not isinstance(value, list):
        raise BadRow("bad_field_type", f"{field}: {type(value).__name__}")
    if not value:
        raise BadRow(f"empty_{field}")
    return value


def conversation_turns(row: dict) -> list[tuple[str, str]]:
    """`conversations` [{from, value}] (a list or JSON text) -> [(from, value)] with string values.
    BadRow: the list missing / empty / not a list (see require_list), a turn that is not an object
    (`bad_turn`), a turn without a value (`missing_turn_value`) or with a non-text one (`bad_field_type`)."""
    turns = require_list(row, "conversations")
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRow("bad_turn", str(turn)[:80])
        if turn.get("value") is None:
            raise BadRow("missing_turn_value", str(turn)[:80])
        if not isinstance(turn["value"], str):
            raise BadRow("bad_field_type", f"value: {type(turn['value']).__name__}")
    return [(str(turn.get("from", "")), turn["value"]) for turn in turns]


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


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def arguments_json(arguments) -> str:
    """Tool-call arguments as JSON object text, the one rule of every adapter (docs/formats.md).

    Text that parses as a JSON object is kept as written (the model's own text); a dict becomes JSON
    text; none (None or blank text) is `{}`. Anything else - a truncated `{"command": "pytest -q`, a
    Python-repr dict, NaN, a list or a number - is BadRow `unparseable_tool_call`: the target would
    see, and the draft learn, a call no parser accepts.
    """
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return "{}"
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments, parse_constant=_reject_constant)
        except ValueError:  # JSONDecodeError, NaN / Infinity
            raise BadRow("unparseable_tool_call", arguments[:80]) from None
        if not isinstance(value, dict):
            raise BadRow("unparseable_tool_call", f"arguments are a JSON {type(value).__name__}, not an object")
        return arguments
    if not isinstance(arguments, dict):
        raise BadRow("unparseable_tool_call", f"arguments of type {type(arguments).__name__}")
    try:  # values parsed from Python literals may be sets, bytes or NaN: not JSON
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BadRow("unparseable_tool_call", str(e)) from None


def _tool_call(call) -> dict:
    call = _maybe_json(call, "bad_tool_call_json")
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not fn.get("name"):
        raise BadRow("bad_tool_call", str(call)[:80])
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments_json(fn.get("arguments"))}}


def clean_message(msg: dict) -> dict:
    """Keep only the unified fields of one OpenAI-style message."""
    role = msg.get("role")
    if role is None:
        raise BadRow("missing_role")
    if role not in ROLES:
        raise BadRow("unknown_role", str(role))
    if role == "user" and msg.get("content") is None:
        raise BadRow("missing_user_content")  # (an empty one is `empty_user_message`)
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
    messages = require_list(row, "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRow("bad_message", "a message is not an object")
    messages = [clean_message(_drop_none(m)) for m in messages]
    meta = {k: row[k] for k in ("category", "language", "repo", "instance_id") if row.get(k) is not None}
    return row_key(row, index), messages, _tools(row.get("tools")), meta


def adapt_conversations(row: dict, index: int):
    turns = conversation_turns(row)
    messages = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    dropped = 0
    for speaker, text in turns:
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            dropped += 1
            continue
        if role == "tool":
            raise BadRow("unsupported_tool_format")  # ShareGPT tool turns carry no call ids
        messages.append({"role": role, "content": text})
    return row_key(row, index), messages, None, add_repair({}, "unknown_speaker_turns_dropped", dropped)


INSTRUCTION_FIELDS = ("instruction", "problem", "question", "prompt")


def adapt_instruction(row: dict, index: int):
    field = next((f for f in INSTRUCTION_FIELDS if isinstance(row.get(f), str) and row[f].strip()), None)
    if field is None:
        # OpenCodeInstruct keeps the task in `input` alone.
        if not (isinstance(row.get("input"), str) and row["input"].strip()):
            present = [row[f] for f in INSTRUCTION_FIELDS + ("input",) if row.get(f) is not None]
            if not present:
                raise BadRow("missing_instruction")
            raise BadRow("bad_field_type" if any(not isinstance(v, str) for v in present) else "empty_instruction")
        text = row["input"]
    else:
        text = row[field]
        if isinstance(row.get("input"), str) and row["input"].strip():
            text = f"{text}\n\n{row['input']}"
    # The original answer (output/response/solution) is not the target's: it is dropped here.
    return row_key(row, index), [{"role": "user", "content": text}], None, {}


def drop_leading_turns(messages: list[dict]) -> tuple[list[dict], int]:
    """Drop the assistant and tool turns before the first user turn (system turns stay); returns
    (messages, number dropped). Split conversations (ShareGPT) often open with the bot's turn, a
    prompt the target never sees in service. No user turn at all drops nothing (the row is no prompt)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return messages, 0
    kept = [m for m in messages[:first] if m["role"] == "system"] + messages[first:]
    return kept, len(messages) - len(kept)


def finish_record(key: str, messages: list[dict], tools: list[dict] | None, meta: dict, source: str,
                  scrub: re.Pattern, thinking: bool, complete: bool = False,
                  kimi_tool_ids: bool = True) -> tuple[dict, int]:
    """The family-independent half of 01's work on a row: an adapter's output -> record and scrub count.
    `kimi_tool_ids`: rewrite tool-call ids to Kimi's form (only for a Kimi-format target)."""
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
        messages = normalize_tool_call_ids(messages, kimi_ids=kimi_tool_ids)
    except ValueError as e:
        raise BadRow("unknown_tool_call_id", str(e)) from None
    messages, n_scrubbed = scrub_messages(messages, scrub)
    if tools:
        tools, n = scrub_value(tools, scrub)
        n_scrubbed += n
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
