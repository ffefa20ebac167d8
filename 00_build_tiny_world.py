"""Build the tiny Kimi-shaped world: a small tokenizer, a trained DeepSeek-V3 target, and a prompt set.

Reads:  assets/tiny_kimi/world.{json,tar.gz} (the shipped build), or with --retrain or other build
        settings the Python standard library's source files on this machine (sysconfig stdlib path)
Writes: <tiny-dir>/target/ (HF model folder: safetensors, config, tokenizer, generation_config.json),
        <tiny-dir>/data/prompts.jsonl (prompt-only `messages` rows from held-out functions),
        <tiny-dir>/greedy_samples.jsonl (the quality-gate generations), <tiny-dir>/manifest.json
Real:   not used (the real target is Kimi-K2.5 itself)
Tiny:   python 00_build_tiny_world.py --config configs/tiny.yaml

The embedded default that lets the whole pipeline run on a CPU in minutes. Tasks come from the
Python standard library's own functions (common/worlds/tiny_tasks.py): signature -> body, docstring ->
summary, and a get_source tool call followed by an answer, rendered in the Kimi-K2.5 chat format.
Functions are split by a stable hash into target-train and held-out; the target trains on the
first, the prompt set and the quality gates use only the second. Deterministic for a given seed on one
CPU, but training amplifies each CPU's float rounding, so the default settings are not rebuilt: the
build made with them is shipped (assets/tiny_kimi/, hashes and quality gates in world.json) and
unpacked, and every machine runs the demo on the same target. --retrain builds anyway; --pack-asset
writes a finished build as the asset. Cached: a folder with manifest.json is reused unless --overwrite.
Its greedy demo answers ship too (responses.jsonl.gz, configs/tiny.yaml's response-cache; --pack-responses).
"""
from __future__ import annotations

import io
import json
import random
import shutil
import tarfile
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM, GenerationConfig

from common.config import base_parser, parse_args
from common.generation.hf_engine import hf_generator
from common.generation.response_cache import pack_responses
from common.io import write_jsonl
from common.stage import (StageError, TINY_WORLD, host_info, package_versions, read_manifest, sha256_file, start_stage,
                          target_identity, tokenizer_identity, torch_threads, write_manifest)
from common.text.chat_format import render_prompt
from common.worlds import tiny_tasks as tw
from common.worlds import tiny_train as tt
from common.worlds.tiny_target import (KIMI_KV_LORA_RANK, KIMI_QK_ROPE_HEAD_DIM, KIMI_ROUTED_SCALING_FACTOR,
                                      deepseek_v3_config)
from common.worlds.tiny_tokenizer import build_tokenizer

STAGE = TINY_WORLD
ASSET = Path("assets/tiny_kimi")
# The files of a tiny world, relative to --tiny-dir (manifest.json is written by whoever builds or unpacks).
WORLD_FILES = ("target/config.json", "target/generation_config.json", "target/model.safetensors",
               "target/tokenizer.json", "target/tokenizer_config.json", "target/chat_template.jinja",
               "data/prompts.jsonl", "greedy_samples.jsonl")
# Manifest fields a build measures; the asset carries them so that an unpacked world reports them too.
BUILD_FIELDS = ("model", "training", "counts", "held_out_functions_sha256", "quality", "build_seconds")
# Config fields the manifest's "model" reports besides the sizes: the MLA widths and the router (what an
# engine must support to serve the target: common/worlds/tiny_target.py).
MODEL_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "topk_method",
                "scoring_func", "routed_scaling_factor")
# Flags that do not change what is built.
NOT_SETTINGS = ("config", "overwrite", "tiny_dir", "tiny_threads", "tiny_asset", "retrain", "pack_asset",
                "pack_responses")
RESPONSES = "responses.jsonl.gz"   # in --tiny-asset: the target's greedy answers (01b --response-cache)


def build_parser():
    p = base_parser(__doc__, work_dir=False)
    g = p.add_argument_group("tiny world")
    g.add_argument("--tiny-dir", type=Path, default=Path("build/tiny-kimi"),
                   help="output folder of the tiny world (target/, data/, manifest.json)")
    g.add_argument("--tiny-asset", type=Path, default=ASSET,
                   help="folder of the shipped build (world.json + world.tar.gz), unpacked when the build "
                        "settings equal its own")
    g.add_argument("--retrain", action="store_true", help="build and train even when the asset matches")
    g.add_argument("--pack-asset", action="store_true",
                   help="write the complete world in --tiny-dir as the asset in --tiny-asset, then stop")
    g.add_argument("--pack-responses", type=Path, nargs="+", default=None, metavar="WORK_DIR",
                   help=f"write the greedy answers of the finished 01b runs in these work dirs (transformers, "
                        f"float32 on the CPU) as --tiny-asset's {RESPONSES}, then stop")
    g.add_argument("--seed", type=int, default=0, help="seed of the tokenizer, tasks, init and training")
    g.add_argument("--tiny-train-steps", type=int, default=400,
                   help="target training steps (optimizer steps)")
    g.add_argument("--tiny-batch-size", type=int, default=16, help="target training batch (sequences)")
    g.add_argument("--tiny-lr", type=float, default=4e-3, help="peak AdamW learning rate of the target")
    g.add_argument("--tiny-loss-on", choices=("all", "completion"), default="all",
                   help="tokens the target trains on: all (prompt too: learns to copy faster) or completion")
    g.add_argument("--tiny-max-len", type=int, default=320, help="longest training sample kept (tokens)")
    g.add_argument("--tiny-vocab-size", type=int, default=4096, help="BPE vocabulary incl. specials (tokens)")
    g.add_argument("--tiny-stdlib-files", type=int, default=0,
                   help="standard-library modules the tasks come from (an evenly spaced subset; 0 = all)")
    g.add_argument("--tiny-tokenizer-files", type=int, default=40,
                   help="standard-library files the tokenizer trains on (an evenly spaced subset)")
    g.add_argument("--tiny-hidden-size", type=int, default=128, help="target hidden size (features)")
    g.add_argument("--tiny-num-hidden-layers", type=int, default=8,
                   help="target decoder layers (>= 8 keeps capture points 2, N/2, N-3 distinct)")
    g.add_argument("--tiny-num-attention-heads", type=int, default=4, help="target attention heads")
    g.add_argument("--tiny-kv-lora-rank", type=int, default=KIMI_KV_LORA_RANK,
                   help="MLA key/value latent width (features); Kimi-K2.5's 512 by default: vLLM's CPU MLA kernel "
                        "serves only kv-lora-rank + qk-rope-head-dim = 576 (a narrow latent also slows learning "
                        "to copy)")
    g.add_argument("--tiny-qk-rope-head-dim", type=int, default=KIMI_QK_ROPE_HEAD_DIM,
                   help="MLA rotary part of each query/key head, shared by the heads' keys (features); Kimi-K2.5's 64")
    g.add_argument("--tiny-qk-nope-head-dim", type=int, default=32,
                   help="MLA non-rotary part of each query/key head (features); as Kimi-K2.5's equals its "
                        "v-head-dim, here hidden / heads")
    g.add_argument("--tiny-v-head-dim", type=int, default=32, help="MLA value width per head (features)")
    g.add_argument("--tiny-kv-norm-init", type=float, default=0.125,
                   help="initial weight of each layer's latent RMSNorm (kv_a_layernorm): 64 / kv-lora-rank, so "
                        "that the 512-wide latent learns as fast as a 64-wide one (common/worlds/tiny_train.py "
                        "init_latent_norm)")
    g.add_argument("--tiny-router-bias-speed", type=float, default=1e-3,
                   help="per-step change of each router's e_score_correction_bias in DeepSeek-V3's "
                        "auxiliary-loss-free load balancing (its report: 0.001; 0 leaves the bias at zero)")
    g.add_argument("--tiny-num-experts", type=int, default=8, help="routed experts per MoE layer")
    g.add_argument("--tiny-num-experts-per-tok", type=int, default=2, help="routed experts per token (top-k)")
    g.add_argument("--tiny-moe-intermediate-size", type=int, default=128,
                   help="width of each routed and the shared expert (features)")
    g.add_argument("--tiny-intermediate-size", type=int, default=256,
                   help="width of the dense MLP of the first layer (features)")
    g.add_argument("--tiny-threads", type=int, default=1,
                   help="torch CPU threads of the build; 1 is deterministic and, on a shared 2-core machine, "
                        "far faster than 2 (spinning threads of busy processes starve each other)")
    g.add_argument("--tiny-held-out-share", type=float, default=0.15,
                   help="share of functions kept out of target training (prompts, gates)")
    g.add_argument("--tiny-num-prompts", type=int, default=320, help="rows of data/prompts.jsonl")
    g.add_argument("--tiny-eval-loss-samples", type=int, default=128,
                   help="held-out samples the held-out loss is measured on (train loss: half as many)")
    g.add_argument("--tiny-eval-prompts", type=int, default=50, help="held-out prompts of the greedy gate")
    g.add_argument("--tiny-eval-new-tokens", type=int, default=192,
                   help="greedy tokens per gate prompt at most (tokens)")
    return p


def log_time(name: str, t0: float) -> float:
    now = time.time()
    print(f"[00] {name}: {now - t0:.1f} s", flush=True)
    return now


def build_settings(args) -> dict:
    """What decides the world: the seed and the tiny-* build flags."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in NOT_SETTINGS}


def pack_asset(tiny_dir: Path, asset: Path) -> None:
    """world.tar.gz (the files of a complete build) + world.json (its settings, file hashes, what the
    build measured and where it ran)."""
    manifest = read_manifest(tiny_dir)
    if manifest.get("source") != "build":
        raise StageError(f"{tiny_dir} is not a complete build (source {manifest.get('source')!r}); "
                         "run with --retrain first")
    asset.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
        for rel in WORLD_FILES:
            info = tar.gettarinfo(str(tiny_dir / rel), arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(tiny_dir / rel, "rb") as f:
                tar.addfile(info, f)
    (asset / "world.tar.gz").write_bytes(buf.getvalue())
    info = {"settings": manifest["build_settings"],
            "files": {rel: sha256_file(tiny_dir / rel) for rel in WORLD_FILES},
            "archive_sha256": sha256_file(asset / "world.tar.gz"),
            "built_on": manifest["built_on"], **{k: manifest[k] for k in BUILD_FIELDS}}
    (asset / "world.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[00] packed {tiny_dir} into {asset}/world.tar.gz ({len(buf.getvalue()) / 1e6:.1f} MB)")


def unpack_asset(asset: Path, tiny_dir: Path, info: dict) -> None:
    """Extract the shipped world; every file must have the hash world.json records."""
    if sha256_file(asset / "world.tar.gz") != info["archive_sha256"]:
        raise StageError(f"{asset}/world.tar.gz does not match the sha256 in world.json: re-fetch the asset, "
                         "or build with --retrain")
    for d in ("target", "data"):  # leftovers of a killed run (no manifest): start clean
        if (tiny_dir / d).exists():
            shutil.rmtree(tiny_dir / d)
    with tarfile.open(asset / "world.tar.gz", "r:gz") as tar:
        if sorted(tar.getnames()) != sorted(WORLD_FILES):
            raise StageError(f"{asset}/world.tar.gz holds {sorted(tar.getnames())}, not the world's files")
        # names checked above (no absolute or parent paths); the "data" filter where this Python has it
        tar.extractall(tiny_dir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    bad = [rel for rel in WORLD_FILES if sha256_file(tiny_dir / rel) != info["files"][rel]]
    if bad:
        raise StageError(f"unpacked files differ from world.json: {bad}")


def stale_build(tiny_dir: Path, settings: dict, info: dict | None) -> str | None:
    """Why a complete tiny world in tiny_dir is not the one these settings and the shipped asset give (a
    repository update that changed the asset or its settings), or None: it is reused only when it is."""
    if not (tiny_dir / "manifest.json").is_file():
        return None
    made = read_manifest(tiny_dir)
    if made.get("build_settings") != settings:
        return "other build settings"
    shipped = (made.get("asset") or {}).get("archive_sha256")
    if made.get("source") == "asset" and info is not None and shipped != info["archive_sha256"]:
        return f"asset {str(shipped)[:12]}, the shipped one is {info['archive_sha256'][:12]}"
    return None


def main(argv=None):
    args = parse_args(build_parser(), argv)
    tiny_dir = Path(args.tiny_dir)
    if args.pack_asset:
        return pack_asset(tiny_dir, args.tiny_asset)
    if args.pack_responses is not None:
        return pack_responses(args.pack_responses, tiny_dir / "target", args.tiny_asset / RESPONSES,
                              hf_generator("cpu"))
    if args.tiny_num_hidden_layers < 8:
        raise StageError("--tiny-num-hidden-layers must be >= 8 (capture points 2, N//2, N-3 distinct)")
    settings = build_settings(args)
    info_path = args.tiny_asset / "world.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    stale = stale_build(tiny_dir, settings, info)
    if stale:
        print(f"[00] {tiny_dir} was built for another world ({stale}): building it again")
    if not start_stage(tiny_dir, args.overwrite or bool(stale), STAGE):
        return
    if info is not None and info["settings"] == settings and not args.retrain:
        unpack_asset(args.tiny_asset, tiny_dir, info)
        target_dir = tiny_dir / "target"
        write_manifest(tiny_dir, STAGE, args, source="asset", build_settings=settings,
                       asset={"path": str(args.tiny_asset), "archive_sha256": info["archive_sha256"]},
                       built_on=info["built_on"], tokenizer=tokenizer_identity(target_dir),
                       target=target_identity(target_dir), target_path=str(target_dir),
                       prompts_path=str(tiny_dir / "data" / "prompts.jsonl"), **{k: info[k] for k in BUILD_FIELDS})
        q = info["quality"]
        print(f"[00] unpacked the shipped tiny world into {tiny_dir} (built on {info['built_on']['cpu']}; "
              f"held-out loss {q['held_out_loss']:.3f}, {q['distinct_token_ids']} distinct ids in its greedy "
              f"answers, ends with <|im_end|> {q['ends_with_im_end_share']:.2f}); --retrain builds it here")
        return
    why = ("--retrain" if args.retrain else "no asset" if info is None
           else "settings differ from the asset's: " + ", ".join(
               k for k in sorted(set(settings) | set(info["settings"]))
               if settings.get(k) != info["settings"].get(k)))
    print(f"[00] building the tiny world ({why})")
    with torch_threads(args.tiny_threads):
        build(args, tiny_dir)


def build(args, tiny_dir: Path) -> None:
    print(f"[00] building the tiny world in {tiny_dir} (seed {args.seed}, "
          f"{args.tiny_train_steps} train steps, torch threads {torch.get_num_threads()})")
    target_dir, data_dir = tiny_dir / "target", tiny_dir / "data"
    for d in (target_dir, data_dir):  # leftovers of a killed build (no manifest): start clean
        if d.exists():
            shutil.rmtree(d)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = t = time.time()

    files = tw.stdlib_files()
    if args.tiny_stdlib_files:
        files = files[::max(1, len(files) // args.tiny_stdlib_files)][:args.tiny_stdlib_files]
    functions = tw.collect_functions(files)
    held_out = [f for f in functions if tw.is_held_out(f["qualname"], args.tiny_held_out_share)]
    train_fns = [f for f in functions if not tw.is_held_out(f["qualname"], args.tiny_held_out_share)]
    print(f"[00] {len(functions)} functions from {len(files)} stdlib files: "
          f"{len(train_fns)} target-train, {len(held_out)} held-out")
    train_samples = tw.training_samples(train_fns, args.seed)
    held_samples = tw.training_samples(held_out, args.seed)
    t = log_time("tasks", t)

    step = max(1, len(files) // args.tiny_tokenizer_files)
    tok_files = files[::step][:args.tiny_tokenizer_files]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in tok_files]
    tok = build_tokenizer(texts + tw.sample_texts(train_samples), args.tiny_vocab_size, target_dir)
    t = log_time(f"tokenizer ({len(tok)} tokens, {len(tok_files)} stdlib files + task texts)", t)

    train_seqs = tt.encode_samples(tok, train_samples, args.tiny_max_len)
    held_seqs = tt.encode_samples(tok, held_samples, args.tiny_max_len)
    rows = tw.prompt_rows(held_out, args.tiny_num_prompts, args.seed)
    write_jsonl(data_dir / "prompts.jsonl", rows)
    num_tokens = sum(len(s["ids"]) for s in train_seqs)
    t = log_time(f"encode ({len(train_seqs)} train samples, {num_tokens} tokens; "
                 f"{len(held_seqs)} held-out; {len(rows)} prompt rows)", t)

    config, model, num_params = new_target(args, tok)
    trained = tt.train_target(model, train_seqs, tok.pad_token_id, args.tiny_train_steps,
                              args.tiny_batch_size, args.tiny_lr, args.seed, args.tiny_loss_on,
                              bias_speed=args.tiny_router_bias_speed)
    t = log_time(f"train ({args.tiny_train_steps} steps)", t)

    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids("[BOS]"), eos_token_id=eos_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(str(target_dir))  # safetensors + config.json + generation_config.json
    tok.save_pretrained(str(target_dir))

    quality, outputs = quality_gates(args, model, tok, train_seqs, held_seqs, rows, tiny_dir)
    held_loss, train_loss = quality["held_out_loss"], quality["train_loss"]
    t = log_time("quality gates", t)
    total = time.time() - t_start
    print(f"[00] held-out loss {held_loss:.3f} (train {train_loss:.3f}) | greedy on {len(outputs)} "
          f"held-out prompts: {quality['distinct_token_ids']} distinct ids, repeated 4-grams "
          f"{quality['repeated_4gram_rate']:.3f}, ends with <|im_end|> "
          f"{quality['ends_with_im_end_share']:.2f}, "
          f"{quality['mean_response_tokens']} tokens/response | build {total:.0f} s")
    write_manifest(
        tiny_dir, STAGE, args, source="build", build_settings=build_settings(args),
        built_on={**host_info(),
                  **{k: v for k, v in package_versions().items() if k in ("torch", "transformers", "tokenizers")}},
        tokenizer=tokenizer_identity(target_dir), target=target_identity(target_dir),
        target_path=str(target_dir), prompts_path=str(data_dir / "prompts.jsonl"),
        model={"architecture": "DeepseekV3ForCausalLM", "num_parameters": num_params,
               "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
               "vocab_size": config.vocab_size, "n_routed_experts": config.n_routed_experts,
               "num_experts_per_tok": config.num_experts_per_tok,
               **{k: getattr(config, k) for k in MODEL_FIELDS}},
        training={"steps": args.tiny_train_steps, "loss_on": args.tiny_loss_on, "seconds": round(trained["seconds"], 1),
                  "router_bias_max_abs": round(trained["router_bias_max_abs"], 4),
                  "first_loss": round(trained["losses"][0], 4) if trained["losses"] else None,
                  "last_loss": round(sum(trained["losses"][-20:]) / max(1, len(trained["losses"][-20:])), 4)
                  if trained["losses"] else None, "seed": args.seed},
        counts={"stdlib_files": len(files), "functions": len(functions), "train_functions": len(train_fns),
                "held_out_functions": len(held_out), "train_samples": len(train_seqs),
                "train_tokens": num_tokens, "held_out_samples": len(held_seqs), "prompt_rows": len(rows),
                "train_samples_by_family": dict(Counter(s["family"] for s in train_seqs)),
                "prompt_rows_by_family": dict(Counter(r["id"].split("/")[0] for r in rows))},
        held_out_functions_sha256=tw.stable_hash("\n".join(sorted(f["qualname"] for f in held_out))),
        quality=quality, build_seconds=round(total, 1))
    print(f"[00] done: {tiny_dir}/manifest.json")


def new_target(args, tok):
    """The untrained DeepSeek-V3 target of the tiny-* dims (Kimi's MLA latent and router), seeded."""
    config = deepseek_v3_config(
        tok, hidden_size=args.tiny_hidden_size, num_hidden_layers=args.tiny_num_hidden_layers,
        num_attention_heads=args.tiny_num_attention_heads, n_routed_experts=args.tiny_num_experts,
        num_experts_per_tok=args.tiny_num_experts_per_tok,
        moe_intermediate_size=args.tiny_moe_intermediate_size,
        intermediate_size=args.tiny_intermediate_size, kv_lora_rank=args.tiny_kv_lora_rank,
        qk_rope_head_dim=args.tiny_qk_rope_head_dim, qk_nope_head_dim=args.tiny_qk_nope_head_dim,
        v_head_dim=args.tiny_v_head_dim, routed_scaling_factor=KIMI_ROUTED_SCALING_FACTOR)
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config)
    tt.init_latent_norm(model, args.tiny_kv_norm_init)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"[00] target: DeepseekV3 {config.num_hidden_layers} layers, hidden {config.hidden_size}, MLA latent "
          f"{config.kv_lora_rank} + {config.qk_rope_head_dim}, {config.n_routed_experts} experts "
          f"top-{config.num_experts_per_tok}, {num_params / 1e6:.2f} M params")
    return config, model, num_params


def quality_gates(args, model, tok, train_seqs, held_seqs, rows, tiny_dir: Path) -> tuple[dict, list]:
    """The trained target's held-out and train completion loss, and its greedy answers to the first held-out
    prompts (written to greedy_samples.jsonl) with their diversity: what the manifest's `quality` holds."""
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    n_eval = args.tiny_eval_loss_samples
    eval_seqs = held_seqs[:: max(1, len(held_seqs) // n_eval)][:n_eval]
    held = tt.completion_loss(model, eval_seqs, tok.pad_token_id)
    held_loss = held["loss"]
    train_eval = train_seqs[:: max(1, 2 * len(train_seqs) // n_eval)][:n_eval // 2]
    train_loss = tt.completion_loss(model, train_eval, tok.pad_token_id)["loss"]
    eval_rows = rows[:args.tiny_eval_prompts]
    prompts = [render_prompt(tok, r["messages"], r.get("tools")) for r in eval_rows]
    outputs = tt.greedy_outputs(model, tok, prompts, eos_id, args.tiny_eval_new_tokens)
    quality = tt.diversity(outputs, eos_id)
    write_jsonl(tiny_dir / "greedy_samples.jsonl",
                ({"id": r["id"], "prompt": p, "completion": tok.decode(o)}
                 for r, p, o in zip(eval_rows, prompts, outputs)))

    quality = {"held_out_loss": round(held_loss, 4), "held_out_loss_by_family": held["by_family"],
               "train_loss": round(train_loss, 4),
               "held_out_loss_samples": len(eval_seqs), **quality}
    return quality, outputs


if __name__ == "__main__":
    main()
