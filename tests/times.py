"""Per-tier test durations, written where TEST_TIMES points (.ci/run: docs/test_times.json) and rendered into
README.md by scripts/test_times.py. One file per measured commit: each pytest session of `make test` (the suite,
then the core tests under the other transformers releases) adds its tiers; a file of another commit, date or
CPU is started afresh."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.paths import REPO

START = time.time()          # this module is imported at the first test report: conftest's import is earlier
_tests: dict[str, dict] = {}  # nodeid -> {"seconds", "outcome", "path"}


def add_report(report) -> None:
    t = _tests.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed", "path": str(report.fspath)})
    t["seconds"] += report.duration
    if report.failed:
        t["outcome"] = "failed"
    elif report.skipped and t["outcome"] != "failed":
        t["outcome"] = "skipped"


def cpu() -> str:
    """The CPU as README names it: model, the vector extensions that matter here, cores."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(ext + [f'{os.cpu_count()} cores'])})"


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(session, path: str, tier_of) -> None:
    out = Path(path)
    with open(out.with_name(out.name + ".lock"), "w") as lock:   # `make test` runs two sessions side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        add_session(out, session, tier_of)


def add_session(out: Path, session, tier_of) -> None:
    import transformers

    here = {"commit": commit(), "date": time.strftime("%Y-%m-%d"), "cpu": cpu()}
    doc = json.loads(out.read_text()) if out.is_file() else {}
    if any(doc.get(k) != v for k, v in here.items()):
        doc = {**here, "sessions": []}
    tiers: dict[str, dict] = {}
    files: dict[str, float] = {}
    for t in _tests.values():
        tier = tiers.setdefault(tier_of(t["path"]), {"seconds": 0.0, "passed": 0, "failed": 0, "skipped": 0})
        tier["seconds"] += t["seconds"]
        tier[t["outcome"]] += 1
        rel = str(Path(t["path"]).resolve().relative_to(REPO))
        files[rel] = files.get(rel, 0.0) + t["seconds"]
    venv = Path(sys.prefix)   # as invoked: a venv linked into the checkout is named by its place here
    doc["sessions"].append({
        "command": "pytest " + " ".join(session.config.invocation_params.args),
        "venv": str(venv.relative_to(REPO)) if venv.is_relative_to(REPO) else str(venv),
        "transformers": transformers.__version__, "exit_status": int(session.exitstatus),
        "wall_s": round(time.time() - START, 1), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "tiers": {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in sorted(tiers.items())},
        "files": {k: round(v, 1) for k, v in sorted(files.items(), key=lambda kv: -kv[1])}})
    out.write_text(json.dumps(doc, indent=1) + "\n")
