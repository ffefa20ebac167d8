"""02b --capture-engine sglang around a stand-in for the one GPU call: SpecForge's
`capture_eagle3([B, T] ids) -> (data, aux_rows [T, 3H], last_rows [T, H])` for rows of one length, here
computed by the HF micro target. Proves: equal-length grouping under a token budget (shards keep 01c's
order), refused settings (also SpecForge's own keyword arguments), the process count checked before any
model loads, rank 0 alone preparing the stage folder, shape checks that stop before storing, shards
identical to the hf engine, per-shard resume, and 01c's length order giving shards of one length."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from common.target import sglang_capture as cs
from common.target.capture import capture_hf
from common.target.shards import ShardReader, list_shards, shard_name
from common.io import iter_jsonl
from common.stage import EXTRACT, GENERATE, MERGE, PREPARE, StageError, read_manifest, stage_dir
from tests.stages.test_02b_extract import STAGE, make_01c


def test_engine_kwargs_refusals():
    kw = cs.engine_kwargs(8, 0.8, '{"attention_backend": "flashinfer"}')
    assert kw == {"mem_fraction_static": 0.8, "disable_radix_cache": True, "enable_two_batch_overlap": False,
                  "attention_backend": "flashinfer"}
    for bad, msg in (('{"pp_size": 2}', "pipeline parallel"), ('{"enable_two_batch_overlap": true}', "two-batch"),
                     ('{"disable_radix_cache": false}', "radix-cache"), ('{"tp_size": 4}', "may not set"),
                     ('[1]', "JSON object"), ('{"mem_fraction_static": 0.5}', "--mem-fraction-static")):
        with pytest.raises(StageError, match=msg):
            cs.engine_kwargs(1, 0.8, bad)
    # Keys SpecForge's build() passes to ServerArgs itself: harmless-looking values would raise
    # "got multiple values for keyword argument" on the GPU box, so they stop here.
    for key, value in (("pp_size", 1), ("dtype", "bfloat16"), ("model_path", "/m"), ("trust_remote_code", True),
                       ("enable_return_hidden_states", True), ("disable_cuda_graph", True),
                       ("chunked_prefill_size", -1)):
        with pytest.raises(StageError, match=f"may not set {key}"):
            cs.engine_kwargs(1, 0.8, json.dumps({key: value}))
    with pytest.raises(StageError):
        cs.engine_kwargs(1, 1.5, None)


def test_batch_equal_lengths():
    # capture_eagle3 takes one [B, T] tensor (no padding): only equal lengths share a call
    assert cs.batch_equal_lengths([7, 5, 7, 7, 5, 9], 30) == [[0, 2, 3], [1, 4], [5]]
    assert cs.batch_equal_lengths([7, 7, 7, 7, 7], 14) == [[0, 1], [2, 3], [4]]  # rows x length <= budget
    assert cs.batch_equal_lengths([50, 50, 3], 10) == [[0], [1], [2]]  # longer than the budget: alone
    assert sorted(sum(cs.batch_equal_lengths([4, 9, 4, 2] * 5, 16), [])) == list(range(20))


def test_check_world_reads_torchrun_env():
    assert cs.check_world(8, {"WORLD_SIZE": "8", "RANK": "3"}) == 3
    assert cs.check_world(1, {}) == 0
    with pytest.raises(StageError, match="nproc_per_node 8"):
        cs.check_world(8, {"WORLD_SIZE": "4", "RANK": "0"})


class StandIn:
    """What build_backend returns: SpecForge's backend after set_eagle3_capture_layers(layer_ids).
    Its capture_eagle3 answers like the pinned one: one [B, T] tensor in, per-row tuples out."""

    def __init__(self, target, layer_ids, kwargs, bad=False):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.points = [j + 1 for j in layer_ids]  # what the DeepSeek rule captures for ids starting at 1
        self.layer_ids, self.kwargs, self.bad, self.calls = layer_ids, kwargs, bad, []

    def capture_eagle3(self, *, input_ids, attention_mask, loss_mask):
        self.calls.append([int(input_ids.shape[1])] * int(input_ids.shape[0]))
        aux, final = capture_hf(self.model, input_ids, attention_mask, self.points)  # [B, T, 3H], [B, T, H]
        aux_rows = tuple(a[:, :32] if self.bad else a for a in aux)  # bad: H-wide, as with EAGLE
        return [None] * len(aux_rows), aux_rows, tuple(final)


@pytest.fixture()
def patched(monkeypatch, micro_target):
    made = []

    def build(target, layer_ids, kwargs):
        made.append(StandIn(target, layer_ids, kwargs, bad=getattr(build, "bad", False)))
        return made[-1]
    monkeypatch.setattr(cs, "build_backend", build)
    monkeypatch.setattr(cs, "init_process_group", lambda tp: None)
    monkeypatch.setattr(cs, "barrier", lambda: None)
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    return build, made


def run(work, *extra):
    STAGE.main(["--work-dir", str(work), "--samples-per-shard", "2", "--capture-batch-tokens", "30",
                "--hidden-states-dtype", "float32", *extra])


def test_sglang_engine_equals_hf(tmp_path, micro_target, patched):
    _, made = patched
    hf, sg = tmp_path / "hf", tmp_path / "sg"
    make_01c(hf, micro_target)
    make_01c(sg, micro_target)
    run(hf, "--device", "cpu")
    run(sg, "--capture-engine", "sglang", "--sglang-tp-size", "1", "--mem-fraction-static", "0.7")
    assert made[0].kwargs["mem_fraction_static"] == 0.7 and made[0].kwargs["disable_radix_cache"] is True
    assert made[0].layer_ids == [1, 3, 4]  # capture points [2, 4, 5] - 1, first id 1: DeepSeek adds 1
    # shard plan of 2 samples, lengths [9, 23 | 5, 17 | 12]: no two equal, one row per call
    assert made[0].calls == [[9], [23], [5], [17], [12]]
    a, b = list_shards(stage_dir(hf, EXTRACT)), list_shards(stage_dir(sg, EXTRACT))
    assert [p.name for p in a] == [p.name for p in b] == [shard_name(k) for k in range(3)]
    for pa, pb in zip(a, b):
        ra, rb = ShardReader(pa), ShardReader(pb)
        assert ra.sample_ids == rb.sample_ids
        for i in range(len(ra)):
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(ra[i][key], rb[i][key])
            for key in ("aux", "final"):
                torch.testing.assert_close(ra[i][key], rb[i][key], rtol=1e-5, atol=1e-6)
    man = read_manifest(stage_dir(sg, EXTRACT))
    assert man["capture_engine"] == "sglang" and man["num_tokens"] == 66

    # resume: a deleted shard is the only one captured again
    (stage_dir(sg, EXTRACT) / "manifest.json").unlink()
    (stage_dir(sg, EXTRACT) / shard_name(1)).unlink()
    run(sg, "--capture-engine", "sglang")
    assert made[1].calls == [[5], [17]]
    assert man["target_architecture"] == "DeepseekV3ForCausalLM" and man["sglang_layer_ids"] == [1, 3, 4]
    assert man["this_run"]["num_forward_calls"] == 5 and man["this_run"]["num_tokens"] == 66


def test_equal_lengths_share_one_call(tmp_path, micro_target, patched):
    """Rows of one length go through capture_eagle3 together; the shard keeps 01c's order and equals
    the hf engine's."""
    _, made = patched
    lengths = [7, 5, 7, 7, 5, 9]
    hf, sg = tmp_path / "hf", tmp_path / "sg"
    rows = make_01c(hf, micro_target, lengths)
    make_01c(sg, micro_target, lengths)
    STAGE.main(["--work-dir", str(hf), "--samples-per-shard", "6", "--hidden-states-dtype", "float32",
                "--device", "cpu"])
    STAGE.main(["--work-dir", str(sg), "--samples-per-shard", "6", "--capture-batch-tokens", "30",
                "--hidden-states-dtype", "float32", "--capture-engine", "sglang"])
    assert made[0].calls == [[7, 7, 7], [5, 5], [9]]
    a, b = ShardReader(stage_dir(hf, EXTRACT) / shard_name(0)), ShardReader(stage_dir(sg, EXTRACT) / shard_name(0))
    assert a.sample_ids == b.sample_ids == [r["id"] for r in rows]
    for i in range(len(rows)):
        assert b[i]["input_ids"].tolist() == rows[i]["input_ids"]
        for key in ("aux", "final"):
            torch.testing.assert_close(a[i][key], b[i][key], rtol=1e-5, atol=1e-5)
    assert read_manifest(stage_dir(sg, EXTRACT))["this_run"]["num_forward_calls"] == 3


def test_01c_order_gives_shards_of_one_length(tmp_path, micro_target, patched):
    """01 -> 01b (hf) -> 01c -> 02b (sglang): prompts of two lengths alternate within each of two datasets
    (content of 1 or 2 tokens, answers capped at 4 tokens). 01c writes them shortest first, so each
    02b shard of 4 holds one length and goes through capture_eagle3 in one call; in 01b's order (dataset
    by dataset, id by id) every shard would mix both lengths and take two calls."""
    _, made = patched
    prompts = {"a": ["class", "return", "self", "def"], "b": ["None", "True", "value", "False"]}
    datasets = []
    for name, texts in prompts.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": str(k), "messages": [{"role": "user", "content": text}]}) + "\n"
                                for k, text in enumerate(texts)))
        datasets.append({"name": name, "adapter": "messages", "path": str(path)})
    work = tmp_path / "work"
    importlib.import_module(PREPARE).main(
        ["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(datasets)])
    importlib.import_module(GENERATE).main(
        ["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "4", "--device", "cpu"])
    importlib.import_module(MERGE).main(["--work-dir", str(work), "--benchmark-size", "0"])
    samples = list(iter_jsonl(stage_dir(work, MERGE) / "tokenized_data.jsonl"))
    assert read_manifest(stage_dir(work, MERGE))["sample_order"] == "seq_len, id"
    short, long = sorted({s["seq_len"] for s in samples})
    assert [s["seq_len"] for s in samples] == [short] * 4 + [long] * 4
    assert [s["id"] for s in samples] == sorted(s["id"] for s in samples[:4]) + sorted(s["id"] for s in samples[4:])
    in_01b_order = [s["seq_len"] for s in sorted(samples, key=lambda s: s["id"])]  # "a/0" < ... < "b/3"
    assert in_01b_order == [short, long] * 4

    STAGE.main(["--work-dir", str(work), "--samples-per-shard", "4", "--capture-batch-tokens", "1000",
                "--hidden-states-dtype", "float32", "--capture-engine", "sglang"])
    shards = list_shards(stage_dir(work, EXTRACT))
    assert [ShardReader(p).sample_ids for p in shards] == [[s["id"] for s in samples[:4]],
                                                           [s["id"] for s in samples[4:]]]
    assert made[0].calls == [[short] * 4, [long] * 4]  # one call per shard, all its rows at once


def test_world_size_checked_before_any_model_loads(tmp_path, micro_target, patched, monkeypatch):
    _, made = patched
    make_01c(tmp_path, micro_target)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StageError, match="--sglang-tp-size 1 but 2 process"):
        run(tmp_path, "--capture-engine", "sglang", "--sglang-tp-size", "1")
    assert made == [] and not stage_dir(tmp_path, EXTRACT).exists()


def test_only_rank_0_prepares_the_stage_folder(tmp_path, micro_target, patched, monkeypatch):
    """Rank 1 of 2 under torchrun, --overwrite over a complete stage with a stale *.tmp: it deletes
    nothing, waits at the barrier (where rank 0, simulated, prepares the folder), then captures in
    lockstep without writing."""
    _, made = patched
    make_01c(tmp_path, micro_target)
    out = stage_dir(tmp_path, EXTRACT)
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    (out / (shard_name(0) + ".tmp")).write_bytes(b"partial")
    seen = []

    def barrier():
        seen.append(sorted(p.name for p in out.iterdir()))  # what rank 1 left before the barrier
        STAGE.prepare_out_dir(out, True, 0, lambda: None)  # rank 0's side of the barrier
    monkeypatch.setattr(cs, "barrier", barrier)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run(tmp_path, "--capture-engine", "sglang", "--sglang-tp-size", "2", "--overwrite")
    assert seen == [["manifest.json", shard_name(0) + ".tmp"]]
    assert len(made[0].calls) == 5  # captured in lockstep with rank 0 ...
    assert list(out.iterdir()) == []  # ... but wrote neither shards nor a manifest

    # A complete stage without --overwrite: rank 1 sees rank 0 keep it and does nothing.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cs, "barrier", lambda: None)
    run(tmp_path, "--capture-engine", "sglang", "--sglang-tp-size", "2")
    assert read_manifest(out)["num_samples"] == 5
    monkeypatch.setenv("RANK", "1")
    before = len(made)
    run(tmp_path, "--capture-engine", "sglang", "--sglang-tp-size", "2")
    assert len(made) == before  # no model built: the stage is complete


def test_wrong_shape_is_not_stored(tmp_path, micro_target, patched):
    build, _ = patched
    build.bad = True
    make_01c(tmp_path, micro_target)
    with pytest.raises(StageError, match=r"expected \(9, 96\) and \(9, 32\)"):
        run(tmp_path, "--capture-engine", "sglang")
    assert list_shards(stage_dir(tmp_path, EXTRACT)) == []


def test_refused_before_any_work(tmp_path, micro_target):
    make_01c(tmp_path, micro_target)
    with pytest.raises(StageError, match="pipeline parallel"):
        run(tmp_path, "--capture-engine", "sglang", "--capture-engine-args", '{"pp_size": 2}')
    assert not stage_dir(tmp_path, EXTRACT).exists()


def test_capture_rows_on_the_pinned_api():
    """SpecForge @e630ca4e has capture_eagle3([B, T] tensors) -> (data, aux_rows, last_rows), one extend
    pass for all B rows, no padding: equal-length rows go in as one tensor."""
    class Pinned:
        def __init__(self):
            self.seen = []

        def capture_eagle3(self, *, input_ids, attention_mask, loss_mask):
            self.seen.append(tuple(input_ids.shape))
            assert bool(attention_mask.all()) and input_ids.dtype == torch.long
            b, t = input_ids.shape
            rows = tuple(torch.full((t, 6), float(input_ids[i, 0])) for i in range(b))
            return [None] * b, rows, tuple(torch.ones(t, 2) for _ in range(b))

    p = Pinned()
    aux, final = cs.capture_rows(p, [[1, 2, 3], [4, 5, 6]])
    assert p.seen == [(2, 3)] and [tuple(a.shape) for a in aux] == [(3, 6), (3, 6)]
    assert [tuple(f.shape) for f in final] == [(3, 2), (3, 2)] and float(aux[1][0, 0]) == 4.0
    with pytest.raises(AssertionError, match="one length"):
        cs.capture_rows(p, [[1, 2, 3], [4]])
