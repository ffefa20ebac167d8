"""05b's prompt-length buckets (`--bench-context short 16384 65536`): the timed prompts of each
bucket, built once before any server starts.

Why: speculation's gain depends on load and context. A verify round of c requests puts c x n tokens through
the target and reads c contexts' KV cache; public numbers for Kimi-K2.5 on 8x RTX PRO 6000 (vLLM TP 8, FP8 KV,
a 3-token draft) went from x1.29 at c = 1 to x0.98 at c = 128 on short prompts and x0.61 at c = 128 with 64K
context. So the sweep times a grid of concurrency x prompt length, and deploy names the best setting per cell.

- "short" = the held-out prompts as they are (the timed split: 05's first --num-prompts);
- a length L = held-out prompts of about L tokens (NEAR x L to L): the held-out split's longest prompts (the
  agentic ones) as they stand when they are that long ("natural"), else padded to that length with REAL
  context ("padded"): earlier held-out conversations' turns prepended as prior turns and rendered by the
  target's own chat template, never random tokens.

Every bucket is built from the held-out rows that are never used for warm-up or agreement (`pool`): its base
prompts and its padding alike, so no server meets a warm-up prompt's text in a timed request. Deterministic:
the same rows, order and tokenizer give the same prompts on every run.
"""
from __future__ import annotations

import statistics

from common.stage import StageError

SHORT = "short"
NEAR = 0.9  # "about L tokens": from 0.9 L to L (a prompt never exceeds its bucket: the context check holds L)
AIM = 0.95  # padding goes on to here: past NEAR, so that a bucket's prompts are not all at its lower edge


def context_level(level: dict, ctx: str) -> dict:
    """The part of one temperature level of a run (metrics `runs[key].by_temperature[T]`) that holds bucket
    `ctx`'s by_concurrency: the level itself for the short prompts (where they always were), its
    `by_context[ctx]` for a prompt-length bucket."""
    return level if ctx == SHORT else (level.get("by_context") or {}).get(ctx, {})


def measured_buckets(metrics: dict) -> list[str]:
    """The prompt buckets a sweep's runs hold: short, then each length bucket in ascending length."""
    names = {ctx for e in metrics["runs"].values() for level in e.get("by_temperature", {}).values()
             for ctx in level.get("by_context") or {}}
    return [SHORT] + sorted(names, key=int)


def parse_buckets(values) -> list[str]:
    """--bench-context's values as bucket names: "short" first (always timed, as concurrency 1 always is),
    then each length L > 0 in tokens, ascending, as a string ("16384")."""
    lengths = set()
    for v in values or []:
        if str(v).strip().lower() == SHORT:
            continue
        try:
            n = int(v)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            raise StageError(f"--bench-context {v!r}: expected 'short' or a prompt length in tokens (e.g. 16384)")
        lengths.add(n)
    return [SHORT] + [str(n) for n in sorted(lengths)]


def longest_bucket(buckets: list[str]) -> int:
    """The largest prompt length a bucket asks for (0 with short prompts only)."""
    return max([int(b) for b in buckets if b != SHORT] + [0])


def history_turns(row: dict) -> list[dict]:
    """A held-out row's turns as prior turns of another conversation: its messages without the system ones
    (one system prompt, the timed prompt's own, opens the conversation)."""
    return [m for m in row.get("messages") or [] if m.get("role") != "system"]


def padded_messages(base: dict, history: list[dict]) -> list[dict]:
    """base's messages with `history` (earlier rows, oldest first) as prior turns after its system prompt."""
    own = base.get("messages") or []
    system = [m for m in own if m.get("role") == "system"]
    return system + [m for row in history for m in history_turns(row)] + [m for m in own if m.get("role") != "system"]


def earlier_rows(pool: list[dict], at: int) -> list[dict]:
    """The rows before pool[at] in the split's order, nearest first, wrapping around (the padding's source)."""
    return [pool[(at - k) % len(pool)] for k in range(1, len(pool))]


def pad_prompt(base: dict, earlier: list[dict], length: int, encode) -> tuple[list[int], list[dict]]:
    """(prompt ids, the rows used, oldest first): base with whole earlier conversations prepended until it
    holds AIM x length to length tokens (or no earlier row fits any more). A row whose turns would overflow is
    skipped for a smaller one.

    The rows' own prompt lengths guess what they add (their rendering inside another conversation drops
    their generation prompt and any default system prompt, so it costs no more, up to a token at a seam);
    the conversation is rendered once per round of guesses and a row that overflows is dropped, so the
    target's real tokenizer has the last word on every length."""
    taken, rest = [], list(earlier)
    ids = list(base["prompt_ids"])
    while len(ids) < AIM * length and rest:
        guess, added = len(ids), []
        for row in list(rest):
            if guess + len(row["prompt_ids"]) <= length:
                added.append(row)
                rest.remove(row)
                guess += len(row["prompt_ids"])
                if guess >= AIM * length:
                    break
        if not added:
            break
        taken += added
        ids = encode(base, taken[::-1])
        while len(ids) > length:   # a guess too low: the oldest row goes (the seam of the chat format)
            taken.pop()
            ids = encode(base, taken[::-1])
    return ids, taken[::-1]


def bucket_prompts(pool: list[dict], length: int, n: int, encode) -> list[dict]:
    """The n timed prompts of the bucket of about `length` tokens, from `pool` (the held-out rows never used
    for warm-up or agreement, in the split's order). Bases: the pool's longest prompts that fit in `length`
    (longest first, ties in pool order): "natural" when one holds NEAR x length tokens or more, otherwise
    "padded" with the rows before it in the pool (pad_prompt). `encode(base, history)` -> the ids of base's
    conversation with `history` as prior turns, rendered by the target's template (render_encoder).
    Each record: id (base id @ length), base, source, thinking (the base's), prompt_ids, tokens, made, padding
    (the ids of the rows whose turns pad it, oldest first)."""
    order = {id(r): i for i, r in enumerate(pool)}
    fits = sorted((r for r in pool if len(r["prompt_ids"]) <= length),
                  key=lambda r: (-len(r["prompt_ids"]), order[id(r)]))
    if len(fits) < n:
        raise StageError(f"--bench-context {length}: {n} prompts wanted, but only {len(fits)} held-out prompts "
                         f"outside the warm-up fit in {length} tokens: lower --bench-context-prompts")
    out = []
    for base in fits[:n]:
        if len(base["prompt_ids"]) >= NEAR * length:
            ids, history, made = list(base["prompt_ids"]), [], "natural"
        elif not base.get("messages"):   # padding re-renders the conversation: it needs the turns, not just ids
            raise StageError(f"--bench-context {length}: held-out prompt {base.get('id')} has no messages (an older "
                             "01c): re-run 01c_merge_datasets.py --overwrite")
        else:
            ids, history = pad_prompt(base, earlier_rows(pool, order[id(base)]), length, encode)
            made = "padded"
        if len(ids) < NEAR * length:
            raise StageError(f"--bench-context {length}: held-out prompt {base.get('id')} reaches only {len(ids)} "
                             f"tokens with every other held-out conversation outside the warm-up prepended "
                             f"(about {length} wanted): the split holds too little text; lower the bucket")
        out.append({"id": f"{base.get('id')}@{length}", "base": base.get("id"), "source": base.get("source"),
                    "thinking": base.get("thinking"), "prompt_ids": ids, "tokens": len(ids), "made": made,
                    "padding": [r.get("id") for r in history]})
    return out


def render_encoder(tok):
    """encode(base, history) for bucket_prompts: base's messages with history's turns before them, rendered
    as 01c renders a held-out prompt (the target's chat template with base's tools and thinking switch, then
    its tokenizer without added special tokens)."""
    from common.text.chat_format import render_prompt

    def encode(base: dict, history: list[dict]) -> list[int]:
        text = render_prompt(tok, padded_messages(base, history), base.get("tools"),
                             thinking=bool(base.get("thinking", True)))
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return encode


def bucket_record(prompts: list[dict], length: int | None) -> dict:
    """metrics.json's `context_buckets[name]`: the bucket's length, its prompts' token counts and how each
    was made (natural / padded, with the rows that pad it)."""
    tokens = [p["tokens"] for p in prompts]
    made = [p.get("made", "natural") for p in prompts]
    return {"length": length, "num_prompts": len(prompts), "natural": made.count("natural"),
            "padded": made.count("padded"),
            "tokens_min": min(tokens) if tokens else None, "tokens_median": statistics.median(tokens) if tokens else None,
            "tokens_max": max(tokens) if tokens else None,
            "prompts": [{k: p.get(k) for k in ("id", "tokens", "made", "padding")} for p in prompts]}


def bucket_words(name: str, rec: dict | None) -> str:
    """A bucket as the report names it: 'short prompts' or 'prompts of ~16384 tokens (4 natural, 6 padded;
    15012-16380 tokens)'."""
    if name == SHORT:
        return "short prompts (the held-out prompts as they are)"
    if not rec:
        return f"prompts of ~{name} tokens"
    return (f"prompts of ~{name} tokens ({rec['natural']} natural, {rec['padded']} padded with earlier held-out "
            f"conversations; {rec['tokens_min']}-{rec['tokens_max']} tokens)")
