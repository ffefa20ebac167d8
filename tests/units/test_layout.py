"""The folder tree is the architecture: imports inside common/ go downward only (common/__init__.py).

Layers: the stage contract (common.stage/config/io/parallel) imports nothing else of common; the shared cores
(text, target, draft) import only the contract; each stage-owned package (datasets, generation,
training, benchmark, serving) and the world package (worlds) import what ALLOWED lists (05b's serving
side reuses 05's benchmark code, never the other way round). Nothing under common/ imports, loads or
executes a stage script, or any module by a computed name (import_module, exec_module,
spec_from_file_location, run_path, __import__). Module imports never form a loop. A module outside the
known packages fails too, so a new flat module has to pick its room.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from tests.paths import REPO

CONTRACT = {"stage", "config", "io", "parallel"}
CORES = {"contract", "text", "target", "draft"}
ALLOWED = {
    "contract": {"contract"},
    "text": {"contract", "text"},
    "target": {"contract", "target"},
    "draft": {"contract", "draft"},
    "datasets": {"contract", "text", "datasets"},
    "generation": {"contract", "text", "generation"},
    "training": {"contract", "target", "draft", "training"},
    "benchmark": {"contract", "text", "target", "draft", "benchmark"},
    "serving": {"contract", "text", "target", "draft", "benchmark", "serving"},
    "worlds": {"contract", "text", "target", "draft", "generation", "training", "worlds"},
}
STAGE_NAME = re.compile(r"^\d\d[a-z]?_\w+$")
DYNAMIC_LOADERS = ("import_module", "exec_module", "spec_from_file_location", "run_path", "__import__",
                   "module_from_spec")


def layer_of(module: str) -> str | None:
    """'common.training.loss' -> 'draft'; 'common.io' -> 'contract'; None for a module of no known layer."""
    parts = module.split(".")
    if parts[0] != "common" or len(parts) < 2:
        return None
    if parts[1] in CONTRACT:
        return "contract"
    return parts[1] if parts[1] in ALLOWED else None


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every import anywhere in the file, function-level ones included.
    `from common.training import loss` yields common.training.loss."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def dynamic_loads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, loader) for every call that imports or executes a module by a name computed at run time,
    whatever its argument (a stage file found by glob is still a stage)."""
    return [(node.lineno, name) for node in ast.walk(tree) if isinstance(node, ast.Call)
            for name in [getattr(node.func, "attr", getattr(node.func, "id", None))] if name in DYNAMIC_LOADERS]


def common_modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "common").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return out


def violations(root: Path) -> list[str]:
    bad = []
    for module, path in common_modules(root).items():
        if module == "common":
            continue
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{path.relative_to(root)}: not in a known package ({', '.join(sorted(ALLOWED))})")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, loader in dynamic_loads(tree):
            bad.append(f"{path.relative_to(root)}:{line}: loads a module at run time ({loader})")
        for line, name in imported_modules(tree):
            if STAGE_NAME.match(name.split(".")[0]):
                bad.append(f"{path.relative_to(root)}:{line}: imports the stage script {name}")
                continue
            theirs = layer_of(name)
            if theirs is not None and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(root)}:{line}: {mine} imports {name} ({theirs})")
    return bad


def import_loops(root: Path) -> list[list[str]]:
    """Cycles in the module import graph of common/ (function-level imports included)."""
    modules = common_modules(root)
    graph = {}
    for module, path in modules.items():
        names = {n for _, n in imported_modules(ast.parse(path.read_text(), str(path)))}
        graph[module] = sorted({n for n in names if n in modules and n != module and n != "common"})
    loops, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                loops.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    return loops


def test_imports_go_downward_only():
    assert violations(REPO) == []


def test_no_import_loops():
    assert import_loops(REPO) == []


def test_package_layers_form_no_loop():
    """ALLOWED itself must be a downward order: no package may reach itself through another."""
    def reach(pkg, seen):
        for dep in ALLOWED[pkg] - {pkg}:
            assert dep != seen[0], f"package loop: {' -> '.join(seen + [dep])}"
            reach(dep, seen + [dep])
    for pkg in ALLOWED:
        reach(pkg, [pkg])


def test_every_package_says_what_lives_there():
    for pkg in sorted(set(ALLOWED) - {"contract"}):
        doc = ast.get_docstring(ast.parse((REPO / "common" / pkg / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"common/{pkg}/__init__.py needs a docstring naming what it may import"


def test_checker_catches_each_kind_of_violation(tmp_path):
    """The rule tests above must be able to fail: plant one violation of each kind in a copy."""
    for pkg in ("text", "draft", "benchmark", "serving", "training"):
        (tmp_path / "common" / pkg).mkdir(parents=True)
        (tmp_path / "common" / pkg / "__init__.py").write_text('"""x"""\n')
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "io.py").write_text("from common.target.shards import ShardReader\n")
    (tmp_path / "common" / "text" / "a.py").write_text("def f():\n    from common.serving import http\n")
    (tmp_path / "common" / "draft" / "b.py").write_text("from common.text import chat_format\n")
    (tmp_path / "common" / "benchmark" / "f.py").write_text("from common.serving.sweep import write_report\n")
    (tmp_path / "common" / "serving" / "c.py").write_text(
        "import importlib\nstage = importlib.import_module('04_train')\n")
    # The old config.all_stage_flags: every stage file executed from below, by a computed path.
    (tmp_path / "common" / "config.py").write_text(
        "import importlib.util\nfor path in STAGES:\n"
        "    spec = importlib.util.spec_from_file_location(path.stem, path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
    (tmp_path / "common" / "training" / "d.py").write_text("import common.training.e\n")
    (tmp_path / "common" / "training" / "e.py").write_text("def f():\n    from common.training import d\n")
    (tmp_path / "common" / "loose.py").write_text("")
    found = "\n".join(violations(tmp_path))
    assert "io.py:1: contract imports common.target.shards" in found
    assert "a.py:2: text imports common.serving" in found
    assert "b.py:1: draft imports common.text" in found
    assert "f.py:1: benchmark imports common.serving.sweep (serving)" in found
    assert "c.py:2: loads a module at run time (import_module)" in found
    assert "config.py:3: loads a module at run time (spec_from_file_location)" in found
    assert "config.py:4: loads a module at run time (exec_module)" in found
    assert "loose.py: not in a known package" in found
    assert import_loops(tmp_path) == [["common.training.d", "common.training.e", "common.training.d"]]


def test_stage_docstrings_open_with_their_contract():
    """A stage's docstring: one summary line, then Reads:/Writes:/Real:/Tiny:, then the what-and-why in
    at most 12 lines (the fault policy lives in the module that implements it)."""
    from common.stage import STAGE_SCRIPTS, stage_script

    for name in STAGE_SCRIPTS:
        doc = ast.get_docstring(ast.parse((REPO / stage_script(name)).read_text()))
        summary, contract, *body = doc.split("\n\n")
        assert "\n" not in summary, name
        tags = [line.split(":")[0] for line in contract.splitlines() if not line.startswith(" ")]
        assert tags == ["Reads", "Writes", "Real", "Tiny"], (name, tags)
        assert body and len("\n\n".join(body).splitlines()) <= 12, (name, len("\n\n".join(body).splitlines()))


def test_every_stage_script_is_registered():
    """A numbered script at the root is a stage (or a world builder) and must be in the registry: presets are
    checked against the registered stages' flags, and --help and the contract tests above cover those alone
    (05b, split off 05, was such a new script)."""
    from common.stage import STAGE_DIRS, STAGE_SCRIPTS

    scripts = {p.stem for p in REPO.glob("*.py") if STAGE_NAME.match(p.stem)}
    assert scripts == set(STAGE_SCRIPTS)
    # --overwrite removes a stage's folder: no stage may share it or live inside it (05 and 05b are siblings)
    folders = [Path(f) for f in STAGE_DIRS.values()]
    assert not [(a, b) for a in folders for b in folders if a is not b and (a == b or a in b.parents)]
