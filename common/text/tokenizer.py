"""Load the target's tokenizer from its model folder (the one way every stage gets it)."""
from __future__ import annotations

import json
from pathlib import Path

from common.stage import StageError


def tokenizer_kind(model_dir: str | Path) -> str:
    """"auto" when the folder brings its own tokenizer (code via auto_map / tokenization_*.py, or a
    tokenizer.json), "kimi_tiktoken" when it has only Kimi's tiktoken.model (+ template)."""
    model_dir = Path(model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    own_code = "AutoTokenizer" in (config.get("auto_map") or {}) or any(model_dir.glob("tokenization_*.py"))
    if own_code or (model_dir / "tokenizer.json").is_file():
        return "auto"
    if (model_dir / "tiktoken.model").is_file():
        return "kimi_tiktoken"
    return "auto"


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a model folder: its own code where it ships some, else Kimi's offline one."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise StageError(f"target folder {model_dir} does not exist")
    if tokenizer_kind(model_dir) == "kimi_tiktoken":
        from common.text.kimi_tokenizer import KimiK25Tokenizer

        try:
            return KimiK25Tokenizer.from_model_dir(model_dir)
        except ValueError as exc:
            raise StageError(str(exc)) from exc
    from transformers import AutoTokenizer

    # trust_remote_code: Kimi-K2.5 ships tokenization_kimi.py (tiktoken) referenced by auto_map.
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
