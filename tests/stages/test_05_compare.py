"""05 --draft NAME=PATH (common/benchmark/compare.py): other drafts measured next to 04's on the same prompts
(05, the reference benchmark; 05b's side is in tests/units/serving/test_sweep.py).
04's own export under another name or in the speculators layout must measure exactly as 04's; a draft reading
other capture points gets the features at its own points; a draft that does not fit is refused before 05
writes anything; the deploy pick is the highest tau at the serving setting, clearly better only when every
paired interval lies above 0."""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
from collections import Counter

import pytest
import torch

from common.benchmark import compare as cmp
from common.benchmark import reference as rb
from common.benchmark import replay as rp
from common.benchmark import spec_decode as sd
from common.config import parse_args
from common.draft.export_sglang import export_sglang
from common.draft.export_speculators import export_speculators
from common.draft.imported import load_draft
from common.draft.model import Eagle3DraftModel, draft_config
from common.io import iter_jsonl
from common.stage import BENCH, MERGE, StageError, TRAIN, read_manifest, stage_dir
from common.target.capture import sglang_points_reader
from common.target.head import read_target_text_config
from common.text.target_format import load_target_format
from common.text.tokenizer import load_tokenizer
from tests.spec_helpers import POINTS, make_chain

KS, MAX_NEW, NUM_PROMPTS = [2, 4], 10, 3
T = "0.001"  # the sampled temperature: near greedy (the random target's logits are flat), so the constant
# draft's proposals still land
OTHER_POINTS = [3, 5, 7]   # declared as SGLang ids [3, 5, 7] (DeepSeek rule: kept as is) and vLLM points


def argv(work, micro_target, *extra):
    return ["--work-dir", str(work), "--num-draft-tokens", *map(str, KS), "--benchmark-max-new-tokens", str(MAX_NEW),
            "--num-prompts", str(NUM_PROMPTS), "--loop-prompts", "0", "--acceptance-temperatures", "0", T,
            "--acceptance-loop-prompts", "0", "--device", "cpu", "--target-path", str(micro_target),
            "--replay-cache-dir", str(work / "replay_cache"), *extra]


def with_points(src, dst, points):
    """A copy of the draft folder src that declares other capture points (same weights)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = points
    cfg["eagle_aux_hidden_state_layer_ids"] = points
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def run(micro_target, target, prompts, tmp_path_factory):
    """One 05 run next to drafts: 04's export (random: tau 1) as `same`; `other`, which always proposes the
    most frequent token of the target's answers (so some are accepted); `spec`, other's speculators layout;
    `shifted`, other's weights reading other capture points. Returns (work dir, metrics, folders)."""
    work = tmp_path_factory.mktemp("compare")
    make_chain(work, micro_target, target, prompts)
    eos = set(load_target_format(micro_target, load_tokenizer(micro_target)).stop_ids)
    answers = [t for p in prompts[:NUM_PROMPTS] for t in sd.greedy_decode(target, p, MAX_NEW, eos)[0]]
    other = full_vocab_draft(micro_target, work / "other", Counter(answers).most_common(1)[0][0])
    folders = {"same": stage_dir(work, TRAIN) / "export_sglang", "other": other,
               "spec": export_speculators(other, work / "spec", POINTS, micro_target, ["DeepseekV3ForCausalLM"]),
               "shifted": with_points(other, work / "shifted", OTHER_POINTS)}
    importlib.import_module(BENCH).main(argv(work, micro_target, "--draft",
                                             *(f"{n}={p}" for n, p in folders.items())))
    metrics = json.loads((stage_dir(work, BENCH) / "metrics.json").read_text())
    return work, metrics, folders


def direct_tau(micro_target, target, work, folder, points) -> dict:
    """tau per k of the draft in `folder` replayed alone on 05's prompts and answers, features at `points`."""
    tok = load_tokenizer(micro_target)
    eos = set(load_target_format(micro_target, tok).stop_ids)
    rows = list(iter_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl"))[:NUM_PROMPTS]
    cache = rb.replay_cache_file(work / "replay_cache", micro_target, MAX_NEW, eos)
    rs = rb.ReplaySet(target, rows, points, MAX_NEW, eos, cache)
    model, _, got = load_draft(folder, read_target_text_config(micro_target), sglang_points_reader(
        "DeepseekV3ForCausalLM"), target.get_input_embeddings().weight.detach())
    assert got == points
    return {str(k): sd.acceptance_stats(r, k)["tau"] for k, r in rs.replay(model, KS).items()}


def test_04s_export_under_another_name_measures_exactly_as_04(run):
    _, m, _ = run
    ours, same = m["drafts"]["04"], m["drafts"]["same"]
    assert same["sha256"] == ours["sha256"] and same["layout"] == "sglang"
    assert same["tau"] == ours["tau"] and same["by_segment"] == ours["by_segment"]
    assert set(ours["tau"]) == {"0", T} and set(ours["tau"]["0"]) == {"2", "4"}
    for k, e in m["by_num_draft_tokens"].items():
        assert ours["tau"]["0"][k]["tau"] == e["tau"] and ours["tau"]["0"][k]["tau_ci95"] == e["tau_ci95"]
        assert ours["tau"][T][k]["tau"] == m["sampled"]["by_temperature"][T]["by_num_draft_tokens"][k]["tau"]
    pair = next(p for p in m["pairs"] if {p["a"], p["b"]} == {"04", "same"})
    for by_k in pair["by_temperature"].values():
        for d in by_k.values():
            assert d["difference"] == 0 and d["ci"] == [0, 0]
    assert "prompt_totals" not in m["sampled"]["by_temperature"][T]


def test_speculators_layout_gives_the_same_tau_as_its_sglang_layout(run):
    _, m, _ = run
    assert (m["drafts"]["spec"]["layout"], m["drafts"]["other"]["layout"]) == ("speculators", "sglang")
    assert m["drafts"]["spec"]["tau"] == m["drafts"]["other"]["tau"]
    assert m["drafts"]["spec"]["by_segment"] == m["drafts"]["other"]["by_segment"]


def test_a_different_draft_gets_its_own_tau_pairs_and_a_deploy_pick(run, micro_target, target):
    work, m, folders = run
    names = ["04", "same", "other", "spec", "shifted"]
    assert list(m["drafts"]) == names and len(m["pairs"]) == len(names) * (len(names) - 1) // 2
    assert all(m["drafts"]["other"]["tau"]["0"][k]["tau"] > m["drafts"]["04"]["tau"]["0"][k]["tau"] for k in ("2", "4"))
    assert {k: c["tau"] for k, c in m["drafts"]["other"]["tau"]["0"].items()} == direct_tau(
        micro_target, target, work, folders["other"], POINTS)
    # features at the union of every draft's points; each draft reads its own columns
    assert m["feature_capture_points"] == sorted(set(POINTS + OTHER_POINTS))
    assert m["drafts"]["shifted"]["capture_points"] == OTHER_POINTS
    assert {k: c["tau"] for k, c in m["drafts"]["shifted"]["tau"]["0"].items()} == direct_tau(
        micro_target, target, work, folders["shifted"], OTHER_POINTS)
    for p in m["pairs"]:
        for d in p["by_temperature"][T].values():
            assert d["ci"][0] <= d["difference"] <= d["ci"][1]
    dep = m["deploy"]
    assert (dep["num_draft_tokens"], dep["temperature"]) == (2, float(T))   # smallest k, largest temperature
    assert dep["tau"] == max(d["tau"][T]["2"]["tau"] for d in m["drafts"].values())
    assert dep["clearly_better"] == all(a["ci"][0] > 0 for a in dep["against"].values())
    report = (stage_dir(work, BENCH) / "report.md").read_text()
    assert "## Drafts compared" in report and f"| other - 04 | 2 | T={T} |" in report and "**Deploy**" in report
    man = read_manifest(stage_dir(work, BENCH))
    assert set(man["drafts"]) == set(folders) and man["deploy"] == dep["draft"]
    assert man["drafts"]["spec"] == {key: m["drafts"]["spec"][key] for key in ("path", "layout", "sha256")}


def test_greedy_only_deploys_the_better_draft(run, micro_target, target, prompts, tmp_path):
    """Only T = 0 given: the serving setting is greedy at the smallest k, where `other` beats 04's."""
    _, m, folders = run
    make_chain(tmp_path, micro_target, target, prompts)
    stage_argv = argv(tmp_path, micro_target, "--draft", f"other={folders['other']}")
    stage_argv[stage_argv.index(T)] = "0"
    importlib.import_module(BENCH).main(stage_argv)
    dep = json.loads((stage_dir(tmp_path, BENCH) / "metrics.json").read_text())["deploy"]
    assert (dep["draft"], dep["num_draft_tokens"], dep["temperature"]) == ("other", 2, 0.0)
    assert dep["tau"] == m["drafts"]["other"]["tau"]["0"]["2"]["tau"] and dep["against"]["04"]["difference"] > 0
    assert dep["statement"].startswith("deploy other" if dep["clearly_better"] else "other has the highest tau")


def full_vocab_draft(micro_target, out, token: int = 0, **target_changes):
    """A full-vocab draft for the micro target with `target_changes` (another hidden size or vocab: a draft
    made for another target) whose every proposal is `token`: its final norm is zero, so every logit is 0
    and the argmax is draft id 0, which d2t maps to `token` (and `token`'s draft id to target id 0)."""
    tcfg = {**read_target_text_config(micro_target), **target_changes}
    v = tcfg["vocab_size"]
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(tcfg, v, num_attention_heads=4))
    perm = torch.arange(v)
    perm[[0, token]] = perm[[token, 0]]
    model.set_vocab_mapping(perm - torch.arange(v), torch.ones(v, dtype=torch.bool))
    model.norm.weight.data.zero_()
    return export_sglang(model, out, POINTS, torch_dtype="float32")


def out_of_range_points(micro_target, out):
    """04's export declaring h_9 on the 8-layer target (points must lie in 1..7)."""
    return with_points(stage_dir(out.parent, TRAIN) / "export_sglang", out, [3, 5, 9])


@pytest.mark.parametrize("make, message", [
    (lambda t, out: full_vocab_draft(t, out, hidden_size=48), r"target_hidden_size is 48, expected 32 \(the target's\)"),
    (lambda t, out: full_vocab_draft(t, out, vocab_size=700), r"vocab_size is 700, expected 600 \(the target's\)"),
    (out_of_range_points, r"capture points by .* is \[3, 5, 9\], expected ascending layers in 1..7"),
], ids=["hidden", "vocab", "points"])
def test_a_draft_that_does_not_fit_is_refused_before_05_writes(micro_target, target, prompts, tmp_path, make,
                                                               message):
    make_chain(tmp_path, micro_target, target, prompts)
    bad = make(micro_target, tmp_path / "bad")
    with pytest.raises(StageError, match=message) as e:
        importlib.import_module(BENCH).main(argv(tmp_path, micro_target, "--draft", f"x={bad}"))
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    assert not stage_dir(tmp_path, BENCH).parent.exists()


def test_draft_names_and_the_list_flag(tmp_path):
    assert cmp.parse_specs(["kimi=/d/k", "b.2=rel/x"]) == {"kimi": cmp.Path("/d/k"), "b.2": cmp.Path("rel/x")}
    for specs, message in ((["04=/x"], "reserved"), (["trained=/x"], "reserved"), (["a=/x", "a=/y"], "used twice"),
                           (["/just/a/path"], "expected NAME=PATH"), (["a b=/x"], "expected NAME=PATH")):
        with pytest.raises(StageError, match=message):
            cmp.parse_specs(specs)
    stage = importlib.import_module(BENCH)
    preset = tmp_path / "p.yaml"
    preset.write_text("draft:\n  - kimi=/models/kimi-eagle3\n")
    base = ["--work-dir", str(tmp_path), "--config", str(preset)]
    assert parse_args(stage.build_parser(), base).draft == ["kimi=/models/kimi-eagle3"]
    assert parse_args(stage.build_parser(), base + ["--draft", "a=1", "--draft", "b=2", "c=3"]).draft == [
        "a=1", "b=2", "c=3"]   # the command line replaces the preset's list
    with pytest.raises(StageError, match="reserved"):   # 05b's baseline runs are named so
        cmp.parse_specs(["baseline=/x"])


def rounds(emitted_per_prompt: list[list[int]]) -> list[sd.SpecResult]:
    return [sd.SpecResult(tokens=[0] * (sum(e) + 1), drafted=[2] * len(e), accepted=[x - 1 for x in e], emitted=e)
            for e in emitted_per_prompt]


def test_deploy_is_clearly_better_only_when_every_interval_excludes_0():
    """Planted per-prompt rounds at k = 2: `good` accepts everything, `twin` is good but for one round,
    `bad` accepts nothing. good vs bad is clear; good vs twin is not."""
    good = [[3, 3, 3]] * 8
    twin = [[3, 3, 2]] + [[3, 3, 3]] * 7
    bad = [[1, 1, 1]] * 8
    args = argparse.Namespace(num_draft_tokens=[2], bench_seed=0)
    ident = {n: {"path": n, "layout": "sglang", "sha256": "0" * 64, "capture_points": POINTS,
                 "draft_vocab_size": v} for n, v in (("trained", 64), ("good", 600), ("twin", 32))}

    def decide(names, table):
        replayed = {(n, 2): rounds(table[n]) for n in names}
        return cmp.compare_drafts(args, replayed, {}, {n: ident[n] for n in names}, None, [])["deploy"]
    clear = decide(["trained", "good"], {"trained": bad, "good": good})
    assert clear["draft"] == "good" and clear["clearly_better"] and clear["temperature"] == 0.0
    assert clear["statement"].startswith("deploy good: tau 3.00") and "04 (2.000 [2.00, 2.00])" in clear["statement"]
    close = decide(["trained", "good", "twin"], {"trained": bad, "good": good, "twin": twin})
    assert close["draft"] == "good" and not close["clearly_better"] and close["not_distinguishable_from"] == ["twin"]
    assert "not distinguishable from twin" in close["statement"] and "twin has the smallest draft vocab, 32" in \
        close["statement"] and "clearly better than 04" in close["statement"]


def test_features_at_the_union_hold_each_draft_s_own(target, prompts):
    seq = prompts[0] + [5, 6, 7]
    union = rp.union_points(POINTS, {"x": OTHER_POINTS})
    aux, _ = rp.target_features(target, seq, union)
    for points in (POINTS, OTHER_POINTS, [4]):
        assert torch.equal(rp.select_points(aux, union, points), rp.target_features(target, seq, points)[0])
