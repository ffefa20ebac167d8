"""Tests of 01c_merge_datasets: the target's emitted ids and the loss mask, held-out split (benchmark-only datasets),
counted drops (re-tokenization mismatches of text-only answers), caps, refusals."""
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from common.text.chat_format import IM_END, render_prompt
from common.io import iter_jsonl, read_json
from common.stage import GENERATE, MERGE, PREPARE, StageError, stage_dir
from tests.paths import FIXTURES

prep = importlib.import_module(PREPARE)
gen = importlib.import_module(GENERATE)
merge = importlib.import_module(MERGE)
DATASETS = [{"name": "msg", "adapter": "messages", "path": str(FIXTURES / "messages_rows.jsonl")},
            {"name": "comp", "adapter": "messages", "path": str(FIXTURES / "complete_rows.jsonl"), "complete": True}]


@pytest.fixture(scope="module")
def generated(micro_target, tmp_path_factory):
    """01 + 01b (hf, 8 new tokens) on the micro target: 9 generated (all cut by the cap) + 6 passed through."""
    work = tmp_path_factory.mktemp("gen") / "work"
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(DATASETS)])
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "8", "--device", "cpu"])
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
    return list(iter_jsonl(stage_dir(work, MERGE) / name))


def test_merge_exact_tokens_and_split(generated, tmp_path, tok, capsys):
    work = fresh(generated, tmp_path)
    merge.main(["--work-dir", str(work), "--benchmark-size", "4", "--max-seq-len", "120", "--no-drop-length-finished",
                "--tokenize-batch-size", "3"])
    gen_rows = {r["id"]: r for n in ("msg", "comp")
                for r in iter_jsonl(stage_dir(work, GENERATE, n) / "generated.jsonl")}
    out, bench = merged(work), merged(work, "benchmark_prompts.jsonl")
    stats = read_json(stage_dir(work, MERGE) / "stats.json")
    assert len(bench) == 4 and not {b["id"] for b in bench} & {s["id"] for s in out}
    n_differ = 0
    for s in out:
        g = gen_rows[s["id"]]
        p = tok(g["prompt"], add_special_tokens=False)["input_ids"]
        retokenized = tok(g["completion"], add_special_tokens=False)["input_ids"]
        # The target's own ids where 01b has them (generated), the text's tokenization otherwise (dataset).
        c = g["completion_ids"] if g["origin"] == "target" else retokenized
        assert (g["completion_ids"] is None) == (g["origin"] == "dataset")
        n_differ += c != retokenized
        assert s["input_ids"] == p + c and s["seq_len"] == len(p + c) <= 120
        assert s["loss_mask"] == [0] * len(p) + [1] * len(c)
        assert (s["n_prompt_tokens"], s["n_response_tokens"]) == (len(p), len(c))
        # The supervised part starts right after the generation prompt's <think>.
        assert tok.decode(s["input_ids"][:s["n_prompt_tokens"]]).endswith("<|im_middle|><think>")
        if g["finish_reason"] == "stop":
            assert s["input_ids"][-1] == tok.convert_tokens_to_ids(IM_END) and s["loss_mask"][-1] == 1
    # The random micro target emits ids its text does not re-tokenize to: the reason to keep them.
    assert n_differ >= 1 and n_differ == sum(v["emitted_ids_differ_from_retokenized"]
                                             for v in stats["per_source"].values())
    recs = {r["id"]: r for n in ("msg", "comp") for r in iter_jsonl(stage_dir(work, PREPARE, n) / "records.jsonl")}
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
    m = read_json(stage_dir(work, MERGE) / "manifest.json")
    assert m["tokenizer"] == read_json(stage_dir(work, GENERATE) / "manifest.json")["tokenizer"]
    capsys.readouterr()
    merge.main(["--work-dir", str(work)])  # second run: a no-op
    assert "nothing to do" in capsys.readouterr().out


def test_length_finished_kept_by_default_caps_and_stable_benchmark(generated, tmp_path):
    work = fresh(generated, tmp_path)
    merge.main(["--work-dir", str(work), "--benchmark-size", "3", "--max-seq-len", "1000", "--drop-length-finished"])
    out = merged(work)
    stats = read_json(stage_dir(work, MERGE) / "stats.json")
    gen_rows = {r["id"]: r for r in iter_jsonl(stage_dir(work, GENERATE, "msg") / "generated.jsonl")}
    n_length = sum(r["finish_reason"] == "length" for r in gen_rows.values())
    bench_ids = [b["id"] for b in merged(work, "benchmark_prompts.jsonl")]
    n_length_bench = sum(i.startswith("msg/") for i in bench_ids)
    # The micro target never stops within 8 tokens: with --drop-length-finished every msg sample is dropped.
    dropped = stats["per_source"]["msg"]["dropped"]
    assert n_length == 9 and dropped["length_finished"] + dropped.get("benchmark_prompt_overlap", 0) == 9 - n_length_bench
    assert {s["source"] for s in out} == {"comp"}
    # By default they are trained on: the mask covers exactly the emitted tokens, no end of turn added.
    # Caps and weights apply after the filters; the held-out choice does not move.
    merge.main(["--work-dir", str(work), "--overwrite", "--benchmark-size", "3", "--max-seq-len", "1000",
                "--dataset-caps", '{"comp": 2}', "--dataset-weights", '{"msg": 0.5}'])
    capped = merged(work)
    assert [b["id"] for b in merged(work, "benchmark_prompts.jsonl")] == bench_ids
    for s in capped:
        if s["source"] == "msg":
            ids = gen_rows[s["id"]]["completion_ids"]
            assert s["input_ids"][s["n_prompt_tokens"]:] == ids and len(ids) == 8
            assert s["loss_mask"] == [0] * s["n_prompt_tokens"] + [1] * 8
    by_source = {src: sum(s["source"] == src for s in capped) for src in ("msg", "comp")}
    assert by_source["comp"] == 2
    dropped = read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]["msg"]["dropped"]
    assert "length_finished" not in dropped
    n_msg = 9 - n_length_bench - sum(n for reason, n in dropped.items() if reason != "capped")
    assert by_source["msg"] == round(0.5 * n_msg) >= 1 and dropped["capped"] == n_msg - by_source["msg"]
    with pytest.raises(StageError, match="nope"):
        merge.main(["--work-dir", str(work), "--overwrite", "--dataset-caps", '{"nope": 1}'])


def test_text_only_answers_that_retokenize_differently_are_dropped(generated, tmp_path, tok):
    """A server that returns only text: 01c tokenizes it, and an answer whose token count differs from
    the one the target reported is dropped by default (kept and counted with --keep-retokenize-mismatch)."""
    work = fresh(generated, tmp_path)
    path = stage_dir(work, GENERATE, "msg") / "generated.jsonl"
    rows = list(iter_jsonl(path))
    path.write_text("".join(json.dumps({**r, "completion_ids": None, "engine": "openai"}) + "\n" for r in rows))
    differ = {r["id"] for r in rows
              if len(tok(r["completion"], add_special_tokens=False)["input_ids"]) != r["num_completion_tokens"]}
    assert differ and len(differ) < len(rows)  # the micro target's answers give both cases
    merge.main(["--work-dir", str(work), "--benchmark-size", "1", "--max-seq-len", "1000"])
    bench = {b["prompt"]: b["id"] for b in merged(work, "benchmark_prompts.jsonl")}
    eligible = {r["id"] for r in rows if r["prompt"] not in bench}  # not held out, no held-out prompt
    kept = {s["id"] for s in merged(work) if s["source"] == "msg"}
    stats = read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]["msg"]
    assert kept == eligible - differ and stats["dropped"]["retokenize_mismatch"] == len(differ & eligible) >= 1
    merge.main(["--work-dir", str(work), "--overwrite", "--benchmark-size", "1", "--max-seq-len", "1000",
                "--keep-retokenize-mismatch"])
    stats = read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]["msg"]
    kept = {s["id"] for s in merged(work) if s["source"] == "msg"}
    assert kept == eligible and stats["completion_retokenize_mismatch"] == len(differ & eligible)
    assert "retokenize_mismatch" not in stats["dropped"]


def test_benchmark_only_dataset_is_held_out_whole(micro_target, tmp_path):
    bench_rows = tmp_path / "bench.jsonl"
    questions = [f"Held-out question {i}: what does {name}() do?" for i, name in enumerate(("zip", "map", "any"))]
    bench_rows.write_text("".join(json.dumps({"id": f"b{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                                  for i, q in enumerate(questions)))
    work = tmp_path / "work"
    datasets = DATASETS + [{"name": "bench", "adapter": "messages", "path": str(bench_rows), "benchmark-only": True}]
    prep.main(["--work-dir", str(work), "--target-path", str(micro_target), "--datasets", json.dumps(datasets)])
    gen.main(["--work-dir", str(work), "--generation-engine", "hf", "--max-new-tokens", "8", "--device", "cpu"])
    passed = list(iter_jsonl(stage_dir(work, GENERATE, "bench") / "generated.jsonl"))
    assert [r["origin"] for r in passed] == ["prompt"] * 3 and all(r["completion"] is None for r in passed)
    assert read_json(stage_dir(work, GENERATE, "bench") / "manifest.json")["counts"]["generated"] == 0
    n_answered = sum(1 for n in ("msg", "comp") for _ in iter_jsonl(stage_dir(work, GENERATE, n) / "generated.jsonl"))
    with pytest.raises(StageError, match="hold out all"):  # no silent `rows - 1`
        merge.main(["--work-dir", str(work), "--benchmark-size", str(n_answered)])
    merge.main(["--work-dir", str(work), "--benchmark-size", "2", "--max-seq-len", "1000"])
    bench = merged(work, "benchmark_prompts.jsonl")
    chosen = [b for b in bench if b["benchmark_only"]]
    assert sorted(b["id"] for b in chosen) == ["bench/b0", "bench/b1", "bench/b2"]
    assert len(bench) == 3 + 2 and not {b["id"] for b in bench} & {s["id"] for s in merged(work)}
    assert [b["messages"][-1]["content"] for b in sorted(chosen, key=lambda b: b["id"])] == questions
    assert read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]["bench"]["benchmark_prompts"] == 3


def test_refusals(generated, other_micro_target, tmp_path):
    with pytest.raises(StageError, match=GENERATE):
        merge.main(["--work-dir", str(tmp_path / "empty")])
    work = fresh(generated, tmp_path)
    with pytest.raises(StageError, match="tokenizer"):  # 01b output made with another tokenizer
        merge.main(["--work-dir", str(work), "--target-path", str(other_micro_target)])
    (stage_dir(work, GENERATE, "msg") / "manifest.json").unlink()  # an interrupted 01b dataset
    (stage_dir(work, GENERATE) / "manifest.json").unlink()
    with pytest.raises(StageError, match="incomplete"):
        merge.main(["--work-dir", str(work)])


def test_repetition_loop_period():
    from common.text.repetition import loop_period

    prose = list(range(200))
    assert loop_period(prose) == 0
    assert loop_period(prose + [7, 8, 9] * 30) == 3                 # a 3-token stretch, 90 tokens long
    assert loop_period(prose + [7, 8, 9] * 10) == 0                 # 30 tokens: too short a tail to call a loop
    assert loop_period(prose + list(range(40)) * 4) == 40           # a repeated 40-token line
    assert loop_period([5] * 70) == 1 and loop_period([5] * 40) == 0


def test_ids_that_contradict_their_text_are_never_trained_on(generated, tmp_path, tok):
    """Records an older 01b kept from a proxy that sent another tokenizer's ids with the right text: their ids
    do not decode to their text, so 01c trains on none of them. Each becomes a text answer (its text
    tokenized, held against the server's count like any other) and is counted as ids_contradict_text."""
    work = fresh(generated, tmp_path)
    path = stage_dir(work, GENERATE, "msg") / "generated.jsonl"
    rows = list(iter_jsonl(path))
    foreign = {r["id"]: [(i + 1) % len(tok) for i in r["completion_ids"]] for r in rows[::2]}
    path.write_text("".join(json.dumps({**r, "completion_ids": foreign.get(r["id"], r["completion_ids"])}) + "\n"
                            for r in rows))
    merge.main(["--work-dir", str(work), "--benchmark-size", "1", "--max-seq-len", "1000",
                "--keep-retokenize-mismatch"])
    by_id = {r["id"]: r for r in rows}
    out = [s for s in merged(work) if s["source"] == "msg"]
    assert {s["id"] for s in out} & set(foreign)
    for s in out:
        answer = s["input_ids"][s["n_prompt_tokens"]:]
        assert tok.decode(answer, skip_special_tokens=False) == by_id[s["id"]]["completion"], s["id"]
        if s["id"] in foreign:
            assert answer == tok(by_id[s["id"]]["completion"], add_special_tokens=False)["input_ids"]
    stats = read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]["msg"]
    assert stats["ids_contradict_text"] == len(foreign) and stats["server_count_differs_from_ids"] == 0


def test_a_refusal_names_the_cause_it_measured(generated, tmp_path):
    """Wrong usage counts from a server that sends text only (01b cannot check them) make every answer's
    re-tokenization disagree with its count: 01c's refusal names that cause with its count, and does not
    advise --max-seq-len, which is not what dropped them. A --max-seq-len that is too short is named as such."""
    work = fresh(generated, tmp_path)
    path = stage_dir(work, GENERATE, "msg") / "generated.jsonl"
    rows = list(iter_jsonl(path))
    path.write_text("".join(json.dumps({**r, "completion_ids": None, "num_completion_tokens":
                                        2 * r["num_completion_tokens"]}) + "\n" for r in rows))
    with pytest.raises(StageError) as e:
        merge.main(["--work-dir", str(work), "--benchmark-size", "1", "--max-seq-len", "1000",
                    "--dataset-caps", '{"comp": 0}'])
    msg = str(e.value)
    assert "\n" not in msg and re.match(r"no sample survived the filters: \d+ retokenize_mismatch \(the text "
                                        r"re-tokenizes to another count than the server reported", msg), msg
    assert "--max-seq-len" not in msg and "capped" in msg
    with pytest.raises(StageError, match=r"^no sample survived the filters: \d+ over_length \(prompt \+ answer over "
                                         r"--max-seq-len: raise it"):
        merge.main(["--work-dir", str(fresh(generated, tmp_path / "short")), "--benchmark-size", "1",
                    "--max-seq-len", "5"])
