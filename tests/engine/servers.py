"""The engine tier's helpers: a vLLM server started for a test, free ports, the engine venv's settings
(tests/engine/conftest.py shares the servers several modules would launch identically)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common.serving import process, vllm
from tests.paths import ENGINE_PY, REPO

SMOLLM2_TARGET = REPO / "build" / "smollm2" / "target"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(**over) -> vllm.VllmSettings:
    return vllm.VllmSettings(python=str(ENGINE_PY), kv_cache_space_gib=1, **over)


def need_engine(*targets: Path) -> None:
    if not ENGINE_PY.is_file():
        pytest.fail(f"{ENGINE_PY} is missing: build the engine venv with `make engine` (make test does)")
    for t in targets:
        if not (t / "config.json").is_file():
            pytest.fail(f"{t} is missing: run `python 00_build_smollm2_world.py --config configs/smollm2.yaml`")


class Served:
    """A vLLM server started for tests (prefix caching off, as 05b launches its own: 05b refuses an attached server
    that caches): url, process, log, its command. `ready()` waits until it answers."""

    def __init__(self, name: str, target: Path, logs: Path, draft: Path | None = None, k: int | None = None,
                 method: str = "eagle3", served_name: str | None = None, server_settings: vllm.VllmSettings | None = None):
        s = server_settings or settings()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"{name}.log"
        self.cmd = vllm.server_command(target, self.port, s, False, draft, k, served_name=served_name, method=method,
                                       prefix_cache=False)
        self.proc = process.launch_server(self.cmd, self.log, vllm.server_env(s, target))

    def ready(self):
        """Answers, and has answered its info document once: vLLM imports what /server_info needs on the first
        request, which took over get_info's 30 s on the loaded 2-core box (2026-12-05, two tier runs at load 8-9)."""
        process.wait_ready(self.url, self.proc, 600, log_path=self.log)
        vllm.get_info(self.url, timeout=300)
        return self

    def stop(self) -> None:
        process.stop_server(self.proc)
        self.proc = None   # stopped once: its process group id is not signalled again
