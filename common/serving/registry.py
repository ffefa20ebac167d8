"""The engines 05b can sweep, by the name --engine takes (ENGINES), and what goes through that name: each
engine's flags in 05b's parser (`add_engine_flags`), the Engine built from 05b's flags (`engine_from_args`) and
the declared drafts it can serve (`check_servable`). An unknown name stops with one line here (`engine_class`),
never falling through to another engine's rules.
"""
from __future__ import annotations

from pathlib import Path

from common.draft.config import read_config
from common.draft.imported import serving_differences
from common.draft.manifest import DraftManifest
from common.serving.engine import Engine, ServedDraft
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.io import read_json
from common.stage import StageError
from common.target.capture import default_capture_points
from common.target.head import load_target_head, read_target_text_config
from common.target.manifests import HiddenStatesManifest

ENGINES: dict[str, type[Engine]] = {"sglang": SGLangEngine, "vllm": VllmEngine}


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass named `name` (its `label` names it for people); an unknown name is refused."""
    if name not in ENGINES:
        raise StageError(f"unknown serving engine {name!r}: 05b serves through {', '.join(map(repr, ENGINES))} "
                         "(common/serving/registry.py; docs/serving.md, 'Adding an engine')")
    return ENGINES[name]


def add_engine_flags(parser) -> None:
    """Each engine's own 05b flags (Engine.add_flags) in its own argument group, "<label> servers (--engine
    <name>)"; an engine that inherits its add_flags (a subclass of another engine) reads its parent's flags."""
    declared = set()
    for cls in ENGINES.values():
        if cls.add_flags.__func__ not in declared:
            declared.add(cls.add_flags.__func__)
            cls.add_flags(parser.add_argument_group(f"{cls.label} servers (--engine {cls.name})"))


def engine_from_args(args, export_dir: Path, m02b: HiddenStatesManifest, m04: DraftManifest, target_dir: Path,
                     work_dir: Path, foreign: list[ServedDraft] = ()) -> Engine:
    """05b's flags -> the Engine that serves this run (`foreign`: the declared drafts, check_servable's)."""
    return engine_class(args.engine).from_args(args, export_dir, m02b, m04, target_dir, work_dir, list(foreign))


def check_servable(engine: str, checked: dict, target_dir: Path, ours: Path | None = None) -> list[ServedDraft]:
    """The declared drafts (compare.check_drafts: {name: (ImportedDraft, capture points)}) as `engine` will
    serve them; one line refusing a draft it cannot serve as checked (the engine's refuse_unservable), or
    that it would serve as another network than the one imported and replayed (imported.serving_differences:
    an MHA YaRN vLLM computes otherwise, a shipped embedding vLLM keeps, names an engine cannot load), before
    anything launches; `ours` (04's export) is held to the latter too. Without any declaration of their
    points both engines use [2, N//2, N-3], which check_draft assumes too."""
    cls = engine_class(engine)
    default = default_capture_points(int(read_target_text_config(target_dir)["num_hidden_layers"]))
    embed = lambda: load_target_head(target_dir, dtype=None, with_head=False)[0]  # noqa: E731 (only if asked)
    named = [(f"--draft {name} ({d.path})", serving_differences(d, cls.name, embed)) for name, (d, _) in checked.items()]
    if ours is not None:   # 04's export: its config (an imported draft's RoPE); its names and embedding are 04's
        named.insert(0, (f"04's export ({ours})",
                         read_config(ours, read_json(Path(ours) / "config.json")).unservable.get(cls.name)))
    for where, why in named:
        if why:
            raise StageError(f"{where}: {cls.label} would serve another network than the one imported and "
                             f"replayed: {why[0]}")
    served = []
    for name, (d, points) in checked.items():
        cls.refuse_unservable(f"--draft {name} ({d.path}): {cls.label}", d, list(points), default)
        served.append(ServedDraft(name, Path(d.path), tuple(points)))
    return served
