"""common/benchmark/segments.py: every continuation token gets the segment it belongs to, and every round
the segment and position of the first token it drafts; the cells add up to the overall statistics."""
from __future__ import annotations

import importlib
import json
import random

import numpy as np
import pytest
import torch

from common.benchmark import reference as rb
from common.benchmark import replay as rp
from common.benchmark import segments as sg
from common.benchmark import spec_decode as sd
from common.stage import BENCH, stage_dir
from common.text.chat_format import render_completion, render_prompt
from common.text.kimi_tokenizer import load_kimi_k25_tokenizer

from tests.spec_helpers import make_chain

R, A, C, T = sg.REASONING, sg.ANSWER, sg.CODE, sg.TOOL_CALL
TOOLS = [{"type": "function", "function": {"name": "get_source", "description": "Source of a function.",
                                           "parameters": {"type": "object", "properties": {
                                               "module": {"type": "string"}}, "required": ["module"]}}}]
USER = [{"role": "user", "content": "What does json.dumps do?"}]


@pytest.fixture(scope="module")
def kimi():
    return load_kimi_k25_tokenizer()


def labels_of(tok, prompt: str, parts: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(labels segments.py gives the continuation made of `parts`, the labels each part says). Parts
    are split where the tokenizer splits anyway (special tokens, or checked below), so the expected
    label of every token is the label of the part it came from."""
    cont = tok.encode("".join(p for p, _ in parts), add_special_tokens=False)
    pieces = [tok.encode(p, add_special_tokens=False) for p, _ in parts]
    assert cont == [i for p in pieces for i in p], "a part boundary is not a token boundary"
    expected = np.concatenate([np.full(len(p), s) for p, (_, s) in zip(pieces, parts)])
    markers = sg.segment_markers(tok)
    start = sg.start_segment(tok.encode(prompt, add_special_tokens=False), markers)
    return sg.label_tokens(cont, sg.decode_pieces(tok, cont), markers, start), expected


def test_kimi_markers_are_its_special_tokens(kimi):
    m = sg.segment_markers(kimi)
    assert (m.think_begin, m.think_end, m.tool_begin, m.tool_end) == (163606, 163607, 163595, 163596)


def test_kimi_thinking_on_reasoning_answer_and_tool_call_with_arguments(kimi):
    prompt = render_prompt(kimi, USER, TOOLS, thinking=True)
    assert prompt.endswith("<think>")
    call = {"id": "functions.get_source:0", "type": "function",
            "function": {"name": "get_source", "arguments": '{"module": "json", "name": "dumps"}'}}
    msg = {"role": "assistant", "reasoning_content": "I need the source. A ``` here is reasoning text.",
           "content": "Let me look it up.", "tool_calls": [call]}
    text = render_completion(msg, thinking=True)
    section = text[text.index("<|tool_calls_section_begin|>"):text.index("<|im_end|>")]
    assert "<|tool_call_argument_begin|>{\"module\"" in section and section.endswith("<|tool_calls_section_end|>")
    got, want = labels_of(kimi, prompt, [
        ("I need the source. A ``` here is reasoning text.", R), ("</think>", R),
        ("Let me look it up.", A), (section, T), ("<|im_end|>", A)])
    assert got.tolist() == want.tolist()


def test_kimi_thinking_off_code_block_inside_the_answer(kimi):
    prompt = render_prompt(kimi, USER, thinking=False)
    assert prompt.endswith("<think></think>")
    body = "```python\nimport json\nprint(json.dumps({'a': 1}))\n```"
    text = render_completion({"role": "assistant", "content": f"Like this:\n{body}\nIt prints JSON."},
                             thinking=False)
    cont = kimi.encode(text, add_special_tokens=False)
    markers = sg.segment_markers(kimi)
    assert sg.start_segment(kimi.encode(prompt, add_special_tokens=False), markers) == A
    got = sg.label_tokens(cont, sg.decode_pieces(kimi, cont), markers, A)
    # a token is code iff its characters meet the fenced block (both fences included)
    pieces = sg.decode_pieces(kimi, cont)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - [len(p) for p in pieces]
    lo, hi = text.index(body), text.index(body) + len(body)
    want = np.where((ends > lo) & (starts < hi), C, A)
    assert "".join(pieces) == text and got.tolist() == want.tolist()
    assert (got == C).sum() >= 10 and got[0] == A and got[-1] == A  # `<|im_end|>` is answer


def test_kimi_start_follows_the_prompts_last_think_marker(kimi):
    markers = sg.segment_markers(kimi)
    history = USER + [{"role": "assistant", "content": "It serialises."}, {"role": "user", "content": "And loads?"}]
    on, off = (kimi.encode(render_prompt(kimi, history, thinking=t), add_special_tokens=False) for t in (True, False))
    assert on.count(markers.think_end) >= 1  # the history's `<think></think>` comes before the final `<think>`
    assert sg.start_segment(on, markers) == R and sg.start_segment(off, markers) == A
    # a continuation that leaves reasoning, then thinks again (no prompt marker between)
    text = "plan</think>answer<think>more</think>done<|im_end|>"
    ids = kimi.encode(text, add_special_tokens=False)
    got = sg.label_tokens(ids, sg.decode_pieces(kimi, ids), markers, R)
    lab = dict(zip(sg.decode_pieces(kimi, ids), got.tolist()))
    assert lab["plan"] == lab["</think>"] == lab["<think>"] == lab["more"] == R
    assert lab["answer"] == lab["done"] == lab["<|im_end|>"] == A


def test_chatml_target_has_no_think_or_tool_markers(micro_chatml_target):
    from common.text.tokenizer import load_tokenizer

    tok = load_tokenizer(micro_chatml_target)
    markers = sg.segment_markers(tok)
    assert markers.events() == {}   # `<think>` is plain text to a ChatML tokenizer
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    text = "Sure <think>x</think>:\n```python\ndef f(): return 1\n```\nDone.<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = sg.decode_pieces(tok, ids)
    assert "".join(pieces) == text
    assert sg.start_segment(tok.encode(prompt, add_special_tokens=False), markers) == A
    got = sg.label_tokens(ids, pieces, markers, A)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - [len(p) for p in pieces]
    lo = text.index("```")
    hi = text.index("```", lo + 3) + 3
    assert got.tolist() == np.where((ends > lo) & (starts < hi), C, A).tolist()


def test_a_fence_cut_between_tokens_and_an_unclosed_block_before_a_tool_section(kimi):
    m = sg.segment_markers(kimi)
    # hand-cut pieces: the closing fence spans two tokens; ids only matter for the special markers
    pieces = ["Hi", "``", "`py\n", "x=1\n", "``", "`\n", "ok", "```", "y", "<|tool_calls_section_begin|>", "{}",
              "<|tool_calls_section_end|>", "end"]
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, m.tool_begin, 10, m.tool_end, 11]
    got = sg.label_tokens(ids, pieces, m, A).tolist()
    assert got == [A, C, C, C, C, C, A, C, C, T, T, T, A]


def hand_made_result() -> tuple[sd.SpecResult, np.ndarray]:
    """12 continuation tokens: offsets 0-3 reasoning, 4-5 answer, 6-8 tool call, 9-11 code. Rounds commit
    3, 1, 4, 2 tokens after the prefill's token, so their first drafted tokens sit at offsets 1, 4, 5, 9
    (their pending tokens at 0, 3, 4, 8; the tokens after them at 2, 5, 6, 10): attributing by the pending
    (anchor) token or one token late gives other segments."""
    labels = np.array([R, R, R, R, A, A, T, T, T, C, C, C], dtype=np.int8)
    res = sd.SpecResult(tokens=list(range(11)), drafted=[4, 4, 4, 4], accepted=[2, 0, 3, 1], emitted=[3, 1, 4, 2])
    return res, labels


def test_attribution_goes_by_the_first_drafted_token():
    res, labels = hand_made_result()
    assert sg.round_offsets(res).tolist() == [1, 4, 5, 9]
    b = sg.breakdown([res], [labels], ["src"], k=4, seed=0)
    seg = b["by_segment"]
    assert [seg[s]["num_rounds"] for s in sg.SEGMENTS] == [1, 2, 1, 0]  # reasoning, answer, code, tool_call
    assert [seg[s]["tau"] for s in sg.SEGMENTS] == [3.0, 2.5, 2.0, None]
    # answer: rounds accepting 0 and 3 of 4 drafts
    assert seg["answer"]["per_position_acceptance"] == [0.5, 1.0, 1.0, 0.0]
    assert seg["answer"]["per_position_reached"] == [2, 1, 1, 1]
    assert seg["tool_call"]["per_position_acceptance"] == [None] * 4
    assert seg["answer"]["tau_ci95"] == [None, None]  # one prompt: too few for an interval
    assert b["by_position"]["0-256"]["num_rounds"] == 4 and b["by_position"]["4K+"]["num_rounds"] == 0


def test_attribution_by_position_bucket_and_source():
    long = sd.SpecResult(tokens=list(range(1300)), drafted=[1] * 1044, accepted=[1] * 255 + [0] * 789,
                         emitted=[2] * 255 + [1] * 789)
    labels = np.full(1300, A, dtype=np.int8)
    res, hand = hand_made_result()
    b = sg.breakdown([long, res], [labels, hand], ["web", "code"], k=1, seed=0)
    pos = b["by_position"]
    # first drafted offsets 1, 3, ..., 509 (255 rounds of 2), then 511, 512, ..., 1299: 128 of the 2-token
    # rounds start below 256, plus the hand-made prompt's 4 rounds
    assert pos["0-256"]["num_rounds"] == 128 + 4
    assert pos["256-1K"]["num_rounds"] == 127 + (1024 - 511) and pos["4K+"]["num_rounds"] == 0
    assert pos["1K-4K"]["num_rounds"] == 1300 - 1024
    assert pos["0-256"]["num_prompts"] == 2 and pos["1K-4K"]["num_prompts"] == 1
    assert b["by_source"]["web"]["num_rounds"] == 1044 and b["by_source"]["code"]["tau"] == 2.5
    curve = b["tau_by_position_curve"]
    assert curve["bin_width"] == 64 and len(curve["bins"]) == 21
    assert sum(x["num_rounds"] for x in curve["bins"]) == 1044 + 4
    assert curve["bins"][0]["tau"] == (32 * 2 + 3 + 1 + 4 + 2) / 36  # offsets 1..63 of `long`: 32 rounds


def test_offsets_are_replays_anchors_and_cells_sum_to_the_totals():
    """Random sequences, planted drafts and end-of-turn ids through the real replay: the offset of each
    round re-derives its acceptance from the predictions, and every table sums to acceptance_stats."""
    rng = random.Random(0)
    for trial in range(40):
        n_prompt, length, k = rng.randint(1, 6), rng.randint(8, 60), rng.randint(1, 6)
        seq = [rng.randrange(20) for _ in range(n_prompt + length)]
        rows = [[seq[t + 2 + j] if t + 2 + j < len(seq) and rng.random() < 0.7 else 99
                 for t in range(len(seq))] for j in range(k)]
        pred = torch.tensor(rows)
        eos = {seq[n_prompt + length - 1]} if trial % 3 == 0 else set()
        cont = seq[n_prompt:]
        if eos & set(cont[:-1]):
            seq = seq[:n_prompt + cont.index(next(iter(eos))) + 1]
        results, labels = [], []
        for max_new in (len(seq) - n_prompt, max(1, (len(seq) - n_prompt) // 2)):
            res = rp.replay(pred, seq, n_prompt, k, max_new, eos)
            for o, judged, a in zip(sg.round_offsets(res), res.drafted, res.accepted):
                t = n_prompt + o - 2   # the round's anchor
                match = 0
                while match < judged and rows[match][t] == seq[t + 2 + match]:
                    match += 1
                assert a == match, (trial, o)
            results.append(res)
            labels.append(np.array([rng.randrange(4) for _ in seq[n_prompt:]], dtype=np.int8))
        stats = sd.acceptance_stats(results, k)
        b = sg.breakdown(results, labels, ["x", "y"], k, seed=0)
        for table in ("by_segment", "by_position", "by_source"):
            cells = b[table].values()
            assert sum(c["num_rounds"] for c in cells) == stats["num_rounds"], table
            assert sum(c["num_emitted"] for c in cells) == stats["num_emitted_in_rounds"], table
            assert np.sum([c["per_position_reached"] for c in cells], 0).tolist() == stats["per_position_reached"]
        assert sum(x["num_rounds"] for x in b["tau_by_position_curve"]["bins"]) == stats["num_rounds"]


def test_main_reports_segments_and_keeps_the_existing_tables(micro_target, target, prompts, tmp_path):
    make_chain(tmp_path, micro_target, target, prompts)
    stage = importlib.import_module(BENCH)
    stage.main(["--work-dir", str(tmp_path), "--num-draft-tokens", "2", "3", "--benchmark-max-new-tokens", "12",
                "--num-prompts", "3", "--loop-prompts", "0", "--device", "cpu", "--target-path", str(micro_target),
                "--replay-cache-dir", str(tmp_path / "replay_cache")])
    out = stage_dir(tmp_path, BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert m["segments"]["segments"] == list(sg.SEGMENTS)
    assert sum(m["segments"]["num_continuation_tokens_by_segment"].values()) == m["num_continuation_tokens"]
    for k, e in m["by_num_draft_tokens"].items():
        for table in ("by_segment", "by_position", "by_source"):
            assert sum(c["num_rounds"] for c in e[table].values()) == e["trained"]["num_rounds"]
            assert sum(c["num_emitted"] for c in e[table].values()) == e["trained"]["num_emitted_in_rounds"]
        assert list(e["by_source"]) == ["bench"] and e["by_source"]["bench"]["tau"] == e["tau"]
    report = (out / "report.md").read_text().split("\n")
    without = {key: v for key, v in m.items() if key != "segments"}
    rb.write_report(tmp_path, without, {"target": "T", "export": "E", "draft_vocab_size": 64})
    old = (tmp_path / "report.md").read_text().split("\n")
    # the report without segments, line for line (but the line naming target and draft), then the tables
    assert report[:2] + report[3:len(old)] == old[:2] + old[3:] and len(report) > len(old) + 20
    report = "\n".join(report)
    assert "| k | segment | tokens | rounds |" in report and "| 3 | 4K+ | 0 | 0 | empty | - |" in report
    assert (out / "tau_by_position.png").read_bytes()[:4] == b"\x89PNG"
