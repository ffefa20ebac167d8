"""05b's prompt-length buckets (--bench-context, common/serving/context.py): prompts of about L
tokens made of real held-out text in the target's chat format (never random ids), deterministic, disjoint from
the warm-up prompts; the sweep timed on the grid of bucket x concurrency, stored per cell in metrics.json and
reported per cell; and the refusal, before any launch, of a bucket the launched servers' context cannot hold."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from common.draft.manifest import DraftManifest
from common.io import write_jsonl
from common.serving import context
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.stage import MERGE, SERVE_BENCH, StageError, stage_dir
from common.target.manifests import HiddenStatesManifest
from common.text.chat_format import render_prompt
from common.text.tokenizer import load_tokenizer

NO_MANIFESTS = (HiddenStatesManifest.from_dict({}), DraftManifest.from_dict({}))  # 02b, 04: none read
from tests.sglang_server_stub import StubServer, StubState
from tests.units.serving.test_sweep import fake_launches, free_ports, make_work, run_05b, sweep_05b  # noqa: F401 (fixture)
from tests.paths import REPO



def stdlib_paragraphs(n: int) -> list[str]:
    """n distinct pieces of real English/Python text (module docstrings of the standard library)."""
    import ast
    out = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8", errors="replace")))
        if doc and len(doc) > 80:
            out.append(" ".join(doc.split())[:400])
        if len(out) == n:
            return out
    raise AssertionError("too few docstrings")


def held_out_rows(tok, n: int, long_at: int | None = None, long_text: str = "") -> list[dict]:
    """Held-out rows as 01c writes them (messages, tools, thinking, the rendered prompt and its ids); row
    `long_at` gets `long_text` appended (a long, agentic-like prompt)."""
    rows = []
    for k, text in enumerate(stdlib_paragraphs(n)):
        body = f"Question {k}: {text}" + (long_text if k == long_at else "")
        messages = [{"role": "user", "content": body}]
        prompt = render_prompt(tok, messages, None, thinking=k % 2 == 0)
        rows.append({"id": f"p{k}", "source": "abc"[k % 3], "prompt": prompt,
                     "prompt_ids": tok(prompt, add_special_tokens=False)["input_ids"], "messages": messages,
                     "tools": None, "thinking": k % 2 == 0, "benchmark_only": True})
    return rows


def test_buckets_are_real_text_deterministic_and_of_the_asked_length(micro_target):
    """A padded prompt is the target's own rendering of held-out conversations (earlier ones as prior turns,
    the base last): every id is the tokenizer's for that text, never a random one; it holds 0.9 L to L tokens;
    a held-out prompt already that long is taken as it stands; the same inputs give the same prompts."""
    tok = load_tokenizer(micro_target)
    long_text = " " + " ".join(stdlib_paragraphs(30)[20:30])
    pool = held_out_rows(tok, 20, long_at=7, long_text=long_text)
    natural_len = len(pool[7]["prompt_ids"])
    length = natural_len + 20             # row 7 is "about L" as it stands: natural
    encode = context.render_encoder(tok)
    got = context.bucket_prompts(pool, length, 4, encode)
    assert got == context.bucket_prompts(pool, length, 4, encode)        # deterministic
    assert [p["made"] for p in got] == ["natural", "padded", "padded", "padded"]
    assert got[0]["prompt_ids"] == pool[7]["prompt_ids"] and got[0]["base"] == "p7" and got[0]["padding"] == []
    by_id = {r["id"]: r for r in pool}
    for p in got:
        assert 0.9 * length <= p["tokens"] == len(p["prompt_ids"]) <= length, p["tokens"]
        base = by_id[p["base"]]
        history = [by_id[i] for i in p["padding"]]
        # exactly the template's rendering of real messages, the base's own turn last
        text = render_prompt(tok, [m for r in history for m in r["messages"]] + base["messages"], None,
                             thinking=base["thinking"])
        assert p["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        decoded = tok.decode(p["prompt_ids"])
        for r in history + [base]:
            assert r["messages"][0]["content"] in decoded
    # the padding comes from the rows before the base in the pool's order, nearest last (just before the base)
    padded = got[1]
    order = [r["id"] for r in pool]
    at = order.index(padded["base"])
    assert padded["padding"][-1] == order[at - 1]
    rec = context.bucket_record(got, length)
    assert (rec["natural"], rec["padded"], rec["num_prompts"]) == (1, 3, 4)
    assert rec["tokens_max"] <= length and [p["tokens"] for p in rec["prompts"]] == [p["tokens"] for p in got]
    with pytest.raises(StageError, match=r"--bench-context 100000: held-out prompt p\d+ reaches only \d+ tokens"):
        context.bucket_prompts(pool, 100000, 1, encode)


def test_bucket_names_are_short_or_a_length():
    assert context.parse_buckets(["short", 65536, "16384"]) == ["short", "16384", "65536"]
    assert context.parse_buckets([16384]) == ["short", "16384"]    # short is always timed
    for bad in (["long"], ["0"], [-5]):
        with pytest.raises(StageError, match="expected 'short' or a prompt length"):
            context.parse_buckets(bad)


def write_held_out(work: Path, target: Path, n: int = 12) -> list[dict]:
    rows = held_out_rows(load_tokenizer(target), n)
    write_jsonl(stage_dir(work, MERGE) / "benchmark_prompts.jsonl", rows)
    return rows


def test_the_sweep_times_every_bucket_on_prompts_disjoint_from_the_warm_up(tmp_path, micro_target):
    """With --bench-context short L every (setting, T, concurrency) is timed on both buckets; the L bucket's
    prompts (their bases and their padding) never hold a warm-up prompt's text; metrics.json stores the grid
    per cell and each bucket's token counts and how its prompts were made; the report has a table per bucket
    and the per-cell verdicts."""
    export = make_work(tmp_path, micro_target)
    rows = write_held_out(tmp_path, micro_target)
    tok = load_tokenizer(micro_target)
    length = 3 * max(len(r["prompt_ids"]) for r in rows)
    base = StubState(model_path=str(micro_target))
    spec = StubState(algorithm="EAGLE3", draft_path=str(export), model_path=str(micro_target), accept_length=3.0)
    with StubServer(base) as b, StubServer(spec) as e:
        run_05b(tmp_path, "--baseline-url", b, "--eagle3-url", e, "--num-prompts", "4", "--warmup-requests", "2",
               "--bench-context", "short", str(length), "--bench-context-prompts", "3", "--bench-concurrency", "1", "2")
    out = stage_dir(tmp_path, SERVE_BENCH)
    m = json.loads((out / "metrics.json").read_text())
    warm_ids = set(m["prompt_split"]["warmup"])
    warm_text = [r["messages"][0]["content"] for r in rows if r["id"] in warm_ids]
    assert len(warm_text) == 2
    for state in (base, spec):
        timed = [r["input_ids"] for r in state.requests if r["sampling_params"]["max_new_tokens"] == 8]
        warm = [r["input_ids"] for r in state.requests if r["sampling_params"]["max_new_tokens"] == 64]
        assert warm and not {tuple(x) for x in warm} & {tuple(x) for x in timed}
        long = [x for x in timed if len(x) > 0.8 * length]
        assert len(long) == 3 * 2 * 2   # 3 prompts x 2 concurrency levels x 2 passes
        for ids in long:
            assert not any(w in tok.decode(ids) for w in warm_text)
    rec = m["context_buckets"][str(length)]
    assert rec["num_prompts"] == 3 and rec["padded"] == 3 and rec["length"] == length
    assert all(0.9 * length <= p["tokens"] <= length and p["padding"] and not set(p["padding"]) & warm_ids
               for p in rec["prompts"])
    assert m["context_buckets"]["short"]["num_prompts"] == 4 and m["contexts"] == ["short", str(length)]
    for key in ("baseline/graph", "3-1-4/graph"):
        level = m["runs"][key]["by_temperature"]["0"]
        assert set(level["by_concurrency"]) == {"1", "2"}                       # short, where it always was
        cells = level["by_context"][str(length)]["by_concurrency"]
        assert set(cells) == {"1", "2"} and all(c["num_requests"] == 6 for c in cells.values())
    assert m["runs"]["3-1-4/graph"]["by_temperature"]["0"]["by_context"][str(length)]["by_concurrency"]["2"][
        "speed_ratio"] is not None
    assert {p.get("context") for p in m["pass_order"]} == {"short", str(length)}
    grid = m["deploy"]["by_temperature"]["0"]["grid"]
    assert set(grid) == {"short", str(length)} and set(grid[str(length)]) == {"1", "2"}
    report = (out / "report.md").read_text()
    assert f"### Timed on prompts of ~{length} tokens (0 natural, 3 padded" in report
    assert "### Per prompt length and concurrency (greedy, the recommendation's temperature)" in report
    assert f"| ~{length} tokens |" in report and "| prompts | c=1 | c=2 |" in report


def test_a_bucket_the_launched_servers_cannot_hold_is_refused_before_any_launch(tmp_path, micro_target,
                                                                               fake_launches):  # noqa: F811
    """The longest bucket + --benchmark-max-new-tokens must fit the context the launched servers admit
    (SGLang: --context-length in --server-extra-args, else what it derives from the target's config; vLLM:
    --vllm-max-model-len); otherwise 05 stops in one line before anything starts."""
    from common.serving import sglang as srv
    make_work(tmp_path, micro_target)
    write_held_out(tmp_path, micro_target)
    assert srv.derived_context_length(micro_target) == 4096     # the micro target's max_position_embeddings
    fake = fake_launches()
    with pytest.raises(StageError, match=r"^--bench-context 4090 \+ --benchmark-max-new-tokens 8 = 4098 tokens, but "
                                         r"the SGLang servers 05 launches admit 4096 \(SGLang's default, derived from "
                                         r".*config.json") as got:
        sweep_05b(tmp_path, "--bench-context", "short", "4090")
    assert "\n" not in str(got.value) and fake.launched == []
    with pytest.raises(StageError, match=r"admit 1024 \(--context-length in --server-extra-args\)"):
        sweep_05b(tmp_path, "--bench-context", "short", "2048", "--server-extra-args", "--context-length 1024",
                 "--overwrite")
    assert fake.launched == []
    base_port, spec_port = free_ports(2)   # a bucket that fits: launched, and timed on both buckets
    run_05b(tmp_path, "--baseline-port", base_port, "--eagle3-port", spec_port, "--spec-settings", "3,1,4",
           "--cuda-graph", "on", "--bench-context", "short", "400", "--bench-context-prompts", "2", "--overwrite")
    assert len(fake.launched) == 2
    for _, state in fake.launched:
        timed = [r["input_ids"] for r in state.requests if r["sampling_params"]["max_new_tokens"] == 8]
        assert sum(360 <= len(ids) <= 400 for ids in timed) == 2 * 2   # 2 prompts x 2 passes
    m = json.loads((stage_dir(tmp_path, SERVE_BENCH) / "metrics.json").read_text())
    assert m["context_length"] == 4096
    engine = VllmEngine(Path("t"), Path("e"), Path("d"), *NO_MANIFESTS)
    assert engine.context_length() == (2048, "--vllm-max-model-len (vLLM's --max-model-len)")
    sglang = SGLangEngine(micro_target, Path("e"), *NO_MANIFESTS, extra_args=["--context-length=8192"])
    assert sglang.context_length()[0] == 8192


def test_the_presets_grids_fit_their_servers():
    """Kimi-K2.5 on the box: c = 1, 16, 64 x short, ~16K, ~64K within the context SGLang derives for the target
    (262,144: max_position_embeddings, YaRN's original length named so not scaled again); SmolLM2 on the CPU
    (make bench-serve): c = 1, 4 x short and ~1.5K within vLLM's --max-model-len 2048, at the preset's 256 new
    tokens and bench-serve's 128."""
    from common.config import load_config
    from common.serving import sglang as srv
    kimi = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert kimi["bench-concurrency"] == [1, 16, 64]
    assert context.parse_buckets(kimi["bench-context"]) == ["short", "16384", "65536"]
    assert srv.derived_context_length(REPO / "assets" / "kimi_k25") == 262144
    new = kimi.get("benchmark-max-new-tokens", 256)
    assert context.longest_bucket(context.parse_buckets(kimi["bench-context"])) + new <= 262144
    small = load_config(REPO / "configs" / "smollm2.yaml")
    assert small["bench-concurrency"] == [1, 4]
    buckets = context.parse_buckets(small["bench-context"])
    assert buckets == ["short", "1536"]
    max_len = small.get("vllm-max-model-len", 2048)
    assert max_len == 2048 and context.longest_bucket(buckets) + small["benchmark-max-new-tokens"] <= max_len
    import re
    recipe = re.search(r"^bench-serve:.*\n\t(.*)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert "--config configs/smollm2.yaml" in recipe and "--benchmark-max-new-tokens 128" in recipe
