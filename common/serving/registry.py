"""The engines 05b can sweep, by the name --engine takes (ENGINES), and what goes through that name: the
Engine built from 05b's flags (`engine_from_args`) and the declared drafts it can serve (`check_servable`).
An unknown name stops with one line here (`engine_class`), never falling through to another engine's rules.
"""
from __future__ import annotations

from pathlib import Path

from common.draft.manifest import DraftManifest
from common.serving.engine import Engine, ServedDraft
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.stage import StageError
from common.target.capture import default_capture_points
from common.target.head import read_target_text_config
from common.target.manifests import HiddenStatesManifest

ENGINES: dict[str, type[Engine]] = {"sglang": SGLangEngine, "vllm": VllmEngine}


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass named `name` (its `label` names it for people); an unknown name is refused."""
    if name not in ENGINES:
        raise StageError(f"unknown serving engine {name!r}: 05b serves through {', '.join(map(repr, ENGINES))} "
                         "(common/serving/registry.py; docs/serving.md, 'Adding an engine')")
    return ENGINES[name]


def engine_from_args(args, export_dir: Path, m02b: HiddenStatesManifest, m04: DraftManifest, target_dir: Path,
                     work_dir: Path, foreign: list[ServedDraft] = ()) -> Engine:
    """05b's flags -> the Engine that serves this run (`foreign`: the declared drafts, check_servable's)."""
    return engine_class(args.engine).from_args(args, export_dir, m02b, m04, target_dir, work_dir, list(foreign))


def check_servable(engine: str, checked: dict, target_dir: Path) -> list[ServedDraft]:
    """The declared drafts (compare.check_drafts: {name: (ImportedDraft, capture points)}) as `engine` will
    serve them; one line refusing a draft it cannot serve as checked (the engine's refuse_unservable), before
    anything launches. Without any declaration of their points both engines use [2, N//2, N-3], which
    check_draft assumes too."""
    cls = engine_class(engine)
    default = default_capture_points(int(read_target_text_config(target_dir)["num_hidden_layers"]))
    served = []
    for name, (d, points) in checked.items():
        cls.refuse_unservable(f"--draft {name} ({d.path}): {cls.label}", d, list(points), default)
        served.append(ServedDraft(name, Path(d.path), tuple(points)))
    return served
