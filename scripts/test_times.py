"""README's and tests/README.md's test times, rendered from the durations file that .ci/run writes
(docs/test_times.json: tests/times.py adds each pytest session's tiers, with the commit, date and CPU), so that no
time in them is typed by hand.

    python scripts/test_times.py --write          # (make test-times) render both blocks from the file
    python scripts/test_times.py --check          # exit 1 when a block is not the file's rendering
    python scripts/test_times.py --record build/test_times.json [--total SECONDS]
        # .ci/run, after `make test`: the run's file (its own wall time added) becomes docs/test_times.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMES = REPO / "docs" / "test_times.json"
BLOCKS = {REPO / "README.md": "tiers", REPO / "tests" / "README.md": "files"}
BEGIN, END = "<!-- test-times: begin -->", "<!-- test-times: end -->"
TIER_ORDER = ["units", "stages", "tools", "engine"]


def span(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def counts(t: dict) -> str:
    return ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "skipped") if t[k])


def render(doc: dict, kind: str) -> str:
    """The block between BEGIN and END: `tiers` (README: every session's tiers) or `files` (tests/README.md:
    the tiers and the engine tier's files)."""
    head = (f"From `docs/test_times.json` (rendered by `make test-times`; .ci/run writes the file): commit "
            f"{doc['commit']}, {doc['date']}, {doc['cpu']}. Each session's load average at its end says what else "
            "ran (about 1 a busy core).")
    if doc.get("ci_run_s"):
        head += f" `.ci/run` in all, venv and world builds included: {span(doc['ci_run_s'])}."
    rows = ["| session | venv (transformers) | tier | tests | time |", "|---|---|---|---|---|"]
    for s in doc["sessions"]:
        tiers = sorted(s["tiers"].items(), key=lambda kv: (TIER_ORDER + [kv[0]]).index(kv[0]))
        for i, (name, t) in enumerate(tiers):
            first = i == 0
            rows.append(f"| {'`' + s['command'] + '`' if first else ''} | {s['venv'] + ' (' + s['transformers'] + ')' if first else ''} "
                        f"| {name} | {counts(t)} | {span(t['seconds'])} |")
        rows.append(f"| | | whole session (wall, load {s['load_average_at_end'][0]:g}) | | {span(s['wall_s'])} |")
    out = [head, "", *rows]
    if kind == "files":
        engine = [(f, sec) for s in doc["sessions"] for f, sec in s["files"].items() if f.startswith("tests/engine/")]
        if engine:
            out += ["", "The engine tier by file (setup included: a module's servers start in its first test):", "",
                    "| file | time |", "|---|---|", *[f"| `{f}` | {span(sec)} |" for f, sec in engine]]
    return "\n".join(out)


def replaced(text: str, block: str, where: Path) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{where} has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{block}\n{END}", text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=TIMES)
    ap.add_argument("--record", type=Path, default=None, help="a run's durations file (TEST_TIMES): copied to --file")
    ap.add_argument("--total", type=float, default=None, help="with --record: .ci/run's own wall time, seconds")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.record:
        doc = json.loads(args.record.read_text())
        if args.total is not None:
            doc["ci_run_s"] = round(args.total, 1)
        args.file.write_text(json.dumps(doc, indent=1) + "\n")
    doc = json.loads(args.file.read_text())
    stale = []
    for path, kind in BLOCKS.items():
        text = path.read_text()
        new = replaced(text, render(doc, kind), path)
        if new != text:
            stale.append(str(path.relative_to(REPO)))
            if args.write:
                path.write_text(new)
    if args.check and stale:
        print(f"not the rendering of {args.file.name}: {', '.join(stale)} (run `make test-times`)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
