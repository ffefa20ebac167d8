"""01c_merge_datasets: exact ids and loss mask, held-out split, counted drops, caps, refusals."""
import importlib
import json
import shutil
from pathlib import Path

import pytest

from common.data.chat_format import IM_END, render_prompt
from common.io import iter_jsonl, read_json
from common.stage import StageError

prep = importlib.import_module("01_prepare_datasets")
gen = importlib.import_module("01b_generate_synthetic")
merge = importlib.import_module("01c_merge_datasets")
FIXTURES = Path(__file__).parent / "fixtures"
DATASETS = [{"name": "msg", "adapter": "messages", "path": str(FIXTURES / "messages_rows.jsonl")},
            {"name": "comp", "adapter": "messages", "path": str(FIXTURES / "complete_rows.jsonl"), "complete": True}]


@pytest.fixture(scope="module")
def generated(micro_target, tmp_path_factory):
    """01 + 01b (hf, 8 new tokens) on the micro target: 9 generated (all cut by the cap) + 6 passed through."""
    work = tmp_path_factory.mktemp("gen") / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(DATASETS)])
    gen.main(["--work-dir", str(work), "--generation-backend", "hf", "--max-new-tokens", "8", "--device", "cpu"])
    return work


@pytest.fixture(scope="module")
def tok(micro_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(micro_target))


def fresh(generated, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(generated, work)
    return work


def merged(work, name="tokenized_data.jsonl"):
    return list(iter_jsonl(work / "01c_merged" / name))


def test_merge_exact_tokens_and_split(generated, tmp_path, tok, capsys):
    work = fresh(generated, tmp_path)
    merge.main(["--work-dir", str(work), "--benchmark-size", "4", "--max-seq-len", "120", "--no-drop-length-finished",
                "--tokenize-batch-size", "3"])
    gen_rows = {r["id"]: r for n in ("msg", "comp") for r in iter_jsonl(work / "01b_generated" / n / "generated.jsonl")}
    out, bench = merged(work), merged(work, "benchmark_prompts.jsonl")
    stats = read_json(work / "01c_merged" / "stats.json")
    assert len(bench) == 4 and not {b["id"] for b in bench} & {s["id"] for s in out}
    for s in out:
        g = gen_rows[s["id"]]
        p = tok(g["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(g["completion"], add_special_tokens=False)["input_ids"]
        assert s["input_ids"] == p + c and s["seq_len"] == len(p + c) <= 120
        assert s["loss_mask"] == [0] * len(p) + [1] * len(c)
        assert (s["n_prompt_tokens"], s["n_response_tokens"]) == (len(p), len(c))
        # The supervised part starts right after the generation prompt's <think>.
        assert tok.decode(s["input_ids"][:s["n_prompt_tokens"]]).endswith("<|im_middle|><think>")
        if g["finish_reason"] == "stop":
            assert s["input_ids"][-1] == tok.convert_tokens_to_ids(IM_END) and s["loss_mask"][-1] == 1
    recs = {r["id"]: r for n in ("msg", "comp") for r in iter_jsonl(work / "01_prepared" / n / "records.jsonl")}
    for b in bench:  # what 05 needs to run a held-out prompt, consistent with what 01b sent
        assert b["prompt"] == gen_rows[b["id"]]["prompt"] == render_prompt(tok, b["messages"], b["tools"], b["thinking"])
        assert b["prompt_ids"] == tok(b["prompt"], add_special_tokens=False)["input_ids"]
        assert b["messages"][-1]["role"] in ("user", "tool") and b["messages"][0] == recs[b["id"]]["messages"][0]
    # Drops are counted, and everything is accounted for.
    totals = stats["totals"]
    n_dupes = totals["dropped"].get("duplicate", 0)
    assert n_dupes >= 1  # comp/c0 and comp/c2 are the same conversation (unless one is held out)
    assert len(out) + len(bench) + sum(totals["dropped"].values()) == len(gen_rows) == totals["num_input_rows"]
    over = [i for i, g in gen_rows.items() if i not in {b["id"] for b in bench}
            and len(tok(g["prompt"] + g["completion"], add_special_tokens=False)["input_ids"]) > 120]
    assert totals["dropped"].get("over_length", 0) >= 1 and totals["dropped"]["over_length"] <= len(over)
    assert totals["num_samples"] == len(out) and totals["num_tokens"] == sum(s["seq_len"] for s in out)
    assert sum(stats["length_histogram"].values()) == len(out)
    assert stats["per_source"]["comp"]["num_response_tokens"] == sum(
        s["n_response_tokens"] for s in out if s["source"] == "comp")
    m = read_json(work / "01c_merged" / "manifest.json")
    assert m["tokenizer"] == read_json(work / "01b_generated" / "manifest.json")["tokenizer"]
    capsys.readouterr()
    merge.main(["--work-dir", str(work)])  # second run: a no-op
    assert "nothing to do" in capsys.readouterr().out


def test_length_finished_dropped_caps_and_stable_benchmark(generated, tmp_path):
    work = fresh(generated, tmp_path)
    merge.main(["--work-dir", str(work), "--benchmark-size", "3", "--max-seq-len", "1000"])
    out = merged(work)
    stats = read_json(work / "01c_merged" / "stats.json")
    n_length = sum(r["finish_reason"] == "length" for r in iter_jsonl(work / "01b_generated/msg/generated.jsonl"))
    bench_ids = [b["id"] for b in merged(work, "benchmark_prompts.jsonl")]
    n_length_bench = sum(i.startswith("msg/") for i in bench_ids)
    # The micro target never stops within 8 tokens: every generated msg sample is cut and dropped.
    dropped = stats["per_source"]["msg"]["dropped"]
    assert n_length == 9 and dropped["length_finished"] + dropped.get("benchmark_prompt_overlap", 0) == 9 - n_length_bench
    assert {s["source"] for s in out} == {"comp"}
    # Caps and weights apply after the filters; the held-out choice does not move.
    merge.main(["--work-dir", str(work), "--overwrite", "--benchmark-size", "3", "--max-seq-len", "1000",
                "--no-drop-length-finished", "--dataset-caps", '{"comp": 2}', "--dataset-weights", '{"msg": 0.5}'])
    capped = merged(work)
    assert [b["id"] for b in merged(work, "benchmark_prompts.jsonl")] == bench_ids
    by_source = {src: sum(s["source"] == src for s in capped) for src in ("msg", "comp")}
    assert by_source["comp"] == 2
    dropped = read_json(work / "01c_merged/stats.json")["per_source"]["msg"]["dropped"]
    assert "length_finished" not in dropped
    n_msg = 9 - n_length_bench - sum(n for reason, n in dropped.items() if reason != "capped")
    assert by_source["msg"] == round(0.5 * n_msg) and dropped["capped"] == n_msg - by_source["msg"]
    with pytest.raises(StageError, match="nope"):
        merge.main(["--work-dir", str(work), "--overwrite", "--dataset-caps", '{"nope": 1}'])


def test_refusals(generated, other_micro_target, tmp_path):
    with pytest.raises(StageError, match="01b_generate_synthetic"):
        merge.main(["--work-dir", str(tmp_path / "empty")])
    work = fresh(generated, tmp_path)
    with pytest.raises(StageError, match="tokenizer"):  # 01b output made with another tokenizer
        merge.main(["--work-dir", str(work), "--target-path", str(other_micro_target)])
    (work / "01b_generated" / "msg" / "manifest.json").unlink()  # an interrupted 01b dataset
    (work / "01b_generated" / "manifest.json").unlink()
    with pytest.raises(StageError, match="incomplete"):
        merge.main(["--work-dir", str(work)])
