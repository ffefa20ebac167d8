"""The folder tree is the architecture: imports inside common/ go downward only (common/__init__.py).

Layers: the stage contract (common.stage/config/io) imports nothing else of common; data and draft
import only the contract (and themselves); sglang and worlds may also import data and draft. Nothing
under common/ imports or loads a stage script. A module outside the known packages fails too, so a new
flat module has to pick its room.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTRACT = {"stage", "config", "io"}
ALLOWED = {
    "contract": {"contract"},
    "data": {"contract", "data"},
    "draft": {"contract", "draft"},
    "sglang": {"contract", "data", "draft", "sglang"},
    "serving": {"contract", "data", "draft", "sglang", "serving"},
    "worlds": {"contract", "data", "draft", "worlds"},
}
STAGE_NAME = re.compile(r"^\d\d[a-z]?_\w+$")


def layer_of(module: str) -> str | None:
    """'common.draft.loss' -> 'draft'; 'common.io' -> 'contract'; None for a module of no known layer."""
    parts = module.split(".")
    if parts[0] != "common" or len(parts) < 2:
        return None
    if parts[1] in CONTRACT:
        return "contract"
    return parts[1] if parts[1] in ALLOWED else None


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every import anywhere in the file, function-level ones included.
    `from common.draft import loss` yields common.draft.loss; `import_module("04_train")` yields 04_train."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "spec_from_file_location", "run_path")):
            found += [(node.lineno, a.value.removesuffix(".py")) for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return found


def violations(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "common").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if module == "common":
            continue
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{path.relative_to(root)}: not in a known package ({', '.join(sorted(ALLOWED))})")
            continue
        for line, name in imported_modules(ast.parse(path.read_text(), str(path))):
            if STAGE_NAME.match(Path(name).name):
                bad.append(f"{path.relative_to(root)}:{line}: loads the stage script {name}")
                continue
            theirs = layer_of(name)
            if theirs is not None and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(root)}:{line}: {mine} imports {name} ({theirs})")
    return bad


def test_imports_go_downward_only():
    assert violations(REPO) == []


def test_every_package_says_what_lives_there():
    for pkg in sorted(set(ALLOWED) - {"contract"}):
        doc = ast.get_docstring(ast.parse((REPO / "common" / pkg / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"common/{pkg}/__init__.py needs a docstring naming what it may import"


def test_checker_catches_each_kind_of_violation(tmp_path):
    """The rule test above must be able to fail: plant one violation of each kind in a copy."""
    for pkg in ("data", "draft", "sglang"):
        (tmp_path / "common" / pkg).mkdir(parents=True)
        (tmp_path / "common" / pkg / "__init__.py").write_text('"""x"""\n')
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "io.py").write_text("from common.draft.shards import ShardReader\n")
    (tmp_path / "common" / "data" / "a.py").write_text("def f():\n    from common.sglang import server\n")
    (tmp_path / "common" / "draft" / "b.py").write_text("from common.data import chat_format\n")
    (tmp_path / "common" / "sglang" / "c.py").write_text(
        "import importlib\nstage = importlib.import_module('04_train')\n")
    (tmp_path / "common" / "loose.py").write_text("")
    found = "\n".join(violations(tmp_path))
    assert "io.py:1: contract imports common.draft.shards" in found
    assert "a.py:2: data imports common.sglang" in found
    assert "b.py:1: draft imports common.data" in found
    assert "c.py:2: loads the stage script 04_train" in found
    assert "loose.py: not in a known package" in found
