"""Per-item work in forked worker processes, one thread each, results in input order.

On a 2-core CPU box two single-threaded processes use both cores without the spin-waiting two busy threads of
one process cost beside other work (README, "The machines"); their results are those of one process at one
thread, because every item is computed alone from its own inputs and seeds (another thread count only sums
in another order: last-bit float differences). Used by 02b (a shard per item) and 05
(a prompt per item).

Workers are forked after the caller has loaded its models, so the weights are shared copy-on-write and the
item function may be a closure over them. A worker dies with its parent (PR_SET_PDEATHSIG on Linux): a
killed stage leaves no orphan writing shards under a re-run. An exception in a worker, a StageError
included, is raised in the parent; a worker killed outright ends the map with BrokenProcessPool.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_ITEM_FN: Callable | None = None  # the caller's function, inherited by the forked workers
PR_SET_PDEATHSIG = 1


def _start_worker() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    torch.set_num_threads(1)


def _run_item(item):
    return _ITEM_FN(item)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """fn(item) for every item, yielded in input order. workers == 1 runs in this process; more fork that many
    processes and keep at most 2 x workers items in flight (the items are read lazily: 02b streams shards)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    if workers == 1:
        yield from map(fn, items)
        return
    global _ITEM_FN
    if _ITEM_FN is not None:
        raise RuntimeError("ordered_map does not nest")
    _ITEM_FN = fn
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker)
    try:
        pending = deque()
        for item in items:
            pending.append(pool.submit(_run_item, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException:
        # Stop now, not after the items in flight: a failed or interrupted stage ends in one clear line.
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _ITEM_FN = None
