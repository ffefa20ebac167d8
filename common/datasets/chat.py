"""The mix's adapters for code-instruction, reasoning and general-chat datasets (prompt sources).

Same contract as common/datasets/agentic.py: `fn(row, index, **options) -> (key, messages, tools,
meta)`, `BadRow` for broken rows, `FilteredRow` for rows a filter drops. Every answer here was written
by another model, so these datasets are prompts: 01 cuts the answer off and the target writes its own
in 01b. Schemas: docs/design.md section 8 (#1-#3, #5-#9, #19).
"""
from __future__ import annotations

import math
import re

from common.datasets.adapters import (SHAREGPT_ROLES, BadRow, _drop_none, _maybe_json, add_repair, clean_message,
                                  conversation_turns, require_field, require_list, row_key)
from common.datasets.agentic import FilteredRow


def _text(row: dict, field: str) -> str:
    value = require_field(row, field, str)
    if not value.strip():
        raise BadRow(f"empty_{field}")
    return value


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def adapt_opencodeinstruct(row: dict, index: int, min_test_score: float | None = 0.9):
    """nvidia/OpenCodeInstruct: `id`, `input` (the task), `output`, `average_test_score` (text or number,
    the share of its generated unit tests the output passed)."""
    text = _text(row, "input")
    if min_test_score is not None:
        raw = row.get("average_test_score")
        if raw is None:
            raise BadRow("missing_average_test_score")
        try:
            score = float(raw)
        except (TypeError, ValueError):
            raise BadRow("bad_field_type", f"average_test_score: {raw!r}") from None
        if math.isnan(score) or score < min_test_score:
            raise FilteredRow("filtered_test_score")
    meta = {k: row[k] for k in ("domain", "generation_algorithm") if row.get(k) is not None}
    return row_key(row, index), _user(text), None, meta


def adapt_magicoder_oss(row: dict, index: int):
    """ise-uiuc/Magicoder-OSS-Instruct-75K: `problem`, `solution`, `lang`, `seed`."""
    meta = {"lang": row["lang"]} if isinstance(row.get("lang"), str) else {}
    return row_key(row, index), _user(_text(row, "problem")), None, meta


def adapt_magicoder_evol(row: dict, index: int):
    """ise-uiuc/Magicoder-Evol-Instruct-110K: `instruction`, `response`."""
    return row_key(row, index), _user(_text(row, "instruction")), None, {}


def adapt_opc_sft(row: dict, index: int):
    """OpenCoder-LLM/opc-sft-stage1 (any config): `instruction`, `output`, `tag`."""
    meta = {"tag": row["tag"]} if isinstance(row.get("tag"), str) else {}
    return row_key(row, index), _user(_text(row, "instruction")), None, meta


def adapt_opencodereasoning(row: dict, index: int):
    """nvidia/OpenCodeReasoning: `id`, `input` (the problem; "-" in split_1, where it lives in another
    dataset), `output` (R1 trace), `source`, `difficulty`."""
    text = _text(row, "input")
    if text.strip() == "-":
        raise BadRow("external_input")  # split_1 points at TACO/APPS/...; join them first
    meta = {k: row[k] for k in ("source", "difficulty", "dataset") if row.get(k) is not None}
    return row_key(row, index), _user(text), None, meta


# OpenThoughts / Bespoke-Stratos answer markers.
THOUGHT = re.compile(r"^\s*<\|begin_of_thought\|>(?P<thought>.*?)<\|end_of_thought\|>\s*"
                     r"<\|begin_of_solution\|>(?P<solution>.*?)<\|end_of_solution\|>\s*$", re.S)


def split_thought(text: str) -> tuple[str, str]:
    """`<|begin_of_thought|>T<|end_of_thought|><|begin_of_solution|>S<|end_of_solution|>` -> (T, S)."""
    m = THOUGHT.match(text)
    if m is None:
        raise BadRow("bad_thought_markers", text[:80])
    return m.group("thought").strip(), m.group("solution").strip()


def adapt_openthoughts(row: dict, index: int, keep_system: bool = False):
    """open-thoughts/OpenThoughts-114k: `system`, `conversations` [{from: user|assistant, value}];
    assistant values carry thought/solution markers, split into reasoning_content and content.
    The dataset's system prompt (it asks for those markers) is dropped unless `keep_system`."""
    turns = conversation_turns(row)
    messages = []
    if keep_system and isinstance(row.get("system"), str) and row["system"].strip():
        messages.append({"role": "system", "content": row["system"]})
    for speaker, text in turns:
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role not in ("user", "assistant"):
            raise BadRow("unknown_role", speaker)
        if role == "assistant":
            thought, solution = split_thought(text)
            messages.append({"role": "assistant", "content": solution, "reasoning_content": thought})
        else:
            messages.append({"role": "user", "content": text})
    return row_key(row, index), messages, None, {}


def adapt_ultrachat(row: dict, index: int):
    """HuggingFaceH4/ultrachat_200k: `prompt`, `prompt_id`, `messages` [{role, content}]. A row whose
    `messages` is missing or empty falls back to the top-level `prompt` (counted as a repair)."""
    raw = _maybe_json(row.get("messages"), "bad_messages_json")
    meta = {}
    if raw is None or raw == []:
        raw = [{"role": "user", "content": _text(row, "prompt")}]
        add_repair(meta, "prompt_field_fallback")
    if not isinstance(raw, list):
        raise BadRow("bad_field_type", f"messages: {type(raw).__name__}")
    if not all(isinstance(m, dict) for m in raw):
        raise BadRow("bad_message", "a message is not an object")
    return row_key(row, index), [clean_message(_drop_none(m)) for m in raw], None, meta


def adapt_sharegpt(row: dict, index: int):
    """Aeala/ShareGPT_Vicuna_unfiltered: `id`, `conversations` [{from: human|gpt|system|..., value}];
    speakers other than the mapped ones (SpecForge's mapping) are dropped and counted in meta."""
    messages, dropped = [], 0
    for speaker, text in conversation_turns(row):
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role in (None, "tool"):
            dropped += 1
            continue
        messages.append({"role": role, "content": text})
    if not messages:
        raise BadRow("no_known_speaker")
    return row_key(row, index), messages, None, add_repair({}, "unknown_speaker_turns_dropped", dropped)


def adapt_wildchat(row: dict, index: int, languages=("English", "Chinese"), drop_toxic: bool = True,
                   drop_redacted: bool = True):
    """allenai/WildChat-1M: `conversation_hash` (or `conversation_id`), `conversation` [{role, content,
    ...}], `language`, `toxic`, `redacted`, `model`. Toxic, redacted (PII-scrubbed) and other-language
    conversations are filtered (`languages` None keeps all)."""
    for flag in ("toxic", "redacted"):
        if not isinstance(row.get(flag), bool):
            raise BadRow("bad_field_type" if flag in row else f"missing_{flag}", flag)
    if drop_toxic and row["toxic"]:
        raise FilteredRow("filtered_toxic")
    if drop_redacted and row["redacted"]:
        raise FilteredRow("filtered_redacted")
    language = require_field(row, "language", str)
    if languages is not None and language not in languages:
        raise FilteredRow("filtered_language")
    raw = require_list(row, "conversation", "bad_messages_json")
    messages = []
    for m in raw:
        if not isinstance(m, dict):
            raise BadRow("bad_message", type(m).__name__)
        messages.append(clean_message({"role": m.get("role"), "content": m.get("content")}))
    key = next((str(row[f]) for f in ("conversation_hash", "conversation_id") if row.get(f)), None) or row_key(row, index)
    meta = {"language": language, **({"model": row["model"]} if isinstance(row.get("model"), str) else {})}
    return key, messages, None, meta
