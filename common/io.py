"""Atomic file writes and crash-tolerant JSONL reading/appending."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path):
    """Yield a `*.tmp` sibling of `path`; on success it is renamed over `path` (os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: str | Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write all rows atomically; returns the number written."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Yield the complete records of a JSONL file.

    A last line without its newline (a writer killed mid-record) is ignored; a malformed line
    anywhere else is corruption and raises, naming the file and line.
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # torn tail of a killed appender
            if not raw.strip():
                continue
            try:
                yield json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: corrupt JSONL line ({e})") from None


def truncate_torn_tail(path: str | Path) -> int:
    """Cut a partial last line left by a killed appender; returns the bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
    return len(data) - keep


class JsonlAppender:
    """Append whole records to a JSONL file, flushing (and optionally fsyncing) each one.

    Opening it first truncates a torn tail, so every line in the file is a complete record.
    """

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync = fsync

    def write(self, row: dict) -> None:
        # One write call of one whole line: a kill leaves at most one torn tail.
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
