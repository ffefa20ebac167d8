"""Which draft a server serves, and whether it may be timed, for every engine.

A server names its draft by a path (SGLang's `speculative_draft_model_path`, vLLM's `speculative_config.model`):
it is one of 05b's drafts when it is that folder or a byte-identical copy of its config.json and weights
(`served_draft`, `same_folder`; fingerprints cached by path, size and mtime). 04's export is checked against
the 02b and 04 manifests (`check_draft_files`), and a warmed-up server's acceptance must clear the floor that
tells a working draft from one accepted at chance (`check_acceptance`).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from common.draft import OURS
from common.draft.manifest import DraftManifest
from common.stage import StageError, sha256_file
from common.target.manifests import HiddenStatesManifest

CHANCE_CAUSES = (
    "the server runs --speculative-algorithm EAGLE instead of EAGLE3 (no aux capture: the draft sees "
    "H-wide final states), the draft was trained on other capture points (eagle_config ids must be "
    "capture points - 1), the draft was trained for another target/tokenizer or chat template, the "
    "draft folder is not 04's export (an older or untrained checkpoint), or d2t is missing/zero so "
    "draft ids map to the wrong target ids")


DRAFT_FILES = ("config.json", "model.safetensors")


def draft_files(folder: str | Path) -> tuple[str, ...]:
    """The files that identify a draft folder by content: config.json and its weights (model.safetensors,
    or a sharded checkpoint's index and shards, as a public draft may come)."""
    index = Path(folder) / "model.safetensors.index.json"
    if not index.is_file():
        return DRAFT_FILES
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ("config.json", index.name, *shards)


def folder_fingerprint(folder: str | Path, files: tuple[str, ...]) -> str | None:
    """sha256 over the named files' bytes (name + content hash each), or None when one is unreadable.
    Cached by path, size and mtime: a Kimi draft's weights are gigabytes and every preflight asks."""
    stats = []
    for name in files:
        path = Path(folder) / name
        if not path.is_file():
            return None
        st = path.stat()
        stats.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return _fingerprint(tuple(stats))


@functools.lru_cache(maxsize=16)
def _fingerprint(stats: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _size, _mtime in stats:
        h.update(Path(path).name.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()


def same_folder(reported: str | None, ours: Path, files: tuple[str, ...]) -> bool:
    """The server's folder is ours: the same resolved path, or byte-identical `files` (a copy on another
    mount). Read from this machine: a path that exists only on the server's host cannot be checked."""
    if not reported:
        return False
    if Path(reported).resolve() == Path(ours).resolve():
        return True
    theirs = folder_fingerprint(reported, files)
    return theirs is not None and theirs == folder_fingerprint(ours, files)


def candidates(drafts) -> dict[str, Path]:
    """{name: folder} of the drafts a server may serve; a bare folder is 04's export alone."""
    return {n: Path(f) for n, f in drafts.items()} if isinstance(drafts, dict) else {OURS: Path(drafts)}


def served_draft(reported: str | None, drafts) -> str | None:
    """The name of the first of `drafts` (candidates) that the server's folder is, by folder or content
    (same_folder over that draft's draft_files); None when it is none of them."""
    for name, folder in candidates(drafts).items():
        if same_folder(reported, folder, draft_files(folder)):
            return name
    return None


def not_one_of(drafts) -> str:
    """The refusal's middle: what the served draft is not, and how it was compared."""
    named = candidates(drafts)
    if len(named) == 1:
        (name, folder), = named.items()
        what = f"not 04's export {folder.resolve()}" if name == OURS else f"not the draft {name} {folder.resolve()}"
    else:
        what = "none of 05's drafts (" + ", ".join(f"{n} {f.resolve()}" for n, f in named.items()) + ")"
    return (f"{what} (neither the same folder nor a byte-identical copy of its config.json and weights, as read "
            "from this machine)")


def check_draft_files(export_dir: Path, m02b: HiddenStatesManifest, m04: DraftManifest) -> dict:
    """The exported draft against the target (02b manifest) and 04's manifest. Returns its config."""
    from safetensors import safe_open

    from common.target.capture import sglang_layer_ids

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    with safe_open(str(Path(export_dir) / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    points = list(m02b.capture_points)
    hidden, vocab = m02b.hidden_size, m02b.vocab_size
    dv = m04.draft_vocab_size
    # The ids SGLang must read to capture exactly the 02b points on this target (its rule per model
    # family; 02b already refused points it cannot express, unless the architecture was accepted as
    # unknown there, in which case the common +1 applies).
    architecture = m02b.target_architecture
    if architecture is None:
        raise StageError("the 02b manifest has no target_architecture (made by an older 02b): re-run "
                         "`python 02b_extract_hidden_states_sglang.py --overwrite`")
    expected = sglang_layer_ids(points, architecture, allow_unknown=True)
    problems = []
    if "fc.weight" not in shapes or shapes["fc.weight"][1] != 3 * hidden:
        problems.append(f"fc.weight {shapes.get('fc.weight')} must take 3 x target hidden = {3 * hidden}")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids != expected:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} must be {expected}: SGLang "
                        f"captures h{points} (the 02b capture points) from those ids on {architecture}")
    if list(m04.capture_points or []) != points:
        trained = None if m04.capture_points is None else list(m04.capture_points)
        problems.append(f"04 trained on capture points {trained}, 02b captured {points}")
    if cfg.get("vocab_size") != vocab:
        problems.append(f"vocab_size {cfg.get('vocab_size')} != target vocab {vocab}")
    if cfg.get("draft_vocab_size") != dv:
        problems.append(f"draft_vocab_size {cfg.get('draft_vocab_size')} != 04's {dv}")
    if shapes.get("d2t") != (dv,) and not ("d2t" not in shapes and dv == vocab):   # a full vocab stores none
        problems.append(f"d2t {shapes.get('d2t')} must be present with shape ({dv},)")
    if shapes.get("lm_head.weight", (None,))[0] != dv:
        problems.append(f"lm_head.weight {shapes.get('lm_head.weight')} must have {dv} rows")
    if problems:
        raise StageError(f"draft {export_dir} does not fit the target/manifests:\n  - "
                         + "\n  - ".join(problems) + "\nRe-run `python 04_train.py --overwrite`.")
    return cfg


def check_acceptance(tau: float, min_accept_length: float, where: str) -> None:
    """Refuse a tau at chance: 1.0 means only the bonus token is ever accepted."""
    if not tau >= min_accept_length:
        raise StageError(f"{where}: acceptance length {tau:.3f} is at chance (< {min_accept_length}). "
                         f"Usual causes: {CHANCE_CAUSES}.")
