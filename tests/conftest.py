"""Shared fixtures: a micro Kimi-shaped target (random DeepSeek-V3 + Kimi-special BPE tokenizer)."""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def stdlib_texts(limit: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def make_micro_target(out_dir: Path, seed: int = 0, vocab_size: int = 600) -> Path:
    from common.worlds.tiny_target import save_random_target
    from common.worlds.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(stdlib_texts(12), vocab_size, out_dir)
    save_random_target(out_dir, tok, seed=seed, hidden_size=32, num_hidden_layers=8,
                       moe_intermediate_size=32, intermediate_size=64)
    return out_dir


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory) -> Path:
    """A model folder: random 8-layer DeepseekV3 (hidden 32) with a 600-token Kimi-special tokenizer."""
    return make_micro_target(tmp_path_factory.mktemp("micro_target"))


@pytest.fixture(scope="session")
def other_micro_target(tmp_path_factory) -> Path:
    """Same shape, different tokenizer (other vocab size): for mismatch-refusal tests."""
    return make_micro_target(tmp_path_factory.mktemp("other_target"), seed=1, vocab_size=700)
