"""The engine tier's shared servers. A vLLM server start costs about a minute on the 2-core box, so a server that
several modules launched identically (same target, no draft, the same settings) is started once here and
attached to by each: 05b takes it with --baseline-url, as it takes any attached baseline (its checks included).
- `smollm2_baseline`: SmolLM2-135M, no draft, served as "smollm2" (test_vllm_real.py: 01b against it and 05b's
  baseline; test_vllm_simulated.py: the break-even map's baseline);
- `tiny_world`, `tiny_baseline`: the shipped tiny Kimi-shaped world unpacked once, and its target served without a
  draft as "tiny-kimi" (test_vllm_tiny.py: its answers against transformers'; test_vllm_tiny_drafts.py: 05b's
  baseline).
A fixture starts its server without waiting (each test calls `ready()` when it needs it, so a server starts while
the test builds its chain); the shared servers stop when the last engine test is done, before any other tier runs.
If the engine venv or the SmolLM2 world is missing, the tests that need them FAIL (make test builds both first)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from common.stage import TINY_WORLD
from tests.engine.servers import SMOLLM2_TARGET, Served, need_engine
from tests.paths import REPO, tier_of

SHARED = ("smollm2_baseline", "tiny_baseline")
_last_user: dict[str, str] = {}      # shared fixture -> the last test (in run order) that uses it
_running: dict[str, Served] = {}     # shared fixture -> its server, while it runs


def shared(name: str, server: Served):
    _running[name] = server
    yield server
    server.stop()


def pytest_collection_finish(session):
    for item in session.items:
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server after the last test that uses it (and all of them once no engine test follows): the
    tests after it, and the other tiers, run without it."""
    for name in list(_running):
        if _last_user.get(name) == item.nodeid or nextitem is None or tier_of(nextitem.path) != "engine":
            _running.pop(name).stop()


@pytest.fixture(scope="session")
def smollm2_baseline(tmp_path_factory):
    need_engine(SMOLLM2_TARGET)
    yield from shared("smollm2_baseline", Served("smollm2_baseline", SMOLLM2_TARGET, tmp_path_factory.mktemp("smollm2_baseline"),
                             served_name="smollm2"))


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> Path:
    """The shipped tiny world, unpacked as `make demo` unpacks it (00 with configs/tiny.yaml)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-kimi"
    importlib.import_module(TINY_WORLD).main(["--tiny-dir", str(out), "--config", str(REPO / "configs" / "tiny.yaml"),
                                              "--tiny-asset", str(REPO / "assets" / "tiny_kimi")])
    assert json.loads((out / "manifest.json").read_text())["source"] == "asset"
    return out


@pytest.fixture(scope="session")
def tiny_baseline(tiny_world, tmp_path_factory):
    need_engine()
    yield from shared("tiny_baseline", Served("tiny_baseline", tiny_world / "target", tmp_path_factory.mktemp("tiny_baseline"),
                             served_name="tiny-kimi"))
