"""Flags first: `--config X.yaml` supplies flag defaults, the command line wins, unknown keys fail."""
from __future__ import annotations

import argparse
import importlib.util
from functools import lru_cache
from pathlib import Path

import yaml

from common.stage import REPO_ROOT, StageError

# Stage files whose flags a shared config may set (one flat YAML serves the whole chain).
STAGE_FILES = ("00_build_tiny_world.py", "00_build_smollm2_world.py", "01_prepare_datasets.py",
               "01b_generate_synthetic.py", "01c_merge_datasets.py", "02b_extract_hidden_states_sglang.py",
               "03_build_vocab_mapping.py", "04_train.py", "05_benchmark.py")


def base_parser(doc: str | None, work_dir: bool = True) -> argparse.ArgumentParser:
    """Parser with the flags every stage shares: --work-dir (required), --config, --overwrite."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("stage")
    if work_dir:
        g.add_argument("--work-dir", type=Path, default=None,
                       help="root of the stage folders (01_prepared/, 01b_generated/, ...)")
    g.add_argument("--config", type=Path, default=None,
                   help="flat YAML of flag defaults (keys are flag names); the command line wins")
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


@lru_cache(maxsize=1)
def all_stage_flags() -> frozenset[str]:
    """Every flag name of every stage (imports each stage file; stages keep heavy imports lazy)."""
    names: set[str] = set()
    for fname in STAGE_FILES:
        path = REPO_ROOT / fname
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"_stage_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names |= set(_flag_names(module.build_parser()))
    return frozenset(names)


def load_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise StageError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise StageError(f"{path}: a config is a flat mapping of flag names to values")
    return data


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse argv, with defaults from --config. Keys that are no stage's flag are an error."""
    pre, _ = parser.parse_known_args(argv)
    config_path = getattr(pre, "config", None)
    if config_path is not None:
        values = load_config(config_path)
        own = _flag_names(parser)
        unknown = sorted(k for k in values if k not in own and k not in all_stage_flags())
        if unknown:
            raise StageError(f"{config_path}: unknown key(s) {', '.join(unknown)}; keys are flag "
                             "names of the stages (see `python <stage>.py --help`)")
        bad_form = sorted(k for k in values if "_" in k)
        if bad_form:
            raise StageError(f"{config_path}: keys are kebab-case flag names: {', '.join(bad_form)}")
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
