"""Flags first: `--config X.yaml` supplies flag defaults, the command line wins, unknown keys fail.

`--config` may be given more than once (the real run: configs/kimi-k2.5.yaml for the target, lengths,
serving and training, configs/datasets_v4.yaml for the mix). The files are merged key by key; a key
two files set to different values is refused unless the command line sets it, so no value is ever
silently dropped. A key may be any stage's flag (one preset serves the whole chain); which flags exist
is read from the stage scripts' source with `ast`, never by running them.
"""
from __future__ import annotations

import argparse
import ast
import sys
from functools import lru_cache
from pathlib import Path

import yaml

from common.stage import REPO_ROOT, STAGE_SCRIPTS, StageError, stage_script


def base_parser(doc: str | None, work_dir: bool = True) -> argparse.ArgumentParser:
    """Parser with the flags every stage shares: --work-dir (required), --config, --overwrite."""
    # allow_abbrev=False: a misspelt flag must fail, not silently become another one that shares its
    # prefix (`01b --datasets x` was read as `--datasets-only x`, generating one source instead of all).
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("stage")
    if work_dir:
        g.add_argument("--work-dir", type=Path, default=None,
                       help="root of the stage folders (01_prepared/, 01b_generated/, ...)")
    g.add_argument("--config", type=Path, action="append", default=None,
                   help="flat YAML of flag defaults (keys are flag names); repeatable: files merge key by "
                        "key, two files disagreeing on a key is an error unless the command line sets it")
    g.add_argument("--overwrite", action="store_true",
                   help="redo a stage whose manifest.json says it is complete")
    return p


def _flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Map kebab-case flag names (without --) to argparse dests."""
    names = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                names[opt[2:]] = action.dest
    return names


def declared_flags(script: Path) -> set[str]:
    """The `--name` flags a script declares: string arguments of its add_argument calls, read from its
    source (and `--no-name` for a BooleanOptionalAction); those of the functions it imports from `common` and
    calls, where flags two stages share are declared once (common/benchmark/inputs.py add_benchmark_flags); and,
    for a script that hands its parser to the serving engines (`add_engine_flags(`: 05b), the engines' own
    (engine_flags). tests/units/test_common.py checks this equals each stage's real parser."""
    tree = ast.parse(script.read_text(), str(script))
    names = own_flags(tree)
    called = {getattr(n.func, "id", None) or getattr(n.func, "attr", None)   # f(...) and module.f(...)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in tree.body:   # base_parser's flags (this module's) are every stage's: all_stage_flags adds them
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common.")
                and node.module != "common.config"):
            continue
        source = REPO_ROOT / f"{node.module.replace('.', '/')}.py"
        wanted = {a.name for a in node.names} & called
        text = source.read_text() if wanted and source.is_file() else ""
        if "add_argument" in text:   # parse only a module that declares flags
            names |= set().union(*(own_flags(f) for f in ast.parse(text, str(source)).body
                                   if isinstance(f, ast.FunctionDef) and f.name in wanted))
    return names | (engine_flags() if "add_engine_flags" in called else set())


# Where every serving engine's module lives (common/serving/<engine>.py): each declares its own 05b flags in
# its Engine subclass's `add_flags` (common/serving/engine.py), read here from the source like a stage's.
ENGINE_MODULES = REPO_ROOT / "common" / "serving"


@lru_cache(maxsize=1)
def engine_flags() -> frozenset[str]:
    """The flags declared inside an `add_flags` function of a module in ENGINE_MODULES."""
    names = set()
    for module in sorted(ENGINE_MODULES.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.FunctionDef) and node.name == "add_flags":
                names |= own_flags(node)
    return frozenset(names)


def own_flags(tree: ast.AST) -> set[str]:
    """The `--name` flags of the add_argument calls in `tree` itself (declared_flags)."""
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        flags = [a.value[2:] for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
        action = next((k.value for k in node.keywords if k.arg == "action"), None)
        negated = getattr(action, "attr", getattr(action, "id", None)) == "BooleanOptionalAction"
        names.update(flags + ([f"no-{f}" for f in flags] if negated else []))
    return names


@lru_cache(maxsize=1)
def all_stage_flags() -> frozenset[str]:
    """Every flag name of every stage script (STAGE_SCRIPTS), plus the shared ones of base_parser."""
    names = set(_flag_names(base_parser(None)))
    for name in STAGE_SCRIPTS:
        names |= declared_flags(REPO_ROOT / stage_script(name))
    return frozenset(names)


# Flags that were renamed, for a one-line hint when an old config or command line still says them.
RENAMED_FLAGS = {"generation-backend": "generation-engine", "capture-backend": "capture-engine",
                 "init": "init-scheme"}


def load_config(path: str | Path, known: frozenset[str] | set[str] | None = None) -> dict:
    """One config file; every key must be in `known` (default: every stage's flags)."""
    known = all_stage_flags() if known is None else known
    path = Path(path)
    if not path.is_file():
        raise StageError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise StageError(f"{path}: a config is a flat mapping of flag names to values")
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        renamed = "".join(f"; {k} is now {RENAMED_FLAGS[k]}" for k in unknown if k in RENAMED_FLAGS)
        raise StageError(f"{path}: unknown key(s) {', '.join(unknown)}; keys are flag names of the stages "
                         f"(see `python <stage>.py --help`){renamed}")
    bad_form = sorted(k for k in data if "_" in k)
    if bad_form:
        raise StageError(f"{path}: keys are kebab-case flag names: {', '.join(bad_form)}")
    return data


def merge_configs(paths: list[Path], from_command_line: set[str], known: set[str] | None = None) -> dict:
    """The files' keys merged in order. A key set to different values by two files is refused, unless
    `from_command_line` holds it (the command line decides, so neither file's value is used)."""
    merged: dict = {}
    origin: dict[str, Path] = {}
    for path in paths:
        for key, value in load_config(path, known).items():
            if key in merged and merged[key] != value and key not in from_command_line:
                raise StageError(f"--config files disagree on {key}: {origin[key]} says {merged[key]!r}, "
                                 f"{path} says {value!r}; fix one file or pass --{key} on the command line")
            merged[key], origin[key] = value, path
    return merged


def _given_on_command_line(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Flag names (kebab-case) the command line sets. argparse leaves a namespace attribute that already
    exists untouched unless the flag is given, so parse into a namespace pre-filled with a marker."""
    marker = object()
    dests = {a.dest for a in parser._actions if a.dest != "help" and not isinstance(a, argparse._AppendAction)}
    seen = parser.parse_known_args(argv, argparse.Namespace(**{d: marker for d in dests}))[0]
    return {name for name, dest in _flag_names(parser).items()
            if dest in dests and getattr(seen, dest, marker) is not marker}


def refuse_renamed_flags(argv: list[str]) -> None:
    """An old flag name on the command line stops with its new one (argparse would only say "unrecognized
    arguments": base_parser takes no abbreviation, so `--init` is not read as a prefix of `--init-scheme`)."""
    for word in argv:
        name = word[2:].partition("=")[0] if word.startswith("--") else None
        if name in RENAMED_FLAGS:
            raise StageError(f"--{name} is now --{RENAMED_FLAGS[name]}")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse argv, with defaults from the --config files. Keys that are no stage's flag are an error;
    keys of other stages are ignored (a shared preset)."""
    refuse_renamed_flags(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv)
    if getattr(pre, "config", None):
        own = _flag_names(parser)
        values = merge_configs(pre.config, _given_on_command_line(parser, argv), all_stage_flags() | set(own))
        defaults = {}
        for key, value in values.items():
            if key in own:
                action = next(a for a in parser._actions if a.dest == own[key])
                if isinstance(value, str) and action.type is not None:
                    value = action.type(value)
                elif action.type is Path and value is not None:
                    value = Path(value)
                defaults[own[key]] = value
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if getattr(args, "work_dir", "unset") is None:
        raise StageError("--work-dir is required (or set work-dir in the --config file)")
    return args
