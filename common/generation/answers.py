"""The text decides, the ids are checked: what 01b believes of an answer's token ids, and what 01c trains on.

A server's answer holds its text, its token ids (vLLM's `token_ids`; SGLang's /v1/completions sends none)
and its own count (`usage.completion_tokens`). 01c trains on the ids, so they must be the tokens of the
text: decoded with the target's tokenizer (special tokens kept) they give the text back. Comparing them
with the text's re-tokenization instead would refuse right answers: a model may emit a non-canonical
split of its own text (the random micro target does it often; tests/stages/test_01c_merge.py), which decodes to
the same text. What decoding cannot tell apart: detokenizers write a cut multi-byte character (at the
token cap, or mid-answer in a random model's bytes) as one or more U+FFFD, or hold it back; U+FFFD is left
out of both sides before they are compared.

Found by checks from outside (issue 34): a proxy that returns another tokenizer's `token_ids` with the
right text, and a server whose usage counts are wrong (doubled).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"
# How many of one server's answers with ids must have been checked before "most disagree" stops the run
# (01b): fewer could be a few bad answers in a row, which are retried and recorded one by one.
MOST_OF_AT_LEAST = 8


def decoded(tok, ids: list[int]) -> str:
    """The text of `ids` as the target's tokenizer writes it: special tokens kept, no clean-up of spaces."""
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def ids_fault(tok, text: str, ids: list[int], count: int | None) -> str | None:
    """Why `ids` are not the tokens of `text` (or not the `count` the server reported), else None."""
    if count is not None and count != len(ids):
        return f"usage.completion_tokens {count}, but {len(ids)} token ids came back"
    got = decoded(tok, ids)
    ours, theirs = got.replace(REPLACEMENT, ""), text.replace(REPLACEMENT, "")
    if ours == theirs:
        return None
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"its {len(ids)} token ids decode to other text than it sent (first difference at character {k}: "
            f"ids {ours[k:k + 20]!r}, text {theirs[k:k + 20]!r})")


def most_disagree(bad: int, checked: int) -> bool:
    """True when more than half of at least MOST_OF_AT_LEAST checked answers disagree."""
    return checked >= MOST_OF_AT_LEAST and 2 * bad > checked
