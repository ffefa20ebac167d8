"""The dataset mix: the adapter registry, per-dataset options, trajectory cutting, thinking ratio, length partition.

`ADAPTERS` maps every adapter name a --datasets entry may give to `fn(row, index, **filters)` with the contract
of common/datasets/adapters.py: the generic shapes (any dataset stored that way) and one adapter per dataset of
the mix (train_plan_v4.md section 1), whose keyword options are the entry's filters.
`expand_row(row, index, spec, ...)` is what 01 calls for every dataset: the entry's `filters` become
adapter options, the conversation is cut at one or more assistant turns (`cut`: last |
random | every), each cut gets thinking on or off by the entry's `thinking-ratio`, and every cut goes
through common.datasets.adapters.finish_record (id rewriting, scrubbing, validation). Per-dataset keys it reads:
  cut             last (default) | random (one turn, RNG keyed by seed and row key) |
                  every (one record per assistant turn, ids `<key>#turn<N>`, N = 1-based turn number)
  thinking-ratio  share of records rendered with thinking on, in [0, 1] (RNG keyed by seed and id);
                  absent: 01's --thinking for all. Complete records whose final turn has no reasoning
                  are always thinking off (their text is an instant-mode answer).
  filters         mapping of adapter options, kebab-case (resolved-only, min-test-score, languages, ...)
Before cutting, turns before the first user turn are dropped (common.datasets.adapters.drop_leading_turns);
agent trajectories are never cut after the result of their episode-ending tool (EPISODE_END_TOOLS).

Adding a dataset adapter: docs/design.md section 8.
"""
from __future__ import annotations

import inspect
import random
from collections import Counter

from common.datasets.adapters import (BadRow, adapt_conversations, adapt_instruction, adapt_messages, add_repair,
                                      drop_leading_turns, finish_record)
from common.datasets.agentic import (FilteredRow, adapt_hermes, adapt_open_swe, adapt_swe_rebench,
                                     adapt_swe_smith, adapt_toolace, adapt_toucan, adapt_xlam)
from common.datasets.chat import (adapt_magicoder_evol, adapt_magicoder_oss, adapt_opc_sft,
                                  adapt_opencodeinstruct, adapt_opencodereasoning, adapt_openthoughts,
                                  adapt_sharegpt, adapt_ultrachat, adapt_wildchat)

__all__ = ["ADAPTERS", "GENERIC_ADAPTERS", "FilteredRow", "BadRow", "expand_row", "cut_trajectory",
           "thinking_for", "length_partition", "check_mix_spec", "MIX_SPEC_KEYS", "CUT_MODES"]

# Any dataset stored in one of these shapes; no filters.
GENERIC_ADAPTERS = {"messages": adapt_messages, "conversations": adapt_conversations,
                    "instruction": adapt_instruction}
# name -> adapter, by family as in the mix table of train_plan_v4.md section 1.
ADAPTERS = {
    **GENERIC_ADAPTERS,
    "swe_rebench": adapt_swe_rebench,          # SWE trajectories, OpenAI tool calls
    "open_swe": adapt_open_swe,
    "swe_smith": adapt_swe_smith,
    "toucan": adapt_toucan,                    # Kimi-K2-generated MCP agent data
    "hermes_fc": adapt_hermes,                 # function calling, text-encoded calls parsed
    "toolace": adapt_toolace,
    "xlam": adapt_xlam,
    "opencodeinstruct": adapt_opencodeinstruct,  # code instructions
    "magicoder_oss": adapt_magicoder_oss,
    "magicoder_evol": adapt_magicoder_evol,
    "opc_sft": adapt_opc_sft,
    "opencodereasoning": adapt_opencodereasoning,  # reasoning
    "openthoughts": adapt_openthoughts,
    "ultrachat": adapt_ultrachat,              # general chat
    "sharegpt": adapt_sharegpt,
    "wildchat": adapt_wildchat,
}
CUT_MODES = ("last", "random", "every")
# Tools whose call ends the agent's episode: after their result the task is over, so the end of such a
# trajectory is no turn the target would be asked to write (cut_trajectory skips it). OpenHands
# (SWE-rebench, Open-SWE-Traces): `finish` (openhands/agenthub/codeact_agent/tools/finish.py,
# https://github.com/All-Hands-AI/OpenHands); SWE-agent (SWE-smith): `submit` (SWE_AGENT_TOOLS).
EPISODE_END_TOOLS = {"swe_rebench": frozenset({"finish"}), "open_swe": frozenset({"finish"}),
                     "swe_smith": frozenset({"submit"})}
MIX_SPEC_KEYS = {"cut", "thinking-ratio", "filters"}


def name_tool_results(messages: list[dict]) -> list[dict]:
    """Give tool results without a `name` the name of the call they answer: the template renders the
    turn as `<|im_system|>{name}<|im_middle|>` (else `tool`), and Kimi's tool-call guidance sends it."""
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    return [{**m, "name": names[m["tool_call_id"]]} if m["role"] == "tool" and not m.get("name")
            and m.get("tool_call_id") in names else m for m in messages]


def adapter_options(spec: dict) -> dict:
    """The entry's `filters` as keyword arguments of its adapter; ValueError names unknown ones."""
    filters = spec.get("filters") or {}
    if not isinstance(filters, dict):
        raise ValueError(f"dataset {spec.get('name')}: filters must be a mapping, not {type(filters).__name__}")
    fn = ADAPTERS[spec["adapter"]]
    params = [p for p in inspect.signature(fn).parameters][2:]
    options = {k.replace("-", "_"): v for k, v in filters.items()}
    unknown = sorted(k for k in options if k not in params)
    if unknown:
        raise ValueError(f"dataset {spec.get('name')}: adapter {spec['adapter']} has no filter(s) "
                         f"{[u.replace('_', '-') for u in unknown]}; it takes {[p.replace('_', '-') for p in params] or 'none'}")
    if isinstance(options.get("languages"), list):
        options["languages"] = tuple(options["languages"])
    return options


def check_mix_spec(spec: dict) -> None:
    """Validate the mix keys of one --datasets entry whose adapter is known (ValueError with a message for the
    user)."""
    name = spec.get("name")
    if spec.get("cut", "last") not in CUT_MODES:
        raise ValueError(f"dataset {name}: cut {spec.get('cut')!r} is not one of {CUT_MODES}")
    ratio = spec.get("thinking-ratio")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
        raise ValueError(f"dataset {name}: thinking-ratio {ratio!r} is not a number in [0, 1]")
    adapter_options(spec)


def cut_trajectory(key: str, messages: list[dict], mode: str = "last", seed: int = 0,
                   complete: bool = False, end_tools: frozenset = frozenset()) -> list[tuple[str, list[dict], int | None]]:
    """Cut a conversation at assistant turns: [(record key, messages, turn number)].

    A cut point is an assistant message right after a user or tool message (a turn the model starts
    from scratch), plus, for prompt-only records, the end of a conversation that ends with a user or
    tool message (the turn it waits for) - unless that last message is the result of a call to one
    of `end_tools` (the episode is over; BadRow `episode_over` when no other point is left).
    Prompt-only records keep everything before the point (the target writes that turn); complete
    records keep the turn as their final message. Turn numbers count assistant messages from 1.
    """
    if mode not in CUT_MODES:
        raise ValueError(f"cut mode {mode!r} is not one of {CUT_MODES}")
    points, turn = [], 0
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            turn += 1
            if i > 0 and messages[i - 1]["role"] in ("user", "tool"):
                points.append((i, turn))
    over = bool(messages) and messages[-1]["role"] == "tool" and _answered_tool(messages) in end_tools
    if not complete and messages and messages[-1]["role"] in ("user", "tool") and not over:
        points.append((len(messages), turn + 1))  # the turn the conversation is waiting for
    if not points:
        if complete:
            raise BadRow("no_final_assistant")
        if over:
            raise BadRow("episode_over")
        return [(key, messages, None)]
    end = 1 if complete else 0
    if mode == "last":
        chosen = [points[-1]]
    elif mode == "random":
        # Keyed by seed and row key, not by position in the file: re-runs and reorderings agree.
        chosen = [random.Random(f"{seed}/cut/{key}").choice(points)]
    else:
        return [(f"{key}#turn{t}", messages[:i + end], t) for i, t in points]
    (i, t), = chosen
    return [(key, messages[:i + end], t)]


def _answered_tool(messages: list[dict]) -> str | None:
    """Name of the call the last (tool) message answers: its call's function name, else its `name`."""
    last = messages[-1]
    for msg in reversed(messages[:-1]):
        for call in msg.get("tool_calls") or []:
            if call.get("id") == last.get("tool_call_id"):
                return call["function"]["name"]
    return last.get("name")


def thinking_for(record_id: str, ratio: float, seed: int = 0) -> bool:
    """Thinking on for a `ratio` share of records, decided per record id (stable across re-runs)."""
    if ratio >= 1:
        return True
    if ratio <= 0:
        return False
    return random.Random(f"{seed}/thinking/{record_id}").random() < ratio


def expand_row(row: dict, index: int, spec: dict, scrub, seed: int = 0, thinking: bool = True,
               thinking_ratio: float | None = None, repairs: Counter | None = None,
               kimi_tool_ids: bool = True) -> list[tuple[dict, int]]:
    """One raw row -> [(unified record, special strings scrubbed)], one per cut (see module doc).

    `thinking_ratio` (01's --thinking-ratio) applies to entries without their own; with neither, every
    record gets `thinking`. Raises BadRow / FilteredRow for the whole row, like an adapter. The row's
    `meta["repairs"]` are added to `repairs` once per row (not per cut), and only when it is used.
    """
    name, complete = spec["adapter"], bool(spec.get("complete", False))
    key, messages, tools, meta = ADAPTERS[name](row, index, **adapter_options(spec))
    messages = name_tool_results(messages)
    messages, dropped = drop_leading_turns(messages)
    meta = add_repair(dict(meta), "leading_turns_dropped", dropped)
    ratio = spec.get("thinking-ratio", thinking_ratio)  # the entry's, else the stage-wide one
    out = []
    cuts = cut_trajectory(key, messages, spec.get("cut", "last"), seed, complete,
                          EPISODE_END_TOOLS.get(name, frozenset()))
    for cut_key, msgs, turn in cuts:
        pre = {"key": cut_key, "messages": msgs, "tools": tools,
               "meta": {**meta, "cut_turn": turn} if turn is not None and name not in GENERIC_ADAPTERS else dict(meta)}
        th = thinking if ratio is None else thinking_for(f"{spec['name']}/{cut_key}", ratio, seed)
        if complete and not msgs[-1].get("reasoning_content"):
            th = False  # a kept answer without reasoning is an instant-mode answer, never `<think></think>`
        out.append(finish_record(pre["key"], pre["messages"], pre["tools"], pre["meta"], spec["name"], scrub,
                                 th, complete=complete, kimi_tool_ids=kimi_tool_ids))
    if repairs is not None:
        repairs.update(meta.get("repairs", {}))
    return out


def length_partition(num_prompt_tokens: int, max_new_tokens: int, max_context: int,
                     long_context: int | None) -> str | None:
    """"normal" when prompt + max new tokens fits max_context, "long" when it fits long_context,
    None when it fits neither (dropped and counted)."""
    need = num_prompt_tokens + max_new_tokens
    if need <= max_context:
        return "normal"
    if long_context and need <= long_context:
        return "long"
    return None
