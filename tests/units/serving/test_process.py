"""Engine-neutral server life (common/serving/process.py), on real subprocesses: readiness polled on /health, an
early exit named with its status, and a shutdown that waits for (or kills) the whole process group."""
from __future__ import annotations

import sys

import pytest

from common.serving import process
from common.serving import sglang as srv
from common.stage import StageError
from tests.paths import REPO


def test_launch_ready_stop(tmp_path):
    """A real subprocess: readiness polling on /health, info document, SIGTERM of the process group."""
    code = ("import sys, time; sys.path.insert(0, %r); from tests.sglang_server_stub import *; "
            "import http.server as h; s = StubState(algorithm='EAGLE3', draft_path='/d'); "
            "h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), make_handler(s)).serve_forever()" % str(REPO))
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = process.launch_server([sys.executable, "-c", code, str(port)], tmp_path / "log.txt")
    try:
        process.wait_ready(f"http://127.0.0.1:{port}", proc, 60, poll_s=0.2)
        info = srv.get_server_info(f"http://127.0.0.1:{port}")
        assert info["speculative_algorithm"] == "EAGLE3" and srv.spec_settings_of(info) == (3, 1, 4)
    finally:
        process.stop_server(proc, grace_s=10)
    assert proc.returncode is not None and process.group_members(proc.pid) == []
    dead = process.launch_server([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log2.txt")
    with pytest.raises(StageError, match="exited with status 3"):
        process.wait_ready("http://127.0.0.1:9", dead, 30, poll_s=0.2)


def test_stop_server_waits_for_the_whole_process_group(tmp_path):
    """Like SGLang's TP workers, a child outlives the launcher's SIGTERM by a moment: stop_server returns
    only once it has gone too (a new server would otherwise find the GPU memory still held)."""
    child = ("import signal, sys, time; open(sys.argv[1], 'w').write('up'); "
             "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0))); time.sleep(60)")
    ready = tmp_path / "child_up"
    parent = ("import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(ready)!r}]); time.sleep(60)")
    proc = process.launch_server([sys.executable, "-c", parent], tmp_path / "log.txt")
    import time
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    members = process.group_members(proc.pid)
    assert len(members) == 2, members
    process.stop_server(proc, grace_s=20)
    assert process.group_members(proc.pid) == []


def test_stop_server_kills_what_ignores_sigterm(tmp_path):
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1], 'w').write('up'); time.sleep(60)")
    ready = tmp_path / "up"
    proc = process.launch_server([sys.executable, "-c", code, str(ready)], tmp_path / "log.txt")
    import time
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    process.stop_server(proc, grace_s=0.5)
    assert proc.returncode == -9 and process.group_members(proc.pid) == []
