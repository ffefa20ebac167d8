"""Compact feature formats of the 02b shards (common/target/shards.py): fp8 aux states, top-k teacher,
prompt-tail window, and every combination, written and read back."""
from __future__ import annotations

import itertools

import pytest
import torch

from common.stage import EXTRACT, TRAIN, VOCAB, stage_dir
from common.target.shards import FeatureFormat, ShardReader, decode_fp8, encode_fp8, write_shard

H, V = 16, 50


def samples(num: int = 3, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n, prompt = 12 + 5 * i, 7 + i
        aux = torch.randn(n, 3 * H, generator=g) * torch.tensor([1.0, 8.0, 60.0]).repeat_interleave(H)
        aux[:, 3] = 400.0  # an outlier feature: per-(token, point) scales must keep the rest accurate
        out.append({"id": f"s{i}", "input_ids": torch.randint(0, V, (n,), generator=g),
                    "loss_mask": torch.arange(n) >= prompt, "aux": aux, "final": torch.randn(n, H, generator=g)})
    return out


def test_fp8_blocks_keep_three_mantissa_bits():
    x = samples()[0]["aux"]
    q, scales = encode_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (x.shape[0], 3)
    back = decode_fp8(q, scales, torch.float32)
    step = (scales.repeat_interleave(H, dim=1) * 2 ** -9)       # e4m3's smallest subnormal, scaled
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + step).all()
    assert (back.view(-1, 3, H).abs().amax(-1) - x.view(-1, 3, H).abs().amax(-1)).abs().max() < 1e-3


FORMATS = [FeatureFormat(aux=a, teacher=t, topk=8 if t == "topk" else None, window=w)
           for a, t, w in itertools.product(("bf16", "fp8"), ("final", "topk"), (None, 3))]


@pytest.mark.parametrize("features", FORMATS, ids=lambda f: f"{f.aux}-{f.teacher}-w{f.window}")
def test_every_combination_round_trips(features, tmp_path):
    data = samples()
    lm_head = torch.randn(V, H)
    path = tmp_path / "shard_00000.safetensors"
    rows = write_shard(path, data, features=features, lm_head=lm_head)
    r = ShardReader(path)
    assert r.format == features and r.num_tokens == rows
    for i, s in enumerate(data):
        got = r.sample(i)
        first = int(s["loss_mask"].nonzero()[0])
        start = 0 if features.window is None else first - features.window
        assert got["start"] == start and torch.equal(got["input_ids"], s["input_ids"][start:])
        assert torch.equal(got["loss_mask"], s["loss_mask"][start:])
        ref_aux = s["aux"][start:]
        tol = 2 ** -4 if features.aux == "fp8" else 2 ** -8
        assert ((got["aux"].float() - ref_aux).abs() <= ref_aux.abs() * tol + ref_aux.abs().max() * 2 ** -9).all()
        if features.teacher == "topk":
            logits = s["final"][start:] @ lm_head.T                      # [T, V]
            vals, ids = logits.topk(features.topk, dim=-1)
            assert torch.equal(got["topk_ids"], ids) and "final" not in got
            torch.testing.assert_close(got["topk_logits"], vals, rtol=1e-3, atol=1e-3)
        else:
            torch.testing.assert_close(got["final"].float(), s["final"][start:], rtol=2 ** -8, atol=1e-6)
            assert "topk_ids" not in got


def test_bytes_per_token_match_the_files(tmp_path):
    """The arithmetic the 02b preflight and the plan use equals what the files hold (large H: the
    safetensors header is then negligible)."""
    hidden, n = 512, 256
    data = [{"id": "a", "input_ids": torch.zeros(n, dtype=torch.int64), "loss_mask": torch.ones(n, dtype=torch.bool),
             "aux": torch.randn(n, 3 * hidden), "final": torch.randn(n, hidden)}]
    for features in (FeatureFormat(), FeatureFormat(aux="fp8"), FeatureFormat(aux="fp8", teacher="topk", topk=32)):
        path = tmp_path / f"{features.aux}{features.teacher}.safetensors"
        write_shard(path, data, features=features, lm_head=torch.randn(1000, hidden))
        per_token = path.stat().st_size / n
        assert abs(per_token - features.bytes_per_token(hidden)) < 0.02 * features.bytes_per_token(hidden), (features, per_token)
    kimi = 7168
    assert FeatureFormat().bytes_per_token(kimi) == 57353
    assert FeatureFormat().bytes_per_token(kimi) / FeatureFormat(aux="fp8", teacher="topk", topk=32).bytes_per_token(kimi) > 2.5


def test_old_shards_read_as_bf16_final(tmp_path):
    """Shards written before formats existed (no feature_format metadata, no starts) still read."""
    from safetensors.torch import save_file

    path = tmp_path / "shard_00000.safetensors"
    save_file({"aux_hidden_states": torch.zeros(4, 3 * H, dtype=torch.bfloat16),
               "final_hidden_states": torch.zeros(4, H, dtype=torch.bfloat16),
               "input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.uint8),
               "offsets": torch.tensor([0, 4])}, str(path), metadata={"sample_ids": '["x"]'})
    r = ShardReader(path)
    assert r.format == FeatureFormat() and r.sample(0)["start"] == 0 and r.sample(0)["final"].shape == (4, H)


def test_format_validation():
    with pytest.raises(ValueError):
        FeatureFormat(teacher="topk")
    with pytest.raises(ValueError):
        FeatureFormat(aux="int4")
    with pytest.raises(ValueError):
        FeatureFormat(window=0)
    assert FeatureFormat.from_dict(FeatureFormat(aux="fp8", window=64).as_dict()) == FeatureFormat(aux="fp8", window=64)


def test_topk_teacher_equals_the_full_teacher_when_k_covers_the_vocab():
    """With k = V the stored logits are all of them: the top-k teacher is the lm_head teacher (up to the
    float16 rounding of the logits); with a small k it is that teacher truncated and renormalised."""
    from common.training.teacher import teacher_targets
    from common.training.teacher import teacher_from_topk

    g = torch.Generator().manual_seed(0)
    b, t, dv = 2, 9, 12
    final, lm_head = torch.randn(b, t, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    kept = torch.randperm(V, generator=g)[:dv].sort().values
    d2t, t2d = kept - torch.arange(dv), torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    mask = torch.rand(b, t, generator=g) > 0.3
    full = teacher_targets(final, lm_head, d2t, t2d, mask)
    logits = final @ lm_head.T                                              # [B, T, V]
    for k in (V, 6):
        vals, ids = logits.topk(k, dim=-1)
        got = teacher_from_topk(ids, vals.half().float(), d2t, t2d, mask)
        assert torch.equal(got["row"], full["row"]) and torch.equal(got["target_arg"], full["target_arg"])
        if k == V:
            torch.testing.assert_close(got["target_p"], full["target_p"], rtol=2e-3, atol=1e-4)
        else:  # the same distribution over the draft-vocab entries among the top k, renormalised
            keep = torch.zeros_like(full["target_p"], dtype=torch.bool)
            flat_ids = ids.reshape(b * t, k)[mask.reshape(-1)]
            to_draft = torch.full((V,), -1, dtype=torch.int64)
            to_draft[kept] = torch.arange(dv)
            for r, row_ids in enumerate(to_draft[flat_ids]):
                keep[r, row_ids[row_ids >= 0]] = True
            ref = full["target_p"] * keep
            ref = ref / ref.sum(-1, keepdim=True).clamp_min(1e-30)
            torch.testing.assert_close(got["target_p"], ref, rtol=2e-3, atol=1e-4)
            assert (got["target_p"][~keep] == 0).all()


def test_compact_chain_02b_03_04(micro_target, tmp_path):
    """fp8 + top-k + window through the real stages: 02b writes and records the format, 03 counts the
    same supervised tokens as from bf16 shards, 04 reads the format from the manifest (no flags, no
    lm_head), trains, and exports; the window keeps true positions (a one-row shift would change the
    RoPE positions and the loss)."""
    import importlib
    import json

    from tests.stages.test_02b_extract import make_01c

    stage02, stage03, stage04 = (importlib.import_module(m) for m in (EXTRACT, VOCAB, TRAIN))
    runs = {}
    for name, extra in (("bf16", []), ("compact", ["--aux-format", "fp8", "--teacher-format", "topk",
                                                   "--teacher-topk", "16", "--prompt-window", "4"])):
        work = tmp_path / name
        make_01c(work, micro_target, lengths=[30, 26, 34, 28, 31, 25])
        stage02.main(["--work-dir", str(work), "--samples-per-shard", "3", "--device", "cpu", *extra])
        stage03.main(["--work-dir", str(work), "--draft-vocab-size", "64"])
        stage04.main(["--work-dir", str(work), "--num-epochs", "2", "--batch-tokens", "64", "--learning-rate",
                      "3e-3", "--eval-fraction", "0", "--ttt-steps", "3", "--device", "cpu", "--precision", "fp32",
                      "--draft-num-attention-heads", "4", "--log-every", "1", "--save-every", "100"])
        runs[name] = {s: json.loads((stage_dir(work, s) / "manifest.json").read_text())
                      for s in (EXTRACT, VOCAB, TRAIN)}
        log = stage_dir(work, TRAIN) / "train_log.jsonl"
        runs[name]["log"] = [json.loads(x) for x in log.read_text().splitlines()]
    bf16, compact = runs["bf16"], runs["compact"]
    assert compact[EXTRACT]["feature_format"] == {"aux": "fp8", "teacher": "topk", "topk": 16, "window": 4}
    assert compact[EXTRACT]["num_tokens"] < bf16[EXTRACT]["num_tokens"]   # window
    assert compact[EXTRACT]["num_bytes"] * 1.5 < bf16[EXTRACT]["num_bytes"]  # H=32: headers weigh
    assert compact[VOCAB]["num_supervised_tokens"] == bf16[VOCAB]["num_supervised_tokens"]
    losses = [r["loss"][0] for r in compact["log"] if r["split"] == "train"]
    assert losses[-1] < losses[0]
    assert (stage_dir(tmp_path / "compact", TRAIN) / "export_sglang" / "model.safetensors").is_file()


def test_02b_refuses_to_resume_in_another_format(micro_target, tmp_path):
    import importlib

    import pytest as _pytest

    from common.stage import StageError
    from tests.stages.test_02b_extract import make_01c

    stage02 = importlib.import_module(EXTRACT)
    make_01c(tmp_path, micro_target)
    stage02.main(["--work-dir", str(tmp_path), "--samples-per-shard", "2", "--device", "cpu"])
    (stage_dir(tmp_path, EXTRACT) / "manifest.json").unlink()     # as if killed before the end
    with _pytest.raises(StageError, match="feature format"):
        stage02.main(["--work-dir", str(tmp_path), "--samples-per-shard", "2", "--device", "cpu",
                      "--aux-format", "fp8"])
