"""04's checkpoints: `step_NNNNNN/` folders that count only once their COMPLETE marker exists (written
last), the newest `keep` kept, leftovers of a killed save removed. A checkpoint holds the trainable
weights (the export key set), the full optimizer state (plain AdamW format, whatever the number of
ranks that made it), the scheduler, the RNG states and `state.json` (step, data cursor, plan)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from common.io import write_json

CKPT_MARKER = "COMPLETE"


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
    (path / CKPT_MARKER).write_text("ok\n")          # last: the folder counts from now on
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.glob("step_*"):                 # incomplete leftovers of a killed save
        if not (stale / CKPT_MARKER).is_file() and stale != path:
            shutil.rmtree(stale)
    return path


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
