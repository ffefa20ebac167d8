"""What 05 (the reference benchmark) and 05b (the serving one) both read and check before they write:
04's export, 01c's held-out prompts split once, the target, the declared --draft folders, and the flags
they share.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from common.benchmark import compare as cmp
from common.draft.manifest import DraftManifest
from common.io import iter_jsonl
from common.stage import (MERGE, StageError, TRAIN, changed_file, check_same_tokenizer, require_complete, resolve_target,
                          stage_dir)


class Repeated(argparse.Action):
    """A list flag that may be given more than once (`--draft a=X --draft b=Y`, or `--draft a=X b=Y`); its
    first use on the command line replaces a preset's list instead of adding to it (the command line wins)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        fresh = current is self.default or not isinstance(current, list)   # the default or parse_args' marker
        setattr(namespace, self.dest, ([] if fresh else current) + list(values))


def add_benchmark_flags(group, *, draft: str, num_prompts: str, bench_seed: str, acceptance_temperatures: str) -> None:
    """The flags 05 and 05b both take, declared once: their names, types, defaults and units are the same in
    both stages (one flat preset feeds both). Each keyword is that flag's help in the calling stage, where
    its use differs (05 replays the drafts in-process; 05b serves them)."""
    group.add_argument("--draft", nargs="+", action=Repeated, default=[], metavar="NAME=PATH", help=draft)
    group.add_argument("--benchmark-max-new-tokens", type=int, default=256,
                       help="generation cap of every measured answer (tokens)")
    group.add_argument("--num-prompts", type=int, default=None, help=num_prompts)
    group.add_argument("--target-path", type=Path, default=None,
                       help="target model folder; read from the 04 manifest, and when given it must match")
    group.add_argument("--bench-seed", type=int, default=0, help=bench_seed)
    group.add_argument("--acceptance-temperatures", type=float, nargs="+", default=[0.0],
                       help=acceptance_temperatures)
    group.add_argument("--acceptance-top-p", type=float, default=1.0,
                       help="top-p (0-1] of the sampling at every --acceptance-temperatures T > 0")


def given_mode(argv: list[str]) -> str | None:
    """The value of a `--mode` on the command line, '' without one after it, None when absent: 05 had a
    --mode (reference | server) until the serving benchmark became 05b, and old command lines still say it."""
    for i, word in enumerate(argv):
        if word == "--mode":
            return argv[i + 1] if i + 1 < len(argv) else ""
        if word.startswith("--mode="):
            return word.partition("=")[2]
    return None


def check_shared_flags(args) -> None:
    """The flags both stages take, a preset's YAML scalar made a list, checked before anything is read."""
    if isinstance(args.acceptance_temperatures, (int, float)):
        args.acceptance_temperatures = [args.acceptance_temperatures]
    if isinstance(args.draft, str):
        args.draft = [args.draft]
    if args.benchmark_max_new_tokens < 1:
        raise StageError("--benchmark-max-new-tokens must be >= 1")
    if any(t < 0 for t in args.acceptance_temperatures) or not 0 < args.acceptance_top_p <= 1:
        raise StageError("--acceptance-temperatures must be >= 0 and --acceptance-top-p in (0, 1]")


class Inputs(NamedTuple):
    export_dir: Path | None  # 04's SGLang export (None: 05b without 04, load_inputs_without_04)
    m04: DraftManifest   # 04's manifest (empty without 04)
    rows: list[dict]     # the timed (05b) or measured (05) held-out prompts
    warm: list[dict]     # 05b: held-out prompts never timed, for the warm-up and the agreement check
    pool: list[dict]     # every held-out row but the warm-up ones, in the split's order (05b's --bench-context)
    m01c: dict | None = None  # 01c's manifest: the tokenizer and target identity when there is no 04


def load_inputs(work_dir: Path, num_prompts: int | None, num_warm: int = 0) -> Inputs:
    """Check 04 and 01c (the same tokenizer) and split the held-out prompts once (split_prompts)."""
    draft_dir = stage_dir(work_dir, TRAIN)
    m04 = DraftManifest.require(draft_dir)
    export_dir = draft_dir / "export_sglang"
    if not (export_dir / "config.json").is_file() or not (export_dir / "model.safetensors").is_file():
        raise StageError(f"{export_dir} lacks config.json/model.safetensors: re-run `python 04_train.py "
                         "--overwrite`")
    check_export(export_dir, m04)
    merged = stage_dir(work_dir, MERGE)
    m01c = require_complete(merged, MERGE)
    check_same_tokenizer(m01c["tokenizer"], m04.tokenizer, merged, MERGE)
    return Inputs(export_dir, m04, *held_out_split(merged, num_prompts, num_warm), m01c)


def load_inputs_without_04(work_dir: Path, num_prompts: int | None, num_warm: int = 0) -> Inputs:
    """05b before 04 (the break-even map before training: docs/serving.md; a public draft served alone): 01c's
    held-out prompts split as load_inputs splits them; the drafts are the declared --draft ones, the target
    01c's (or a --target-path with its tokenizer and config: target_and_drafts)."""
    merged = stage_dir(work_dir, MERGE)
    m01c = require_complete(merged, MERGE)
    return Inputs(None, DraftManifest.from_dict({}), *held_out_split(merged, num_prompts, num_warm), m01c)


def held_out_split(merged: Path, num_prompts: int | None, num_warm: int) -> tuple[list, list, list]:
    """(timed rows, warm rows, pool) of 01c's held-out prompts (split_prompts; the pool: every row but the warm)."""
    held_out = list(iter_jsonl(merged / "benchmark_prompts.jsonl"))
    rows, warm = split_prompts(held_out, num_prompts, num_warm, merged / "benchmark_prompts.jsonl")
    if not rows:
        raise StageError(f"{merged / 'benchmark_prompts.jsonl'} holds no prompts: re-run 01c with "
                         "--benchmark-size > 0")
    pool = [r for r in spread_over_sources(held_out, len(held_out)) if all(r is not w for w in warm)]
    return rows, warm, pool


def check_export(folder: Path, m04: DraftManifest) -> None:
    """One of 04's export folders holds the bytes 04's manifest recorded for it (`export_files`): an export
    edited, cut short or swapped since 04 stops the stage in one line naming the file, before any use (a
    corrupted copy can still hold finite values). A manifest from before 04 recorded them is not checked."""
    recorded = (m04.raw.get("export_files") or {}).get(folder.name)
    problem = None if recorded is None else changed_file(folder, recorded)
    if problem:
        raise StageError(f"{problem} (04's manifest records each exported file's size and sha256): restore "
                         "04's export or re-run `python 04_train.py --overwrite`")


def split_prompts(rows: list[dict], num_timed: int | None, num_warm: int, where: Path) -> tuple[list, list]:
    """(timed rows, warm-up rows), split once. 05 (num_warm 0): --num-prompts rows taken in turn from each
    source (spread_over_sources), or all. 05b: in that same order, the first --num-prompts (default: all but
    num_warm) are timed and the next num_warm warm every server up and feed the agreement check, so no
    server has seen a timed prompt before it is timed (a prefix cache or warm state would favour whichever
    server saw it)."""
    if not num_warm:
        return (rows if num_timed is None else spread_over_sources(rows, num_timed)), []
    order = spread_over_sources(rows, len(rows))
    timed = len(order) - num_warm if num_timed is None else num_timed
    if timed < 1 or timed + num_warm > len(order):
        raise StageError(f"{where} holds {len(order)} held-out prompts; 05b needs "
                         f"{'--num-prompts ' + str(num_timed) if num_timed is not None else 'at least one'} timed "
                         f"and {num_warm} more, never timed, for the warm-up and agreement requests "
                         "(max of --warmup-requests, --agreement-prompts): lower them or re-run 01c with a larger "
                         "--benchmark-size")
    return order[:timed], order[timed:timed + num_warm]


def spread_over_sources(rows: list[dict], n: int) -> list[dict]:
    """n rows taken in turn from each source, each source in file order: 01c writes the held-out prompts
    source by source, so the first n alone could leave whole datasets (the tool calls) out."""
    order, seen, keys = {}, {}, []
    for r in rows:
        src = order.setdefault(r.get("source"), len(order))
        keys.append((seen.get(src, 0), src))
        seen[src] = seen.get(src, 0) + 1
    return [rows[i] for i in sorted(range(len(rows)), key=keys.__getitem__)[:n]]


def target_and_drafts(args, m04: DraftManifest, m01c: dict | None = None) -> tuple[Path, dict]:
    """The target (--target-path, which must be 04's, else 04's; without 04 (`m01c`), 01c's) and every --draft
    checked against it (compare.check_drafts): a draft that does not fit stops the stage before it writes."""
    specs = cmp.parse_specs(args.draft)
    target_dir = (resolve_target(args.target_path, m04.raw, stage_dir(args.work_dir, TRAIN), TRAIN) if m04.raw
                  else resolve_target(args.target_path, m01c, stage_dir(args.work_dir, MERGE), MERGE))
    return target_dir, cmp.check_drafts(specs, target_dir)


def drafts_identity(checked: dict) -> dict:
    """The manifest's record of the --draft folders: {name: {path, layout, sha256}}."""
    return {n: {key: d.identity()[key] for key in ("path", "layout", "sha256")} for n, (d, _) in checked.items()}
