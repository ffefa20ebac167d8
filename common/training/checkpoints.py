"""04's checkpoints: `step_NNNNNN/` folders that count only once their COMPLETE marker exists (written
last), the newest `keep` kept, leftovers of a killed save removed. A checkpoint holds the trainable
weights (the export key set), the full optimizer state (plain AdamW format, whatever the number of
ranks that made it), the scheduler, the RNG states and `state.json` (step, data cursor, plan).

The marker records each file's size and sha256 (JSON {"files": common.stage.file_digests}). A marker
only says the save got that far: on a full disk or a power loss the marker can land while model.pt is cut
short, and loading it ends in an OSError far from the cause. So resume verifies a checkpoint's files
against its marker first and falls back to the newest one that verifies (`newest_verified`). Cost: one
read of the folder per save and per resume (Kimi's 0.96 B-parameter draft: ~3.8 GB of fp32 weights and
~7.7 GB of moments, ~10 s at ~1 GB/s of sha256; arithmetic, not measured). 04's selection candidates
(common/training/selection.py) carry the same marker."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from common.io import write_json
from common.stage import changed_file, file_digests

CKPT_MARKER = "COMPLETE"
SET_ASIDE = "COMPLETE.failed"   # a marker whose files did not verify, renamed: the folder no longer counts
LEGACY_MARKER = "ok\n"          # markers written before they recorded the files: taken at their word


def complete_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if (p / CKPT_MARKER).is_file())


def save_checkpoint(root: Path, step: int, model, opt_state: dict, sched, cursor: dict, plan: dict,
                    keep: int) -> Path:
    import torch
    path = root / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    torch.save(model.trainable_state_dict(), path / "model.pt")
    torch.save(opt_state, path / "optimizer.pt")
    torch.save(sched.state_dict(), path / "scheduler.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}   # this rank's GPU
    torch.save(rng, path / "rng.pt")
    write_json(path / "state.json", {"step": step, "cursor": cursor, "plan": plan})
    write_marker(path)                                # last: the folder counts from now on
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.glob("step_*"):                 # incomplete leftovers of a killed save
        if not (stale / CKPT_MARKER).is_file() and stale != path:
            shutil.rmtree(stale)
    return path


def write_marker(path: Path) -> None:
    """The COMPLETE marker, recording the size and sha256 of every file already in `path`."""
    write_json(path / CKPT_MARKER, {"files": file_digests(path)})


def marker_problem(path: Path) -> str | None:
    """Why the files of a marked folder are not the ones its marker recorded (one phrase naming the
    file), or None when they are (or when the marker predates recorded files: LEGACY_MARKER)."""
    try:
        text = (path / CKPT_MARKER).read_text()
        if text == LEGACY_MARKER:
            return None
        return changed_file(path, json.loads(text)["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {CKPT_MARKER} marker cannot be read ({type(e).__name__})"


def set_aside(path: Path) -> None:
    """Rename a failed folder's marker: it stops counting, and the next save removes it as a leftover."""
    (path / CKPT_MARKER).rename(path / SET_ASIDE)


def newest_verified(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint whose files match its marker, or None; one line per newer one that
    did not, each set aside so that neither the pruning nor a later resume counts it)."""
    failed = []
    for path in reversed(complete_checkpoints(root)):
        problem = marker_problem(path)
        if problem is None:
            return path, failed
        set_aside(path)
        failed.append(f"{path.name} does not verify ({problem}): set aside")
    return None, failed


def load_checkpoint(path: Path, model, opt, sched, device) -> dict:
    import torch
    missing, unexpected = model.load_state_dict(torch.load(path / "model.pt", map_location=device), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    opt.load_state_dict(torch.load(path / "optimizer.pt", map_location=device))
    sched.load_state_dict(torch.load(path / "scheduler.pt"))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "state.json").read_text())
