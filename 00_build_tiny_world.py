"""Build the tiny Kimi-shaped world: a small tokenizer, a trained DeepSeek-V3 target, and a prompt set.

Reads:  the Python standard library's source files on this machine (sysconfig stdlib path)
Writes: <tiny-dir>/target/ (HF model folder: safetensors, config, tokenizer, generation_config.json),
        <tiny-dir>/data/prompts.jsonl (prompt-only `messages` rows from held-out functions),
        <tiny-dir>/greedy_samples.jsonl (the quality-gate generations), <tiny-dir>/manifest.json
Real:   not used (the real target is Kimi-K2.5 itself)
Tiny:   python 00_build_tiny_world.py --config configs/tiny.yaml

The embedded default that lets the whole pipeline run on a CPU in minutes. Tasks come from the
Python standard library's own functions (common/worlds/tiny_tasks.py): signature -> body, docstring ->
summary, and a get_source tool call followed by an answer, rendered in the Kimi-K2.5 chat format.
Functions are split by a stable hash into target-train and held-out; the target trains on the
first, the prompt set and the quality gates use only the second. Deterministic for a given seed;
cached: a folder with manifest.json is reused unless --overwrite.
"""
from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM, GenerationConfig

from common.config import base_parser, parse_args
from common.io import write_jsonl
from common.stage import StageError, start_stage, target_identity, tokenizer_identity, torch_threads, write_manifest
from common.text.chat_format import render_prompt
from common.worlds import tiny_tasks as tw
from common.worlds import tiny_train as tt
from common.worlds.tiny_target import deepseek_v3_config
from common.worlds.tiny_tokenizer import build_tokenizer

STAGE = "00_build_tiny_world"


def build_parser():
    p = base_parser(__doc__, work_dir=False)
    g = p.add_argument_group("tiny world")
    g.add_argument("--tiny-dir", type=Path, default=Path("build/tiny-kimi"),
                   help="output folder of the tiny world (target/, data/, manifest.json)")
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
    g.add_argument("--tiny-kv-lora-rank", type=int, default=64,
                   help="MLA key/value latent width (features); a narrow latent slows learning to copy")
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


def main(argv=None):
    args = parse_args(build_parser(), argv)
    tiny_dir = Path(args.tiny_dir)
    if args.tiny_num_hidden_layers < 8:
        raise StageError("--tiny-num-hidden-layers must be >= 8 (capture points 2, N//2, N-3 distinct)")
    if not start_stage(tiny_dir, args.overwrite, STAGE):
        return
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

    config = deepseek_v3_config(
        tok, hidden_size=args.tiny_hidden_size, num_hidden_layers=args.tiny_num_hidden_layers,
        num_attention_heads=args.tiny_num_attention_heads, n_routed_experts=args.tiny_num_experts,
        num_experts_per_tok=args.tiny_num_experts_per_tok,
        moe_intermediate_size=args.tiny_moe_intermediate_size,
        intermediate_size=args.tiny_intermediate_size)
    config.kv_lora_rank = args.tiny_kv_lora_rank
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"[00] target: DeepseekV3 {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.n_routed_experts} experts top-{config.num_experts_per_tok}, "
          f"{num_params / 1e6:.2f} M params")
    trained = tt.train_target(model, train_seqs, tok.pad_token_id, args.tiny_train_steps,
                              args.tiny_batch_size, args.tiny_lr, args.seed, args.tiny_loss_on)
    t = log_time(f"train ({args.tiny_train_steps} steps)", t)

    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids("[BOS]"), eos_token_id=eos_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(str(target_dir))  # safetensors + config.json + generation_config.json
    tok.save_pretrained(str(target_dir))

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
    t = log_time("quality gates", t)

    quality = {"held_out_loss": round(held_loss, 4), "held_out_loss_by_family": held["by_family"],
               "train_loss": round(train_loss, 4),
               "held_out_loss_samples": len(eval_seqs), **quality}
    total = time.time() - t_start
    print(f"[00] held-out loss {held_loss:.3f} (train {train_loss:.3f}) | greedy on {len(outputs)} "
          f"held-out prompts: {quality['distinct_token_ids']} distinct ids, repeated 4-grams "
          f"{quality['repeated_4gram_rate']:.3f}, ends with <|im_end|> "
          f"{quality['ends_with_im_end_share']:.2f}, "
          f"{quality['mean_response_tokens']} tokens/response | build {total:.0f} s")
    write_manifest(
        tiny_dir, STAGE, args,
        tokenizer=tokenizer_identity(target_dir), target=target_identity(target_dir),
        target_path=str(target_dir), prompts_path=str(data_dir / "prompts.jsonl"),
        model={"architecture": "DeepseekV3ForCausalLM", "num_parameters": num_params,
               "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
               "vocab_size": config.vocab_size, "n_routed_experts": config.n_routed_experts,
               "num_experts_per_tok": config.num_experts_per_tok, "kv_lora_rank": config.kv_lora_rank},
        training={"steps": args.tiny_train_steps, "loss_on": args.tiny_loss_on, "seconds": round(trained["seconds"], 1),
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


if __name__ == "__main__":
    main()
