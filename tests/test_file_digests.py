"""Checkpoints and exports carry their bytes (issue 34 item 3): the COMPLETE marker records each file's size
and sha256 and tells a torn, edited or unreadable folder from a good one."""
import json

from common.stage import file_digests
from common.training.checkpoints import (CKPT_MARKER, LEGACY_MARKER, SET_ASIDE, complete_checkpoints, marker_problem,
                                         newest_verified, write_marker)


def marked(folder, files: dict):
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_marker(folder)
    return folder


def test_the_marker_records_each_file_and_names_the_one_that_changed(tmp_path):
    ckpt = marked(tmp_path / "step_000004", {"model.pt": b"w" * 1000, "state.json": b"{}"})
    rec = json.loads((ckpt / CKPT_MARKER).read_text())["files"]
    on_disk = file_digests(ckpt)
    assert rec == {n: d for n, d in on_disk.items() if n != CKPT_MARKER} and rec["model.pt"]["size"] == 1000
    assert set(on_disk) == {"model.pt", "state.json", CKPT_MARKER} and marker_problem(ckpt) is None
    (ckpt / "model.pt").write_bytes(b"w" * 400)                                      # cut short
    assert marker_problem(ckpt) == f"{ckpt / 'model.pt'} is 400 bytes where 1,000 were written"
    (ckpt / "model.pt").write_bytes(b"w" * 999 + b"x")                               # same size, one byte
    assert marker_problem(ckpt).startswith(f"{ckpt / 'model.pt'} has sha256 ")
    (ckpt / "model.pt").unlink()
    assert marker_problem(ckpt) == f"{ckpt / 'model.pt'} is missing"
    (ckpt / CKPT_MARKER).write_text('{"files": {"model.pt": {"si')                  # a torn marker
    assert marker_problem(ckpt) == f"its {CKPT_MARKER} marker cannot be read (JSONDecodeError)"
    (ckpt / CKPT_MARKER).write_text(LEGACY_MARKER)           # made before markers recorded files: as before
    assert marker_problem(ckpt) is None


def test_newest_verified_sets_aside_every_newer_one_that_fails(tmp_path):
    good = marked(tmp_path / "step_000002", {"model.pt": b"a" * 10})
    for step in (4, 6):
        marked(tmp_path / f"step_{step:06d}", {"model.pt": b"b" * 10})
        (tmp_path / f"step_{step:06d}" / "model.pt").write_bytes(b"b" * 3)
    path, failed = newest_verified(tmp_path)
    assert path == good and [f.split(" ")[0] for f in failed] == ["step_000006", "step_000004"]
    assert complete_checkpoints(tmp_path) == [good] and (tmp_path / "step_000004" / SET_ASIDE).is_file()
    (good / "model.pt").write_bytes(b"")
    assert newest_verified(tmp_path) == (None, [f"step_000002 does not verify ({good / 'model.pt'} is 0 bytes where "
                                                "10 were written): set aside"])


def test_a_torn_candidate_is_set_aside_and_the_best_that_verifies_is_exported(tmp_path, capsys):
    """The selection's candidates carry the checkpoint marker: the best one cut short is not judged, and
    the best that verifies is loaded."""
    import torch

    from common.training.selection import CANDIDATE_DIR, choose_candidate, save_candidate
    from tests.train_helpers import micro_batch
    models = {step: micro_batch(seed=step)[0] for step in (3, 6, 9)}
    for step, tau in ((3, 1.5), (6, 2.5), (9, 2.0)):
        save_candidate(tmp_path, step, models[step], torch.float32, {"replay_tau": tau, "num_draft_tokens": 3})
    torn = tmp_path / CANDIDATE_DIR / "step_000006" / "model.pt"
    with open(torn, "r+b") as f:
        f.truncate(100)
    target = micro_batch(seed=0)[0]
    record, _ = choose_candidate(tmp_path, target)
    assert record["chosen_step"] == 9 and [c["step"] for c in record["candidates"]] == [3, 9]
    assert torch.equal(target.fc.weight, models[9].fc.weight)
    said = [line for line in capsys.readouterr().out.splitlines() if "does not verify" in line]
    assert len(said) == 1 and said[0].startswith(f"[04] selection: candidate step_000006 does not verify ({torn} "
                                                 "is 100 bytes where ") and said[0].endswith("set aside, not judged")
