"""Load the target's tokenizer from its model folder (the one way every stage gets it)."""
from __future__ import annotations

from pathlib import Path

from common.stage import StageError


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a model folder, through AutoTokenizer (its own code where it ships some)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise StageError(f"target folder {model_dir} does not exist")
    # trust_remote_code: Kimi-K2.5 ships tokenization_kimi.py (tiktoken) referenced by auto_map.
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
