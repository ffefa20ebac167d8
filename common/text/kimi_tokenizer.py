"""Kimi-K2.5's tokenizer offline: tiktoken BPE + Kimi's pre-tokenizer + 256 special ids + K2.5 template.

Encodes exactly as Moonshot's `tokenization_kimi.py` (`TikTokenTokenizer`) does: the 163,584 BPE ranks
of `tiktoken.model`, Kimi's split pattern, special ids 163584..163839 (named ones from the table below,
the others `<|reserved_token_{id}|>`), special-token strings in the text become control tokens
(`allowed_special="all"`), and long inputs are cut at 400k chars and at runs of more than 25k
(non-)whitespace chars before BPE, as the original does.
Chat rendering goes through transformers' own `apply_chat_template` (its Jinja environment and
settings) with K2.5's `tools_ts_str` injected, as K2.5's tokenizer code does.

Use `common.text.tokenizer.load_tokenizer(path)`; this module is what it returns for a folder that has a
`tiktoken.model` but no tokenizer code, and `load_kimi_k25_tokenizer()` / `write_kimi_k25_model_dir()`
give the bundled K2.5 tokenizer with no model folder at all.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, BatchEncoding, PreTrainedTokenizer
from transformers.utils import PaddingStrategy
from transformers.tokenization_utils_base import TruncationStrategy

from common.text.kimi_tool_declaration import encode_tools_to_typescript
from common.stage import REPO_ROOT

log = logging.getLogger(__name__)

ASSET_DIR = REPO_ROOT / "assets" / "kimi_k25"
TIKTOKEN_FILE = "tiktoken.model"
TIKTOKEN_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"
NUM_BASE_TOKENS = 163_584
NUM_SPECIAL_TOKENS = 256  # ids 163584..163839; vocab 163,840
# Kimi's pre-tokenizer (tiktoken / fancy-regex syntax; `&&` is set intersection): Han runs, cased
# words with English contractions, 1-3 digit groups, punctuation runs, newlines, spaces.
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# The named special ids shared by K2 / K2.5 / K2.6 (`added_tokens_decoder` of Moonshot's
# tokenizer_config.json; docs/design.md section 6; golden ids in assets/kimi_k25/verification.txt).
SPECIAL_TOKEN_NAMES = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
    163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
    163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]",
}
ROLE_TOKENS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
# tiktoken panics on very long inputs and is quadratic on very long runs (openai/tiktoken#195);
# Kimi's code cuts there, and since the cut changes BPE merges at the seams, so must we.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def special_token_names(added_tokens_decoder: dict | None = None) -> dict[int, str]:
    """id -> name for all 256 special ids: the folder's names, else the table, else reserved."""
    names = {i: f"<|reserved_token_{i}|>" for i in range(NUM_BASE_TOKENS, NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS)}
    names.update(SPECIAL_TOKEN_NAMES)
    for key, tok in (added_tokens_decoder or {}).items():
        names[int(key)] = tok["content"] if isinstance(tok, dict) else str(tok)
    return names


SPACE = re.compile(r"\s")  # Python's \s is str.isspace(), what Kimi's splitter tests
NON_SPACE = re.compile(r"\S")


def may_have_long_run(text: str, max_run: int) -> bool:
    """False when `text` surely has no run of > max_run whitespace or non-whitespace chars.

    Such a run covers at least one whole aligned block of (max_run + 1) // 2 chars, so it is enough
    to look for a block with no whitespace or no non-whitespace: a few C-level searches per block.
    """
    step = max(1, (max_run + 1) // 2)
    for start in range(0, len(text) - step + 1, step):
        end = start + step
        if SPACE.search(text, start, end) is None or NON_SPACE.search(text, start, end) is None:
            return True
    return False


def split_run_lengths(text: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut `text` so no piece holds more than `max_run` consecutive (non-)whitespace chars.

    Same cut points as Kimi's `_split_whitespaces_or_nonwhitespaces`: a piece ends just before the
    char that would make its current run max_run + 1 long.
    """
    if not may_have_long_run(text, max_run):
        return [text]  # the common case, without a Python loop over every char
    pieces, start, run, in_space = [], 0, 0, text[0].isspace()
    for i, ch in enumerate(text):
        space = ch.isspace()
        if space != in_space:
            run, in_space = 1, space
            continue
        run += 1
        if run > max_run:
            pieces.append(text[start:i])
            start, run = i, 1
    pieces.append(text[start:])
    return pieces


def encode_pieces(text: str) -> list[str]:
    """The substrings Kimi's tokenizer hands to tiktoken one by one for `text`."""
    return [piece for i in range(0, len(text), MAX_ENCODE_CHARS)
            for piece in split_run_lengths(text[i:i + MAX_ENCODE_CHARS])]


def byte_to_unicode_table() -> dict[int, str]:
    """GPT-2's byte -> printable char map, used for token strings (`convert_ids_to_tokens`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class KimiK25Tokenizer(PreTrainedTokenizer):
    """Kimi-K2.5's tokenizer as a transformers slow tokenizer (ids, template, TS tool declarations)."""

    vocab_files_names = {"vocab_file": TIKTOKEN_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str | Path, chat_template: str | None = None,
                 added_tokens_decoder: dict | None = None, num_threads: int | None = None, **kwargs):
        self.vocab_file = str(vocab_file)
        ranks = load_tiktoken_bpe(self.vocab_file)
        if len(ranks) != NUM_BASE_TOKENS:
            raise ValueError(f"{vocab_file}: {len(ranks)} BPE ranks, Kimi's tiktoken.model has {NUM_BASE_TOKENS}")
        names = special_token_names(added_tokens_decoder)
        self.special_ids = {name: i for i, name in names.items()}
        self._tiktoken = tiktoken.Encoding(name="kimi_k25", pat_str=PAT_STR, mergeable_ranks=ranks,
                                           special_tokens=self.special_ids)
        # encode_batch threads (the BPE runs in Rust with the GIL released).
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        # Token strings in GPT-2 byte-to-unicode form, as Kimi's `_convert_id_to_token` gives them.
        to_uni = str.maketrans({chr(b): c for b, c in byte_to_unicode_table().items()})
        self._id_to_token = [b.decode("latin-1").translate(to_uni) for b, _ in
                             sorted(ranks.items(), key=lambda kv: kv[1])]
        self._id_to_token += [names[i] for i in range(NUM_BASE_TOKENS, NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS)]
        self._token_to_id = {t: i for i, t in enumerate(self._id_to_token)}
        self._byte_decoder = {c: b for b, c in byte_to_unicode_table().items()}
        # Every one of the 256 ids is an added special token (never split, scrubbed by chat_format).
        decoder = {i: AddedToken(name, special=True, normalized=False, lstrip=False, rstrip=False)
                   for i, name in names.items()}
        for key in ROLE_TOKENS:
            kwargs.pop(key, None)
        kwargs.pop("additional_special_tokens", None)
        kwargs.pop("extra_special_tokens", None)
        super().__init__(chat_template=chat_template, added_tokens_decoder=decoder,
                         additional_special_tokens=[n for n in SPECIAL_TOKEN_NAMES.values()
                                                    if n not in ROLE_TOKENS.values()],
                         clean_up_tokenization_spaces=False, model_max_length=1 << 30,
                         **ROLE_TOKENS, **kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs) -> "KimiK25Tokenizer":
        """From a folder holding `tiktoken.model` and a chat template (`chat_template.jinja` or
        `tokenizer_config.json: chat_template`); special names from its tokenizer_config if any."""
        model_dir = Path(model_dir)
        config = {}
        if (model_dir / "tokenizer_config.json").is_file():
            config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        if not template:
            raise ValueError(f"{model_dir} has tiktoken.model but no chat template "
                             "(chat_template.jinja or tokenizer_config.json: chat_template)")
        return cls(model_dir / TIKTOKEN_FILE, chat_template=template,
                   added_tokens_decoder=config.get("added_tokens_decoder"), **kwargs)

    # ---- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def __len__(self) -> int:
        return len(self._id_to_token)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_to_id)

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.special_ids["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for tok in tokens:
            if tok in self.special_ids:
                out += tok.encode("utf-8")
            else:
                out += bytes(self._byte_decoder[c] for c in tok)
        return out.decode("utf-8", errors="replace")

    # ---- encoding ---------------------------------------------------------------------------
    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Kimi's ids for each text (no BOS/EOS: Kimi adds none), BPE threaded over all pieces."""
        pieces, bounds = [], []
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"expected str, got {type(text).__name__}")
            start = len(pieces)
            pieces += encode_pieces(text)
            bounds.append((start, len(pieces)))
        encoded = self._tiktoken.encode_batch(pieces, num_threads=self.num_threads, allowed_special="all")
        out = []
        for start, end in bounds:
            ids = encoded[start] if end == start + 1 else [i for part in encoded[start:end] for i in part]
            out.append(ids)
        return out

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self._id_to_token[i] for i in self.encode_texts([text])[0]]

    def _encode_plus(self, text, text_pair=None, add_special_tokens: bool = True,
                     padding_strategy=PaddingStrategy.DO_NOT_PAD,
                     truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE, max_length=None,
                     stride: int = 0, is_split_into_words: bool = False, pad_to_multiple_of=None,
                     padding_side=None, return_tensors=None, return_token_type_ids=None,
                     return_attention_mask=None, return_overflowing_tokens: bool = False,
                     return_special_tokens_mask: bool = False, return_length: bool = False,
                     verbose: bool = True, **kwargs) -> BatchEncoding:
        # Fast path for plain strings: straight to tiktoken's threaded batch encode. Anything fancier
        # (pairs, padding, truncation, masks, control-token sanitizing) takes transformers' path,
        # which splits on the special tokens and calls `_tokenize` per chunk: the same ids.
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        plain = (text_pair is None and not is_split_into_words and not kwargs.get("sanitize_control_tokens")
                 and padding_strategy == PaddingStrategy.DO_NOT_PAD
                 and truncation_strategy == TruncationStrategy.DO_NOT_TRUNCATE
                 and not (return_overflowing_tokens or return_special_tokens_mask or return_length
                          or return_token_type_ids)
                 and all(isinstance(t, str) for t in texts))
        if not plain:
            return super()._encode_plus(
                text, text_pair=text_pair, add_special_tokens=add_special_tokens,
                padding_strategy=padding_strategy, truncation_strategy=truncation_strategy,
                max_length=max_length, stride=stride, is_split_into_words=is_split_into_words,
                pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side,
                return_tensors=return_tensors, return_token_type_ids=return_token_type_ids,
                return_attention_mask=return_attention_mask,
                return_overflowing_tokens=return_overflowing_tokens,
                return_special_tokens_mask=return_special_tokens_mask, return_length=return_length,
                verbose=verbose, **kwargs)
        # add_special_tokens is a no-op: Kimi's tokenizer adds no BOS/EOS.
        ids = self.encode_texts(texts)
        data = {"input_ids": ids if batched else ids[0]}
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_attention_mask:
            data["attention_mask"] = [[1] * len(x) for x in ids] if batched else [1] * len(ids[0])
        return BatchEncoding(data, tensor_type=return_tensors, prepend_batch_axis=not batched)

    # ---- decoding ---------------------------------------------------------------------------
    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            skip = set(self.all_special_ids)
            ids = [i for i in ids if i not in skip]
        # Invalid UTF-8 (a cut multi-byte char) becomes U+FFFD, as in Kimi's decode.
        return self._tiktoken.decode(ids)

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs):
        """K2.5's override: tools are key-sorted recursively, then written as the TypeScript block the
        template reads from `tools_ts_str`. If that fails, K2.5 logs and the template falls back to
        compact JSON; so do we. Defaults (tokenize=False, add_generation_prompt=True) are K2.5's."""
        tools = deep_sort_dict(tools) if tools else tools
        if tools:
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript(tools)
            except Exception as exc:  # noqa: BLE001 - any schema the encoder rejects means JSON, as in K2.5
                log.warning("tool declarations fall back to JSON: %s", exc)
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + TIKTOKEN_FILE)
        if Path(self.vocab_file).resolve() != out.resolve():
            shutil.copyfile(self.vocab_file, out)
        return (str(out),)


def deep_sort_dict(obj):
    """Every dict's keys sorted, recursively (K2.5 does this to `tools` before rendering)."""
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(v) for v in obj]
    return obj


def load_kimi_k25_tokenizer(**kwargs) -> KimiK25Tokenizer:
    """The bundled Kimi-K2.5 tokenizer (assets/kimi_k25), with no model folder."""
    return KimiK25Tokenizer.from_model_dir(ASSET_DIR, **kwargs)


def tokenizer_config() -> dict:
    """The tokenizer_config.json written beside a materialised tiktoken.model."""
    return {
        "offline_tokenizer": "common.text.kimi_tokenizer.KimiK25Tokenizer",
        **ROLE_TOKENS,
        "added_tokens_decoder": {str(i): {"content": n, "special": True, "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
                                 for i, n in sorted(SPECIAL_TOKEN_NAMES.items())},
        "clean_up_tokenization_spaces": False,
    }


def write_kimi_k25_model_dir(out_dir: str | Path) -> Path:
    """A model-folder-like dir for the bundled K2.5 tokenizer: tiktoken.model, tokenizer_config.json,
    chat_template.jinja, config.json, LICENSE. Point `--target-path` at it when a stage needs only the
    tokenizer and config; `load_tokenizer` and `tokenizer_identity` treat it like the real folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (TIKTOKEN_FILE, "chat_template.jinja", "config.json", "LICENSE"):
        tmp = out_dir / (name + ".tmp")
        shutil.copyfile(ASSET_DIR / name, tmp)
        os.replace(tmp, out_dir / name)
    tmp = out_dir / "tokenizer_config.json.tmp"
    tmp.write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / "tokenizer_config.json")
    return out_dir
