"""common/parallel.ordered_map: the one-process results in input order, failures raised in the parent (a
StageError with its own message), items read lazily, and no worker outliving a killed parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common.parallel import ordered_map
from common.stage import StageError
from tests.paths import REPO


def test_results_in_input_order_from_other_processes():
    parent = os.getpid()
    weights = [3, 1, 2]   # a closure over the caller's state, as 02b and 05 pass their loaded models

    def work(i):
        time.sleep(0.05 * (i % 3))   # later items finish first
        return i * weights[i % 3], os.getpid()

    out = list(ordered_map(work, range(12), workers=2))
    assert [v for v, _ in out] == [i * weights[i % 3] for i in range(12)]
    assert parent not in {pid for _, pid in out} and len({pid for _, pid in out}) == 2


def test_one_worker_runs_in_this_process():
    assert list(ordered_map(lambda i: os.getpid(), range(3), workers=1)) == [os.getpid()] * 3
    with pytest.raises(ValueError, match="workers must be >= 1"):
        list(ordered_map(abs, [1], workers=0))


def test_stage_error_in_a_worker_is_raised_with_its_message():
    def work(i):
        if i == 5:
            raise StageError("shard 5 holds other samples")
        return i

    with pytest.raises(StageError) as e:
        list(ordered_map(work, range(10), workers=2))
    assert e.value.message == "shard 5 holds other samples"
    assert str(e.value) == "shard 5 holds other samples"


def test_items_are_read_lazily():
    read = []

    def items():
        for i in range(100):
            read.append(i)
            yield i

    it = ordered_map(lambda i: i, items(), workers=2)
    assert next(it) == 0
    assert len(read) <= 5   # at most 2 x workers in flight, then one more read before the first result
    it.close()


def test_a_killed_parent_takes_its_workers_with_it(tmp_path):
    pids = tmp_path / "pids"
    script = (
        "import os, sys, time\n"
        "from common.parallel import ordered_map\n"
        "def work(i):\n"
        f"    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    time.sleep(60)\n"
        "list(ordered_map(work, range(4), workers=2))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.time() + 30
    while time.time() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
        time.sleep(0.1)
    workers = [int(p) for p in pids.read_text().split()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in workers):
        time.sleep(0.1)
    assert not any(alive(p) for p in workers), "a worker outlived its killed parent"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"   # a zombie has exited (its reaper is init)
    except FileNotFoundError:
        return False
