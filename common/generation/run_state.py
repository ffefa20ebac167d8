"""01b's run state in one dataset's output folder: one process at a time, every id once, one set of
generation settings, and totals over all runs.

  dataset_lock(folder)       an exclusive `fcntl.flock` on `<folder>/01b.lock` (pid, host and start
                             time written inside) held while 01b works on the dataset. A second 01b on
                             the same dataset - two runs at once, or a restart while a SIGTERM'd run
                             still finishes its requests in flight - is refused with the holder named,
                             instead of writing the same ids twice. The kernel drops the lock when the
                             holder's file is closed or the process ends, however it ends (SIGKILL too),
                             so a stale lock file never blocks anyone.
  drop_duplicate_ids(path)   repair a generated.jsonl that holds an id twice (first record wins).
  generation_settings(...)   what decides a record's text: engine, the model the server reported,
                             --max-new-tokens, --max-context, --long-context (they cap every request),
                             --temperature, --top-p and --generation-seed (sampling only), the tokenizer and
                             chat template (their hash) and the stop strings. Stored in every record
                             and the manifest; `settings_conflicts` finds records made otherwise, and
                             01b refuses such a resume unless --allow-mixed-settings.
  RunLog(folder)             `runs.jsonl`: one line per run of 01b on the dataset (requests, attempt
                             errors by kind, work lost to timeouts, completion tokens, seconds,
                             repairs), appended when the run ends (also when it stops on a signal or
                             an error; a SIGKILL'd run leaves no line); `totals()` is the manifest's
                             `all_runs`.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from common.io import iter_jsonl, write_jsonl
from common.stage import StageError

LOCK_FILE = "01b.lock"
RUN_LOG = "runs.jsonl"


@contextmanager
def dataset_lock(folder: str | Path):
    """Hold the dataset folder's lock for the `with` block; StageError naming the holder if taken."""
    path = Path(folder) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_RDWR without O_TRUNC: the holder's note stays readable until we own the lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that has not written its pid yet"
            raise StageError(
                f"another 01b is working on {Path(folder).name} ({holder}; lock {path}). Two runs on one dataset "
                "would write the same ids twice: wait for it to end (a SIGTERM'd run finishes its requests in "
                "flight for up to --shutdown-grace s) or stop it, then re-run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # still ours: no later reader sees a note of a run that has ended
    finally:
        os.close(fd)  # releases the flock


def check_unlocked(folders: Iterable[str | Path]) -> None:
    """StageError when another 01b holds the lock of one of `folders` (before deleting their files)."""
    for folder in folders:
        if (Path(folder) / LOCK_FILE).exists():
            with dataset_lock(folder):
                pass


def scan_generated(path: str | Path) -> tuple[set[str], int, list[dict | None]]:
    """(ids, number of records whose id came before, distinct `settings` of the records) of a
    generated.jsonl; a record without settings (an older 01b) counts as settings None."""
    ids, duplicates, settings = set(), 0, {}
    if Path(path).exists():
        for row in iter_jsonl(path):
            duplicates += row["id"] in ids
            ids.add(row["id"])
            s = row.get("settings")
            settings.setdefault(json.dumps(s, sort_keys=True), s)
    return ids, duplicates, list(settings.values())


def drop_duplicate_ids(path: str | Path) -> int:
    """Rewrite `path` (atomically) with the first record of each id; returns the records dropped."""
    seen, dropped = set(), 0

    def firsts():
        nonlocal dropped
        for row in iter_jsonl(path):
            if row["id"] in seen:
                dropped += 1
                continue
            seen.add(row["id"])
            yield row

    write_jsonl(path, firsts())
    return dropped


def generation_settings(engine: str, model: str | None, max_new_tokens: int, temperature: float, seed: int,
                        tokenizer_sha256: str, stop: Iterable[str] = (), max_context: int | None = None,
                        long_context: int | None = None, top_p: float = 1.0) -> dict:
    """The settings that decide a generated record's text (see the module doc). max_context and
    long_context belong here: a request's cap is min(max_new_tokens, context - prompt tokens), so a
    resume with another context silently changes every later answer's length."""
    return {"engine": engine, "model": model, "max_new_tokens": max_new_tokens, "temperature": temperature,
            "seed": seed if temperature > 0 else None, "top_p": top_p if temperature > 0 else None,
            "tokenizer_sha256": tokenizer_sha256, "stop": list(stop),
            # 0, not None, for "no long partition": None means "not known" to settings_conflicts, so
            # adding --long-context on a resume would pass unnoticed
            "max_context": max_context, "long_context": long_context or 0}


# Keys that records written by an older 01b name differently: compared under today's name.
RENAMED_SETTINGS = {"backend": "engine"}


def settings_conflicts(found: list[dict | None], current: dict, skip: Iterable[str] = ()) -> list[str]:
    """How the settings of existing records differ from `current` (keys in `skip` not compared; a
    record's settings may hold only some keys, e.g. a passed-through one only the tokenizer's, and a
    value None there was not known when it was written, e.g. the model of an answer taken from
    --response-cache before the server's start-up checks)."""
    out = []
    for old in found:
        if old is None:
            out.append("records without settings (written by an older 01b)")
            continue
        for key, value in old.items():
            key = RENAMED_SETTINGS.get(key, key)
            if key not in skip and key in current and value is not None and current[key] != value:
                out.append(f"{key} {value!r} (now {current[key]!r})")
    return sorted(set(out))


class RunLog:
    """`runs.jsonl` of a dataset folder: one line per 01b run (module doc)."""

    SUMMED = ("requests", "completion_tokens", "seconds", "duplicate_ids_removed")

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / RUN_LOG

    def append(self, entry: dict) -> None:
        from common.io import JsonlAppender

        with JsonlAppender(self.path) as out:
            out.write({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(), **entry})

    def totals(self) -> dict:
        """Sums over every logged run: runs, requests, attempt errors by kind, completion tokens,
        seconds, duplicate ids removed, work lost to timeouts (`lost_work`)."""
        rows = list(iter_jsonl(self.path)) if self.path.exists() else []
        errors, lost = Counter(), Counter()
        for row in rows:
            errors.update(row.get("errors") or {})
            lost.update(row.get("lost_work") or {})
        totals = {"runs": sum("requests" in row for row in rows)}
        for key in self.SUMMED:
            totals[key] = round(sum(row.get(key) or 0 for row in rows), 2)
        totals["errors"] = dict(sorted(errors.items()))
        totals["lost_work"] = dict(sorted(lost.items()))
        return totals


def distinct_settings(rows: Iterable[dict]) -> list[dict | None]:
    """The distinct `settings` of records, in first-seen order (the manifest's `settings`)."""
    seen = {}
    for row in rows:
        seen.setdefault(json.dumps(row.get("settings"), sort_keys=True), row.get("settings"))
    return list(seen.values())


def refuse_mixed_settings(path: str | Path, found: list[dict | None], current: dict, allow_mixed: bool,
                          keys: Iterable[str] | None = None) -> None:
    """StageError when records of `path` were made with other settings than `current` (only `keys`
    compared when given), unless `allow_mixed`."""
    keys = set(current) if keys is None else set(keys)
    conflicts = settings_conflicts(found, current, skip=set(current) - keys)
    if not conflicts:
        return
    if allow_mixed:
        from common.generation.progress import log

        log(f"[01b] --allow-mixed-settings: {path} mixes records made with other settings: {'; '.join(conflicts)}")
        return
    raise StageError(f"{path} holds records made with other settings: {'; '.join(conflicts)}. Resume with the "
                     "same settings, start over with --overwrite, or pass --allow-mixed-settings to mix them "
                     "on purpose")


def resume_generated(path: str | Path, settings: dict, allow_mixed: bool, run_log: RunLog
                     ) -> tuple[set[str], list[dict | None]]:
    """Before a run resumes a generated.jsonl: refuse records made with other settings (all keys
    whose value is known now; a server's model is compared after its start-up checks), then repair
    duplicate ids (first record wins; the count goes to the run log). Returns (ids written, the
    distinct settings found)."""
    ids, duplicates, found = scan_generated(path)
    refuse_mixed_settings(path, found, settings, allow_mixed, keys=[k for k, v in settings.items() if v is not None])
    if duplicates:
        from common.generation.progress import log

        dropped = drop_duplicate_ids(path)
        run_log.append({"duplicate_ids_removed": dropped})
        log(f"[01b] {path}: {dropped} records repeated an id written before them (two runs at once?); "
            "kept the first of each")
    return ids, found
