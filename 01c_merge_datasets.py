"""Merge datasets: the per-dataset generations -> one tokenized training set plus held-out prompts.

Reads:  <work-dir>/01b_generated/<dataset>/generated.jsonl (+ manifest.json),
        <work-dir>/01_prepared/<dataset>/records.jsonl (messages of the held-out prompts)
Writes: <work-dir>/01c_merged/{tokenized_data.jsonl, benchmark_prompts.jsonl, stats.json, manifest.json}
Real:   python 01c_merge_datasets.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3
Tiny:   python 01c_merge_datasets.py --config configs/tiny.yaml --work-dir runs/tiny

Steps (each a function below): hold out every benchmark-only prompt and --benchmark-size random samples
(chosen before any filter, so caps never move them); drop held-out prompts, exact duplicates, empty and
(with --drop-length-finished) capped answers; drop samples over --max-seq-len and text answers whose
re-tokenization disagrees with the target's own count; apply --dataset-weights and --dataset-caps; write
the samples shortest first (02b's shards then hold similar lengths). Every drop is counted per reason, and
a run where none survive names each reason with its count and what it measured.
A sample's ids are the prompt's tokenization followed by the ids the target emitted (text answers are
tokenized); the loss mask is 1 exactly on the completion, end-of-turn token included. The text decides:
emitted ids that do not decode to their text are never trained on (the answer counts as a text answer).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm import tqdm

from common.config import base_parser, parse_args
from common.io import iter_jsonl, write_json, write_jsonl
from common.stage import (GENERATE, MERGE, PREPARE, StageError, check_same_tokenizer, input_manifests, require_complete,
                          resolve_target, stage_dir, stage_script, start_stage, tokenizer_identity, write_manifest)
from common.text.repetition import loop_period
from common.text.tokenizer import load_tokenizer

STAGE, UPSTREAM = MERGE, GENERATE
# The order of tokenized_data.jsonl, recorded in the manifest (see the sort in main).
SAMPLE_ORDER = "seq_len, id"
TARGET_ORIGINS = ("target", "cache")  # 01b rows the target wrote (others: "dataset" answers, "prompt" only)


def mapping(value):
    """A name -> number mapping: a dict (from YAML) or JSON text (command line)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"expected a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a mapping of dataset name -> number")
    return value


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("merge")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; default: the one 01b used (refused if its tokenizer differs)")
    g.add_argument("--max-seq-len", type=int, default=4096, help="longest training sample kept (tokens)")
    g.add_argument("--dataset-caps", type=mapping, default=None,
                   help="dataset name -> max samples kept (after filters), e.g. '{\"ultrachat\": 20000}'")
    g.add_argument("--dataset-weights", type=mapping, default=None,
                   help="dataset name -> kept fraction in (0, 1] (after filters; upsampling belongs to "
                        "the trainer's sampler, not to stored hidden states)")
    g.add_argument("--benchmark-size", type=int, default=64, help="held-out prompts for 05_benchmark (count)")
    g.add_argument("--mix-seed", type=int, default=0,
                   help="seed of the data mix: the held-out choice and subsampling here, cuts and thinking choices in 01")
    g.add_argument("--drop-length-finished", action=argparse.BooleanOptionalAction, default=False,
                   help="drop answers that hit the token cap (finish_reason length); default: train on them, "
                        "they are the target's own tokens and only lack the end of turn (docs/formats.md)")
    g.add_argument("--keep-retokenize-mismatch", action="store_true",
                   help="keep text-only target answers whose re-tokenization has another token count than the "
                        "target emitted (default: drop them, counted as retokenize_mismatch)")
    g.add_argument("--tokenize-batch-size", type=int, default=512, help="texts per tokenizer call (count)")
    return p




def read_generated(path: Path, ids_at: dict, tok=None, checked: Counter | None = None) -> list[dict]:
    """The rows of a 01b generated.jsonl, without their `completion_ids` (100K answers' ids as Python lists
    would not fit in memory): `ids_at[id] = (path, byte offset of the row, number of ids)` instead, for
    EmittedIds to read back the few that are kept. A torn last line is ignored, as in common.io.

    With `tok`, the text decides and the ids are checked (common/generation/answers.py): ids that do not
    decode to the row's text are never trained on; the row becomes a text answer (its text tokenized, held
    against the server's count like any other) and `checked[source, "ids_contradict_text"]` counts it; ids
    that do but are not as many as the server counted count in `checked[source, "server_count_differs_from_ids"]`."""
    from common.generation.answers import ids_fault

    rows = []
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            at, offset = offset, offset + len(raw)
            if not raw.endswith(b"\n"):
                break
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise StageError(f"{path}:{lineno}: corrupt JSONL line ({e})") from None
            ids = row.pop("completion_ids", None)
            if ids is not None and tok is not None:
                if ids_fault(tok, row["completion"], ids, None):
                    checked[row["source"], "ids_contradict_text"] += 1
                    ids = None
                elif row.get("num_completion_tokens") not in (None, len(ids)):
                    checked[row["source"], "server_count_differs_from_ids"] += 1
            if ids is not None:
                ids_at[row["id"]] = (path, at, len(ids))
            rows.append(row)
    return rows


class EmittedIds:
    """Reads a row's `completion_ids` back from its generated.jsonl line (see read_generated)."""

    def __init__(self, ids_at: dict):
        self.ids_at, self.files = ids_at, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()

    def read(self, row_id: str) -> list[int]:
        path, at, n = self.ids_at[row_id]
        if path not in self.files:
            self.files[path] = open(path, "rb")
        f = self.files[path]
        f.seek(at)
        ids = json.loads(f.readline())["completion_ids"]
        assert len(ids) == n, row_id
        return ids


def token_lengths(tok, texts: list[str], batch_size: int, desc: str) -> list[int]:
    out = []
    for i in tqdm(range(0, len(texts), batch_size), desc=f"[01c] {desc}", unit="batch", disable=len(texts) < 1):
        out += [len(x) for x in tok(texts[i:i + batch_size], add_special_tokens=False)["input_ids"]]
    return out


def check_weights(args, names: list[str]):
    for flag, values in (("--dataset-caps", args.dataset_caps), ("--dataset-weights", args.dataset_weights)):
        unknown = sorted(set(values or {}) - set(names))
        if unknown:
            raise StageError(f"{flag} names {unknown}, which 01b did not generate (it has {names})")
    for name, w in (args.dataset_weights or {}).items():
        if not 0 < float(w) <= 1:
            raise StageError(f"--dataset-weights {name}: {w} is not in (0, 1]")
    for name, c in (args.dataset_caps or {}).items():
        if int(c) < 0:
            raise StageError(f"--dataset-caps {name}: {c} is negative")


def benchmark_rows(bench: list[dict], work_dir: Path, tok, batch_size: int) -> list[dict]:
    """Held-out prompts with what 05 needs to run them: messages, tools, thinking, prompt ids, and whether
    they come from a benchmark-only dataset."""
    records = {}
    for source in sorted({r["source"] for r in bench}):
        wanted = {r["id"] for r in bench if r["source"] == source}
        path = stage_dir(work_dir, PREPARE, source) / "records.jsonl"
        records.update({r["id"]: r for r in iter_jsonl(path) if r["id"] in wanted})
    out = []
    for i in range(0, len(bench), batch_size):
        chunk = bench[i:i + batch_size]
        ids = tok([r["prompt"] for r in chunk], add_special_tokens=False)["input_ids"]
        for r, prompt_ids in zip(chunk, ids):
            rec = records[r["id"]]
            msgs = rec["messages"][:-1] if rec["complete"] else rec["messages"]
            out.append({"id": r["id"], "source": r["source"], "prompt": r["prompt"], "prompt_ids": prompt_ids,
                        "messages": msgs, "tools": rec.get("tools"), "thinking": rec["thinking"],
                        "benchmark_only": r["origin"] == "prompt"})
    return out


def length_histogram(lengths: list[int], max_seq_len: int) -> dict:
    edges = [0, 64]
    while edges[-1] < max_seq_len:
        edges.append(min(edges[-1] * 2, max_seq_len))
    counts = Counter()
    for n in lengths:
        i = next(k for k in range(1, len(edges)) if n <= edges[k] or k == len(edges) - 1)
        counts[i] += 1
    return {f"{edges[k - 1] + 1}-{edges[k]}": counts[k] for k in range(1, len(edges))}


def hold_out(rows: list[dict], args) -> tuple[set[str], list[dict]]:
    """The held-out prompts, chosen first from all ids so caps and filters never change which they are:
    every benchmark-only prompt, plus --benchmark-size random samples of the rest."""
    answered = sorted(r["id"] for r in rows if r["origin"] != "prompt")
    if args.benchmark_size < 0:
        raise StageError(f"--benchmark-size {args.benchmark_size} is negative")
    if args.benchmark_size >= len(answered) > 0:
        raise StageError(f"--benchmark-size {args.benchmark_size} would hold out all {len(answered)} answered "
                         "samples and leave none to train on; lower it (benchmark-only datasets are held out "
                         "on top of it)")
    rng = random.Random(args.mix_seed)
    bench_ids = set(rng.sample(answered, args.benchmark_size)) | {r["id"] for r in rows if r["origin"] == "prompt"}
    return bench_ids, [r for r in rows if r["id"] in bench_ids]


def drop_by_content(rows: list[dict], bench_ids: set[str], bench: list[dict], args, dropped) -> list[dict]:
    """Training candidates: not held out, no held-out prompt, not length-capped (when dropped), not empty,
    not an exact duplicate (same prompt and completion text). Drops are counted in `dropped`."""
    bench_prompts = {r["prompt"] for r in bench}
    seen, candidates = set(), []
    for r in rows:
        if r["id"] in bench_ids:
            continue
        if r["prompt"] in bench_prompts:
            dropped[r["source"]]["benchmark_prompt_overlap"] += 1
        elif args.drop_length_finished and r["finish_reason"] == "length":
            dropped[r["source"]]["length_finished"] += 1
        elif not r["completion"]:
            dropped[r["source"]]["empty_completion"] += 1
        else:
            key = hashlib.sha1(f"{r['prompt']}\0{r['completion']}".encode()).digest()
            if key in seen:
                dropped[r["source"]]["duplicate"] += 1
                continue
            seen.add(key)
            candidates.append(r)
    return candidates


def drop_by_length(candidates: list[dict], ids_at: dict, tok, args, dropped) -> tuple[dict, Counter]:
    """Pass 1, lengths only (ids of 100K long samples would not fit in memory as Python lists): answers
    with emitted ids have their length, only text answers are tokenized. Drops samples over --max-seq-len
    and text answers that do not re-tokenize to the target's own count. Returns ({source: [(row,
    prompt tokens, completion tokens)]}, re-tokenization mismatches per source)."""
    n_prompt = token_lengths(tok, [r["prompt"] for r in candidates], args.tokenize_batch_size, "prompt lengths")
    text_only = [r for r in candidates if r["id"] not in ids_at]
    n_text = dict(zip((r["id"] for r in text_only), token_lengths(
        tok, [r["completion"] for r in text_only], args.tokenize_batch_size, "completion lengths")))
    per_source = defaultdict(list)
    retokenize_mismatch = Counter()
    for r, n_p in zip(candidates, n_prompt):
        n_c = ids_at[r["id"]][2] if r["id"] in ids_at else n_text[r["id"]]
        if n_p + n_c > args.max_seq_len:
            dropped[r["source"]]["over_length"] += 1
            continue
        if r["id"] not in ids_at and r["origin"] in TARGET_ORIGINS and r["num_completion_tokens"] is not None \
                and n_c != r["num_completion_tokens"]:
            # Text that does not re-tokenize to the target's own token count (e.g. a byte sequence cut
            # mid-character, a merge across the prompt boundary) would train ids it never emitted.
            retokenize_mismatch[r["source"]] += 1
            if not args.keep_retokenize_mismatch:
                dropped[r["source"]]["retokenize_mismatch"] += 1
                continue
        per_source[r["source"]].append((r, n_p, n_c))
    return per_source, retokenize_mismatch


def apply_mix(per_source: dict, names: list[str], args, dropped) -> list[tuple]:
    """Per-dataset --dataset-weights (kept fraction) then --dataset-caps (max samples), seeded per
    dataset; the kept samples sorted shortest first, ties by id (SAMPLE_ORDER)."""
    selected = []
    for name in names:
        items = per_source.get(name, [])
        k = len(items)
        if args.dataset_weights and name in args.dataset_weights:
            k = round(float(args.dataset_weights[name]) * k)
        if args.dataset_caps and name in args.dataset_caps:
            k = min(k, int(args.dataset_caps[name]))
        if k < len(items):
            dropped[name]["capped"] += len(items) - k
            keep = sorted(random.Random(f"{args.mix_seed}/{name}").sample(range(len(items)), k))
            items = [items[i] for i in keep]
        selected += items
    if not selected:
        raise StageError(f"no sample survived the filters: {drop_causes(dropped)}")
    # 02b cuts the file into shards of consecutive samples, and its SGLang engine captures only rows of
    # one length in one call (no padding), so equal lengths must sit together; 04 shuffles shards and
    # samples within a shard, so a batch drawn from one length-homogeneous shard pads little. Only the
    # lengths of pass 1 are needed: ids stay on disk and are read back by offset, in this order.
    selected.sort(key=lambda item: (item[1] + item[2], item[0]["id"]))
    return selected


# What each drop reason measured, and what to do about it (no_sample refusal: the causes as counted).
DROP_CAUSES = {
    "over_length": "prompt + answer over --max-seq-len: raise it, or lower 01b's --max-new-tokens",
    "retokenize_mismatch": "the text re-tokenizes to another count than the server reported "
                           "(usage.completion_tokens, kept by 01b): a server whose counts are wrong (check it, "
                           "regenerate with 01b), or text cut mid-character; --keep-retokenize-mismatch trains "
                           "on the text's own tokens",
    "length_finished": "answers that hit 01b's token cap: --no-drop-length-finished keeps them",
    "empty_completion": "empty answers: look at the server's answers in 01b's generated.jsonl",
    "duplicate": "exact duplicates of another sample",
    "benchmark_prompt_overlap": "the prompt of a held-out sample",
    "capped": "--dataset-caps / --dataset-weights",
}


def drop_causes(dropped) -> str:
    """One line: every drop reason with its count summed over datasets, largest first, and what it measured."""
    total = sum((Counter(v) for v in dropped.values()), Counter())
    return "; ".join(f"{n} {reason} ({DROP_CAUSES.get(reason, reason)})" for reason, n in total.most_common()) \
        or "no input row was a training candidate"


def training_samples(selected: list[tuple], ids_at: dict, tok, batch_size: int, stats, lengths: list[int],
                     emitted_differ: Counter):
    """Pass 2: the kept samples tokenized in batches, as tokenized_data.jsonl rows (a generator; it fills
    `stats`, `lengths` and `emitted_differ` as it goes). A sample's ids are the prompt's tokenization
    followed by the target's emitted ids, or the completion's tokenization for a text answer."""
    with EmittedIds(ids_at) as emitted:
        for i in tqdm(range(0, len(selected), batch_size), desc="[01c] tokenize", unit="batch"):
            chunk = selected[i:i + batch_size]
            p_ids = tok([r["prompt"] for r, _, _ in chunk], add_special_tokens=False)["input_ids"]
            t_ids = tok([r["completion"] for r, _, _ in chunk], add_special_tokens=False)["input_ids"]
            for (r, n_p, n_c), p, t in zip(chunk, p_ids, t_ids):
                c = emitted.read(r["id"]) if r["id"] in ids_at else t  # the target's own ids first
                emitted_differ[r["source"]] += c != t
                assert (len(p), len(c)) == (n_p, n_c), r["id"]
                s = stats[r["source"]]
                s["num_samples"] += 1
                s["num_tokens"] += n_p + n_c
                s["num_prompt_tokens"] += n_p
                s["num_response_tokens"] += n_c
                s["max_seq_len"] = max(s["max_seq_len"], n_p + n_c)
                looped = loop_period(c) > 0  # a tail that repeats one stretch (common/text/repetition.py)
                s["repetition_loops"] += looped
                s["repetition_loops_at_the_cap"] += looped and r.get("finish_reason") == "length"
                lengths.append(n_p + n_c)
                yield {"id": r["id"], "source": r["source"], "input_ids": p + c,
                       "loss_mask": [0] * n_p + [1] * n_c, "seq_len": n_p + n_c,
                       "n_prompt_tokens": n_p, "n_response_tokens": n_c}


def main(argv=None):
    args = parse_args(build_parser(), argv)
    up_dir = stage_dir(args.work_dir, UPSTREAM)
    upstream = require_complete(up_dir, UPSTREAM)
    target = resolve_target(args.target_path, upstream, up_dir, UPSTREAM)
    names = upstream["datasets"]
    for name in names:  # every per-dataset folder must come from the same tokenizer too
        sub_manifest = require_complete(stage_dir(args.work_dir, UPSTREAM, name), UPSTREAM)
        check_same_tokenizer(sub_manifest["tokenizer"], tokenizer_identity(target),
                             stage_dir(args.work_dir, UPSTREAM, name), UPSTREAM)
    check_weights(args, names)
    out = stage_dir(args.work_dir, STAGE)
    if not start_stage(out, args.overwrite, STAGE):
        return
    t0 = time.time()
    tok = load_tokenizer(target)
    print(f"[01c] target {target} | datasets {names} | max-seq-len {args.max_seq_len}")
    rows, ids_at, checked = [], {}, Counter()
    for name in names:
        rows += sorted(read_generated(stage_dir(args.work_dir, UPSTREAM, name) / "generated.jsonl", ids_at, tok,
                                      checked), key=lambda r: r["id"])
    if not rows:
        raise StageError(f"{up_dir} holds no generated samples: re-run `python {stage_script(UPSTREAM)} --overwrite`")

    dropped = defaultdict(Counter)
    bench_ids, bench = hold_out(rows, args)
    candidates = drop_by_content(rows, bench_ids, bench, args, dropped)
    per_source, retokenize_mismatch = drop_by_length(candidates, ids_at, tok, args, dropped)
    selected = apply_mix(per_source, names, args, dropped)
    stats, lengths, emitted_differ = defaultdict(Counter), [], Counter()
    num_samples = write_jsonl(out / "tokenized_data.jsonl", training_samples(
        selected, ids_at, tok, args.tokenize_batch_size, stats, lengths, emitted_differ))
    bench_out = benchmark_rows(bench, args.work_dir, tok, args.tokenize_batch_size)
    write_jsonl(out / "benchmark_prompts.jsonl", bench_out)

    per = {name: {**stats[name], "dropped": dict(sorted(dropped[name].items())),
                  "completion_retokenize_mismatch": retokenize_mismatch[name],
                  "emitted_ids_differ_from_retokenized": emitted_differ[name],
                  "ids_contradict_text": checked[name, "ids_contradict_text"],
                  "server_count_differs_from_ids": checked[name, "server_count_differs_from_ids"],
                  "benchmark_prompts": sum(r["source"] == name for r in bench)} for name in names}
    totals = {k: sum(stats[n][k] for n in names)
              for k in ("num_samples", "num_tokens", "num_prompt_tokens", "num_response_tokens", "repetition_loops")}
    result = {**totals, "num_input_rows": len(rows), "num_benchmark_prompts": len(bench_out),
              "dropped": dict(sum((dropped[n] for n in names), Counter())), "seconds": round(time.time() - t0, 2)}
    write_json(out / "stats.json", {"totals": result, "per_source": per,
                                    "length_histogram": length_histogram(lengths, args.max_seq_len)})
    write_manifest(out, STAGE, args, datasets=names, tokenizer=upstream["tokenizer"], target=upstream["target"],
                   inputs=input_manifests(args.work_dir, up_dir), sample_order=SAMPLE_ORDER, counts=result)
    print(f"[01c] {num_samples} samples, {totals['num_tokens']} tokens ({totals['num_response_tokens']} "
          f"supervised), {len(bench_out)} held-out prompts, dropped {result['dropped'] or 0}, "
          f"{result['seconds']} s")

if __name__ == "__main__":
    main()
