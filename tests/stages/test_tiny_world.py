"""Tests of 00_build_tiny_world: a loadable Kimi-shaped target, a held-out prompt set, caching, determinism."""
import importlib
import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from common.stage import TINY_WORLD

stage = importlib.import_module(TINY_WORLD)

from common.worlds import tiny_tasks as tw  # noqa: E402
from tests.paths import REPO  # noqa: E402

# Small everything: ~20 stdlib modules, a 600-token vocab, hidden 32 with a narrow MLA latent, a few steps.
SMALL = ["--tiny-train-steps", "3", "--tiny-batch-size", "4", "--tiny-stdlib-files", "20",
         "--tiny-tokenizer-files", "4", "--tiny-vocab-size", "600", "--tiny-hidden-size", "32",
         "--tiny-kv-lora-rank", "64", "--tiny-qk-rope-head-dim", "4", "--tiny-qk-nope-head-dim", "4",
         "--tiny-v-head-dim", "8", "--tiny-moe-intermediate-size", "32", "--tiny-intermediate-size", "64",
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
    stage.main(["--tiny-dir", str(built), "--seed", "3", *SMALL])
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
    assert man["model"]["num_parameters"] == 6289024
    # what vLLM's CPU build needs to serve it (common/worlds/tiny_target.py, tests/engine/test_vllm_tiny.py): Kimi's
    # 512 + 64 MLA latent and router fields, and a trained (nonzero) correction bias in every MoE router
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["routed_scaling_factor"]) == ("noaux_tc", "sigmoid", 2.827)
    weights = load_file(out / "target" / "model.safetensors")
    biases = [v for k, v in weights.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert all(b.abs().max() > 0.01 for b in biases)



def test_shipped_answers_are_the_shipped_targets_and_regenerate_identically(tmp_path, monkeypatch):
    """configs/tiny.yaml's response cache holds the shipped target's greedy answer to every demo prompt under
    the demo's cap (01b serves them instead of ~10 minutes of generation), and three of them (the shortest,
    and the longest that stops) come out of 01b's hf engine again token for token."""
    import torch

    from common.config import load_config, parse_args
    from common.generation.hf_engine import HFEngine, hf_generator
    from common.generation.response_cache import ResponseCache, cache_identity, prompt_sha256
    from common.generation.jobs import make_jobs
    from common.io import iter_jsonl
    from common.stage import GENERATE, PREPARE, stage_dir
    from common.text.target_format import load_target_format
    from common.text.tokenizer import load_tokenizer

    monkeypatch.chdir(REPO)
    out = tmp_path / "tiny-kimi"
    stage.main(["--tiny-dir", str(out), "--config", str(REPO / "configs" / "tiny.yaml")])
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert Path(cfg["response-cache"]) == Path("assets") / "tiny_kimi" / stage.RESPONSES
    target = out / "target"
    tok = load_tokenizer(target)
    fmt = load_target_format(target, tok)
    cache = ResponseCache.load(REPO / cfg["response-cache"], cache_identity(target, fmt, hf_generator("cpu")), tok)
    assert not cache.mismatch, cache.mismatch   # the shipped target's answers
    work = tmp_path / "work"   # 01 on the world's prompts, then 01b's own rendering of them
    importlib.import_module(PREPARE).main(["--config", str(REPO / "configs" / "tiny.yaml"), "--work-dir", str(work),
                                           "--target-path", str(target),
                                           "--datasets", json.dumps([{**cfg["datasets"][0],
                                                                      "path": str(out / "data" / "prompts.jsonl")}])])
    records = list(iter_jsonl(stage_dir(work, PREPARE) / cfg["datasets"][0]["name"] / "records.jsonl"))
    gen = parse_args(importlib.import_module(GENERATE).build_parser(),
                     ["--config", str(REPO / "configs" / "tiny.yaml"), "--work-dir", str(work)])
    jobs, _, _ = make_jobs(records, tok, fmt, max_new_tokens=gen.max_new_tokens, max_context=gen.max_context,
                           long_context=gen.long_context)
    texts = {prompt_sha256(j["prompt"]): j["prompt"] for j in jobs}
    entries = [e for e in cache.entries.values() if e["prompt_sha256"] in texts]
    assert len(entries) == len(cache.entries) >= 0.95 * len(texts)
    assert {e["max_new_tokens"] for e in entries} <= {j["max_new"] for j in jobs}
    by_length = sorted(entries, key=lambda e: len(e["completion_ids"]))
    stopped = [e for e in by_length if e["finish_reason"] == "stop"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFEngine(target, tok, fmt.stop_ids)
        for e in by_length[:2] + stopped[-1:]:
            got = engine.generate_batch([texts[e["prompt_sha256"]]], [e["max_new_tokens"]])[0]
            assert got["completion_ids"] == e["completion_ids"] and got["finish_reason"] == e["finish_reason"]
    finally:
        torch.set_num_threads(before)

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
    # a world unpacked from an older asset (a repository update shipped another) is unpacked again, not reused
    made = json.loads((again / "manifest.json").read_text())
    (again / "manifest.json").write_text(json.dumps({**made, "asset": {**made["asset"], "archive_sha256": "0" * 64}}))
    stage.main(["--tiny-dir", str(again), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])
    assert json.loads((again / "manifest.json").read_text())["asset"] == got["asset"]
    info = json.loads((asset / "world.json").read_text())
    info["files"]["target/model.safetensors"] = "0" * 64
    (asset / "world.json").write_text(json.dumps(info))
    with pytest.raises(StageError, match="differ from world.json"):
        stage.main(["--tiny-dir", str(tmp_path / "bad"), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])
    (asset / "world.tar.gz").write_bytes(b"not the archive")
    with pytest.raises(StageError, match="does not match the sha256"):
        stage.main(["--tiny-dir", str(tmp_path / "bad2"), "--seed", "3", *SMALL, "--tiny-asset", str(asset)])


def test_router_balancer_moves_each_bias_toward_balance(tmp_path):
    """DeepSeek-V3's auxiliary-loss-free balancing (tiny_train.RouterBalancer): an expert that took more tokens
    than the mean loses `speed` of bias, one that took fewer gains it, padding is not counted, and the hooks
    come off."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from common.worlds import tiny_train as tt
    from common.worlds.tiny_target import deepseek_v3_config
    from common.worlds.tiny_tokenizer import build_tokenizer
    from tests.conftest import stdlib_texts

    tok = build_tokenizer(stdlib_texts(4), 300, tmp_path)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(tok, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                     moe_intermediate_size=8, intermediate_size=16))
    balancer = tt.RouterBalancer(model, speed=0.01)
    router = balancer.routers[0]
    ids = torch.randint(30, len(tok), (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # four pad tokens
    balancer.mask = mask.flatten().bool()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    load = balancer.loads[0].clone()
    assert load.sum() == 20 * model.config.num_experts_per_tok  # the 20 real tokens' choices only
    balancer.step()
    bias = router.e_score_correction_bias
    assert torch.equal(bias, 0.01 * torch.sign(load.mean() - load))
    assert balancer.loads[0].sum() == 0
    balancer.remove()
    with torch.no_grad():
        model(input_ids=ids)
    assert balancer.loads[0].sum() == 0
