"""The mix's adapters for agent and function-calling datasets: native tool calls, and text-encoded calls parsed.

Each adapter is `fn(row, index, **options) -> (key, messages, tools, meta)` (the contract of
common/datasets/adapters.py) and raises `BadRow(reason)` for a broken row or `FilteredRow(reason)` for a good row
a configured filter rejects (counted apart). Messages come out as whole conversations with the
dataset's own call ids; cutting at an assistant turn, id rewriting to `functions.NAME:IDX` and
scrubbing happen later (common/datasets/mix.expand_row, common/datasets/adapters.unify). Schemas:
docs/design.md section 8 (#10-#18); a field seen in two forms (e.g. `messages` or `trajectory`) is
handled both ways.
"""
from __future__ import annotations

import ast
import json
import re

from common.datasets.adapters import (SHAREGPT_ROLES, BadRow, _content_text, _drop_none, _maybe_json, _tools,
                                  add_repair, arguments_json, clean_message, conversation_turns, require_field,
                                  require_list, row_key)


class FilteredRow(BadRow):
    """A well-formed row that a configured filter drops (resolved-only, score, language, toxicity)."""


# SWE-smith's `tool` split has no `tools` column: its calls are SWE-agent's default tool bundle
# (bash, str_replace_editor, submit), declared here so the target sees the same functions (verify
# the descriptions against SWE-agent's tools/ config of the run you use).
SWE_AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "runs the given command directly in bash",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The bash command to execute."}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "str_replace_editor",
        "description": "Custom editing tool for viewing, creating and editing files. State is persistent "
                       "across command calls and discussions with the user.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The commands to run.",
                        "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string", "description": "Absolute path to file or directory."},
            "file_text": {"type": "string", "description": "Content of the file to be created."},
            "old_str": {"type": "string", "description": "String in `path` to replace."},
            "new_str": {"type": "string", "description": "Replacement or inserted string."},
            "insert_line": {"type": "integer", "description": "Insert `new_str` after this line."},
            "view_range": {"type": "array", "items": {"type": "integer"},
                           "description": "Line range to show, e.g. [11, 12]."}},
            "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "submits the current file",
        "parameters": {"type": "object", "properties": {}}}},
]
# Python-ish / BFCL type names some datasets use in tool schemas -> JSON Schema types, so the K2.5
# TypeScript declaration reads like a real API request (K2.5 would print `dict` as is).
SCHEMA_TYPES = {"dict": "object", "float": "number", "int": "integer", "bool": "boolean", "list": "array",
                "str": "string", "tuple": "array", "any": "string", "double": "number", "long": "integer"}


def normalize_schema(schema):
    """JSON-Schema-ify a tool parameter schema in place of dataset quirks (`dict`, `float`, ...)."""
    if isinstance(schema, list):
        return [normalize_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            value = SCHEMA_TYPES.get(value.lower(), value)
        elif key == "properties" and isinstance(value, dict):
            value = {k: normalize_schema(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "$defs", "additionalProperties"):
            value = ({k: normalize_schema(v) for k, v in value.items()} if key == "$defs" and isinstance(value, dict)
                     else normalize_schema(value))
        out[key] = value
    return out


def tools_list(value) -> list[dict] | None:
    tools = _tools(value)
    if not tools:
        return None
    return [{**t, "function": {**t["function"], "parameters": normalize_schema(
        t["function"].get("parameters") or {"type": "object", "properties": {}})}} for t in tools]


def _resolved_filter(value, resolved_only: bool, allow_unknown: bool = False):
    """`resolved` is bool (rebench, smith) or -1/0/1 (Open-SWE-Traces, -1 = not evaluated)."""
    if not resolved_only:
        return
    if value is None:
        raise BadRow("missing_resolved")
    if isinstance(value, bool) or value in (0, 1):
        if not value:
            raise FilteredRow("filtered_unresolved")
        return
    if value == -1:
        if not allow_unknown:
            raise FilteredRow("filtered_resolved_unknown")
        return
    raise BadRow("bad_field_type", f"resolved: {value!r}")


def _openai_messages(row: dict, field: str, tool_call_ids_field: bool = False) -> list[dict]:
    messages = require_list(row, field, "bad_messages_json")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRow("bad_message", type(m).__name__)
        m = _drop_none(m)
        # SWE-agent writes `tool_call_ids: [id]` on observations (verify per split); one id per message.
        if tool_call_ids_field and m.get("role") == "tool" and "tool_call_id" not in m:
            ids = m.get("tool_call_ids")
            if isinstance(ids, list) and len(ids) == 1:
                m = {**m, "tool_call_id": ids[0]}
        out.append(clean_message(m))
    return out


def adapt_swe_rebench(row: dict, index: int, resolved_only: bool = True):
    """nebius/SWE-rebench-openhands-trajectories: `trajectory` (JSON text of OpenAI messages), `tools`."""
    _resolved_filter(row.get("resolved"), resolved_only)
    messages = _openai_messages(row, "trajectory")
    meta = {k: row[k] for k in ("instance_id", "repo", "exit_status") if row.get(k) is not None}
    return row_key(row, index), messages, tools_list(row.get("tools")), meta


def adapt_open_swe(row: dict, index: int, resolved_only: bool = True, allow_unknown_resolved: bool = False):
    """nvidia/Open-SWE-Traces: `messages` (some versions `trajectory`), `tools` (list of JSON texts),
    `resolved` -1/0/1, `metadata` (teacher_model, category, ...)."""
    _resolved_filter(row.get("resolved"), resolved_only, allow_unknown_resolved)
    field = "trajectory" if row.get("messages") is None and row.get("trajectory") is not None else "messages"
    messages = _openai_messages(row, field)
    metadata = _maybe_json(row.get("metadata") or {}, "bad_metadata_json")
    meta = {k: row[k] for k in ("instance_id", "repo", "language") if row.get(k) is not None}
    if isinstance(metadata, dict):
        meta.update({k: metadata[k] for k in ("teacher_model", "category") if metadata.get(k) is not None})
    return row_key(row, index), messages, tools_list(row.get("tools")), meta


def adapt_swe_smith(row: dict, index: int, resolved_only: bool = True):
    """SWE-bench/SWE-smith-trajectories split `tool`: `messages` (JSON text; SWE-agent history items
    with `message_type`, `tool_calls`, `tool_call_ids`), `traj_id`, `resolved`; SWE-agent's tools."""
    _resolved_filter(row.get("resolved"), resolved_only)
    messages = _openai_messages(row, "messages", tool_call_ids_field=True)
    key = str(row["traj_id"]) if row.get("traj_id") else row_key(row, index)
    meta = {k: row[k] for k in ("instance_id", "model") if row.get(k) is not None}
    return key, messages, SWE_AGENT_TOOLS, meta


def _call(name, arguments, call_id: str) -> dict:
    if not isinstance(name, str) or not name:
        raise BadRow("bad_tool_call", f"name {name!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_json(arguments)}}


def _answer(pending: list[dict], content: str, name: str | None = None) -> dict:
    if not pending:
        raise BadRow("unmatched_tool_result")
    call = pending.pop(0)
    return {"role": "tool", "content": content, "tool_call_id": call["id"],
            "name": name or call["function"]["name"]}


def adapt_toucan(row: dict, index: int):
    """Agent-Ark/Toucan-1.5M (configs Kimi-K2, Qwen3, OSS: Qwen-Agent messages where each call is an
    assistant message with `function_call` and each result a `function` message; config SFT: roles
    `tool_call` / `tool_response` with JSON content; OpenAI `tool_calls` are accepted too).
    Consecutive assistant messages merge into one turn (Qwen-Agent writes parallel calls that way)."""
    raw = require_list(row, "messages", "bad_messages_json")
    out, pending, n_calls = [], [], 0

    def assistant_turn() -> dict:
        if out and out[-1]["role"] == "assistant":
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        return out[-1]

    for m in raw:
        if not isinstance(m, dict):
            raise BadRow("bad_message", type(m).__name__)
        m = _drop_none(m)
        role = m.get("role")
        if role == "tool_call" or (role == "assistant" and m.get("function_call")):
            fc = m.get("function_call") if role == "assistant" else _maybe_json(m.get("content"), "unparseable_tool_call")
            if not isinstance(fc, dict):
                raise BadRow("unparseable_tool_call", str(fc)[:80])
            call = _call(fc.get("name"), fc.get("arguments"), f"toucan_{n_calls}")
            n_calls += 1
            turn = assistant_turn()
            if role == "assistant":
                turn["content"] += _content_text(m.get("content"))
            turn.setdefault("tool_calls", []).append(call)
            pending.append(call)
        elif role in ("function", "tool_response") or (role == "tool" and "tool_call_id" not in m):
            content = m.get("content")
            out.append(_answer(pending, content if isinstance(content, str) else json.dumps(content, ensure_ascii=False),
                               m.get("name")))
        elif role == "assistant" and not m.get("tool_calls"):
            turn = assistant_turn()
            if turn.get("tool_calls") and pending:
                raise BadRow("text_after_unanswered_call")
            turn["content"] += clean_message(m)["content"]
            if m.get("reasoning_content"):
                turn["reasoning_content"] = str(m["reasoning_content"])
        else:
            msg = clean_message(m)
            if msg.get("tool_calls"):
                pending += msg["tool_calls"]
            out.append(msg)
    tools = tools_list(row.get("tools") if row.get("tools") is not None else row.get("available_tools"))
    meta = {k: row[k] for k in ("subset_name",) if row.get(k) is not None}
    key = str(row["uuid"]) if row.get("uuid") else row_key(row, index)
    return key, out, tools, meta


# Hermes writes calls as `<tool_call>{json or python dict}</tool_call>` and results as
# `<tool_response>...</tool_response>` inside the turn text.
TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
TOOL_RESPONSE_TAG = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def _loads_lenient(text: str) -> tuple[object, bool]:
    """(value, True when it was read as a Python literal): JSON, else a Python literal (Hermes often
    prints the call envelope as a dict with single quotes; its arguments must still become JSON)."""
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text), True
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        raise BadRow("unparseable_tool_call", text[:80]) from None


def adapt_hermes(row: dict, index: int):
    """NousResearch/hermes-function-calling-v1: `conversations` [{from, value}], `tools` (JSON text).
    The Hermes system prompt that lists `<tools>` and teaches the `<tool_call>` text format is dropped:
    the tools go to the template natively, so the target answers in its own call format."""
    out, pending, n_calls, n_literal = [], [], 0, 0
    for speaker, text in conversation_turns(row):
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            raise BadRow("unknown_role", speaker)
        if role == "system":
            if "<tools>" not in text:
                out.append({"role": "system", "content": text})
        elif role == "assistant":
            calls = []
            for body in TOOL_CALL_TAG.findall(text):
                obj, literal = _loads_lenient(body)
                n_literal += literal
                if not isinstance(obj, dict):
                    raise BadRow("unparseable_tool_call", body[:80])
                calls.append(_call(obj.get("name"), obj.get("arguments"), f"hermes_{n_calls}"))
                n_calls += 1
            if "<tool_call>" in text and not calls:
                raise BadRow("unparseable_tool_call", text[:80])
            msg = {"role": "assistant", "content": TOOL_CALL_TAG.sub("", text).strip() if calls else text}
            if calls:
                msg["tool_calls"] = calls
                pending = list(calls)
            out.append(msg)
        elif role == "tool":
            bodies = TOOL_RESPONSE_TAG.findall(text) or [text.strip()]
            if len(bodies) != len(pending):
                raise BadRow("tool_result_mismatch", f"{len(bodies)} results for {len(pending)} calls")
            out += [_answer(pending, body) for body in bodies]
        else:
            out.append({"role": role, "content": text})
    meta = {k: row[k] for k in ("category", "subcategory", "task") if row.get(k) is not None}
    return row_key(row, index), out, tools_list(row.get("tools")), add_repair(meta, "python_literal_tool_calls", n_literal)


# ToolACE calls: `[Func Name(arg=1, b="x"), other(a=[1, 2])]`; names may hold spaces, dots, dashes.
# A turn that starts like a call list is parsed as one (and a parse failure is a broken row).
BRACKET_CALLS = re.compile(r"^\s*\[\s*[A-Za-z_][\w .\-]*\(", re.S)
CALL_NAME = re.compile(r"(^\s*\[\s*|\)\s*,\s*)([A-Za-z_][\w .\-]*?)\s*\(")


def parse_bracket_calls(text: str) -> list[tuple[str, dict]]:
    """`[f(a=1), g(b="x")]` -> [("f", {"a": 1}), ("g", {"b": "x"})]; BadRow when it does not parse."""
    names = []

    def placeholder(m):
        names.append(m.group(2).strip())
        return f"{m.group(1)}__call{len(names) - 1}("

    try:
        tree = ast.parse(CALL_NAME.sub(placeholder, text).strip(), mode="eval")
        calls = tree.body.elts if isinstance(tree.body, ast.List) else None
        if not calls or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args
                                for c in calls):
            raise ValueError("not a list of keyword-only calls")
        return [(names[int(c.func.id.removeprefix("__call"))],
                 {kw.arg: ast.literal_eval(kw.value) for kw in c.keywords}) for c in calls]
    except (ValueError, SyntaxError, TypeError, IndexError, RecursionError):
        raise BadRow("unparseable_tool_call", text[:80]) from None


def _tools_in_text(text: str) -> list | None:
    """The first JSON array of objects inside a system prompt (ToolACE puts the tool list there)."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\[\s*\{", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value):
            return value
    return None


def adapt_toolace(row: dict, index: int):
    """Team-ACE/ToolACE: `system` (instructions + the tool list as JSON), `conversations`
    [{from: user|assistant|tool, value}]; assistant calls `[Func(arg=val)]`, tool values a JSON list
    of results in call order. The system prompt (it teaches the bracket format) is replaced by the
    native tool declaration."""
    system = require_field(row, "system", str, "missing_system")
    tools = _tools_in_text(system)
    if not tools:
        raise BadRow("no_tools_in_system")
    out, pending, n_calls = [], [], 0
    for role, text in conversation_turns(row):
        if role == "user":
            out.append({"role": "user", "content": text})
        elif role == "assistant" and BRACKET_CALLS.match(text):
            calls = [_call(name, args, f"toolace_{n_calls + i}") for i, (name, args) in enumerate(parse_bracket_calls(text))]
            n_calls += len(calls)
            pending = list(calls)
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif role == "assistant":
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            # ToolACE writes the results of a call turn as one JSON list, `{"name", "results"}` per
            # call in call order: each call's tool message gets its own object, for one call or many.
            results = None
            try:
                results = json.loads(text)
            except json.JSONDecodeError:
                pass
            if isinstance(results, list) and len(results) == len(pending) > 0:
                out += [_answer(pending, json.dumps(r, ensure_ascii=False)) for r in results]
            elif len(pending) == 1:
                out.append(_answer(pending, text))  # not ToolACE's list: the text is the one result
            else:
                raise BadRow("tool_result_mismatch", f"results for {len(pending)} calls: {text[:60]}")
        else:
            raise BadRow("unknown_role", str(role))
    return row_key(row, index), out, tools_list(tools), {}


# xLAM parameter types (Python annotations) -> JSON Schema.
XLAM_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object", "set": "array", "tuple": "array"}


def xlam_tool(tool: dict) -> dict:
    """xLAM's flat `{name, description, parameters: {p: {type: "str, optional", description, default}}}`
    -> an OpenAI function with a JSON-Schema object (required = no default and not `optional`)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise BadRow("bad_tools", str(tool)[:80])
    props, required = {}, []
    params = tool.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRow("bad_tools", f"parameters of {tool['name']}")
    if params.get("type") == "object":  # already JSON Schema (the parsed mirror)
        return {"type": "function", "function": {**tool, "parameters": normalize_schema(params)}}
    for pname, spec in params.items():
        if not isinstance(spec, dict):
            raise BadRow("bad_tools", f"{tool['name']}.{pname}")
        raw = str(spec.get("type", "str"))
        base = raw.split(",")[0].strip()
        outer = re.match(r"(\w+)", base).group(1).lower() if re.match(r"(\w+)", base) else "str"
        prop = {"type": XLAM_TYPES.get(outer, "string")}
        inner = re.match(r"\w+\[\s*(\w+)\s*\]", base)  # List[int] -> items of type integer
        if prop["type"] == "array" and inner and inner.group(1).lower() in XLAM_TYPES:
            prop["items"] = {"type": XLAM_TYPES[inner.group(1).lower()]}
        if spec.get("description"):
            prop["description"] = str(spec["description"])
        if "default" in spec and spec["default"] not in (None, ""):
            prop["default"] = spec["default"]
        props[pname] = prop
        if "optional" not in raw.lower() and "default" not in spec:
            required.append(pname)
    schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return {"type": "function", "function": {"name": tool["name"], "description": str(tool.get("description", "")),
                                             "parameters": schema}}


def adapt_xlam(row: dict, index: int):
    """Salesforce/xlam-function-calling-60k: `query`, `tools` and `answers` (JSON texts). Prompt-only:
    the reference answers are checked to parse (a row whose answers do not is corrupt) but not kept."""
    query = require_field(row, "query", str, "missing_query")
    tools = _maybe_json(require_field(row, "tools", (str, list), "missing_tools"), "bad_tools_json")
    if not isinstance(tools, list) or not tools:
        raise BadRow("bad_tools", "empty")
    answers = _maybe_json(row.get("answers", "[]"), "bad_answers_json")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and "name" in a for a in answers):
        raise BadRow("bad_answers", str(answers)[:80])
    return (row_key(row, index), [{"role": "user", "content": query}], [xlam_tool(t) for t in tools],
            {"num_reference_calls": len(answers)})
