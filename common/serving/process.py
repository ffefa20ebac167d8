"""A launched server's life, whatever the engine: started in its own process group with its output in a
log file (`launch_server`), polled until GET /health answers 200 (`wait_ready`), and stopped with every
process of its group (`stop_server`: SIGTERM, then SIGKILL after a grace period), since an engine's
tensor-parallel workers may outlive its launcher and hold GPU memory that the next server needs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.stage import StageError


def launch_server(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a server in its own process group (so shutdown reaches its TP workers); log to a file.
    `env`: variables set for the server on top of this process's environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"[05b] launching: {shown + ' ' if shown else ''}{' '.join(cmd)}\n[05b]   log: {log_path}")
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout_s: float,
               poll_s: float = 2.0, log_path: Path | None = None) -> None:
    """Poll /health until 200; stop early if the process died. What the server serves is the engine's to
    read next (sglang.get_server_info, vllm.get_info)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise StageError(f"the server exited with status {proc.returncode} before it was ready; "
                             f"see {log_path}")
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(poll_s)
    raise StageError(f"{base_url} was not ready after {timeout_s:.0f} s (--server-timeout); see {log_path}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc (Linux); elsewhere the group's
    existence (killpg signal 0) is all that can be asked."""
    proc_dir = Path("/proc")
    if not (proc_dir / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ')'
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # exited while being read
        if int(pgrp) == pgid and state not in ("Z", "X"):
            live.append(int(stat.parent.name))
    return live


def wait_group_exit(pgid: int, timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait until no live process is left in the group; returns the ones still alive at the timeout."""
    deadline = time.time() + timeout_s
    while (left := group_members(pgid)) and time.time() < deadline:
        time.sleep(poll_s)
    return left


def stop_server(proc: subprocess.Popen | None, grace_s: float = 60.0, kill_wait_s: float = 30.0) -> None:
    """SIGTERM the server's process group and wait until every member has exited (SGLang refuses to
    start while the previous server's TP workers still hold GPU memory); SIGKILL what is left after
    `grace_s`. The launcher alone exiting is not enough: its workers may outlive it."""
    if proc is None:
        return
    pgid = proc.pid  # launch_server starts a new session: the group id is the launcher's pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    try:
        proc.wait(timeout=grace_s)  # reap the launcher so it does not linger as a zombie
    except subprocess.TimeoutExpired:
        pass
    left = wait_group_exit(pgid, max(0.0, deadline - time.time()))
    if left:
        print(f"[05b] server processes {left} still alive {grace_s:.0f} s after SIGTERM: SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=kill_wait_s)
        left = wait_group_exit(pgid, kill_wait_s)
    if left:
        raise StageError(f"server processes {left} (process group {pgid}) survived SIGKILL; they may still "
                         "hold GPU memory: end them before starting another server")
