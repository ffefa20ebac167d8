"""The agreement check on every engine (issue 34 item 5): SGLang judged from its request totals against the stub
SGLang server (tests/sglang_server_stub.py) with the micro target's speculative loop behind it; the tolerance in
the sampled half; the probability gate's band, which grows no stricter with more prompts; z per prompt; the
settings the check can judge; the refusal before any launch of a target replay cannot load.

What the stub proves, and what it does not: it speaks SGLang 0.5.14's /generate documents and counts one verify
a round with the round cut at the budget, as the loop does. That SGLang's own spec_verify_ct counts that way, and
that its verify accepts a draft with p(d), is what scripts/box_smoke.sh checks on a real SGLang server."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.benchmark import sampled as smp
from common.benchmark import spec_decode as sd
from common.draft.manifest import DraftManifest
from common.serving.agreement import AgreementCheck, probability_gate
from common.serving.sglang import SGLangEngine
from common.stage import StageError
from common.target.manifests import HiddenStatesManifest
from tests.sglang_server_stub import StubServer, StubState
from tests.spec_helpers import POINTS
from tests.units.benchmark.test_sampled import T_SHARP, LoopEngine, PrefixOracle, random_prompts

K = 3


class NearTieOracle(PrefixOracle):
    """The engine's copy of the draft where a bf16 engine's would differ from ours: at about one position in
    `every` it proposes the target's second choice (its argmax flipped at a near tie)."""

    def __init__(self, target, first_token: int, every: int = 5):
        super().__init__(target, first_token)
        self.every = every

    def step(self, hidden, input_ids, position_ids, cache):
        logits, h = super().step(hidden, input_ids, position_ids, cache)
        pos = position_ids[0].tolist()
        for r, p in enumerate(pos):
            if sum(self.toks[:p + 2]) % self.every == 0:
                top2 = logits[0, r].topk(2).indices
                logits[0, r, top2[0]], logits[0, r, top2[1]] = logits[0, r, top2[1]], logits[0, r, top2[0]]
        return logits, h


def sglang_answer_fn(target, verify: sd.SamplingParams | None = None, extra_rounds: int = 0, oracle=PrefixOracle):
    """The stub's engine: the micro target's speculative loop at k = 3 (SGLang's accounting: one verify a round,
    the last round cut at the budget), sampled at the request's temperature and top-p with its seed, or at
    `verify` whatever the request asks; `extra_rounds` more verifies reported than it ran."""
    def answer(ids, sp):
        t = float(sp["temperature"])
        params = verify or (sd.SamplingParams(t, float(sp["top_p"])) if t > 0 else None)
        res = sd.speculative_decode(target, oracle(target, ids[0]), list(ids), K, int(sp["max_new_tokens"]), set(),
                                    POINTS, params, smp.generator("cpu", int(sp["sampling_seed"])) if params else None)
        return res.tokens, len(res.accepted) + extra_rounds
    return answer


def agreement(target, tmp_path, prompts, tolerance=0.0, sampling=(sd.SamplingParams(T_SHARP, 0.95),), max_new=16):
    engine = SGLangEngine(tmp_path, tmp_path, HiddenStatesManifest.from_dict({}), DraftManifest.from_dict({}))
    check = AgreementCheck(engine, tmp_path, tmp_path, DraftManifest.from_dict({}), prompts, max_new, 30, tolerance,
                           tmp_path, tuple(sampling), 0)
    check._models = (target, PrefixOracle(target, 0), set(), POINTS)   # the micro target, not loaded from disk
    return check


def test_sglang_is_judged_from_its_request_totals(target, tmp_path, capsys):
    """Greedy and sampled, the rounds follow from each answer and our draft (the committed token equals the draft
    token exactly when it was accepted), so SGLang's spec_verify_ct is checked request by request and every draft
    judged along its answers feeds the probability gate. A server that reports one verify more per request is
    refused; one that verifies at 3x the temperature with top-p off passes the round count and fails the gate."""
    prompts = random_prompts(8, target.config.vocab_size, seed=2)
    with StubServer(StubState(algorithm="EAGLE3", answer_fn=sglang_answer_fn(target))) as url:
        got = agreement(target, tmp_path, prompts)(url, "3-1-4/graph", (3, 1, 4))
    assert got["agree"] and got["exact"] and not got["reports_per_round"] and got["counters_equal_per_request_sums"] is None
    assert all(r["equal"] and r["engine"] == len(r["replay"]) for r in got["per_prompt"])
    sampled = got["sampled"][f"{T_SHARP:g}"]
    assert sampled["exact"] and sampled["rounds_agree"] and not sampled["reports_per_round"]
    gate = sampled["expected"]["along_answers"]
    assert gate["enforced"] and gate["agree"] and sum(gate["judged"]) > 60, gate
    assert all(isinstance(r["z"], float) for r in sampled["per_prompt"])   # z per prompt
    assert "on 8 prompts (rounds from its answers): AGREE" in capsys.readouterr().out
    with StubServer(StubState(algorithm="EAGLE3", answer_fn=sglang_answer_fn(target, extra_rounds=1))) as url:
        with pytest.raises(StageError, match=r"^agreement 3-1-4/graph: SGLang and replay disagree - draft's outputs or "
                                             r"accounting: prompt 0: the engine verified \d+ rounds for its 16-token "
                                             r"answer, where the answer and our draft give \d+"):
            agreement(target, tmp_path, prompts[:1])(url, "3-1-4/graph", (3, 1, 4))   # every prompt is off by one
    hot = sglang_answer_fn(target, verify=sd.SamplingParams(3 * T_SHARP, 1.0))
    with StubServer(StubState(algorithm="EAGLE3", answer_fn=hot)) as url:
        with pytest.raises(StageError, match=r"^agreement 3-1-4/graph T=0.02 top-p 0.95: SGLang accepts \d+ of \d+ "
                                             r"judged drafts where p\(d\) expects [\d.]+ \(z -\d+\.\d"):
            agreement(target, tmp_path, prompts, sampling=(sd.SamplingParams(T_SHARP, 0.95),))(
                url, "3-1-4/graph", (3, 1, 4))


def test_the_sampled_half_honours_the_tolerance(target, tmp_path):
    """An engine whose draft picks another argmax now and then (a bf16 engine at near ties) commits other rounds
    than replay along its answers: at --agreement-tolerance 0 that stops 05b, within a tolerance it passes, greedy
    and sampled alike (the sampled half used to ignore the tolerance)."""
    prompts = random_prompts(8, target.config.vocab_size, seed=3)
    near = sglang_answer_fn(target, oracle=NearTieOracle)
    with StubServer(StubState(algorithm="EAGLE3", answer_fn=near)) as url:
        with pytest.raises(StageError, match="SGLang and replay disagree"):
            agreement(target, tmp_path, prompts)(url, "3-1-4/graph", (3, 1, 4))
        got = agreement(target, tmp_path, prompts, tolerance=0.3)(url, "3-1-4/graph", (3, 1, 4))
    sampled = got["sampled"][f"{T_SHARP:g}"]
    assert not got["exact"] and got["agree"] and not sampled["exact"] and sampled["rounds_agree"], sampled
    assert 0 < sampled["relative_tau_difference"] <= 0.3 and sampled["expected"]["along_answers"]["band"] == 0.3


def bernoulli_gate(n: int, shift: float, band: float, seed: int = 0) -> dict:
    """probability_gate over n judged drafts whose p(d) replay gives as p and which an engine accepts with
    p (1 + shift)."""
    rng = random.Random(seed)
    judged = []
    for i in range(n):
        p = 0.1 + 0.8 * rng.random()
        judged.append((i % K, p, rng.random() < p * (1 + shift)))
    return probability_gate(judged, K, band)


def test_the_gate_allows_a_stated_band_and_grows_no_stricter_with_more_prompts():
    """A correct engine that computes p(d) 2% low (a numerical gap) fails the fixed |z| <= 4 rule once enough drafts
    are judged; inside a 5% band it passes at every count, while a deviation beyond the band is still found, and
    sooner the more drafts are judged. The gate reports the deviation it resolves."""
    fixed = [bernoulli_gate(n, -0.02, 0.0) for n in (1_000, 300_000)]
    assert fixed[0]["agree"] and not fixed[1]["agree"], [g["z"] for g in fixed]
    for n in (1_000, 10_000, 100_000, 300_000):
        g = bernoulli_gate(n, -0.02, 0.05)
        assert g["agree"] and g["z_band"] == 0 and 0.05 < g["resolution"], (n, g["z"], g["resolution"])
    far = [bernoulli_gate(n, -0.15, 0.05) for n in (100, 10_000)]
    assert far[0]["agree"] and not far[1]["agree"] and far[1]["z_band"] < -4, [g["z_band"] for g in far]
    assert far[0]["resolution"] > 0.15 > far[1]["resolution"]


def test_only_fixed_chains_are_judged():
    assert AgreementCheck.judges((3, 1, 4)) is None
    assert "adaptive" in AgreementCheck.judges((3, 1, 4, "adaptive"))
    assert "tree" in AgreementCheck.judges((3, 4, 8))


def test_a_target_replay_cannot_load_is_refused_before_any_launch(tmp_path, micro_target, monkeypatch):
    """Replay loads the target with transformers in float32 here: a quantized checkpoint (the Kimi target) or one
    whose float32 weights exceed the memory available stops 05b in one line before any server starts."""
    import json
    import shutil

    from common.serving import agreement as ag
    from common.serving import process
    from tests.units.serving.test_sweep import FakeLaunches, free_ports, make_work, run_05b

    make_work(tmp_path, micro_target)
    fake = FakeLaunches()
    monkeypatch.setattr(process, "launch_server", fake.launch)
    monkeypatch.setattr(process, "stop_server", fake.stop)
    ports = ["--baseline-port", free_ports(1)[0], "--eagle3-port", free_ports(1)[0], "--spec-settings", "3,1,4",
             "--cuda-graph", "on", "--agreement-prompts", "1"]
    monkeypatch.setattr(ag, "available_memory", lambda: 1 << 20)
    need = ag.float32_bytes(micro_target)
    with pytest.raises(StageError, match=rf"^--agreement-prompts: the agreement check replays the target .* in float32 "
                                         rf"on this machine, but it needs {need / 2 ** 30:.1f} GiB in float32, and "
                                         r"0.0 GiB are available"):
        run_05b(tmp_path, *ports)
    quantized = tmp_path / "int4-target"
    shutil.copytree(micro_target, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "compressed-tensors"}}))
    check = AgreementCheck(None, quantized, tmp_path, DraftManifest.from_dict({}), [[1]], 8, 30, 0.0, tmp_path)
    with pytest.raises(StageError, match=r"but its checkpoint is quantized \(compressed-tensors\), which replay does not "
                                         r"load in float32"):
        check.check_loadable()
    assert fake.launched == []


class LoopWithProbabilities(LoopEngine):
    """An engine like vLLM with --logprobs-mode processed_logprobs: the sampled loop verifying at the request's
    temperature and top-p (or at `verify`), whose answers carry, per token, the top logprobs of the distribution
    it verified against and the token it committed."""

    def engine_probabilities(self, url):
        return None

    def request(self, url, ids, max_new_tokens, timeout, sampling, logprobs=None):
        verify = self.verify or sd.SamplingParams(sampling["temperature"], sampling["top_p"])
        ans = super().request(url, ids, max_new_tokens, timeout, sampling)
        _, probs = smp.target_probs(self.target, list(ids) + ans["output_ids"], POINTS, verify)
        rows = []
        for i, tok in enumerate(ans["output_ids"]):
            p = probs[len(ids) - 1 + i]
            top = p.topk(logprobs)
            rows.append({int(t): float(torch.log(v)) for t, v in zip(top.indices, top.values) if v > 0}
                        | {tok: float(torch.log(p[tok]))})
        return {**ans, "logprobs": rows}


def test_the_engines_own_probabilities_are_compared_with_replays(target, tmp_path):
    """Where the engine returns the probabilities it verified against (vLLM's processed logprobs), they are
    compared with replay's p(d) draft by draft: equal for an engine that verifies as asked; for one that verifies
    at 3x the temperature with top-p off they differ, and the gate's z with the engine's own p(d) is small while
    replay's is far off: its acceptance follows its own probabilities, which are not the requested ones."""
    asked = sd.SamplingParams(T_SHARP, 0.95)
    prompts = random_prompts(8, target.config.vocab_size, seed=2)

    def check(engine):
        c = AgreementCheck(engine, tmp_path, tmp_path, DraftManifest.from_dict({}), prompts, 16, 0, 0.0, tmp_path,
                           (asked,), 0)
        c._models = (target, PrefixOracle(target, 0), set(), POINTS)
        return c.sampled("u", "3-1-4", K)[f"{T_SHARP:g}"]

    same = check(LoopWithProbabilities(target))["engine_probabilities"]
    assert same["compared"] > 60 and same["outside_top"] == 0 and same["max_abs_difference"] < 1e-4, same
    assert same["outside_top_replay_sum"] == 0
    assert same["z_engine"] == pytest.approx(same["z_replay"], abs=1e-3)
    with pytest.raises(StageError, match=r"its own p\(d\) sum [\d.]+ vs replay's [\d.]+ \(-\d+\.\d+%\)"):
        check(LoopWithProbabilities(target, verify=sd.SamplingParams(3 * T_SHARP, 1.0)))
    got = __import__("json").loads((tmp_path / "agreement" / "3-1-4_sampled.json").read_text())
    hot = got[f"{T_SHARP:g}"]["engine_probabilities"]
    assert hot["relative_difference"] < -0.3 and abs(hot["z_engine"]) < 3 < -hot["z_replay"], hot
