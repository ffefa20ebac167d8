"""What the target's text format is, derived once from its tokenizer, chat template and generation config.

`describe_target(tokenizer, model_dir)` probes the chat template with a few tiny conversations and
returns a `TargetFormat`; stages 01, 01b and 01c use it instead of assuming Kimi-K2.5:
  kimi                the template produces Kimi-K2.5's format (docs/design.md section 6): the generation
                      prompt ends `<|im_assistant|>assistant<|im_middle|><think>` and turns end with
                      `<|im_end|>`; only then are completions rendered by chat_format.render_completion
                      and tool-call ids rewritten to `functions.NAME:IDX`.
  end_of_turn         the special-token string the template writes right after an assistant turn's
                      content (`<|im_end|>` for Kimi and ChatML, `<|eot_id|>` for Llama 3), falling back
                      to the tokenizer's eos token when the template writes none.
  stop_ids            ids that end generation: end_of_turn's id first, then the eos ids of
                      generation_config.json (else config.json), deduplicated. `stop_strings` are their
                      token strings (the server pool's `stop`).
  renders_thinking    the `thinking` switch changes the generation prompt (Kimi: `<think>` vs
                      `<think></think>`); when False every record is rendered and counted as thinking off.
  renders_tools       a `tools` list changes the rendered prompt (ChatML templates ignore it).
  renders_tool_calls  an assistant turn's `tool_calls` change its rendering (ChatML drops them: the turn
                      renders as its (empty) content).
Each capability is found by rendering the same probe with and without the feature.

`render_final_turn(tokenizer, text_format, messages, tools, thinking)` is the text the target emits for the final
assistant turn of a `complete` record: Kimi's exact completion rendering, or for any other template
the suffix of the whole conversation's rendering after the rendering of its history plus generation
prompt, cut after the end-of-turn string (ChatML writes `<|im_end|>\n`; the model emits `<|im_end|>`
and stops). It raises `FormatError(reason)` when the template cannot do that (the two renderings
disagree on the prefix, no end-of-turn follows, or reasoning the record holds is not rendered), so
01 can skip and count such rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.text.chat_format import IM_END, render_completion, render_prompt

KIMI_GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
_PROBE_USER = {"role": "user", "content": "Probe question 7"}
_PROBE_ANSWER = "Probe answer 7"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool", "description": "Probe tool 7",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]
_PROBE_CALL = {"id": "functions.probe_tool:0", "type": "function",
               "function": {"name": "probe_tool", "arguments": "{\"x\": \"7\"}"}}


class FormatError(ValueError):
    """A record the target's template cannot render as the target would emit it; `reason` is the
    counted skip reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class TargetFormat:
    kimi: bool
    end_of_turn: str
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    renders_thinking: bool
    renders_tools: bool
    renders_tool_calls: bool

    def as_dict(self) -> dict:
        """For manifests: what every stage assumed about the target's text."""
        return {"kimi": self.kimi, "end_of_turn": self.end_of_turn, "stop_ids": list(self.stop_ids),
                "stop_strings": list(self.stop_strings), "renders_thinking": self.renders_thinking,
                "renders_tools": self.renders_tools, "renders_tool_calls": self.renders_tool_calls}


def _render(tokenizer, messages, tools=None, generation_prompt=False, thinking=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=False, thinking=thinking)


def _special_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted(specials, key=len, reverse=True)


def _config_eos_ids(model_dir: Path | None) -> list[int]:
    """eos ids the way generate() and servers read them: generation_config.json, else config.json."""
    if model_dir is None:
        return []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is not None:
                return [int(x) for x in (eos if isinstance(eos, list) else [eos])]
    return []


def _end_of_turn(tokenizer) -> str:
    """The special-token string the template writes right after an assistant turn's content."""
    full = _render(tokenizer, [_PROBE_USER, {"role": "assistant", "content": _PROBE_ANSWER}])
    at = full.rfind(_PROBE_ANSWER)
    if at >= 0:
        after = full[at + len(_PROBE_ANSWER):].lstrip(" ")
        found = next((s for s in _special_strings(tokenizer) if after.startswith(s)), None)
        if found is not None:
            return found
    if tokenizer.eos_token:
        return tokenizer.eos_token
    raise ValueError("cannot tell how the target ends a turn: its chat template writes no special token "
                     "after an assistant turn and the tokenizer has no eos token")


def describe_target(tokenizer, model_dir: str | Path | None = None) -> TargetFormat:
    """Probe the target's template (see the module doc). Raises ValueError for a target it cannot use."""
    end_of_turn = _end_of_turn(tokenizer)
    eot_ids = tokenizer.encode(end_of_turn, add_special_tokens=False)
    if len(eot_ids) != 1:
        raise ValueError(f"the target's end-of-turn string {end_of_turn!r} is not one token ({eot_ids})")
    stop_ids = list(dict.fromkeys(eot_ids + _config_eos_ids(Path(model_dir) if model_dir else None)))
    stop_strings = tuple(tokenizer.convert_ids_to_tokens(i) for i in stop_ids)
    gen_on = _render(tokenizer, [_PROBE_USER], generation_prompt=True, thinking=True)
    gen_off = _render(tokenizer, [_PROBE_USER], generation_prompt=True, thinking=False)
    with_call = [_PROBE_USER, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]
    without_call = [_PROBE_USER, {"role": "assistant", "content": ""}]
    return TargetFormat(
        kimi=gen_on.endswith(KIMI_GENERATION_PROMPT + "<think>") and end_of_turn == IM_END,
        end_of_turn=end_of_turn, stop_ids=tuple(stop_ids), stop_strings=stop_strings,
        renders_thinking=gen_on != gen_off,
        renders_tools=_render(tokenizer, [_PROBE_USER], _PROBE_TOOLS, True) != _render(tokenizer, [_PROBE_USER],
                                                                                        None, True),
        renders_tool_calls=_render(tokenizer, with_call) != _render(tokenizer, without_call))


def load_target_format(model_dir: str | Path, tokenizer=None) -> TargetFormat:
    """describe_target for a model folder (its tokenizer loaded when not given); a StageError names the
    folder when the target cannot be used."""
    from common.stage import StageError

    if tokenizer is None:
        from common.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    try:
        return describe_target(tokenizer, model_dir)
    except ValueError as e:
        raise StageError(f"target {model_dir}: {e}") from None


def render_final_turn(tokenizer, text_format: TargetFormat, messages: list[dict], tools: list[dict] | None,
                      thinking: bool) -> str:
    """The text the target emits for `messages[-1]` (an assistant turn) after the prompt of the history
    (module doc). Raises FormatError when the template cannot give it."""
    final = messages[-1]
    assert final["role"] == "assistant", final["role"]
    if text_format.kimi:
        return render_completion(final, thinking=thinking)
    prompt = render_prompt(tokenizer, messages[:-1], tools, thinking=thinking)
    full = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=False,
                                         tokenize=False, thinking=thinking)
    if not full.startswith(prompt):
        raise FormatError("completion_prefix_mismatch",
                          "the template renders the history differently with the final turn present")
    suffix = full[len(prompt):]
    cut = suffix.find(text_format.end_of_turn)
    if cut < 0:
        raise FormatError("completion_without_end_of_turn", f"no {text_format.end_of_turn} after the final turn")
    completion = suffix[:cut + len(text_format.end_of_turn)]
    reasoning = (final.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in completion:
        raise FormatError("reasoning_not_rendered", "the template drops the final turn's reasoning")
    return completion

