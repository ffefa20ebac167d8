"""Where the draft fails: tau and per-position acceptance split by what is being drafted, by how far
into the target's answer, and by source dataset (05, the reference benchmark).

Segments. Every token of the target's greedy continuation gets one label:
  reasoning  inside `<think>...</think>` (Kimi: the prompt ends in `<think>` when thinking is on, so the
             continuation starts here; `start_segment` reads the prompt's last think marker);
  answer     visible answer text (everything not in another segment, the end-of-turn token included);
  code       a fenced ``` block in the answer, both fence lines included;
  tool_call  a tool-call section, `<|tool_calls_section_begin|>` .. `<|tool_calls_section_end|>`:
             the per-call markers, the `functions.NAME:IDX` id and the argument JSON.
A marker belongs to the segment it opens or closes (`</think>` is reasoning, both section markers
are tool_call, both fences are code): drafting it is predicting where that segment ends or starts.
Think and tool markers are recognised by id, and only when the tokenizer has them as ONE special token
(Kimi, the tiny world); a ChatML target such as SmolLM2 has none, so its segments are answer and code.
Every token holding part of a fence belongs to the segment that fence opens or closes (" ```"
opening a block is code, and so is "```" + newlines closing it). Fences count only in the answer (a
``` inside reasoning or inside tool arguments is text of that segment); every ``` there toggles code,
at a line start or not (the tiny target writes `</think>```python`). A tool section that begins
in reasoning (no `</think>` before it) or inside an unclosed block ends that segment.

Attribution. A round of common/benchmark/spec_decode.py starts at anchor t = n_ctx - 1 with the pending
token x[n_ctx] already committed; its first draft proposes x[n_ctx + 1]. The round belongs to the
segment and output position of THAT token: continuation offset o_r = 1 + (tokens committed by earlier
rounds), since the prefill commits offset 0 and every round commits `emitted` tokens (commit_round's
accounting, the loop's and replay's alike). Position = o_r = tokens of the continuation (reasoning
included) before the first drafted token. Tau of a cell = tokens committed / rounds of its rounds, so
summed over segments (or buckets, or sources) the totals are the overall tau's; per-position
acceptance in a cell counts exactly as spec_decode.acceptance_stats does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.benchmark import replay as rp
from common.benchmark.formatting import fmt, fmt_ci
from common.benchmark.spec_decode import SpecResult
from common.io import atomic_path
from common.text.chat_format import THINK_END, TOOL_SECTION_BEGIN, TOOL_SECTION_END

SEGMENTS = ("reasoning", "answer", "code", "tool_call")
REASONING, ANSWER, CODE, TOOL_CALL = range(len(SEGMENTS))
THINK_BEGIN = "<think>"  # the generation prompt's last token with thinking on (common/text/target_format.py)
FENCE = re.compile("```")
# Report buckets of output position (tokens into the continuation): [start, end), end None = open.
POSITION_BUCKETS = ((0, 256, "0-256"), (256, 1024, "256-1K"), (1024, 4096, "1K-4K"), (4096, None, "4K+"))
MIN_CI_PROMPTS = 5       # a cell gets a bootstrap interval only when this many prompts have rounds in it
MAX_CURVE_BINS = 24      # tau_by_position.png: at most this many bins (curve_bin_width)

# Events: what a marker does in each state -> (new state, marker belongs to the new segment).
_THINK_B, _THINK_E, _TOOL_B, _TOOL_E, _FENCE = range(5)
_TRANSITIONS = {
    (ANSWER, _THINK_B): (REASONING, True),
    (REASONING, _THINK_E): (ANSWER, False),
    (REASONING, _TOOL_B): (TOOL_CALL, True), (ANSWER, _TOOL_B): (TOOL_CALL, True),
    (CODE, _TOOL_B): (TOOL_CALL, True),
    (TOOL_CALL, _TOOL_E): (ANSWER, False),
    (ANSWER, _FENCE): (CODE, True), (CODE, _FENCE): (ANSWER, False),
}


@dataclass(frozen=True)
class SegmentMarkers:
    """Ids of the markers the target's tokenizer has as single special tokens (None: it has none)."""
    think_begin: int | None
    think_end: int | None
    tool_begin: int | None
    tool_end: int | None

    def events(self) -> dict[int, int]:
        ids = (self.think_begin, self.think_end, self.tool_begin, self.tool_end)
        return {i: ev for ev, i in enumerate(ids) if i is not None}

    def as_dict(self) -> dict:
        return {THINK_BEGIN: self.think_begin, THINK_END: self.think_end,
                TOOL_SECTION_BEGIN: self.tool_begin, TOOL_SECTION_END: self.tool_end}


def segment_markers(tokenizer) -> SegmentMarkers:
    """The think and tool-section markers as ids, each only where the tokenizer encodes its string as one
    special token (a ChatML tokenizer spells `<think>` as plain text: no marker)."""
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}

    def one(s):
        ids = tokenizer.encode(s, add_special_tokens=False)
        return ids[0] if s in specials and len(ids) == 1 else None
    return SegmentMarkers(one(THINK_BEGIN), one(THINK_END), one(TOOL_SECTION_BEGIN), one(TOOL_SECTION_END))


def start_segment(prompt_ids: list[int], markers: SegmentMarkers) -> int:
    """reasoning when the prompt's last think marker is `<think>` (thinking on), else answer."""
    if markers.think_begin is None or markers.think_end is None:
        return ANSWER
    ids = np.asarray(prompt_ids)
    last = [np.flatnonzero(ids == m) for m in (markers.think_begin, markers.think_end)]
    begin, end = (int(x[-1]) if x.size else -1 for x in last)
    return REASONING if begin > end else ANSWER


def decode_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens kept; a cut multi-byte character decodes to U+FFFD, which
    never hides an ASCII fence)."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def label_tokens(ids: list[int], pieces: list[str], markers: SegmentMarkers, start: int) -> np.ndarray:
    """[L] int8 segment index per token (module doc). Vectorised but for the walk over the markers."""
    n = len(ids)
    assert len(pieces) == n, (len(pieces), n)
    if n == 0:
        return np.zeros(0, dtype=np.int8)
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=n)
    ends = np.cumsum(lens)
    starts = ends - lens
    fence_chars = np.fromiter((m.start() for m in FENCE.finditer("".join(pieces))), dtype=np.int64)
    # the tokens holding each fence's first and last character (a fence may be cut between tokens)
    fence_first = np.searchsorted(ends, fence_chars, side="right")
    fence_last = np.searchsorted(ends, fence_chars + len(FENCE.pattern) - 1, side="right")
    kinds = markers.events()
    ids_arr = np.asarray(ids)
    marker_toks = np.flatnonzero(np.isin(ids_arr, list(kinds))) if kinds else np.zeros(0, dtype=np.int64)
    events = sorted([(int(starts[t]), int(t), int(t), kinds[int(ids_arr[t])]) for t in marker_toks]
                    + [(int(c), int(a), int(b), _FENCE) for c, a, b in zip(fence_chars, fence_first, fence_last)])
    # change points: tokens >= change_at[i] (up to the next change) are in change_state[i]
    change_at, change_state, state = [0], [start], start
    for _, first, last, ev in events:
        hit = _TRANSITIONS.get((state, ev))
        if hit is None:
            continue
        state, opens = hit
        at = first if opens else last + 1   # every token holding part of the marker is inside
        while change_at and change_at[-1] >= at:  # a later marker in the same token decides it
            change_at.pop()
            change_state.pop()
        change_at.append(at)
        change_state.append(state)
    which = np.searchsorted(np.asarray(change_at), np.arange(n), side="right") - 1
    return np.asarray(change_state, dtype=np.int8)[which]


def label_continuations(tokenizer, rows: list[dict], conts: list[list[int]]) -> tuple[list[np.ndarray], dict]:
    """Segment labels of each row's continuation, and a summary for metrics.json (markers, starts,
    token counts per segment)."""
    markers = segment_markers(tokenizer)
    labels, starts = [], [0] * len(SEGMENTS)
    for row, cont in zip(rows, conts):
        start = start_segment(row["prompt_ids"], markers)
        starts[start] += 1
        labels.append(label_tokens(cont, decode_pieces(tokenizer, cont), markers, start))
    counts = np.bincount(np.concatenate(labels), minlength=len(SEGMENTS)) if labels else np.zeros(len(SEGMENTS))
    return labels, {"segments": list(SEGMENTS), "markers": markers.as_dict(),
                    "continuations_starting_in": dict(zip(SEGMENTS, starts)),
                    "num_continuation_tokens_by_segment": {s: int(c) for s, c in zip(SEGMENTS, counts)}}


def round_offsets(res: SpecResult) -> np.ndarray:
    """[R] continuation offset of the first token each round drafts (module doc)."""
    emitted = np.asarray(res.emitted, dtype=np.int64)
    return 1 + np.concatenate([[0], np.cumsum(emitted)[:-1]]) if emitted.size else emitted


@dataclass
class Rounds:
    """Every round of a set of prompts as flat arrays [R]."""
    prompt: np.ndarray     # index of its prompt
    offset: np.ndarray     # continuation offset of its first drafted token
    segment: np.ndarray    # segment of that token
    drafted: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray
    num_prompts: int


def _flat(parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, dtype=np.int64)


def collect_rounds(results: list[SpecResult], labels: list[np.ndarray]) -> Rounds:
    """results[i] and labels[i]: one prompt's rounds and the segment of each continuation token."""
    assert len(results) == len(labels)
    offs = [round_offsets(r) for r in results]
    for r, o, lab in zip(results, offs, labels):
        assert not o.size or o[-1] < min(len(r.tokens), len(lab)), "a round starts past the continuation"
    return Rounds(prompt=_flat([np.full(len(o), i) for i, o in enumerate(offs)]), offset=_flat(offs),
                  segment=_flat([lab[o] for lab, o in zip(labels, offs)]),
                  drafted=_flat([r.drafted for r in results]), accepted=_flat([r.accepted for r in results]),
                  emitted=_flat([r.emitted for r in results]), num_prompts=len(results))


def cell_stats(rounds: Rounds, mask: np.ndarray, k: int, seed: int) -> dict:
    """tau, its bootstrap interval over prompts (when MIN_CI_PROMPTS prompts have rounds here), counts
    and per-position acceptance of the rounds in `mask`."""
    prompt, drafted, accepted = rounds.prompt[mask], rounds.drafted[mask], rounds.accepted[mask]
    emitted = rounds.emitted[mask]
    num = np.bincount(prompt, weights=emitted, minlength=rounds.num_prompts)
    den = np.bincount(prompt, minlength=rounds.num_prompts)
    num_prompts = int((den > 0).sum())
    ci = (rp.bootstrap_ratio(num.tolist(), den.tolist(), seed=seed) if num_prompts >= MIN_CI_PROMPTS
          else (None, None))
    j = np.arange(k)[None, :]
    reached = (j < np.minimum(drafted, accepted + 1)[:, None]).sum(0)   # as acceptance_stats counts
    hit = (j < accepted[:, None]).sum(0)
    n = int(mask.sum())
    return {"tau": float(emitted.sum()) / n if n else None, "tau_ci95": list(ci), "num_rounds": n,
            "num_emitted": int(emitted.sum()), "num_prompts": num_prompts,
            "per_position_acceptance": [int(h) / int(r) if r else None for h, r in zip(hit, reached)],
            "per_position_reached": [int(r) for r in reached]}


def curve_bin_width(max_offset: int) -> int:
    """The curve's bin width: the smallest power of two >= 16 covering offsets 0..max_offset in at most
    MAX_CURVE_BINS bins."""
    width = 16
    while (max_offset + 1) > width * MAX_CURVE_BINS:
        width *= 2
    return width


def breakdown(results: list[SpecResult], labels: list[np.ndarray], sources: list[str], k: int,
              seed: int) -> dict:
    """By segment, by position bucket, by source and the fine position curve, for one k."""
    r = collect_rounds(results, labels)
    by_segment = {s: cell_stats(r, r.segment == i, k, seed) for i, s in enumerate(SEGMENTS)}
    by_position = {name: cell_stats(r, (r.offset >= lo) & ((r.offset < hi) if hi else True), k, seed)
                   for lo, hi, name in POSITION_BUCKETS}
    source = np.asarray(sources, dtype=object)[r.prompt]                   # [R]
    by_source = {s: cell_stats(r, source == s, k, seed) for s in sorted(set(sources))}
    last = int(r.offset.max()) if r.offset.size else -1
    width = curve_bin_width(max(last, 0))
    bins = []
    for lo in range(0, last + 1, width):
        c = cell_stats(r, (r.offset >= lo) & (r.offset < lo + width), k, seed)
        bins.append({"start": lo, "end": lo + width, "tau": c["tau"], "tau_ci95": c["tau_ci95"],
                     "num_rounds": c["num_rounds"], "num_prompts": c["num_prompts"]})
    return {"by_segment": by_segment, "by_position": by_position, "by_source": by_source,
            "tau_by_position_curve": {"bin_width": width, "bins": bins}}


def report_lines(metrics: dict) -> list[str]:
    """report.md's section: one table per breakdown, rows by k (trained draft)."""
    per_k = metrics["by_num_draft_tokens"]
    summary = metrics["segments"]
    tokens = summary["num_continuation_tokens_by_segment"]
    total = sum(tokens.values()) or 1
    lines = ["## Where the draft fails (trained draft)", "",
             "A round belongs to the segment and output position of the first token it drafts; tau = tokens "
             "committed / rounds over that cell's rounds (the cells of one table sum to the overall totals); "
             "per position = P(draft j accepted | drafts 1..j-1 accepted) in the cell. 95% intervals "
             f"resample prompts and need rounds from {MIN_CI_PROMPTS}+ prompts; `empty` = no round. Segments "
             "(common/benchmark/segments.py): reasoning in `<think>` (`</think>` included), answer text, "
             "code = fenced ``` blocks of the answer (fences included), tool_call = tool-call sections "
             "(markers, call ids, argument JSON). Continuations starting in reasoning: "
             f"{summary['continuations_starting_in']['reasoning']}/{metrics['num_prompts']}.", "",
             "By segment (tokens = continuation tokens in the segment, all prompts):", "",
             "| k | segment | tokens | rounds | prompts | tau | 95% CI | per position |",
             "|---|---|---|---|---|---|---|---|"]
    for k, e in per_k.items():
        for s, c in e["by_segment"].items():
            lines.append(f"| {k} | {s} | {tokens[s]} ({100 * tokens[s] / total:.0f}%) | {c['num_rounds']} | "
                         f"{c['num_prompts']} | {_cell_tau(c)} | {fmt_ci(c['tau_ci95'])} | "
                         f"[{', '.join(fmt(p) for p in c['per_position_acceptance'])}] |")
    lines += ["", "By output position (tokens of the continuation, reasoning included, before the round's first "
              "drafted token; the finer curve: tau_by_position.png):", "",
              "| k | position | rounds | prompts | tau | 95% CI |", "|---|---|---|---|---|---|"]
    for k, e in per_k.items():
        for b, c in e["by_position"].items():
            lines.append(f"| {k} | {b} | {c['num_rounds']} | {c['num_prompts']} | {_cell_tau(c)} | "
                         f"{fmt_ci(c['tau_ci95'])} |")
    lines += ["", "By source dataset (the held-out row's `source`):", "",
              "| k | source | rounds | prompts | tau | 95% CI |", "|---|---|---|---|---|---|"]
    for k, e in per_k.items():
        for s, c in e["by_source"].items():
            lines.append(f"| {k} | {s} | {c['num_rounds']} | {c['num_prompts']} | {_cell_tau(c)} | "
                         f"{fmt_ci(c['tau_ci95'])} |")
    return lines + [""]


def _cell_tau(c: dict) -> str:
    return "empty" if not c["num_rounds"] else fmt(c["tau"])


def plot_tau_by_position(out: Path, metrics: dict) -> None:
    """tau_by_position.png: tau per position bin (95% band where it exists), one line per k, and the
    rounds per bin below it (so thin bins are visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    per_k = metrics["by_num_draft_tokens"]
    width = 1
    for c, (k, e) in enumerate(per_k.items()):
        curve = e["tau_by_position_curve"]
        width = curve["bin_width"]
        bins = curve["bins"]
        mid = np.array([(b["start"] + b["end"]) / 2 for b in bins])
        tau = np.array([np.nan if b["tau"] is None else b["tau"] for b in bins])
        lo = np.array([np.nan if b["tau_ci95"][0] is None else b["tau_ci95"][0] for b in bins])
        hi = np.array([np.nan if b["tau_ci95"][1] is None else b["tau_ci95"][1] for b in bins])
        ax.plot(mid, tau, "-o", ms=3, color=f"C{c}", label=f"k={k} (overall tau {fmt(e['tau'])})")
        ax.fill_between(mid, lo, hi, color=f"C{c}", alpha=0.15, lw=0)
        ax.axhline(e["tau"], color=f"C{c}", ls=":", lw=0.8)
        shift = (c - (len(per_k) - 1) / 2) * width / (len(per_k) + 1)
        ax_n.bar(mid + shift, [b["num_rounds"] for b in bins], width=width / (len(per_k) + 1), color=f"C{c}")
    for lo, _, _ in POSITION_BUCKETS[1:]:
        for a in (ax, ax_n):
            a.axvline(lo, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("tau (committed / round)")
    ax.set_title(f"EAGLE-3 tau against output position ({width}-token bins, greedy, reference)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax_n.set_ylabel("rounds")
    ax_n.set_xlabel("tokens into the continuation at the round's first drafted token")
    ax_n.grid(alpha=0.3)
    xmax = max((b["end"] for e in per_k.values() for b in e["tau_by_position_curve"]["bins"]), default=width)
    ax.set_xlim(0, xmax)
    fig.tight_layout()
    with atomic_path(Path(out) / "tau_by_position.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
