"""04_train: training on micro-target hidden states, export, resume, upstream checks, data plan."""
import argparse
import importlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.draft.shards import shard_name, write_shard
from common.stage import StageError, is_complete, target_identity, tokenizer_identity, write_manifest

train = importlib.import_module("04_train")
POINTS = [2, 4, 5]
DV = 300


@pytest.fixture(scope="module")
def upstream(micro_target, tmp_path_factory):
    """A work dir holding 02b shards and a 03 vocab mapping, made from the micro target.

    aux = the micro target's real states at the capture points. The random target's own next-token
    distribution is almost uniform (nothing to learn), so the stored final state is built by hand to
    make the target confident of the true next token, on sequences that follow a fixed permutation
    chain (next = perm[current]): a draft can learn that, so a working trainer must show progress.
    """
    from transformers import AutoModelForCausalLM
    work = tmp_path_factory.mktemp("work")
    model = AutoModelForCausalLM.from_pretrained(str(micro_target)).eval()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(200, generator=g)
    head = model.lm_head.weight.detach()                             # [V, H]
    hs_dir = work / "02b_hidden_states"
    samples, counts = [], torch.zeros(cfg.vocab_size)
    with torch.no_grad():
        for i in range(24):
            t = int(torch.randint(12, 40, (1,), generator=g))
            ids = [int(torch.randint(0, 200, (1,), generator=g))]
            for _ in range(t - 1):
                ids.append(int(perm[ids[-1]]))
            ids = torch.tensor(ids)
            hs = model(ids[None], output_hidden_states=True).hidden_states
            nxt = torch.cat([ids[1:], ids[:1]])                      # the token after each position
            final = head[nxt] / head[nxt].norm(dim=-1, keepdim=True) * 200.0
            mask = torch.zeros(t, dtype=torch.bool)
            mask[t // 3:] = True
            counts.index_add_(0, ids[mask], torch.ones(int(mask.sum())))
            samples.append({"id": f"micro/{i}", "input_ids": ids, "loss_mask": mask,
                            "aux": torch.cat([hs[p][0] for p in POINTS], -1), "final": final})
    for s in range(3):
        write_shard(hs_dir / shard_name(s), samples[s * 8:(s + 1) * 8])
    ident = {"tokenizer": tokenizer_identity(micro_target), "target": target_identity(micro_target)}
    write_manifest(hs_dir, "02b_extract_hidden_states_sglang", argparse.Namespace(),
                   capture_points=POINTS, hidden_size=cfg.hidden_size, num_hidden_layers=8,
                   vocab_size=cfg.vocab_size, **ident)
    used = counts.argsort(descending=True)[:DV].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    vocab_dir = work / "03_vocab"
    vocab_dir.mkdir()
    save_file({"d2t": used - torch.arange(DV), "t2d": t2d}, str(vocab_dir / "vocab_mapping.safetensors"))
    write_manifest(vocab_dir, "03_build_vocab_mapping", argparse.Namespace(), draft_vocab_size=DV,
                   vocab_size=cfg.vocab_size, **ident)
    return work


def fresh_work(upstream, tmp_path):
    work = tmp_path / "w"
    for d in ("02b_hidden_states", "03_vocab"):
        shutil.copytree(upstream / d, work / d)
    return work


FLAGS = ["--ttt-steps", "3", "--batch-tokens", "96", "--max-seq-len", "48", "--eval-fraction", "0.15",
         "--learning-rate", "3e-3", "--log-every", "5", "--device", "cpu", "--warmup-ratio", "0.1"]


def test_train_end_to_end_improves_and_exports(upstream, tmp_path, micro_target):
    work = fresh_work(upstream, tmp_path)
    argv = ["--work-dir", str(work), *FLAGS, "--num-epochs", "6", "--eval-every", "20",
            "--save-every", "15", "--target-path", str(micro_target)]
    train.main(argv)
    out = work / "04_draft"
    man = json.loads((out / "manifest.json").read_text())
    assert man["capture_points"] == POINTS and man["draft_vocab_size"] == DV
    assert man["num_eval_samples"] > 0 and man["final_eval"]["tau"] >= 1.0
    rows = list(map(json.loads, (out / "train_log.jsonl").read_text().splitlines()))
    tr = [r for r in rows if r["split"] == "train"]
    assert {"loss", "acc", "tau", "lr", "tokens_per_s", "eta_s"} <= set(tr[0]) and len(tr[0]["acc"]) == 3
    assert tr[-1]["loss"][0] < 0.85 * tr[0]["loss"][0]              # it learns
    assert tr[-1]["acc"][0] > tr[0]["acc"][0] + 0.1 and man["final_eval"]["acc"][0] > 0.05
    assert any(r["split"] == "eval" for r in rows)
    assert len(train.complete_checkpoints(out / "checkpoints")) == 2   # keep-checkpoints default
    cfg = json.loads((out / "export_sglang" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == POINTS and cfg["draft_vocab_size"] == DV
    with safe_open(str(out / "export_sglang" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        d2t = f.get_tensor("d2t")
    assert "embed_tokens.weight" not in keys and "fc.weight" in keys and len(keys) == 15
    assert torch.equal(d2t, load_file(str(work / "03_vocab" / "vocab_mapping.safetensors"))["d2t"])
    spec = json.loads((out / "export_speculators" / "config.json").read_text())  # the vLLM layout too
    assert spec["eagle_aux_hidden_state_layer_ids"] == POINTS and spec["norm_before_residual"] is False
    assert (out / "export_speculators" / "model.safetensors").is_file()
    assert man["export_speculators_dir"] == str(out / "export_speculators")
    # a complete stage re-run is a no-op
    mtime = (out / "manifest.json").stat().st_mtime_ns
    train.main(argv)
    assert (out / "manifest.json").stat().st_mtime_ns == mtime


def test_resume_equals_uninterrupted(upstream, tmp_path):
    n = 6
    flags = [*FLAGS, "--num-epochs", "3", "--max-steps", str(2 * n), "--save-every", str(n),
             "--eval-every", "100"]
    a = fresh_work(upstream, tmp_path / "a")
    train.main(["--work-dir", str(a), *flags])
    b = fresh_work(upstream, tmp_path / "b")
    train.main(["--work-dir", str(b), *flags, "--stop-at-step", str(n)])
    assert not is_complete(b / "04_draft") and not (b / "04_draft" / "export_sglang").exists()
    assert [p.name for p in train.complete_checkpoints(b / "04_draft" / "checkpoints")] == ["step_000006"]
    # a half-written checkpoint (no COMPLETE marker) must be ignored
    (b / "04_draft" / "checkpoints" / "step_000009").mkdir()
    with pytest.raises(StageError, match="batch_tokens"):
        train.main(["--work-dir", str(b), *flags, "--batch-tokens", "128"])
    train.main(["--work-dir", str(b), *flags])
    sa = torch.load(a / "04_draft" / "checkpoints" / "step_000012" / "model.pt")
    sb = torch.load(b / "04_draft" / "checkpoints" / "step_000012" / "model.pt")
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), atol=1e-6), k
    la = [r for r in map(json.loads, (a / "04_draft" / "train_log.jsonl").read_text().splitlines())]
    lb = [r for r in map(json.loads, (b / "04_draft" / "train_log.jsonl").read_text().splitlines())]
    assert [r["step"] for r in lb] == [5, 6, 10, 12, 12]          # the stopped run logged step 6
    for ra, rb in zip(la[-2:], lb[-2:]):                         # last train row + final eval
        assert ra["split"] == rb["split"] and abs(ra["loss"][0] - rb["loss"][0]) < 1e-5
        assert abs(ra["tau"] - rb["tau"]) < 1e-6
    assert not (b / "04_draft" / "checkpoints" / "step_000009").exists()


def test_refuses_missing_upstream_and_other_target(upstream, tmp_path, other_micro_target):
    with pytest.raises(StageError, match="02b_extract_hidden_states_sglang"):
        train.main(["--work-dir", str(tmp_path / "empty"), "--device", "cpu"])
    work = fresh_work(upstream, tmp_path)
    with pytest.raises(StageError, match="tokenizer"):
        train.main(["--work-dir", str(work), "--device", "cpu", "--target-path", str(other_micro_target)])
    assert not (work / "04_draft").exists()


def test_data_plan_batches_order_and_split():
    lengths = [10, 30, 5, 40, 20, 8, 33]
    order = list(range(7))
    batches = train.make_batches(order, lengths, batch_tokens=64, max_len=32)
    assert sorted(i for b in batches for i in b) == order
    for b in batches:
        assert len(b) == 1 or len(b) * max(min(lengths[i], 32) for i in b) <= 64
    entries = [(i % 3, 0, 5, f"s{i}") for i in range(30)]
    o1 = train.epoch_order(entries, list(range(30)), seed=1, epoch=0)
    assert sorted(o1) == list(range(30)) and o1 == train.epoch_order(entries, list(range(30)), 1, 0)
    assert o1 != train.epoch_order(entries, list(range(30)), 1, 1)
    shards_seen = [entries[i][0] for i in o1]              # shard by shard: 3 contiguous runs
    assert sum(1 for x, y in zip(shards_seen, shards_seen[1:]) if x != y) == 2
    ids = [f"x/{i}" for i in range(2000)]
    share = sum(train.is_eval(s, 0.1) for s in ids) / len(ids)
    assert 0.07 < share < 0.13 and train.is_eval("x/1", 0.1) == train.is_eval("x/1", 0.1)
