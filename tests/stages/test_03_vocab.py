"""03: draft vocab = most frequent loss-masked ids; d2t/t2d semantics, coverage, padding, refusals."""
from __future__ import annotations

import argparse
import importlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.io import write_jsonl
from common.target.shards import shard_name, write_shard
from common.stage import (EXTRACT, MERGE, StageError, VOCAB, read_manifest, stage_dir, target_identity,
                          tokenizer_identity, write_manifest)

H = 4
IM_END_ID = 2  # third Kimi special in the micro tokenizer



STAGE = importlib.import_module(VOCAB)

# Supervised (loss_mask 1): 10 x5, 20 x3, 30 x2, 40 x1. Unsupervised (prompt): 7 x50, 10 x1 more.
SAMPLES = [
    ([7] * 30 + [10, 10, 20, 30], [0] * 30 + [1, 1, 1, 1]),
    ([7] * 20 + [10] + [10, 10, 10, 20, 20, 30, 40], [0] * 21 + [1] * 7),
]


def make_02b(work: Path, target: Path, samples=SAMPLES, per_shard: int = 1) -> None:
    """02b shards + manifest as 02b writes them (random states: 03 never reads them)."""
    out = stage_dir(work, EXTRACT)
    shards = {}
    for k in range(0, len(samples), per_shard):
        chunk = [{"id": f"s{k + j}", "input_ids": ids, "loss_mask": mask,
                  "aux": torch.randn(len(ids), 3 * H), "final": torch.randn(len(ids), H)}
                 for j, (ids, mask) in enumerate(samples[k:k + per_shard])]
        name = shard_name(k // per_shard)
        n = write_shard(out / name, chunk)
        shards[name] = {"num_samples": len(chunk), "num_tokens": n}
    write_manifest(out, EXTRACT, argparse.Namespace(), capture_points=[2, 4, 5],
                   hidden_size=H, num_hidden_layers=8, vocab_size=600, dtype="bfloat16", shards=shards,
                   num_supervised_tokens=sum(sum(m) for _, m in samples),
                   tokenizer=tokenizer_identity(target), target=target_identity(target))


def run(work: Path, dv: int, *extra: str):
    STAGE.main(["--work-dir", str(work), "--draft-vocab-size", str(dv), *extra])
    out = stage_dir(work, VOCAB)
    return load_file(str(out / "vocab_mapping.safetensors")), read_manifest(out)


def test_mapping_semantics_and_coverage(micro_target, tmp_path):
    make_02b(tmp_path, micro_target)
    maps, man = run(tmp_path, 3)
    d2t, t2d = maps["d2t"], maps["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (3,)
    assert t2d.dtype == torch.bool and t2d.shape == (600,)
    target_ids = torch.arange(3) + d2t  # target_id = draft_id + d2t[draft_id]
    assert target_ids.tolist() == [10, 20, 30]  # ranked by supervised counts; 7 (prompt-only) excluded
    assert torch.nonzero(t2d).flatten().tolist() == [10, 20, 30]
    assert man["coverage"] == pytest.approx(10 / 11)
    assert man["num_supervised_tokens"] == 11 and man["num_distinct_supervised"] == 4
    assert man["draft_vocab_size"] == 3 and man["vocab_size"] == 600
    assert man["end_of_turn_in_draft_vocab"] is False and man["end_of_turn_id"] == IM_END_ID
    assert man["capture_points"] == [2, 4, 5] and man["hidden_size"] == H
    assert man["target"] == read_manifest(stage_dir(tmp_path, EXTRACT))["target"]
    counts = load_file(str(stage_dir(tmp_path, VOCAB) / "token_counts.safetensors"))["counts"]
    assert counts.dtype == torch.int64 and counts.shape == (600,)
    assert counts[10] == 5 and counts[7] == 0 and int(counts.sum()) == 11


def test_prompt_tokens_never_count(micro_target, tmp_path):
    # 40 appears 30 times, but only in the prompt; 20 once, supervised: 20 wins the single slot.
    make_02b(tmp_path, micro_target, samples=[([40] * 30 + [20], [0] * 30 + [1])])
    maps, man = run(tmp_path, 1)
    assert (torch.arange(1) + maps["d2t"]).tolist() == [20]
    assert man["coverage"] == 1.0


def test_padding_with_lowest_unused_ids(micro_target, tmp_path):
    make_02b(tmp_path, micro_target, per_shard=2)
    maps, man = run(tmp_path, 7)
    target_ids = (torch.arange(7) + maps["d2t"]).tolist()
    # 4 supervised ids + the 3 lowest unused ids (7 is only in prompts: unused, but not lowest).
    assert target_ids == [0, 1, 2, 10, 20, 30, 40]
    assert torch.nonzero(maps["t2d"]).flatten().tolist() == target_ids
    assert man["coverage"] == 1.0 and man["num_padding_ids"] == 3
    assert man["end_of_turn_in_draft_vocab"] is True


def test_refusals(micro_target, other_micro_target, tmp_path):
    with pytest.raises(StageError, match=EXTRACT):
        run(tmp_path, 3)  # no upstream
    make_02b(tmp_path, micro_target)
    with pytest.raises(StageError, match="600"):
        run(tmp_path, 601)
    with pytest.raises(StageError, match="tokenizer"):
        run(tmp_path, 3, "--target-path", str(other_micro_target))
    assert not (stage_dir(tmp_path, VOCAB) / "manifest.json").exists()


def test_chain_from_02b_matches_direct_count(micro_target, tmp_path):
    """On real 02b output, counts equal a direct count of loss-masked ids in tokenized_data.jsonl."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for k, n in enumerate([14, 30, 8]):
        ids = torch.randint(0, 40, (n,), generator=g).tolist()  # a small alphabet: repeats and ties
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        rows.append({"id": f"c/{k}", "source": "c", "input_ids": ids, "loss_mask": mask, "seq_len": n,
                     "n_prompt_tokens": n // 3, "n_response_tokens": n - n // 3})
    write_jsonl(stage_dir(tmp_path, MERGE) / "tokenized_data.jsonl", rows)
    write_manifest(stage_dir(tmp_path, MERGE), MERGE, argparse.Namespace(),
                   tokenizer=tokenizer_identity(micro_target), target=target_identity(micro_target))
    importlib.import_module(EXTRACT).main(
        ["--work-dir", str(tmp_path), "--device", "cpu", "--samples-per-shard", "2"])
    maps, man = run(tmp_path, 10)
    direct = Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    counts = load_file(str(stage_dir(tmp_path, VOCAB) / "token_counts.safetensors"))["counts"]
    assert {i: int(c) for i, c in enumerate(counts.tolist()) if c} == dict(direct)
    kept = sorted(sorted(direct, key=lambda t: (-direct[t], t))[:10])
    assert (torch.arange(10) + maps["d2t"]).tolist() == kept
    assert man["coverage"] == pytest.approx(sum(direct[t] for t in kept) / sum(direct.values()))
