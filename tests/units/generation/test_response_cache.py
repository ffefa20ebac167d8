"""01b on a non-Kimi (ChatML, tied-embedding Llama) target: the hf engine keeps the ids it emitted, and
`--response-cache` serves known greedy answers: a cached run equals a generated one byte for byte, a
changed setting misses."""
import gzip
import importlib
import json
import shutil

import pytest

from common.generation.response_cache import ResponseCache, cache_identity, write_response_cache
from common.text.target_format import describe_target
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, MERGE, PREPARE, StageError, stage_dir

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
merge = importlib.import_module(MERGE)
NEW = "12"  # --max-new-tokens
NUM_PROMPTS = 8  # conftest.CHAT_PROMPTS


@pytest.fixture(scope="module")
def prepared(micro_chatml_stopping_target, chat_prompts_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("prepared") / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_chatml_stopping_target), "--datasets",
               json.dumps([{"name": "chat", "adapter": "messages", "path": str(chat_prompts_file)}])])
    return work


def run_01b(work, *extra):
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", NEW, "--device", "cpu",
              "--hf-batch-size", "1", *extra])


@pytest.fixture(scope="module")
def generated(prepared, tmp_path_factory):
    work = tmp_path_factory.mktemp("generated") / "work"
    shutil.copytree(prepared, work)
    run_01b(work)
    return work


def rows(work):
    return list(iter_jsonl(stage_dir(work, GENERATE, "chat") / "generated.jsonl"))


def copy(src, tmp_path, name="work"):
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def identity(target):
    from common.text.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    return cache_identity(target, describe_target(tok, target), "hf-float32"), tok


def test_hf_engine_keeps_the_emitted_ids(generated, micro_chatml_stopping_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(micro_chatml_stopping_target))
    model = AutoModelForCausalLM.from_pretrained(str(micro_chatml_stopping_target), dtype=torch.float32).eval()
    out = rows(generated)
    assert len(out) == NUM_PROMPTS and {r["finish_reason"] for r in out} == {"stop", "length"}
    for r in out:
        ids = r["completion_ids"]
        assert r["prompt"].endswith("<|im_start|>assistant\n") and r["max_new_tokens"] == int(NEW)
        assert tok.decode(ids, skip_special_tokens=False) == r["completion"] and r["num_completion_tokens"] == len(ids)
        if r["finish_reason"] == "stop":  # stopped on ChatML's end of turn (id 2), kept as the last id
            assert ids[-1] == 2 and 2 not in ids[:-1] and r["completion"].endswith("<|im_end|>")
        else:
            assert len(ids) == int(NEW) and 2 not in ids
        # The ids are the target's own greedy continuation of the prompt's ids.
        x = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"]])
        ref = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=len(ids),
                             do_sample=False, eos_token_id=2, pad_token_id=2)[0, x.shape[1]:].tolist()
        assert ref == ids
    m = read_json(stage_dir(generated, GENERATE) / "manifest.json")
    assert m["target_format"]["stop_ids"] == [2] and m["target_format"]["kimi"] is False


def test_cached_run_equals_generated_run(generated, prepared, micro_chatml_stopping_target, tmp_path):
    ident, tok = identity(micro_chatml_stopping_target)
    cache_path = tmp_path / "cache" / "responses.jsonl.gz"
    counts = write_response_cache([stage_dir(generated, GENERATE, "chat") / "generated.jsonl"], cache_path, ident, tok)
    assert counts["num_entries"] == NUM_PROMPTS and counts["skipped"] == {}
    first = cache_path.read_bytes()
    # Same entries, any order, rows or paths: the same bytes (the file is shipped in a repo).
    again = write_response_cache(list(reversed(rows(generated))), tmp_path / "again.jsonl.gz", ident, tok)
    assert (tmp_path / "again.jsonl.gz").read_bytes() == first and again["num_entries"] == NUM_PROMPTS
    with gzip.open(cache_path, "rt") as f:
        header, *entries = [json.loads(line) for line in f]
    assert header["identity"] == ident and header["num_entries"] == len(entries) == NUM_PROMPTS
    assert all("completion" not in e for e in entries)  # the hf text is re-derived from the ids

    work = copy(prepared, tmp_path)
    run_01b(work, "--response-cache", str(cache_path))
    cached, ref = rows(work), {r["id"]: r for r in rows(generated)}
    assert len(cached) == len(ref)
    for r in cached:
        assert r["origin"] == "cache" and r["engine"] is None
        assert {**r, "origin": "target", "engine": "hf"} == ref[r["id"]]
    counts = read_json(stage_dir(work, GENERATE, "chat") / "manifest.json")["counts"]
    assert counts["from_cache"] == NUM_PROMPTS and counts["generated"] == 0
    assert counts["this_run"]["response_cache"] == {"hits": NUM_PROMPTS, "misses": 0}
    # The training data made from both runs is identical, byte for byte.
    for w in (work, copy(generated, tmp_path, "generated")):
        merge.main(["--work-dir", str(w), "--benchmark-size", "2", "--no-drop-length-finished"])
    assert (stage_dir(work, MERGE) / "tokenized_data.jsonl").read_bytes() == (
        stage_dir(tmp_path / "generated", MERGE) / "tokenized_data.jsonl").read_bytes()


def test_changed_settings_miss(generated, prepared, micro_chatml_stopping_target, tmp_path):
    ident, tok = identity(micro_chatml_stopping_target)
    cache_path = tmp_path / "responses.jsonl.gz"
    half = rows(generated)[:NUM_PROMPTS // 2]
    write_response_cache(half, cache_path, ident, tok)
    ref = {r["id"]: r for r in rows(generated)}

    work = copy(prepared, tmp_path)  # part of the prompts known: the rest is generated as usual
    run_01b(work, "--response-cache", str(cache_path))
    out = rows(work)
    assert sorted(r["origin"] for r in out) == sorted(["cache"] * len(half) + ["target"] * (NUM_PROMPTS - len(half)))
    assert all(r["completion_ids"] == ref[r["id"]]["completion_ids"] for r in out)
    assert read_json(stage_dir(work, GENERATE, "chat") / "manifest.json")["counts"]["this_run"]["response_cache"] == {
        "hits": len(half), "misses": NUM_PROMPTS - len(half)}

    work = copy(prepared, tmp_path, "other_cap")  # another max-new-tokens: another request, a miss
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "11", "--device", "cpu",
              "--response-cache", str(cache_path)])
    assert {r["origin"] for r in rows(work)} == {"target"}

    other = tmp_path / "other_target"  # other weights, same config and tokenizer: the whole cache misses
    shutil.copytree(micro_chatml_stopping_target, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("norm.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    other_ident, _ = identity(other)
    assert {k for k in ident if ident[k] != other_ident[k]} == {"weights_sha256"}
    assert ResponseCache.load(cache_path, other_ident, tok).mismatch == ["weights_sha256"]
    assert ResponseCache.load(cache_path, {**ident, "generator": "hf-bfloat16"}, tok).mismatch == ["generator"]
    assert ResponseCache.load(cache_path, ident, tok).lookup(half[0]["prompt"], int(NEW))["completion_ids"] == \
        half[0]["completion_ids"]

    work = copy(prepared, tmp_path, "sampled")
    with pytest.raises(StageError, match="temperature"):
        run_01b(work, "--response-cache", str(cache_path), "--temperature", "0.7")
