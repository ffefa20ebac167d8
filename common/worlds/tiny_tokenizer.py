"""A small byte-level BPE tokenizer with Kimi-K2.5's special tokens and chat template."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.stage import REPO_ROOT

KIMI_TEMPLATE = REPO_ROOT / "assets" / "kimi_k25" / "chat_template.jinja"
# Kimi-K2.5's named special tokens, in Kimi's id order (real ids 163584...; here they come first).
KIMI_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
    "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>",
    "<|media_pad|>", "<think>", "</think>", "[UNK]", "[PAD]",
)


def build_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path):
    """Train byte-level BPE on `texts`, add Kimi's specials and template, save_pretrained to out_dir.

    Deterministic for the same texts in the same order. Returns the PreTrainedTokenizerFast.
    """
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(KIMI_SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
        pad_token="[PAD]", chat_template=KIMI_TEMPLATE.read_text(),
        additional_special_tokens=[t for t in KIMI_SPECIAL_TOKENS
                                   if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")])
    fast.model_max_length = 1 << 20
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
