"""A response cache for deterministic (greedy) answers: 01b serves what it already knows instead of generating.

API (used by 01b `--response-cache PATH` and by world builders that ship a finished 01b output):
  identity = cache_identity(target_path, text_format, generator)
      what makes two greedy answers the same: the target's config.json, weights and tokenizer hashes, the
      generator (engine + dtype, e.g. "hf-float32"; common/generation/hf_engine.hf_generator) and the stop ids
      (common/text/target_format.TargetFormat.stop_ids); temperature is always 0.
  write_response_cache(generated, out_path, identity, tokenizer) -> {"num_entries", "skipped", "bytes"}
      `generated`: 01b generated.jsonl paths and/or row dicts (mixed); rows the target wrote (origin
      "target" or "cache") with `completion_ids` and `max_new_tokens` become entries, others are counted
      in `skipped` by reason. Written atomically, byte-identical for the same entries.
  pack_responses(work_dirs, target_dir, asset, generator)
      a world builder's `--pack-responses`: every finished 01b output under the work dirs into `asset`.
  cache = ResponseCache.load(path, identity, tokenizer)
      `cache.lookup(prompt_text, max_new_tokens)` -> None or {"completion", "completion_ids",
      "finish_reason", "num_completion_tokens"}; `cache.mismatch` lists the identity fields that differ
      from the file's (then every lookup misses).

File: gzip JSONL (gzip mtime 0). Line 1 is the header `{"format": "eagle3-response-cache/1",
"identity": {...}, "num_entries": N}`; then one entry per line, sorted by (prompt_sha256, max_new_tokens):
`{"prompt_sha256": hex of the rendered prompt text, "max_new_tokens": the request's effective cap,
"finish_reason": "stop|length", "completion_ids": [int]}` plus `"completion": str` only when the text
is not `tokenizer.decode(completion_ids, skip_special_tokens=False)` (a server's text may differ; the hf
engine's never does), so ~2,000 answers of ~200 tokens take well under 1 MB.
A hit requires the same identity, the same rendered prompt and the same effective max-new-tokens:
a "stop" answer is the same under a larger cap, but a strict key keeps "cached == generated" exact.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from common.io import atomic_path, iter_jsonl
from common.stage import StageError, sha256_file, target_identity, tokenizer_identity

CACHE_FORMAT = "eagle3-response-cache/1"
TARGET_ORIGINS = ("target", "cache")


def prompt_sha256(prompt_text: str) -> str:
    return hashlib.sha256(prompt_text.encode("utf-8")).hexdigest()


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over the target's weight files (name and content hash of every *.safetensors, sorted).

    Reads every weight file once: about a second for a 135M-parameter model, hours for a 1T one (a cache
    of greedy answers is meant for small targets)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise StageError(f"{model_dir} holds no *.safetensors: the response cache proves 'same model' by the "
                         "weights' hash, so --target-path must be the folder with the weights")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def cache_identity(target_path: str | Path, text_format, generator: str) -> dict:
    """What two greedy answers must share to be the same answer (module doc)."""
    return {"config_sha256": target_identity(target_path)["config_sha256"],
            "weights_sha256": weights_sha256(target_path),
            "tokenizer_sha256": tokenizer_identity(target_path)["sha256"],
            "generator": generator, "stop_ids": [int(i) for i in text_format.stop_ids], "temperature": 0.0}


def _rows(generated) -> Iterable[dict]:
    for item in generated:
        if isinstance(item, (str, Path)):
            yield from iter_jsonl(Path(item))
        else:
            yield item


def _entry(row: dict, tokenizer) -> dict:
    entry = {"prompt_sha256": prompt_sha256(row["prompt"]), "max_new_tokens": int(row["max_new_tokens"]),
             "finish_reason": row["finish_reason"], "completion_ids": [int(i) for i in row["completion_ids"]]}
    if tokenizer.decode(entry["completion_ids"], skip_special_tokens=False) != row["completion"]:
        entry["completion"] = row["completion"]
    return entry


def write_response_cache(generated, out_path: str | Path, identity: dict, tokenizer) -> dict:
    """Pack the target's answers of 01b output(s) into a cache file (module doc); returns counts."""
    entries, skipped = {}, Counter()
    for row in _rows(generated):
        if row.get("origin") not in TARGET_ORIGINS:
            skipped["not_from_target"] += 1
        elif row.get("completion_ids") is None:
            skipped["no_completion_ids"] += 1
        elif row.get("max_new_tokens") is None:
            skipped["no_max_new_tokens"] += 1
        elif row.get("finish_reason") not in ("stop", "length"):
            skipped["bad_finish_reason"] += 1
        else:
            entry = _entry(row, tokenizer)
            key = (entry["prompt_sha256"], entry["max_new_tokens"])
            if key in entries:
                if entries[key] != entry:  # one greedy model cannot answer one prompt two ways
                    raise ValueError(f"two different answers for one prompt ({row['id']}): the inputs "
                                     "were not made by one greedy target")
                skipped["duplicate"] += 1
                continue
            entries[key] = entry
    header = {"format": CACHE_FORMAT, "identity": identity, "num_entries": len(entries)}
    lines = [json.dumps(header, sort_keys=True)] + [json.dumps(entries[k], sort_keys=True, separators=(",", ":"))
                                                    for k in sorted(entries)]
    raw = io.BytesIO()
    # mtime=0 and no file name: the same entries give the same bytes (the file is shipped in a repo).
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))
    with atomic_path(out_path) as tmp:
        tmp.write_bytes(raw.getvalue())
    return {"num_entries": len(entries), "skipped": dict(sorted(skipped.items())), "bytes": len(raw.getvalue())}


class ResponseCache:
    """The entries of one cache file whose identity matches this run's; see the module doc."""

    def __init__(self, path: Path, identity: dict, file_identity: dict, entries: dict, tokenizer):
        self.path, self.identity, self.file_identity = path, identity, file_identity
        self.entries, self.tok = entries, tokenizer
        self.mismatch = sorted(k for k in set(identity) | set(file_identity)
                               if identity.get(k) != file_identity.get(k))

    @classmethod
    def load(cls, path: str | Path, identity: dict, tokenizer) -> "ResponseCache":
        path = Path(path)
        if not path.is_file():
            raise StageError(f"--response-cache {path} does not exist")
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                header = json.loads(f.readline())
                if header.get("format") != CACHE_FORMAT:
                    raise StageError(f"--response-cache {path}: format {header.get('format')!r}, expected "
                                     f"{CACHE_FORMAT!r}")
                entries = {}
                if all(identity.get(k) == header["identity"].get(k) for k in set(identity) | set(header["identity"])):
                    for line in f:
                        e = json.loads(line)
                        entries[(e["prompt_sha256"], e["max_new_tokens"])] = e
        except (OSError, EOFError, ValueError, KeyError) as e:
            raise StageError(f"--response-cache {path} is not a readable cache file ({e})") from None
        return cls(path, identity, header["identity"], entries, tokenizer)

    def lookup(self, prompt_text: str, max_new_tokens: int) -> dict | None:
        e = self.entries.get((prompt_sha256(prompt_text), int(max_new_tokens)))
        if e is None:
            return None
        text = e.get("completion")
        if text is None:
            text = self.tok.decode(e["completion_ids"], skip_special_tokens=False)
        return {"completion": text, "completion_ids": list(e["completion_ids"]), "finish_reason": e["finish_reason"],
                "num_completion_tokens": len(e["completion_ids"])}


def compare_with_cache(generated, path: str | Path) -> dict:
    """How another generator's greedy answers (01b rows with completion_ids, e.g. from a vLLM server)
    compare with a cache file's, prompt by prompt at the same cap, whatever the two identities say:
    {"num_compared", "num_exact", "exact_share", "not_in_cache", "divergences": [{"id", "at",
    "generated", "cached"}]} where `at` is the first answer token that differs (the shorter answer's
    length when one is a prefix of the other)."""
    with gzip.open(Path(path), "rt", encoding="utf-8") as f:
        f.readline()  # header
        cached = {(e["prompt_sha256"], e["max_new_tokens"]): e["completion_ids"] for e in map(json.loads, f)}
    compared, exact, missing, divergences = 0, 0, 0, []
    for row in _rows(generated):
        if row.get("completion_ids") is None or row.get("max_new_tokens") is None:
            continue
        ref = cached.get((prompt_sha256(row["prompt"]), int(row["max_new_tokens"])))
        if ref is None:
            missing += 1
            continue
        ids = [int(i) for i in row["completion_ids"]]
        compared += 1
        if ids == ref:
            exact += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
        divergences.append({"id": row["id"], "at": at, "generated": ids[at:at + 8], "cached": ref[at:at + 8],
                            "generated_tokens": len(ids), "cached_tokens": len(ref)})
    return {"num_compared": compared, "num_exact": exact, "exact_share": exact / compared if compared else None,
            "not_in_cache": missing, "divergences": divergences}


def pack_responses(work_dirs: list[Path], target_dir: Path, asset: Path, generator: str) -> None:
    """Rewrite a response-cache asset from finished 01b outputs, for the generator that made them."""
    from common.stage import GENERATE, stage_dir
    from common.text.target_format import load_target_format
    from common.text.tokenizer import load_tokenizer

    paths = [p for w in work_dirs for p in sorted(stage_dir(w, GENERATE).glob("*/generated.jsonl"))]
    if not paths:
        raise StageError(f"no 01b output under {', '.join(map(str, work_dirs))}: run 01/01b first")
    tok = load_tokenizer(target_dir)
    identity = cache_identity(target_dir, load_target_format(target_dir, tok), generator)
    counts = write_response_cache(paths, asset, identity, tok)
    print(f"[00] packed {len(paths)} 01b outputs into {asset}: {counts}")
