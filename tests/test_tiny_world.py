"""Tests of 00_build_tiny_world: a loadable Kimi-shaped target, a held-out prompt set, caching, determinism."""
import importlib
import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from common.stage import TINY_WORLD

REPO = Path(__file__).resolve().parent.parent
stage = importlib.import_module(TINY_WORLD)

from common.worlds import tiny_tasks as tw  # noqa: E402

# Small everything: ~20 stdlib modules, a 600-token vocab, hidden 32, a few steps.
SMALL = ["--tiny-train-steps", "3", "--tiny-batch-size", "4", "--tiny-stdlib-files", "20",
         "--tiny-tokenizer-files", "4", "--tiny-vocab-size", "600", "--tiny-hidden-size", "32",
         "--tiny-moe-intermediate-size", "32", "--tiny-intermediate-size", "64",
         "--tiny-num-prompts", "40", "--tiny-eval-prompts", "4", "--tiny-eval-new-tokens", "8",
         "--tiny-eval-loss-samples", "16", "--tiny-max-len", "256", "--tiny-held-out-share", "0.3"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny-kimi"
    stage.main(["--tiny-dir", str(out), "--seed", "3", *SMALL])
    return out


def test_target_loads_as_kimi_shaped_deepseek_v3(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = built / "target"
    tok = AutoTokenizer.from_pretrained(str(target))
    for special in ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>",
                    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id, special
        assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(special)) == special
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_user|>user<|im_middle|>hi<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.architectures == ["DeepseekV3ForCausalLM"]
    assert model.config.num_hidden_layers >= 8
    assert model.config.n_routed_experts > 1 and model.config.kv_lora_rank  # MoE + MLA
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((target / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end == model.config.eos_token_id
    assert (target / "model.safetensors").is_file()


def test_manifest_reports_gates_and_identities(built):
    from common.stage import target_identity, tokenizer_identity

    m = json.loads((built / "manifest.json").read_text())
    assert m["stage"] == TINY_WORLD
    assert m["tokenizer"]["sha256"] == tokenizer_identity(built / "target")["sha256"]
    assert m["target"]["config_sha256"] == target_identity(built / "target")["config_sha256"]
    q = m["quality"]
    assert q["held_out_loss"] > 0 and q["num_responses"] == 4
    for key in ("distinct_token_ids", "repeated_4gram_rate", "ends_with_im_end_share"):
        assert key in q
    assert m["training"]["steps"] == 3 and m["model"]["num_parameters"] > 0
    assert len((built / "greedy_samples.jsonl").read_text().splitlines()) == 4


def test_prompts_follow_messages_schema_and_are_held_out(built):
    rows = [json.loads(line) for line in (built / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and len({r["id"] for r in rows}) == 40
    families = {r["id"].split("/")[0] for r in rows}
    assert families == set(tw.FAMILIES)
    share = 0.3
    for r in rows:
        assert set(r) <= {"id", "messages", "tools"}
        msgs = r["messages"]
        assert msgs[-1]["role"] in ("user", "tool")
        for msg in msgs:
            assert msg["role"] in ("system", "user", "assistant", "tool") and isinstance(msg["content"], str)
            for call in msg.get("tool_calls") or []:
                assert call["type"] == "function" and isinstance(call["function"]["arguments"], str)
                assert set(json.loads(call["function"]["arguments"])) == {"module", "name"}
            if msg["role"] == "tool":
                calls = [c["id"] for m in msgs if m.get("tool_calls") for c in m["tool_calls"]]
                assert msg["tool_call_id"] in calls and msg["name"] == tw.TOOL_NAME
        if "tools" in r:
            assert r["tools"][0]["function"]["name"] == tw.TOOL_NAME
        qualname = r["id"].split("/", 1)[1]
        assert tw.is_held_out(qualname, share), qualname


def test_held_out_functions_are_disjoint_from_training():
    fns = tw.collect_functions(tw.stdlib_files()[:30])
    assert len(fns) > 50
    held = {f["qualname"] for f in fns if tw.is_held_out(f["qualname"], 0.15)}
    train = {s["qualname"] for s in tw.training_samples([f for f in fns if f["qualname"] not in held], 0)}
    assert held and train and not held & train
    rows = tw.prompt_rows([f for f in fns if f["qualname"] in held], 30, 0)
    assert {r["id"].split("/", 1)[1] for r in rows} <= held
    # The split is a property of the name alone: the same for any list order or seed.
    assert all(tw.is_held_out(q, 0.15) for q in held)


def test_second_run_is_cached(built, capsys):
    before = (built / "manifest.json").read_bytes()
    t0 = time.time()
    stage.main(["--tiny-dir", str(built), "--config", str(REPO / "configs" / "tiny.yaml")])
    assert time.time() - t0 < 1.0
    assert "nothing to do" in capsys.readouterr().out
    assert (built / "manifest.json").read_bytes() == before


def test_same_seed_same_world(built, tmp_path):
    again = tmp_path / "again"
    stage.main(["--tiny-dir", str(again), "--seed", "3", *SMALL])
    for rel in ("target/tokenizer.json", "data/prompts.jsonl", "target/config.json"):
        assert (built / rel).read_bytes() == (again / rel).read_bytes(), rel
    a = load_file(built / "target" / "model.safetensors")
    b = load_file(again / "target" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), key


def test_fewer_than_eight_layers_is_refused(tmp_path):
    from common.stage import StageError

    with pytest.raises(StageError, match="must be >= 8"):
        stage.main(["--tiny-dir", str(tmp_path / "t"), "--tiny-num-hidden-layers", "7"])
    assert not (tmp_path / "t").exists()


def test_default_settings_unpack_the_shipped_world(tmp_path, monkeypatch):
    """`make demo`'s settings do not train: the shipped build is unpacked, byte for byte the files its
    world.json hashes, with the quality gates it measured. Every CPU runs the demo on this target."""
    from common.stage import sha256_file

    monkeypatch.chdir(REPO)
    info = json.loads((REPO / "assets" / "tiny_kimi" / "world.json").read_text())
    out = tmp_path / "tiny-kimi"
    t0 = time.time()
    stage.main(["--tiny-dir", str(out), "--config", str(REPO / "configs" / "tiny.yaml")])
    assert time.time() - t0 < 60  # unpacking, not the ~7 minutes of training
    man = json.loads((out / "manifest.json").read_text())
    assert man["source"] == "asset" and man["quality"] == info["quality"]
    assert {rel: sha256_file(out / rel) for rel in stage.WORLD_FILES} == info["files"]
    assert man["model"]["num_parameters"] == 4696192


def test_pack_unpack_round_trip_and_a_bad_asset_is_refused(built, tmp_path):
    from common.stage import StageError

    assert json.loads((built / "manifest.json").read_text())["source"] == "build"
    asset = tmp_path / "asset"
    stage.main(["--tiny-dir", str(built), "--tiny-asset", str(asset), "--pack-asset"])
    again = tmp_path / "again"
    stage.main(["--tiny-dir", str(again), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])
    got = json.loads((again / "manifest.json").read_text())
    assert got["source"] == "asset" and got["quality"] == json.loads((built / "manifest.json").read_text())["quality"]
    for rel in stage.WORLD_FILES:
        assert (again / rel).read_bytes() == (built / rel).read_bytes(), rel
    info = json.loads((asset / "world.json").read_text())
    info["files"]["target/model.safetensors"] = "0" * 64
    (asset / "world.json").write_text(json.dumps(info))
    with pytest.raises(StageError, match="differ from world.json"):
        stage.main(["--tiny-dir", str(tmp_path / "bad"), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])
    (asset / "world.tar.gz").write_bytes(b"not the archive")
    with pytest.raises(StageError, match="does not match the sha256"):
        stage.main(["--tiny-dir", str(tmp_path / "bad2"), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])
