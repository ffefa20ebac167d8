"""Prepare datasets: raw chat data -> unified prompt records, one folder per dataset.

Each dataset named in `--datasets` is loaded through the `datasets` library (a hub id with config and
split, or local JSONL / JSON / parquet files), mapped to unified chat records by its adapter
(common/adapters.py), cut to a prompt (the next assistant turn is the target's to write in 01b), its
tool-call ids rewritten to Kimi's `functions.NAME:IDX`, and literal special-token strings scrubbed.
Rows that cannot be used are skipped and counted by reason in the manifest.
Reads:  the datasets of --datasets; the tokenizer of --target-path (for scrubbing)
Writes: <work-dir>/01_prepared/<dataset>/{records.jsonl, manifest.json}, <work-dir>/01_prepared/manifest.json
Real:   python 01_prepare_datasets.py --config configs/kimi-k2.5.yaml --work-dir /data/eagle3
Tiny:   python 01_prepare_datasets.py --config configs/tiny.yaml --work-dir runs/tiny
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

from common.adapters import ADAPTERS, BadRow, unify
from common.config import base_parser, parse_args
from common.io import write_jsonl
from common.stage import (StageError, is_complete, read_manifest, stage_dir, start_stage,
                          target_identity, tokenizer_identity, write_manifest)

STAGE = "01_prepare_datasets"
SPEC_KEYS = {"name", "adapter", "path", "hf-id", "hf-config", "split", "max-rows", "complete"}
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
                        'max-rows (rows read) and complete (true: last assistant turn is the target\'s own); '
                        f'JSON on the command line. Adapters: {", ".join(ADAPTERS)}')
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with thinking on (generation prompt ends with <think>)")
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
    return specs


def load_rows(spec: dict):
    """Yield raw rows of one dataset (dicts), at most `max-rows` of them.

    Local JSONL goes through the `text` builder and json.loads per line, on purpose: the `json`
    builder infers one Arrow schema for all rows, which fills every nested field a row lacks with
    None (tool schemas gain foreign properties) and fails on rows whose types differ.
    """
    from datasets import load_dataset

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


def prepare_one(spec: dict, out: Path, scrub: re.Pattern, args, tok_id: dict, tgt_id: dict) -> dict:
    """Adapt one dataset into out/records.jsonl; returns its counts."""
    t0 = time.time()
    skipped, seen = Counter(), set()
    counts = Counter()

    def records():
        for index, row in enumerate(load_rows(spec)):
            counts["rows_read"] += 1
            try:
                if isinstance(row, BadRow):
                    raise row
                record, n_scrubbed = unify(row, index, spec["adapter"], spec["name"], scrub,
                                           args.thinking, complete=bool(spec.get("complete", False)))
                if record["id"] in seen:
                    raise BadRow("duplicate_id")
            except BadRow as e:
                skipped[e.reason] += 1
                continue
            seen.add(record["id"])
            counts["special_tokens_scrubbed"] += n_scrubbed
            counts["with_tools"] += bool(record.get("tools"))
            counts["num_messages"] += len(record["messages"])
            yield record

    num_records = write_jsonl(out / "records.jsonl", records())
    if num_records == 0:
        raise StageError(f"dataset {spec['name']}: no usable rows ({dict(skipped)}); check its adapter")
    result = {"num_records": num_records, "rows_read": counts["rows_read"],
              "skipped": dict(sorted(skipped.items())),
              "special_tokens_scrubbed": counts["special_tokens_scrubbed"],
              "with_tools": counts["with_tools"], "complete": bool(spec.get("complete", False)),
              "mean_messages": round(counts["num_messages"] / num_records, 2),
              "seconds": round(time.time() - t0, 2)}
    write_manifest(out, STAGE, args, dataset=spec, tokenizer=tok_id, target=tgt_id, counts=result)
    print(f"[01] {spec['name']}: {num_records} records from {counts['rows_read']} rows, "
          f"skipped {dict(skipped) or 0}, scrubbed {counts['special_tokens_scrubbed']} special strings")
    return result


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if args.target_path is None:
        raise StageError("--target-path is required: the target model folder whose tokenizer defines the format")
    specs = check_specs(args.datasets)
    tok_id, tgt_id = tokenizer_identity(args.target_path), target_identity(args.target_path)
    out = stage_dir(args.work_dir, STAGE)
    if not start_stage(out, args.overwrite, "01"):
        return
    from common.chat_format import special_token_pattern
    from common.tokenizer import load_tokenizer

    scrub = special_token_pattern(load_tokenizer(args.target_path))
    summary = {}
    for spec in specs:
        sub = stage_dir(args.work_dir, STAGE, spec["name"])
        if is_complete(sub):
            old = read_manifest(sub)
            # A folder left by an interrupted run is reused only if it was made the same way.
            if (old.get("dataset") == spec and old["tokenizer"]["sha256"] == tok_id["sha256"]
                    and old["config"].get("thinking") == args.thinking):
                print(f"[01] {spec['name']}: complete from an earlier run, kept")
                summary[spec["name"]] = old["counts"]
                continue
            (sub / "manifest.json").unlink()
        sub.mkdir(parents=True, exist_ok=True)
        summary[spec["name"]] = prepare_one(spec, sub, scrub, args, tok_id, tgt_id)
    write_manifest(out, STAGE, args, datasets=[s["name"] for s in specs], tokenizer=tok_id,
                   target=tgt_id, counts=summary)


if __name__ == "__main__":
    main()
