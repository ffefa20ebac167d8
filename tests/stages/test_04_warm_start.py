"""04 --init-from (warm start: vocab kept or mapped, L2-SP, identity in manifest and resume) and
checkpoint selection by replay tau on the held-out selection split."""
import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from common.draft.export_sglang import export_sglang
from common.draft.imported import read_draft
from common.draft.model import Eagle3DraftModel, draft_config
from common.io import write_jsonl
from common.stage import EXTRACT, MERGE, StageError, TRAIN, VOCAB, stage_dir
from common.target.head import read_target_text_config
from common.training.selection import accept_lengths, candidate_steps, walk_rounds
from common.training.warm_start import anchors, l2sp_penalty
from tests.train_helpers import DV, FLAGS, POINTS, fresh_work, make_upstream

train = importlib.import_module(TRAIN)


@pytest.fixture(scope="module")
def upstream(micro_target, tmp_path_factory):
    return make_upstream(micro_target, tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def trained(upstream, tmp_path_factory):
    """A draft 04 trained briefly on the upstream (its export is the 'public draft' of these tests)."""
    work = fresh_work(upstream, tmp_path_factory.mktemp("pre"))
    train.main(["--work-dir", str(work), *FLAGS, "--num-epochs", "2", "--save-every", "1000"])
    return stage_dir(work, TRAIN) / "export_sglang"


def run(work, *extra):
    train.main(["--work-dir", str(work), *FLAGS, "--save-every", "1000", *extra])
    return json.loads((stage_dir(work, TRAIN) / "manifest.json").read_text())


def test_zero_steps_export_the_imported_draft_exactly(upstream, trained, tmp_path):
    man = run(fresh_work(upstream, tmp_path), "--init-from", str(trained), "--max-steps", "0")
    got = load_file(str(stage_dir(tmp_path / "w", TRAIN) / "export_sglang" / "model.safetensors"))
    want = load_file(str(trained / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    warm = man["init_from"]
    assert warm["sha256"] == read_draft(trained).sha256 and warm["vocab"] == "keep"
    assert man["num_steps"] == 0 and man["train_curves"] is None


def test_warm_start_trains_resumes_and_refuses_another_init(upstream, trained, tmp_path):
    work = fresh_work(upstream, tmp_path)
    argv = ["--init-from", str(trained), "--num-epochs", "2", "--l2sp-weight", "0.01"]
    train.main(["--work-dir", str(work), *FLAGS, "--save-every", "4", "--stop-at-step", "4", *argv])
    d = read_draft(trained)
    fresh = Eagle3DraftModel(d.config)
    fresh.set_vocab_mapping(d.state["d2t"], d.state["t2d"])
    other = export_sglang(fresh, tmp_path / "other", POINTS)
    with pytest.raises(StageError, match="other settings .*init_from"):
        train.main(["--work-dir", str(work), *FLAGS, "--save-every", "4", "--init-from", str(other),
                    "--num-epochs", "2", "--l2sp-weight", "0.01"])
    man = run(work, *argv)
    assert man["init_from"]["path"] == str(trained) and man["final_eval"]["tau"] > 1.0


def test_init_vocab_map_moves_rows_by_target_id_and_reports_coverage(upstream, micro_target, tmp_path):
    """An imported draft that covers half of 03's vocab: those rows are its rows of the same target
    token, the others the mean imported row."""
    tcfg = read_target_text_config(micro_target)
    d2t03 = load_file(str(stage_dir(upstream, VOCAB) / "vocab_mapping.safetensors"))["d2t"]
    ours = torch.arange(DV) + d2t03                                   # 03's target ids
    kept = torch.cat([ours[::2], torch.tensor([v for v in range(600) if v not in set(ours.tolist())][:50])]).sort().values
    torch.manual_seed(1)
    model = Eagle3DraftModel(draft_config(tcfg, len(kept)))
    t2d = torch.zeros(600, dtype=torch.bool)
    t2d[kept] = True
    model.set_vocab_mapping(kept - torch.arange(len(kept)), t2d)
    imp = export_sglang(model, tmp_path / "imp", POINTS)
    man = run(fresh_work(upstream, tmp_path), "--init-from", str(imp), "--init-vocab", "map", "--max-steps", "0")
    cov = man["init_from"]["coverage"]
    assert (cov["rows"], cov["rows_found"]) == (DV, DV // 2) and man["draft_vocab_size"] == DV
    got = load_file(str(stage_dir(tmp_path / "w", TRAIN) / "export_sglang" / "model.safetensors"))
    src = load_file(str(imp / "model.safetensors"))["lm_head.weight"]
    row_of = {int(t): i for i, t in enumerate(kept)}
    for j in (0, 2, 1, 3):
        want = src[row_of[int(ours[j])]] if j % 2 == 0 else src.float().mean(0).to(src.dtype)
        assert torch.equal(got["lm_head.weight"][j], want)
    assert torch.equal(got["d2t"], d2t03)


def test_init_refused_before_anything_is_written(upstream, trained, tmp_path):
    work = fresh_work(upstream, tmp_path)
    cfg = json.loads((trained / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
                                                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
    with pytest.raises(StageError, match=r"capture points is h\[2, 4, 6\], expected h\[2, 4, 5\]"):
        run(work, "--init-from", str(bad))
    assert not stage_dir(work, TRAIN).exists()
    with pytest.raises(StageError, match="--l2sp-weight pulls toward an imported draft"):
        run(work, "--l2sp-weight", "1")


def test_l2sp_gradient_is_twice_the_distance():
    w = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    a = anchors(w)
    with torch.no_grad():
        for p in w:
            p.add_(torch.randn(p.shape))
    pen = l2sp_penalty(w, a)
    pen.backward()
    assert torch.allclose(pen, sum(((p - q) ** 2).sum() for p, q in zip(w, a)))
    for p, q in zip(w, a):
        assert torch.allclose(p.grad, 2 * (p.detach() - q))


def test_l2sp_keeps_the_fine_tune_near_the_init(upstream, trained, tmp_path):
    init = load_file(str(trained / "model.safetensors"))

    def distance(weight):
        work = fresh_work(upstream, tmp_path / f"l{weight}")
        run(work, "--init-from", str(trained), "--num-epochs", "2", "--l2sp-weight", str(weight))
        got = load_file(str(stage_dir(work, TRAIN) / "export_sglang" / "model.safetensors"))
        return sum(float(((got[k].float() - init[k].float()) ** 2).sum()) for k in init if init[k].is_floating_point())
    assert distance(100.0) < 0.1 * distance(0.0)


def test_replay_walk_counts_rounds_like_the_decoding_loop():
    """Stored tokens 0..9, supervised from 3; the draft proposes the right token except at anchor 5."""
    ids = torch.arange(10)[None]
    pred = torch.stack([ids + 2 + j for j in range(3)])                # perfect: token t+2+j
    pred[:, 0, 5] = -1                                                  # anchor 5: first proposal wrong
    acc = accept_lengths(pred, ids)[0].tolist()
    assert acc == [3, 3, 3, 3, 3, 0, 2, 1, 0, 0]          # proposals past the end never match
    mask = [False] * 3 + [True] * 7
    # pending 3 -> anchor 2 accepts 3 (4,5,6) + 7; pending 7 -> anchor 6: k_eff = min(3, 10-7-2) = 1, accepts
    # 1 (8) + 9. Rounds: 2, tokens committed: 4 + 2.
    assert walk_rounds(acc, mask, 3) == (6, 2)
    pred[:, 0, 2] = -1                                                  # anchor 2 wrong too
    acc = accept_lengths(pred, ids)[0].tolist()
    # pending 3 -> 0 accepted + 4; pending 4 -> anchor 3: 3 (5,6,7) + 8; pending 8 -> anchor 7: k_eff 0, + 9
    assert walk_rounds(acc, mask, 3) == (6, 3)


def test_candidate_steps_per_epoch():
    assert candidate_steps([10, 10, 10], 1, 30) == [10, 20, 30]
    assert candidate_steps([10, 10], 2, 15) == [5, 10, 15]
    assert candidate_steps([10, 10], 1, 0, with_init=True) == [0]


def test_zero_steps_with_selection_measure_the_imported_draft(upstream, trained, tmp_path):
    """Step 0 of the Kimi path: the public draft's replay tau on the user's own held-out split."""
    man = run(fresh_work(upstream, tmp_path), "--init-from", str(trained), "--max-steps", "0",
              "--candidates-per-epoch", "1")
    assert [c["step"] for c in man["selection"]["candidates"]] == [0] and man["selection"]["chosen_replay_tau"] >= 1.0


def test_selection_exports_the_best_candidate_and_shows_the_curve(upstream, tmp_path):
    work = fresh_work(upstream, tmp_path)
    man = run(work, "--num-epochs", "3", "--candidates-per-epoch", "1")
    sel = man["selection"]
    taus = {c["step"]: c["replay_tau"] for c in sel["candidates"]}
    assert len(taus) == 3 and 0 not in taus and sel["chosen_replay_tau"] == max(taus.values()) and all(t >= 1.0 for t in taus.values())
    cand = torch.load(stage_dir(work, TRAIN) / "candidates" / f"step_{sel['chosen_step']:06d}" / "model.pt")
    got = load_file(str(stage_dir(work, TRAIN) / "export_sglang" / "model.safetensors"))
    assert all(torch.equal(got[k], cand[k].to(got[k].dtype)) for k in cand)
    rows = [json.loads(r) for r in (stage_dir(work, TRAIN) / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "select"] == sorted(taus)


def test_selection_never_holds_the_reported_prompts(upstream, tmp_path):
    """05 reports on 01c's benchmark prompts; a work dir whose selection split holds one is refused."""
    work = fresh_work(upstream, tmp_path)
    args = train.parse_args(train.build_parser(), ["--work-dir", str(work), *FLAGS])
    held = train.plan_data(args, stage_dir(work, EXTRACT), False)
    ids = [e[3] for e in held.data.entries]
    selection = {ids[i] for b in held.eval_batches for i in b}
    stage_dir(work, MERGE).mkdir()
    write_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl", [{"id": "other/1"}])
    train.plan_data(args, stage_dir(work, EXTRACT), False, train.load_inputs(args).reported_ids)
    write_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl", [{"id": sorted(selection)[0]}])
    with pytest.raises(StageError, match="selection split holds 1 of 05's benchmark prompts"):
        run(work, "--candidates-per-epoch", "1")


def test_a_run_killed_before_its_first_checkpoint_leaves_no_candidate_behind(upstream, trained, tmp_path, monkeypatch):
    """Issue 34 item 1: a warm start with selection, killed in its first save, leaves candidates/step_000000
    (the imported draft) and no checkpoint. A next run without --init-from and without selection exports
    what it trained (init None, selection None); a next run that selects never lets the leftover compete."""
    import shutil

    killed = fresh_work(upstream, tmp_path / "killed")

    def kill(*a, **kw):
        raise KeyboardInterrupt   # the process dies in its first save, before anything of it is written
    monkeypatch.setattr(train, "save_checkpoint", kill)
    with pytest.raises(KeyboardInterrupt):
        run(killed, "--init-from", str(trained), "--candidates-per-epoch", "1", "--num-epochs", "2", "--save-every", "2")
    monkeypatch.undo()
    leftover = stage_dir(killed, TRAIN) / "candidates" / "step_000000"
    assert (leftover / "COMPLETE").is_file() and not list((stage_dir(killed, TRAIN) / "checkpoints").glob("step_*"))
    for name in ("plain", "selecting"):
        shutil.copytree(killed, tmp_path / name / "w")
    meta = json.loads((leftover / "meta.json").read_text())
    sel_leftover = stage_dir(tmp_path / "selecting" / "w", TRAIN) / "candidates" / "step_000000" / "meta.json"
    sel_leftover.write_text(json.dumps({**meta, "replay_tau": 99.0}))   # it would win any contest it entered

    plain = stage_dir(tmp_path / "plain" / "w", TRAIN)
    man = run(tmp_path / "plain" / "w", "--num-epochs", "1")   # not the `trained` fixture's run: 2 epochs
    assert man["init_from"] is None and man["selection"] is None
    assert not list((plain / "candidates").glob("step_*"))
    assert not [r for r in map(json.loads, (plain / "train_log.jsonl").read_text().splitlines()) if r["split"] == "select"]
    got = load_file(str(plain / "export_sglang" / "model.safetensors"))
    last = torch.load(plain / "checkpoints" / f"step_{man['num_steps']:06d}" / "model.pt")
    assert all(torch.equal(got[k], last[k].to(got[k].dtype)) for k in last)       # what it trained
    imported = load_file(str(trained / "model.safetensors"))
    assert not torch.equal(got["fc.weight"].float(), imported["fc.weight"].float())

    man = run(tmp_path / "selecting" / "w", "--num-epochs", "1", "--candidates-per-epoch", "1")
    steps = [c["step"] for c in man["selection"]["candidates"]]
    assert 0 not in steps and man["selection"]["chosen_step"] in steps and man["init_from"] is None


def test_final_eval_describes_the_exported_candidate(upstream, tmp_path, monkeypatch):
    """With selection on, the manifest's final_eval is the held-out eval of the exported weights (the chosen
    candidate's, the `sim_tau` of its select row), final_eval_step names their step, and the last step's
    eval moves to selection.last_step_eval."""
    taus = iter([3.0, 2.0, 1.5])      # the first candidate wins, so the export is not the last step
    monkeypatch.setattr(train, "selection_tau", lambda *a, **kw: next(taus))
    work = fresh_work(upstream, tmp_path)
    man = run(work, "--num-epochs", "3", "--candidates-per-epoch", "1", "--eval-every", "1000")
    rows = [json.loads(r) for r in (stage_dir(work, TRAIN) / "train_log.jsonl").read_text().splitlines()]
    first = min(c["step"] for c in man["selection"]["candidates"])
    assert man["selection"]["chosen_step"] == first == man["final_eval_step"] < man["num_steps"]
    picked = next(r for r in rows if r["split"] == "select" and r["step"] == first)
    last = next(r for r in rows if r["split"] == "eval" and r["step"] == man["num_steps"])
    assert man["final_eval"]["tau"] == picked["sim_tau"] and man["selection"]["last_step_eval"]["tau"] == last["tau"]
    assert man["final_eval"]["acc"] != last["acc"]                 # the run moved on after the chosen step


def test_step_0_says_which_draft_competed(upstream, trained, tmp_path, capsys):
    """Candidate 0 is the download as given under --init-vocab keep, the download remapped onto 03's vocab
    under map: the manifest (selection.step_0) and the plan line say which, so "never worse than the
    start" is not read as "never worse than the download" under map."""
    keep = run(fresh_work(upstream, tmp_path / "keep"), "--init-from", str(trained), "--max-steps", "0",
               "--candidates-per-epoch", "1")
    assert keep["selection"]["step_0"].startswith("the imported draft as given")
    capsys.readouterr()
    mapped = run(fresh_work(upstream, tmp_path / "map"), "--init-from", str(trained), "--max-steps", "0",
                 "--candidates-per-epoch", "1", "--init-vocab", "map")
    assert "remapped onto 03's draft vocab" in mapped["selection"]["step_0"]
    assert "not the download itself" in mapped["selection"]["step_0"]
    assert "step 0 is the imported draft remapped onto 03's vocab, not the download itself" in capsys.readouterr().out
    scratch = run(fresh_work(upstream, tmp_path / "scratch"), "--max-steps", "2", "--candidates-per-epoch", "1")
    assert scratch["selection"]["step_0"] is None


def test_resume_refuses_the_same_weights_under_a_changed_config(upstream, trained, tmp_path):
    """The init's identity (the sha256 in the plan that resume compares) covers config.json: a draft folder
    whose config changed in place (another RoPE base: another network) is refused on resume."""
    import shutil
    src = tmp_path / "draft"
    shutil.copytree(trained, src)
    work = fresh_work(upstream, tmp_path)
    argv = ["--init-from", str(src), "--num-epochs", "2"]
    train.main(["--work-dir", str(work), *FLAGS, "--save-every", "4", "--stop-at-step", "4", *argv])
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_theta"] * 2
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match="other settings .*init_from"):
        train.main(["--work-dir", str(work), *FLAGS, "--save-every", "4", *argv])


def test_an_unreadable_init_ends_in_one_line(upstream, trained, tmp_path):
    import shutil
    src = tmp_path / "draft"
    shutil.copytree(trained, src)
    (src / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(StageError) as e:
        run(fresh_work(upstream, tmp_path), "--init-from", str(src), "--max-steps", "0")
    assert "\n" not in str(e.value) and "weights file model.safetensors is unreadable" in str(e.value)
    assert not stage_dir(tmp_path / "w", TRAIN).exists()   # refused before anything was written
