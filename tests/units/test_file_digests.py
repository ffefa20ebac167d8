"""Checkpoints and exports carry their bytes (issue 34 item 3): the COMPLETE marker records each file's size
and sha256 and tells a torn, edited or unreadable folder from a good one; 04's manifest records its
exports' files, and 05 and 05b refuse an export changed since, in one line naming the file."""
import argparse
import importlib
import json

import pytest

from common.benchmark.inputs import load_inputs
from common.draft.export_speculators import export_speculators
from common.stage import BENCH, SERVE_BENCH, StageError, TRAIN, file_digests, stage_dir, target_identity, \
    tokenizer_identity, write_manifest
from common.training.checkpoints import (CKPT_MARKER, LEGACY_MARKER, SET_ASIDE, complete_checkpoints, marker_problem,
                                         newest_verified, write_marker)
from tests.units.serving.test_sweep import make_work
from tests.train_helpers import POINTS


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


@pytest.fixture
def work(tmp_path, micro_target):
    """05's and 05b's inputs (tests.test_sweep.make_work) with both of 04's exports and a manifest that
    records their files, as 04 writes it."""
    export = make_work(tmp_path, micro_target)
    spec = export_speculators(export, stage_dir(tmp_path, TRAIN) / "export_speculators", POINTS, micro_target,
                              ["DeepseekV3ForCausalLM"])
    ident = {"tokenizer": tokenizer_identity(micro_target), "target": target_identity(micro_target)}
    write_manifest(stage_dir(tmp_path, TRAIN), TRAIN, argparse.Namespace(), capture_points=POINTS,
                   draft_vocab_size=64, export_files={d.name: file_digests(d) for d in (export, spec)}, **ident)
    return tmp_path


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_05_and_05b_refuse_an_export_edited_after_04(work, micro_target):
    assert load_inputs(work, None).export_dir == stage_dir(work, TRAIN) / "export_sglang"   # untouched: used
    weights = stage_dir(work, TRAIN) / "export_sglang" / "model.safetensors"
    flip_last_byte(weights)
    said = rf"^{weights} has sha256 \w{{12}} where \w{{12}} was written \(04's manifest records"
    with pytest.raises(StageError, match=said):
        importlib.import_module(BENCH).main(["--work-dir", str(work), "--device", "cpu"])
    with pytest.raises(StageError, match=said):
        importlib.import_module(SERVE_BENCH).main(["--work-dir", str(work), "--baseline-url", "http://127.0.0.1:9",
                                                   "--eagle3-url", "http://127.0.0.1:9", "--warmup-requests", "1"])
    assert not stage_dir(work, BENCH).exists() and not stage_dir(work, SERVE_BENCH).exists()
    flip_last_byte(weights)                                           # restored: 05's inputs pass again
    load_inputs(work, None)
    # vLLM serving the speculators export: that folder is checked too, before any server is asked anything
    spec_cfg = stage_dir(work, TRAIN) / "export_speculators" / "config.json"
    size = spec_cfg.stat().st_size
    spec_cfg.write_text(spec_cfg.read_text().replace('"norm_before_residual": false', '"norm_before_residual": true'))
    with pytest.raises(StageError, match=rf"^{spec_cfg} is {size - 1:,} bytes where {size:,} were written \("):
        importlib.import_module(SERVE_BENCH).main([
            "--work-dir", str(work), "--engine", "vllm", "--draft-format", "speculators", "--warmup-requests", "1",
            "--baseline-url", "http://127.0.0.1:9", "--eagle3-url", "http://127.0.0.1:9"])


def test_a_manifest_from_before_export_files_is_not_checked(tmp_path, micro_target):
    make_work(tmp_path, micro_target)       # its 04 manifest records no export_files
    assert "export_files" not in json.loads((stage_dir(tmp_path, TRAIN) / "manifest.json").read_text())
    flip_last_byte(stage_dir(tmp_path, TRAIN) / "export_sglang" / "model.safetensors")
    assert load_inputs(tmp_path, None).m04.raw.get("export_files") is None


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
