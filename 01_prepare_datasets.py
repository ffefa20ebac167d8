"""Prepare datasets: raw chat data -> unified prompt records, one folder per dataset.

Reads:  the datasets of --datasets; the tokenizer of --target-path (for scrubbing)
Writes: <work-dir>/01_prepared/<dataset>/{records.jsonl, manifest.json}, <work-dir>/01_prepared/manifest.json
Real:   python 01_prepare_datasets.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3
Tiny:   python 01_prepare_datasets.py --config configs/tiny.yaml --work-dir runs/tiny

Each dataset (a hub id with config and split, or local JSONL / JSON / parquet) is mapped to chat
records by its adapter (common/datasets/), cut to a prompt whose next assistant turn the target writes
in 01b (the mix's `cut`, `thinking-ratio`, `filters`, `max-records`: common/datasets/mix.py), its
tool-call ids rewritten to Kimi's `functions.NAME:IDX` (Kimi-format targets only) and literal
special-token strings scrubbed. The target's text format (its template, end of turn, whether it renders
thinking, tools and tool calls; common/text/target_format.py) decides what survives, and is recorded.
Each prompt is marked `normal` (prompt + --max-new-tokens fits --max-context) or `long` (fits
--long-context; 01b runs those at lower concurrency), else dropped. Unusable rows are skipped and counted
by reason (`skipped`), rows a filter drops apart from them (`filtered`).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

from datasets import load_dataset
from jinja2 import TemplateError

from common.config import base_parser, parse_args
from common.datasets.mix import ADAPTERS, MIX_SPEC_KEYS, BadRow, FilteredRow, check_mix_spec, expand_row, length_partition
from common.io import write_jsonl
from common.stage import (PREPARE, StageError, is_complete, read_manifest, stage_dir, start_stage, target_identity,
                          tokenizer_identity, write_manifest)
from common.text.chat_format import render_prompt, special_token_pattern
from common.text.target_format import FormatError, load_target_format, render_final_turn
from common.text.tokenizer import load_tokenizer

STAGE = PREPARE
SPEC_KEYS = {"name", "adapter", "path", "hf-id", "hf-config", "split", "max-rows", "complete",
             "max-records", "benchmark-only"} | MIX_SPEC_KEYS
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def dataset_list(value):
    """--datasets: a list of dicts (from YAML) or the same list as JSON text (command line)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--datasets must be a JSON list of objects: {e}") from None
    return value


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("prepare")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder (HF layout with tokenizer); its tokenizer defines the text format")
    g.add_argument("--datasets", type=dataset_list, default=None,
                   help='list of {name, adapter, path} or {name, adapter, hf-id, hf-config, split}, optional '
                        'max-rows (rows read), complete (true: last assistant turn is the target\'s own) and '
                        'benchmark-only (true: held out whole for 05, never trained, not generated); '
                        f'JSON on the command line. Adapters: {", ".join(ADAPTERS)}')
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with thinking on (generation prompt ends with <think>) for "
                        "datasets without a thinking-ratio")
    g.add_argument("--thinking-ratio", type=float, default=None,
                   help="share of prompts rendered with thinking on, per record id, for datasets without "
                        "their own thinking-ratio; none: --thinking for all")
    g.add_argument("--mix-seed", type=int, default=0,
                   help="seed of the data mix: random trajectory cuts and thinking choices here, held-out choice and "
                        "subsampling in 01c (one key for both in a preset)")
    g.add_argument("--max-new-tokens", type=int, default=4096, help="generation cap per response (tokens)")
    g.add_argument("--max-context", type=int, default=10240,
                   help="prompt + response limit of the normal partition (tokens)")
    g.add_argument("--long-context", type=int, default=None,
                   help="prompt + response limit of the long partition (tokens); none: no long partition")
    g.add_argument("--tools-not-rendered", choices=("drop", "keep", "refuse"), default="drop",
                   help="records with tools or tool calls the target's chat template does not render (e.g. "
                        "ChatML): drop (skip, counted by reason), keep (rendered without them, counted), or "
                        "refuse (stop)")
    return p


def check_specs(specs) -> list[dict]:
    if not isinstance(specs, list) or not specs:
        raise StageError("--datasets must name at least one dataset: a list of {name, adapter, path} "
                         "or {name, adapter, hf-id, hf-config, split}")
    names = set()
    for spec in specs:
        if not isinstance(spec, dict):
            raise StageError(f"--datasets entry {spec!r} is not a mapping")
        unknown = set(spec) - SPEC_KEYS
        if unknown:
            raise StageError(f"dataset {spec.get('name')!r}: unknown key(s) {sorted(unknown)}; "
                             f"allowed: {sorted(SPEC_KEYS)}")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name) or name in names:
            raise StageError(f"dataset name {name!r} must be unique and made of letters, digits, _ . -")
        names.add(name)
        if spec.get("adapter") not in ADAPTERS:
            raise StageError(f"dataset {name}: adapter {spec.get('adapter')!r} is not one of {sorted(ADAPTERS)}")
        if ("path" in spec) == ("hf-id" in spec):
            raise StageError(f"dataset {name}: give exactly one of `path` (local files) or `hf-id`")
        if not isinstance(spec.get("benchmark-only", False), bool):
            raise StageError(f"dataset {name}: benchmark-only must be true or false")
        if spec.get("benchmark-only") and spec.get("complete"):
            raise StageError(f"dataset {name}: benchmark-only prompts need no answer; drop `complete`")
        try:
            check_mix_spec(spec)
        except ValueError as e:
            raise StageError(str(e)) from None
    return specs


def load_rows(spec: dict):
    """Yield raw rows of one dataset (dicts), at most `max-rows` of them.

    Local JSONL goes through the `text` builder and json.loads per line, on purpose: the `json`
    builder infers one Arrow schema for all rows, which fills every nested field a row lacks with
    None (tool schemas gain foreign properties) and fails on rows whose types differ.
    """
    if "path" in spec:
        path = Path(spec["path"])
        if not path.exists():
            raise StageError(f"dataset {spec['name']}: {path} does not exist (the tiny world's data is "
                             "made by `python 00_build_tiny_world.py`)")
        files = sorted(str(f) for f in path.iterdir()) if path.is_dir() else [str(path)]
        suffix = Path(files[0]).suffix
        builder = {".jsonl": "text", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if builder is None:
            raise StageError(f"dataset {spec['name']}: cannot load {suffix} files (jsonl, json, parquet)")
        ds = load_dataset(builder, data_files=files, split="train")
    else:
        builder = None
        ds = load_dataset(spec["hf-id"], spec.get("hf-config"), split=spec.get("split", "train"))
    if spec.get("max-rows") is not None:
        ds = ds.select(range(min(int(spec["max-rows"]), len(ds))))
    for row in ds:
        if builder == "text":
            line = row["text"].strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield BadRow("bad_json_line")
                continue
            if not isinstance(row, dict):
                yield BadRow("bad_json_line")
                continue
        yield row


def rendered_lengths(tok, record: dict, text_format) -> tuple[int, int]:
    """(prompt tokens, prompt + kept answer tokens) of a record rendered by the target's template.
    Raises target_format.FormatError (the skip reason) when the template refuses the conversation or
    cannot render a complete record's answer."""
    msgs = record["messages"][:-1] if record["complete"] else record["messages"]
    try:  # templates refuse some conversations with raise_exception (e.g. roles that do not alternate)
        prompt = render_prompt(tok, msgs, record.get("tools"), thinking=record["thinking"])
        answer = (render_final_turn(tok, text_format, record["messages"], record.get("tools"), record["thinking"])
                  if record["complete"] else None)
    except TemplateError as e:
        raise FormatError("template_error", str(e)) from None
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    if answer is None:
        return n_prompt, n_prompt
    return n_prompt, n_prompt + len(tok(answer, add_special_tokens=False)["input_ids"])


def unrendered_tools(record: dict, text_format) -> str | None:
    """The skip reason of a record whose tool calls or tools the target's template would drop, else None."""
    if not text_format.renders_tool_calls and any(m.get("tool_calls") for m in record["messages"]):
        return "tool_calls_not_rendered"  # a tool-call turn would render as its (often empty) content
    if not text_format.renders_tools and record.get("tools"):
        return "tools_not_rendered"
    return None


def length_summary(lengths: list[int]) -> dict:
    if not lengths:
        return {"num": 0}
    xs = sorted(lengths)
    return {"num": len(xs), "mean": round(sum(xs) / len(xs), 1), "p50": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "max": xs[-1], "total": sum(xs)}


def prepare_one(spec: dict, out: Path, scrub: re.Pattern, args, tok, tok_id: dict, tgt_id: dict,
                text_format=None) -> dict:
    """Adapt one dataset into out/records.jsonl; returns its counts. `text_format`: the target's TargetFormat."""
    t0 = time.time()
    skipped, filtered, repaired, seen = Counter(), Counter(), Counter(), set()
    counts, lengths = Counter(), {"normal": [], "long": []}
    max_records = spec.get("max-records")

    def records():
        for index, row in enumerate(load_rows(spec)):
            if max_records is not None and counts["num_records"] >= int(max_records):
                break
            counts["rows_read"] += 1
            try:
                if isinstance(row, BadRow):
                    raise row
                expanded = expand_row(row, index, spec, scrub, args.mix_seed, args.thinking, args.thinking_ratio,
                                      repaired, kimi_tool_ids=text_format.kimi)
            except FilteredRow as e:
                filtered[e.reason] += 1
                continue
            except BadRow as e:
                skipped[e.reason] += 1
                continue
            for record, n_scrubbed in expanded:
                if record["id"] in seen:
                    skipped["duplicate_id"] += 1
                    continue
                if not text_format.renders_thinking:  # the template has no thinking switch: say so in the record
                    record["thinking"] = False
                dropped_tools = unrendered_tools(record, text_format)
                if dropped_tools and args.tools_not_rendered == "refuse":
                    raise StageError(f"dataset {spec['name']}, record {record['id']}: the target's chat template "
                                     f"does not render {'tool calls' if 'calls' in dropped_tools else 'tools'}; "
                                     "pass --tools-not-rendered drop (skip such records, counted) or keep "
                                     "(train on the prompt as the template renders it)")
                if dropped_tools and args.tools_not_rendered == "drop":
                    skipped[dropped_tools] += 1
                    continue
                try:
                    n, n_total = rendered_lengths(tok, record, text_format)
                except FormatError as e:
                    skipped[e.reason] += 1
                    continue
                # A complete record's answer is known; a prompt needs room for --max-new-tokens.
                part = length_partition(n_total, 0 if record["complete"] else args.max_new_tokens,
                                        args.max_context, args.long_context)
                if part is None:
                    skipped["too_long"] += 1
                    continue
                seen.add(record["id"])
                record.update(partition=part, num_prompt_tokens=n)
                lengths[part].append(n)
                counts["num_records"] += 1
                counts["special_tokens_scrubbed"] += n_scrubbed
                counts["with_tools"] += bool(record.get("tools")) and text_format.renders_tools
                if dropped_tools:  # --tools-not-rendered keep
                    counts["kept_" + dropped_tools] += 1
                counts["thinking"] += record["thinking"]
                counts["num_messages"] += len(record["messages"])
                yield record
                if max_records is not None and counts["num_records"] >= int(max_records):
                    break

    num_records = write_jsonl(out / "records.jsonl", records())
    if num_records == 0:
        raise StageError(f"dataset {spec['name']}: no usable rows (skipped {dict(skipped)}, filtered "
                         f"{dict(filtered)}); check its adapter and filters")
    result = {"num_records": num_records, "rows_read": counts["rows_read"],
              "skipped": dict(sorted(skipped.items())), "filtered": dict(sorted(filtered.items())),
              "repaired": dict(sorted(repaired.items())),  # fallbacks and repairs of used rows (adapters.add_repair)
              "special_tokens_scrubbed": counts["special_tokens_scrubbed"],
              "with_tools": counts["with_tools"], "thinking": counts["thinking"],
              "kept_tools_not_rendered": counts["kept_tools_not_rendered"],
              "kept_tool_calls_not_rendered": counts["kept_tool_calls_not_rendered"],
              "complete": bool(spec.get("complete", False)),
              "mean_messages": round(counts["num_messages"] / num_records, 2),
              "partitions": {p: len(v) for p, v in lengths.items()},
              "prompt_tokens": {p: length_summary(v) for p, v in lengths.items()},
              "seconds": round(time.time() - t0, 2)}
    write_manifest(out, STAGE, args, dataset=spec, tokenizer=tok_id, target=tgt_id,
                   target_format=text_format.as_dict(), counts=result)
    pt = result["prompt_tokens"]["normal"]
    print(f"[01] {spec['name']}: {num_records} records from {counts['rows_read']} rows "
          f"({result['partitions']['normal']} normal, {result['partitions']['long']} long; thinking "
          f"{counts['thinking']}), prompt tokens mean {pt.get('mean', 0)} p90 {pt.get('p90', 0)}, "
          f"skipped {dict(skipped) or 0}, filtered {dict(filtered) or 0}, repaired {dict(repaired) or 0}, "
          f"scrubbed {counts['special_tokens_scrubbed']} special strings")
    return result


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if args.target_path is None:
        raise StageError("--target-path is required: the target model folder whose tokenizer defines the format")
    specs = check_specs(args.datasets)
    if args.thinking_ratio is not None and not 0 <= args.thinking_ratio <= 1:
        raise StageError(f"--thinking-ratio {args.thinking_ratio} is not in [0, 1]")
    tok_id, tgt_id = tokenizer_identity(args.target_path), target_identity(args.target_path)
    out = stage_dir(args.work_dir, STAGE)
    if not start_stage(out, args.overwrite, STAGE):
        return
    tok = load_tokenizer(args.target_path)
    text_format = load_target_format(args.target_path, tok)
    print(f"[01] target format: {text_format.as_dict()}")
    scrub = special_token_pattern(tok)
    summary = {}
    for spec in specs:
        sub = stage_dir(args.work_dir, STAGE, spec["name"])
        if is_complete(sub):
            old = read_manifest(sub)
            # A folder left by an interrupted run is reused only if it was made the same way.
            same = all(old["config"].get(k) == getattr(args, k) for k in
                       ("thinking", "thinking_ratio", "mix_seed", "max_new_tokens", "max_context", "long_context",
                        "tools_not_rendered"))
            if old.get("dataset") == spec and old["tokenizer"]["sha256"] == tok_id["sha256"] and same:
                print(f"[01] {spec['name']}: complete from an earlier run, kept")
                summary[spec["name"]] = old["counts"]
                continue
            (sub / "manifest.json").unlink()
        sub.mkdir(parents=True, exist_ok=True)
        summary[spec["name"]] = prepare_one(spec, sub, scrub, args, tok, tok_id, tgt_id, text_format)
    write_manifest(out, STAGE, args, datasets=[s["name"] for s in specs], tokenizer=tok_id,
                   target=tgt_id, target_format=text_format.as_dict(), counts=summary)


if __name__ == "__main__":
    main()
