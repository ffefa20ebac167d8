"""02b --capture-backend sglang around a stand-in for the one GPU call: SpecForge/SGLang's
`capture_rows(ids) -> (aux_rows [T_i, 3H], final_rows [T_i, H])`, here computed by the HF micro target.
Proves: token-budget batching (ragged, last partial batch kept), refused settings, shape checks that
stop before storing, shards identical to the hf backend, and per-shard resume."""
from __future__ import annotations

import pytest
import torch

from common.sglang import capture as cs
from common.draft.capture import capture_hf
from common.draft.shards import ShardReader, list_shards, shard_name
from common.stage import StageError, read_manifest
from tests.test_02b_extract import STAGE, make_01c


def test_engine_kwargs_refusals():
    kw = cs.engine_kwargs(8, 0.8, '{"attention_backend": "flashinfer"}')
    assert kw == {"mem_fraction_static": 0.8, "disable_radix_cache": True, "enable_two_batch_overlap": False,
                  "attention_backend": "flashinfer"}
    for bad, msg in (('{"pp_size": 2}', "pipeline parallel"), ('{"enable_two_batch_overlap": true}', "two-batch"),
                     ('{"disable_radix_cache": false}', "radix-cache"), ('{"tp_size": 4}', "may not set"),
                     ('[1]', "JSON object")):
        with pytest.raises(StageError, match=msg):
            cs.engine_kwargs(1, 0.8, bad)
    with pytest.raises(StageError):
        cs.engine_kwargs(1, 1.5, None)


def test_batch_by_tokens():
    assert cs.batch_by_tokens([9, 23, 5, 17, 12], 30) == [[0], [1, 2], [3, 4]]
    assert cs.batch_by_tokens([50, 3], 10) == [[0], [1]]  # too long: alone; the last batch is kept
    assert sum(cs.batch_by_tokens([4] * 7, 8), []) == list(range(7))


class StandIn:
    """What build_backend returns; capture_rows below answers like SpecForge's capture_rows."""

    def __init__(self, target, points, kwargs, bad=False):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.points, self.kwargs, self.bad, self.calls = points, kwargs, bad, []


def stand_in_rows(backend, ids):
    backend.calls.append([len(i) for i in ids])
    aux_rows, final_rows = [], []
    for row in ids:  # one packed prefill in SGLang; per row here (same values, no padding)
        t = torch.tensor([row])
        aux, final = capture_hf(backend.model, t, torch.ones_like(t), backend.points)
        aux_rows.append(aux[0][:, :32] if backend.bad else aux[0])  # bad: H-wide, as with EAGLE
        final_rows.append(final[0])
    return tuple(aux_rows), tuple(final_rows)


@pytest.fixture()
def patched(monkeypatch, micro_target):
    made = []

    def build(target, points, kwargs, tp_size):
        made.append(StandIn(target, points, kwargs, bad=getattr(build, "bad", False)))
        return made[-1]
    monkeypatch.setattr(cs, "build_backend", build)
    monkeypatch.setattr(cs, "capture_rows", stand_in_rows)
    monkeypatch.setattr(cs, "check_world", lambda tp: 0)
    return build, made


def run(work, *extra):
    STAGE.main(["--work-dir", str(work), "--samples-per-shard", "2", "--capture-batch-tokens", "30",
                "--hidden-states-dtype", "float32", *extra])


def test_sglang_backend_equals_hf(tmp_path, micro_target, patched):
    _, made = patched
    hf, sg = tmp_path / "hf", tmp_path / "sg"
    make_01c(hf, micro_target)
    make_01c(sg, micro_target)
    run(hf, "--device", "cpu")
    run(sg, "--capture-backend", "sglang", "--sglang-tp-size", "1", "--mem-fraction-static", "0.7")
    assert made[0].kwargs["mem_fraction_static"] == 0.7 and made[0].kwargs["disable_radix_cache"] is True
    assert made[0].points == [2, 4, 5]
    # shard plan of 2 samples, lengths [9, 23 | 5, 17 | 12], budget 30 tokens -> [9] [23] | [5, 17] | [12]
    assert made[0].calls == [[9], [23], [5, 17], [12]]
    a, b = list_shards(hf / "02b_hidden_states"), list_shards(sg / "02b_hidden_states")
    assert [p.name for p in a] == [p.name for p in b] == [shard_name(k) for k in range(3)]
    for pa, pb in zip(a, b):
        ra, rb = ShardReader(pa), ShardReader(pb)
        assert ra.sample_ids == rb.sample_ids
        for i in range(len(ra)):
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(ra[i][key], rb[i][key])
            for key in ("aux", "final"):
                torch.testing.assert_close(ra[i][key], rb[i][key], rtol=1e-5, atol=1e-6)
    man = read_manifest(sg / "02b_hidden_states")
    assert man["capture_backend"] == "sglang" and man["num_tokens"] == 66

    # resume: a deleted shard is the only one captured again
    (sg / "02b_hidden_states" / "manifest.json").unlink()
    (sg / "02b_hidden_states" / shard_name(1)).unlink()
    run(sg, "--capture-backend", "sglang")
    assert made[1].calls == [[5, 17]]


def test_wrong_shape_is_not_stored(tmp_path, micro_target, patched):
    build, _ = patched
    build.bad = True
    make_01c(tmp_path, micro_target)
    with pytest.raises(StageError, match=r"expected \(9, 96\) and \(9, 32\)"):
        run(tmp_path, "--capture-backend", "sglang")
    assert list_shards(tmp_path / "02b_hidden_states") == []


def test_refused_before_any_work(tmp_path, micro_target):
    make_01c(tmp_path, micro_target)
    with pytest.raises(StageError, match="pipeline parallel"):
        run(tmp_path, "--capture-backend", "sglang", "--capture-engine-args", '{"pp_size": 2}')
    assert not (tmp_path / "02b_hidden_states").exists()


def test_capture_rows_on_the_pinned_api():
    """Pinned SpecForge has only capture_eagle3([B, T] tensors) -> (data, aux_rows, last_rows): one row
    per call, unpadded; newer ones have capture_rows(list of lists)."""
    class Pinned:
        def __init__(self):
            self.seen = []

        def capture_eagle3(self, *, input_ids, attention_mask, loss_mask):
            self.seen.append(tuple(input_ids.shape))
            assert bool(attention_mask.all()) and input_ids.dtype == torch.long
            t = input_ids.shape[1]
            return [None], (torch.full((t, 6), float(t)),), (torch.ones(t, 2),)

    b = Pinned()
    aux, final = cs.capture_rows(b, [[1, 2, 3], [4]])
    assert b.seen == [(1, 3), (1, 1)] and [tuple(a.shape) for a in aux] == [(3, 6), (1, 6)]
    assert [tuple(f.shape) for f in final] == [(3, 2), (1, 2)] and float(aux[1][0, 0]) == 1.0

    class Newer:
        def capture_rows(self, ids):
            return ("a",) * len(ids), ("f",) * len(ids)
    assert cs.capture_rows(Newer(), [[1], [2]]) == (("a", "a"), ("f", "f"))
