"""05's sampled target answers in batches (spec_decode.sample_decode_batch, sampled.sampled_continuations)
against one prompt at a time (spec_decode.sample_decode): every answer is drawn with its own generator,
seeded by (bench seed, prompt), so batched and one-at-a-time sampling draw the same tokens wherever their
float32 logits agree - on the micro targets (MLA DeepSeek-V3 and Llama, mixed prompt lengths, rows that
end early and rows that hit the budget) they are the same token for token, whatever the batch size,
order or company. On SmolLM2 (build/smollm2, when built) the first tokens of the held-out prompts too;
benchmarks/bench_batch_sampling.py compares whole answers and times both.
"""
from __future__ import annotations


import pytest
import torch

from common.benchmark import sampled as smp
from common.benchmark import spec_decode as sd
from common.io import iter_jsonl
from tests.paths import REPO
from tests.spec_helpers import TEXTS

PARAMS = sd.SamplingParams(1.0, 0.95)
MAX_NEW = 24
SMOLLM2 = REPO / "build" / "smollm2"


@pytest.fixture(scope="module")
def llama_target(micro_chatml_target, one_thread):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(micro_chatml_target), dtype=torch.float32).eval()


def model_and_prompts(request, which: str):
    from common.text.tokenizer import load_tokenizer

    if which == "deepseek_v3":
        model, folder = request.getfixturevalue("target"), request.getfixturevalue("micro_target")
    else:
        model, folder = request.getfixturevalue("llama_target"), request.getfixturevalue("micro_chatml_target")
    ids = [load_tokenizer(folder).encode(t) for t in TEXTS]
    return model, ids + [p[:3] for p in ids] + [ids[0] + ids[1]]   # 3 to 40+ tokens: real left padding


def one_at_a_time(target, prompts, eos, seed=0):
    return [sd.sample_decode(target, ids, MAX_NEW, eos, PARAMS,
                             smp.generator("cpu", smp.prompt_seed(seed, ids, PARAMS, "replay"))) for ids in prompts]


def batched(target, prompts, eos, seed=0):
    gens = [smp.generator("cpu", smp.prompt_seed(seed, ids, PARAMS, "replay")) for ids in prompts]
    return sd.sample_decode_batch(target, prompts, MAX_NEW, eos, PARAMS, gens)


@pytest.mark.parametrize("which", ["deepseek_v3", "llama"])
def test_batched_answers_are_the_one_at_a_time_answers(which, request):
    target, prompts = model_and_prompts(request, which)
    free = one_at_a_time(target, prompts, set())
    # An end of turn each row meets at its own place (a token two answers emit early): rows leave the
    # batch at different steps, others run to the budget.
    eos = {free[0][4], free[1][9]}
    single = one_at_a_time(target, prompts, eos)
    lengths = [len(s) for s in single]
    assert min(lengths) < MAX_NEW and MAX_NEW in lengths, lengths
    assert batched(target, prompts, set()) == free
    assert batched(target, prompts, eos) == single
    # Batch order and company do not matter: reversed, and in pairs.
    assert batched(target, prompts[::-1], eos) == single[::-1]
    for i in range(0, len(prompts), 2):
        assert batched(target, prompts[i:i + 2], eos) == single[i:i + 2]
    # Another seed: other answers, batched and alone alike.
    other = one_at_a_time(target, prompts, eos, seed=1)
    assert other != single and batched(target, prompts, eos, seed=1) == other


def test_sampled_continuations_any_batch_size_and_the_cache(target, prompts, tmp_path, monkeypatch):
    rows = [{"prompt_ids": ids} for ids in prompts + [prompts[0], prompts[2][:5]]]   # a repeat, a short one
    want = one_at_a_time(target, [r["prompt_ids"] for r in rows], set())
    greedy = tmp_path / "abc_greedy.jsonl"
    files = []
    for b in (1, 2, 16):
        cache = smp.sampled_cache_file(greedy.parent / f"b{b}" / greedy.name, PARAMS, 0)
        files.append(cache)
        assert smp.sampled_continuations(target, rows, MAX_NEW, set(), PARAMS, 0, cache, batch_size=b) == want
    # named by T, top-p, seed and the sampler's version; each distinct prompt stored once
    assert files[0].name == f"abc_T1_topp0.95_seed0_{smp.SAMPLER_VERSION}.jsonl"
    assert len(list(iter_jsonl(files[0]))) == len(rows) - 1
    # a cached prompt is not sampled again; a missing one is, in a batch of its own
    seen = []
    real = sd.sample_decode_batch
    monkeypatch.setattr(sd, "sample_decode_batch", lambda t, ps, *a: seen.append(ps) or real(t, ps, *a))
    assert smp.sampled_continuations(target, rows, MAX_NEW, set(), PARAMS, 0, files[0]) == want and not seen
    more = rows + [{"prompt_ids": prompts[1][:4]}]
    got = smp.sampled_continuations(target, more, MAX_NEW, set(), PARAMS, 0, files[0], batch_size=4)
    assert seen == [[prompts[1][:4]]] and got[:-1] == want
    assert got[-1] == one_at_a_time(target, [prompts[1][:4]], set())[0]
    with pytest.raises(ValueError):
        smp.sampled_continuations(target, more[:1], MAX_NEW, set(), PARAMS, 0, tmp_path / "x.jsonl", batch_size=0)


def test_smollm2_batched_tokens_are_its_one_at_a_time_tokens(one_thread):
    """The real target (30 layers, vocab 49,152, prompts of different lengths, left-padded): 4 held-out prompts,
    8 tokens each. Float noise between a padded batch and a lone row could part them at a near-tie of
    the draw; these prompts have none in their first tokens (the benchmark script compares 256)."""
    if not (SMOLLM2 / "manifest.json").is_file():   # make test and make test-fast build it first
        pytest.fail(f"{SMOLLM2} is not built: run `make test` (or 00_build_smollm2_world.py)")
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_batch_sampling import load_prompts

    folder = SMOLLM2 / "target"
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = load_prompts(folder, None, 4)
    assert len({len(p) for p in prompts}) > 1
    gens = [smp.generator("cpu", smp.prompt_seed(0, ids, PARAMS, "replay")) for ids in prompts]
    single = [sd.sample_decode(target, ids, 8, set(), PARAMS,
                               smp.generator("cpu", smp.prompt_seed(0, ids, PARAMS, "replay"))) for ids in prompts]
    assert sd.sample_decode_batch(target, prompts, 8, set(), PARAMS, gens) == single


def test_top_p_mask_is_the_full_sorts():
    """sampling_probs decides most rows on their 256 most likely tokens (top_p_keep): the mask must be the
    one of sorting the whole row, on peaked rows (decided on the candidates) and flat ones (sorted whole),
    any vocabulary, top-p and shape."""
    def full_sort(probs, top_p):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        return torch.zeros_like(sorted_p, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) < top_p)

    g = torch.Generator().manual_seed(0)
    for vocab in (100, 300, 4096):
        for scale in (0.5, 2, 8, 16):       # flat to peaked: both paths of top_p_keep
            probs = torch.softmax(torch.randn(2, 24, vocab, generator=g) * scale, dim=-1)
            for top_p in (0.5, 0.9, 0.95, 0.99):
                assert torch.equal(sd.top_p_keep(probs, top_p), full_sort(probs, top_p)), (vocab, scale, top_p)
    probs = torch.softmax(torch.randn(4096, generator=g) * 8, dim=-1)          # one row, 1-D
    assert torch.equal(sd.top_p_keep(probs, 0.95), full_sort(probs, 0.95))
