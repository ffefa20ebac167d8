"""The docs against the tree: README's chain table has a row for every stage script and names no other, and the
test times in README.md and tests/README.md are the rendering of docs/test_times.json (scripts/test_times.py),
not numbers typed by hand."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.paths import REPO


def chain_rows() -> list[str]:
    """The scripts README's chain table (section "The chain") names, one a row, in order."""
    section = REPO.joinpath("README.md").read_text().split("\n## The chain\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_the_chain_table_has_a_row_for_every_stage_script_and_no_other():
    scripts = [p.name for p in stage_scripts()]
    rows = chain_rows()
    assert len(rows) == len(set(rows)), rows
    assert sorted(rows) == scripts, {"no row": sorted(set(scripts) - set(rows)),
                                     "no such script": sorted(set(rows) - set(scripts))}


def test_the_test_times_are_the_durations_files_rendering():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "test_times.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def stage_scripts():
    return sorted(p for p in REPO.glob("*.py") if re.match(r"\d\d[a-z]?_", p.name))


def test_every_seed_flag_of_the_chain_is_in_readme_and_every_05b_flag_in_serving_md():
    """README lists the chain's seeds (docs/serving.md points there); docs/serving.md lists 05b's flags by group,
    a bold item for each argument group of 05b's parser (the engines' own included)."""
    import importlib

    from common.config import declared_flags
    from common.stage import SERVE_BENCH

    readme = REPO.joinpath("README.md").read_text()
    seeds = {f for p in stage_scripts() for f in declared_flags(p) if f.endswith("seed")}
    assert {"mix-seed", "generation-seed", "train-seed", "bench-seed"} <= seeds
    assert [f for f in sorted(seeds) if f"`--{f}`" not in readme and f"--{f}`" not in readme] == []
    groups = REPO.joinpath("docs", "serving.md").read_text().split("## 05b's flags, by group")[1].split("\n## ")[0]
    flags = declared_flags(REPO / "05b_serve_benchmark.py") | {"work-dir", "config", "overwrite"}
    assert [f for f in sorted(flags) if f"`--{f}" not in groups and not f.startswith("no-")] == []
    titles = [g.title.split(" (")[0] for g in importlib.import_module(SERVE_BENCH).build_parser()._action_groups
              if g._group_actions and g.title not in ("positional arguments", "options")]
    assert "SGLang servers" in titles and "vLLM servers" in titles
    assert [t for t in titles if f"- **{t}" not in groups] == []
