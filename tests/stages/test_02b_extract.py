"""02b: capture convention (hooks), shard round-trip, batching, resume, re-run no-op, disk preflight."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from common.target.capture import (capture_hf, default_capture_points, target_dims,
                            validate_capture_points)
from common.io import write_jsonl
from common.target.shards import ShardReader, list_shards, shard_name
from common.stage import (EXTRACT, MERGE, StageError, read_manifest, stage_dir, target_identity, tokenizer_identity,
                          torch_threads, write_manifest)
from tests.paths import REPO

LENGTHS = [9, 23, 5, 17, 12]  # 5 samples -> with 2 per shard: 3 shards, the last one partial



STAGE = importlib.import_module(EXTRACT)


def make_01c(work: Path, target: Path, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    """A small tokenized_data.jsonl + manifest as 01c writes them (prompt unmasked, response masked)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, 600, (n,), generator=g).tolist()
        n_prompt = n // 2
        rows.append({"id": f"tiny/{k}", "source": "tiny", "input_ids": ids,
                     "loss_mask": [0] * n_prompt + [1] * (n - n_prompt), "seq_len": n,
                     "n_prompt_tokens": n_prompt, "n_response_tokens": n - n_prompt})
    d = stage_dir(work, MERGE)
    write_jsonl(d / "tokenized_data.jsonl", rows)
    write_manifest(d, MERGE, argparse.Namespace(), num_samples=len(rows),
                   tokenizer=tokenizer_identity(target), target=target_identity(target))
    return rows


def run(work: Path, *extra: str):
    STAGE.main(["--work-dir", str(work), "--samples-per-shard", "2", "--capture-batch-tokens", "48",
                "--device", "cpu", *extra])


def mtimes(d: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def extracted(micro_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("work02b")
    rows = make_01c(work, micro_target)
    run(work)
    return work, rows


@pytest.fixture(scope="module")
def model(micro_target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32).eval()


def reference_states(model, ids: list[int]):
    """Layer inputs and lm_head input of a one-sample forward, recorded by forward hooks."""
    seen = {}

    def grab(name):
        def hook(module, args, kwargs):
            seen[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    handles = [layer.register_forward_pre_hook(grab(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    handles.append(model.lm_head.register_forward_pre_hook(grab("lm_head"), with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_capture_points_and_kimi_text_config():
    from transformers import PretrainedConfig
    kimi = PretrainedConfig.from_dict(json.loads((REPO / "assets/kimi_k25/config.json").read_text()))
    dims = target_dims(kimi)  # fields live under text_config
    assert dims == {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}
    assert default_capture_points(61) == [2, 30, 58]
    assert default_capture_points(8) == [2, 4, 5]
    for bad in ([0, 4, 5], [2, 4, 8], [2, 2, 5], [5, 4, 2], [2, 4]):
        with pytest.raises(StageError):
            validate_capture_points(bad, 8)


def test_capture_convention_matches_hooks(extracted, model):
    """Stored aux == inputs of decoder layers [2, 4, 5]; stored final == input of lm_head."""
    work, rows = extracted
    man = read_manifest(stage_dir(work, EXTRACT))
    assert man["capture_points"] == [2, 4, 5] and man["num_hidden_layers"] == 8
    H = man["hidden_size"]
    samples = [s for p in list_shards(stage_dir(work, EXTRACT)) for s in iter_reader(p)]
    for row, s in zip(rows, samples):
        ref = reference_states(model, row["input_ids"])
        for slot, i in enumerate([2, 4, 5]):
            got = s["aux"][:, slot * H:(slot + 1) * H].float()  # [T, H]
            want = ref[i][0]
            # bf16 storage: relative rounding 2^-9; batching/padding adds ~1e-7.
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5)
            # ... and the neighbours (off-by-one conventions) are clearly NOT what was stored.
            for j in (i - 1, i + 1):
                assert (got - ref[j][0]).abs().max() > 50 * (got - want).abs().max()
        torch.testing.assert_close(s["final"].float(), ref["lm_head"][0], rtol=2 ** -7, atol=1e-5)
        assert (s["final"].float() - ref[7][0]).abs().max() > 0.1  # post-norm, not the last residual


def iter_reader(path):
    r = ShardReader(path)
    return [r[i] for i in range(len(r))]


def test_shards_round_trip(extracted):
    work, rows = extracted
    out = stage_dir(work, EXTRACT)
    assert [p.name for p in list_shards(out)] == [shard_name(k) for k in range(3)]
    samples = [s for p in list_shards(out) for s in iter_reader(p)]
    assert [s["id"] for s in samples] == [r["id"] for r in rows]
    for row, s in zip(rows, samples):
        n = row["seq_len"]
        assert s["input_ids"].tolist() == row["input_ids"]
        assert s["loss_mask"].tolist() == [bool(m) for m in row["loss_mask"]]
        assert s["aux"].shape == (n, 3 * 32) and s["final"].shape == (n, 32)
        assert s["aux"].dtype == torch.bfloat16
    readers = [ShardReader(p) for p in list_shards(out)]
    assert sum(r.num_tokens for r in readers) == sum(LENGTHS)  # no padding rows stored
    man = read_manifest(out)
    assert man["num_samples"] == 5 and man["num_tokens"] == sum(LENGTHS)
    assert man["bytes_per_token"] == (3 * 32 + 32) * 2 + 9 and man["dtype"] == "bfloat16"
    assert man["shards"][shard_name(2)] == {"num_samples": 1, "num_tokens": LENGTHS[4]}
    assert man["vocab_size"] == 600 and man["target"] == read_manifest(stage_dir(work, MERGE))["target"]
    assert man["num_supervised_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_batched_padding_equals_single_forward(model):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 600, (11,), generator=g), torch.randint(0, 600, (4,), generator=g)
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, :4], mask[1, :4] = b, 1
    aux, final = capture_hf(model, ids, mask, [2, 4, 5])
    assert aux.shape == (2, 11, 96) and final.shape == (2, 11, 32) and aux.dtype == torch.float32
    for row, x in enumerate((a, b)):
        n = len(x)
        aux1, final1 = capture_hf(model, x[None], torch.ones(1, n, dtype=torch.long), [2, 4, 5])
        torch.testing.assert_close(aux[row, :n], aux1[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[row, :n], final1[0], rtol=1e-5, atol=1e-6)


def test_resume_redoes_only_missing_shards_and_rerun_is_noop(extracted, tmp_path, capsys):
    work0, _ = extracted
    work = tmp_path / "w"
    shutil.copytree(work0, work)
    out = stage_dir(work, EXTRACT)
    keys = ("aux_hidden_states", "final_hidden_states", "input_ids", "offsets")
    before = {p.name: (ShardReader(p).sample_ids, {k: ShardReader(p).tensor(k) for k in keys})
              for p in list_shards(out)}
    (out / "manifest.json").unlink()
    (out / shard_name(1)).unlink()
    (out / shard_name(2)).rename(out / (shard_name(2) + ".tmp"))  # a killed write
    old = 1_000_000_000 * 10**9
    os.utime(out / shard_name(0), ns=(old, old))
    run(work)
    assert (out / shard_name(0)).stat().st_mtime_ns == old  # untouched
    assert not list(out.glob("*.tmp"))
    for name in (shard_name(1), shard_name(2)):
        again = ShardReader(out / name)
        assert again.sample_ids == before[name][0]
        for key in keys:
            assert torch.equal(again.tensor(key), before[name][1][key])
    assert read_manifest(out)["num_tokens"] == sum(LENGTHS)

    stamps = mtimes(out)
    capsys.readouterr()
    run(work)
    assert "nothing to do" in capsys.readouterr().out
    assert mtimes(out) == stamps

    # Killed after the last shard but before the manifest: nothing is recaptured.
    (out / "manifest.json").unlink()
    run(work)
    assert {k: v for k, v in mtimes(out).items() if k != "manifest.json"} == \
        {k: v for k, v in stamps.items() if k != "manifest.json"}
    assert read_manifest(out)["num_tokens"] == sum(LENGTHS)


def test_two_capture_workers_write_the_same_shards_and_resume(extracted, tmp_path):
    """--capture-workers 2 (forked processes of one thread, common/parallel.py): every shard equals a
    one-thread one-process run's, bit for bit; the manifest counts every token once; a re-run after a lost
    shard redoes only that shard."""
    work0, _ = extracted
    for name in ("one", "two"):
        shutil.copytree(work0, tmp_path / name)
        shutil.rmtree(stage_dir(tmp_path / name, EXTRACT))
    with torch_threads(1):   # a different thread count sums in another order (last-bit differences)
        run(tmp_path / "one")
    run(tmp_path / "two", "--capture-workers", "2")
    ref, out = stage_dir(tmp_path / "one", EXTRACT), stage_dir(tmp_path / "two", EXTRACT)
    work = tmp_path / "two"
    keys = ("aux_hidden_states", "final_hidden_states", "input_ids", "loss_mask", "offsets")
    assert [p.name for p in list_shards(out)] == [p.name for p in list_shards(ref)]
    for p in list_shards(ref):
        a, b = ShardReader(p), ShardReader(out / p.name)
        assert a.sample_ids == b.sample_ids
        for key in keys:
            assert torch.equal(a.tensor(key), b.tensor(key)), (p.name, key)
    m = read_manifest(out)
    assert m["num_tokens"] == sum(LENGTHS) and m["this_run"]["num_tokens"] == sum(LENGTHS)
    assert m["this_run"]["num_forward_calls"] == read_manifest(ref)["this_run"]["num_forward_calls"]

    (out / "manifest.json").unlink()
    (out / shard_name(1)).unlink()
    stamps = mtimes(out)
    run(work, "--capture-workers", "2")
    assert {k: v for k, v in mtimes(out).items() if k in stamps} == stamps
    assert read_manifest(out)["this_run"]["num_tokens"] == LENGTHS[2] + LENGTHS[3]


def test_capture_workers_refusals(micro_target, tmp_path):
    make_01c(tmp_path, micro_target)
    with pytest.raises(StageError, match="--capture-workers must be >= 1"):
        run(tmp_path, "--capture-workers", "0")
    with pytest.raises(StageError, match="--capture-workers is the hf engine's"):
        run(tmp_path, "--capture-workers", "2", "--capture-engine", "sglang")
    with pytest.raises(StageError, match="CUDA does not survive a fork"):
        STAGE.main(["--work-dir", str(tmp_path), "--capture-workers", "2", "--device", "cuda"])


def test_disk_preflight(micro_target, tmp_path, monkeypatch):
    work = tmp_path / "w"
    make_01c(work, micro_target)
    needed = sum(LENGTHS) * ((3 * 32 + 32) * 2 + 9)
    monkeypatch.setattr(STAGE, "free_disk_bytes", lambda path: int(needed * 1.05) - 1)
    with pytest.raises(StageError) as e:
        run(work, "--disk-margin", "0.05")
    assert "GB" in str(e.value) and f"{needed / 1e9:.3f}" in str(e.value)
    out = stage_dir(work, EXTRACT)
    assert not list_shards(out) and not (out / "manifest.json").exists()
    monkeypatch.setattr(STAGE, "free_disk_bytes", lambda path: int(needed * 1.05) + 1)
    run(work, "--disk-margin", "0.05")
    assert read_manifest(out)["num_tokens"] == sum(LENGTHS)


def test_target_path_mismatch_refuses(micro_target, other_micro_target, tmp_path):
    work = tmp_path / "w"
    make_01c(work, micro_target)
    with pytest.raises(StageError, match="tokenizer"):
        run(work, "--target-path", str(other_micro_target))
    run(work, "--target-path", str(micro_target))
    assert read_manifest(stage_dir(work, EXTRACT))["num_samples"] == 5


def test_sglang_layer_id_rule_per_architecture():
    """sglang 0.5.14 set_eagle3_layers_to_capture: Llama/Qwen add 1 to the draft-config ids; the
    DeepSeek family (Kimi) adds 1 only when the first id is 1, else captures the ids as given."""
    from common.target.capture import sglang_captured_points, sglang_layer_ids
    assert sglang_layer_ids([2, 30, 58], "KimiK25ForConditionalGeneration") == [1, 29, 57]
    assert sglang_layer_ids([2, 30, 58], "DeepseekV3ForCausalLM") == [1, 29, 57]
    assert sglang_layer_ids([3, 15, 27], "LlamaForCausalLM") == [2, 14, 26]
    assert sglang_layer_ids([1, 20, 40], "Qwen3MoeForCausalLM") == [0, 19, 39]
    assert sglang_captured_points([2, 29, 57], "+1 if ids[0] == 1") == [2, 29, 57]  # as given
    for points, arch in (([3, 30, 58], "KimiK25ForConditionalGeneration"), ([1, 30, 58], "DeepseekV3ForCausalLM")):
        with pytest.raises(StageError, match="first entry is 2"):
            sglang_layer_ids(points, arch)
    with pytest.raises(StageError, match="--allow-unknown-architecture"):
        sglang_layer_ids([2, 4, 5], "BrandNewForCausalLM")
    assert sglang_layer_ids([2, 4, 5], "BrandNewForCausalLM", allow_unknown=True) == [1, 3, 4]


def test_points_sglang_would_capture_differently_are_refused(micro_target, tmp_path):
    """The micro target is DeepseekV3ForCausalLM: points [3, 4, 5] would be served by SGLang as
    h2/h3/h4 (ids [2, 3, 4] are used as given), so 02b stops before touching its folder."""
    work = tmp_path / "w"
    make_01c(work, micro_target)
    with pytest.raises(StageError, match=r"capture h\[2, 3, 4\] instead"):
        run(work, "--capture-points", "3", "4", "5")
    assert not stage_dir(work, EXTRACT).exists()
    run(work, "--capture-points", "2", "3", "5")
    man = read_manifest(stage_dir(work, EXTRACT))
    assert man["capture_points"] == [2, 3, 5] and man["sglang_layer_ids"] == [1, 2, 4]
    assert man["target_architecture"] == "DeepseekV3ForCausalLM"


def test_unknown_architecture_needs_the_flag(micro_target, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(micro_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": ["BrandNewForCausalLM"]}))
    work = tmp_path / "w"
    make_01c(work, target)
    with pytest.raises(StageError, match="BrandNewForCausalLM.*not in SGLANG_LAYER_ID_RULES"):
        run(work)
    run(work, "--allow-unknown-architecture")
    assert read_manifest(stage_dir(work, EXTRACT))["sglang_layer_ids"] == [1, 3, 4]
