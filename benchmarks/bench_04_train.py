"""Benchmark 04's training step: tokens/s and peak memory of a scaled Kimi-like EAGLE-3 draft.

Part 1 (step): optimizer steps of the draft on random features (teacher, TTT unroll, loss, backward,
clip, AdamW), each variant in a process of its own, so its peak memory is its own:
  today      the trainer before the TTT-attention rework: fp32; TTT attention as one SDPA over all steps' keys under a
             [T, (k+1)T] mask; teacher, lm_head and float32 log-softmax over every position (the code
             of that trainer is kept below as legacy_*)
  attention  today with the causal block + diagonal TTT attention of common/draft/model.py
  fp32       04's run_batch: new attention, teacher/lm_head/soft-CE on supervised rows, fused soft-CE
  bf16       04's run_batch under --precision bf16: autocast over fp32 master weights, bf16 teacher head
  topk       bf16 with the compact teacher (02b --teacher-format topk, k 32): no target lm_head at all
  mla        bf16 with the MLA draft form (--draft-attention mla; dims from common/draft/model.py mla_dims:
             at the CPU default H 1024 / 8 heads they are Kimi-K2.5's, q_lora 1536, kv_lora 512, 128/64/128)
  mla31      mla with EAGLE-3.1's fc_norm and norm_output
Part 2 (stage, CPU): 04_train.py itself on synthetic 02b/03 folders of the same shape, ms per step from
its train log: reading in the loop vs the prefetch thread, and 1 process vs one per core (torchrun, gloo)
on the same global batches. Prints tables (medians over the measured steps); asserts nothing.
Run:    python benchmarks/bench_04_train.py                      # H 1024, Dv 32K, V 163840, T 2048: long on CPU
Quick:  python benchmarks/bench_04_train.py --hidden 512 --seq-len 512 --draft-vocab 8192 --vocab 32768
Mid:    python benchmarks/bench_04_train.py --draft-vocab 8192 --vocab 32768 --seq-len 2048   # the mid shape
GPU:    python benchmarks/bench_04_train.py --device cuda    # Kimi's draft: H 7168, 56/8 heads, MLP 18432, T 4K-16K
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.stage import EXTRACT, TRAIN, VOCAB, stage_dir, stage_script  # noqa: E402

VARIANTS = ("today", "attention", "fp32", "bf16", "topk", "mla", "mla31")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=None, help="draft (= target) hidden size H (CPU 1024, CUDA 7168)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (CPU 8, CUDA 56)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (CPU 8, CUDA 8)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width (default: Kimi's ratio 18432/7168 x H, rounded to 128)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocab size Dv")
    p.add_argument("--vocab", type=int, default=163840, help="target vocab size V")
    p.add_argument("--seq-len", type=int, nargs="+", default=None,
                   help="tokens per sample T, one or more (CPU 2048, CUDA 4096 8192 16384)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per optimizer step")
    p.add_argument("--supervised-share", type=float, default=1.0,
                   help="share of each sample's positions with loss_mask 1 (its tail; 1.0 = all, the worst case "
                        "for the supervised-rows-only head)")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT unroll depth")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per variant process (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, run round-robin over the variants")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                   help="part 1 variants (default: all on CPU; today and bf16 on CUDA, where the new attention "
                        "runs in bf16 only)")
    p.add_argument("--device", default="cpu", help="cpu|cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    p.add_argument("--no-step", action="store_true", help="skip part 1 (the per-variant step runs)")
    p.add_argument("--no-stage", action="store_true", help="skip part 2 (the 04 stage runs)")
    p.add_argument("--stage-steps", type=int, default=4, help="optimizer steps per part 2 run (the first is dropped)")
    p.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)   # child process
    return p


# ---- the trainer before the TTT-attention rework (teacher and loss over every position), for the "today" rows ----

def legacy_teacher_targets(final, lm_head, d2t, t2d, chunk_rows: int = 1024) -> dict:
    import torch
    b, t, h = final.shape
    dv = d2t.shape[0]
    draft_to_target = torch.arange(dv) + d2t
    target_to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.int64)
    target_to_draft[draft_to_target] = torch.arange(dv)
    flat = final.reshape(b * t, h)
    p_out = torch.empty(b * t, dv, dtype=torch.float32, device=final.device)
    arg_out = torch.empty(b * t, dtype=torch.int64, device=final.device)
    with torch.no_grad():
        for a in range(0, b * t, chunk_rows):
            logits = (flat[a:a + chunk_rows].to(lm_head.dtype) @ lm_head.T).float()
            arg_out[a:a + chunk_rows] = target_to_draft.to(final.device)[logits.argmax(-1)]
            p_out[a:a + chunk_rows] = torch.softmax(logits[:, draft_to_target.to(final.device)], dim=-1)
    arg = arg_out.view(b, t)
    return {"target_p": p_out.view(b, t, dv), "target_arg": arg, "in_vocab": arg >= 0}


def legacy_ttt_loss(step_logits, teacher, loss_mask, decay=0.8):
    import torch.nn.functional as F
    total, seq_len = 0.0, loss_mask.shape[1]
    for k, logits in enumerate(step_logits):
        s = 1 + k
        q = logits[:, : seq_len - s].float()
        p = teacher["target_p"][:, s:]
        valid = loss_mask[:, s:] & teacher["in_vocab"][:, s:]
        ce = -(p * F.log_softmax(q, dim=-1)).sum(-1)
        total = total + decay ** k * (ce * valid).sum() / valid.sum().clamp(min=1)
    return total


# ---- part 1: one variant in this process ----

def random_vocab_mapping(vocab: int, draft_vocab: int, generator=None):
    """(d2t [Dv], t2d [V]) of a draft vocab of `draft_vocab` random target ids, as 03 stores them."""
    import torch
    used = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


def intermediate_of(args) -> int:
    return args.intermediate_size or max(128, round(18432 / 7168 * args.hidden / 128) * 128)


def make_step(args, seq_len: int, variant: str):
    """(model, step function returning the loss, tokens per step)."""
    import contextlib

    import torch

    from common.training.distributed import Ranks
    from common.draft.model import Eagle3DraftModel, mla_dims
    train = importlib.import_module(TRAIN)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = {"hidden_size": args.hidden, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
           "intermediate_size": intermediate_of(args), "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
           "max_position_embeddings": 32768, "vocab_size": args.vocab, "draft_vocab_size": args.draft_vocab}
    if variant.startswith("mla"):   # the MLA form: every head its own latent-derived keys, no KV groups
        cfg.update(attention="mla", num_key_value_heads=args.heads, **mla_dims({"hidden_size": args.hidden}, args.heads),
                   fc_norm=variant == "mla31", norm_output=variant == "mla31")
    model = Eagle3DraftModel(cfg)
    d2t, t2d = random_vocab_mapping(args.vocab, args.draft_vocab)
    used = torch.arange(args.draft_vocab) + d2t
    model.set_vocab_mapping(d2t, t2d)
    model.to(device).train()
    bf16 = variant in ("bf16", "topk", "mla", "mla31") or (variant == "today" and device.type == "cuda")
    if bf16:
        model.embed_tokens.to(torch.bfloat16)
    lm_head = torch.randn(args.vocab, args.hidden, device=device) / args.hidden ** 0.5 * 4
    lm_head = lm_head.to(torch.bfloat16 if bf16 else torch.float32)
    b, h = args.batch_size, args.hidden
    mask = torch.zeros(b, seq_len, dtype=torch.bool, device=device)
    mask[:, int(round((1 - args.supervised_share) * seq_len)):] = True
    batch = {"aux": torch.randn(b, seq_len, 3 * h, device=device).to(torch.bfloat16),
             "final": torch.randn(b, seq_len, h, device=device).to(torch.bfloat16),
             "input_ids": torch.randint(0, args.vocab, (b, seq_len), device=device),
             "loss_mask": mask, "num_samples": b}
    if variant == "topk":   # the target's 32 largest logits instead of its final state: 04 loads no lm_head
        del batch["final"]
        lm_head = None
        batch["topk_ids"] = torch.randint(0, args.vocab, (b, seq_len, 32), device=device)
        batch["topk_ids"][..., 0] = used.to(device)[torch.randint(0, args.draft_vocab, (b, seq_len), device=device)]
        batch["topk_logits"] = torch.randn(b, seq_len, 32, device=device).sort(-1, descending=True).values.half()
    autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext)
    if variant in ("today", "attention"):
        def step():
            teach = legacy_teacher_targets(batch["final"], lm_head, model.d2t, model.t2d)
            with autocast():
                logits = model.forward_ttt(batch["aux"], batch["input_ids"], args.ttt_steps,
                                           masked_attention=variant == "today")
            return legacy_ttt_loss(logits, teach, batch["loss_mask"])
    else:
        opts = SimpleNamespace(ttt_steps=args.ttt_steps, loss_normalization="supervised", loss="kl")
        ranks = Ranks(device=device)

        def step():
            return train.run_batch(model, lm_head, batch, opts, ranks, autocast)[0]
    return model, step, b * seq_len


def run_variant(args, seq_len: int, variant: str) -> dict:
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    model, step, tokens = make_step(args, seq_len, variant)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    cuda = args.device.startswith("cuda")
    times = []
    for i in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = step()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times[1:])
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"variant": variant, "seq_len": seq_len, "s_per_step": sec, "tokens_per_s": tokens / sec,
            "peak_gb": peak / 2 ** 30, "loss": float(loss), "threads": torch.get_num_threads()}


def part1(args) -> list[dict]:
    """Each variant in its own process, `--rounds` times round-robin (contention on a shared machine
    drifts; interleaving spreads it over the variants); per variant the median step time over rounds
    and the largest peak memory."""
    runs = {}
    for r in range(args.rounds):
        for seq_len in args.seq_len:
            for variant in args.variants:
                cmd = [sys.executable, __file__, *child_flags(args), "--seq-len", str(seq_len), "--variant", variant]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"variant {variant} at T={seq_len} failed")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault((seq_len, variant), []).append(row)
                print(f"  round {r + 1} T={seq_len} {variant:9s} {row['s_per_step']:8.2f} s/step "
                      f"{row['tokens_per_s']:9.1f} tok/s peak {row['peak_gb']:.2f} GB (loss {row['loss']:.3f})",
                      flush=True)
    rows = []
    for (seq_len, variant), rs in runs.items():
        sec = statistics.median(r["s_per_step"] for r in rs)
        rows.append({"variant": variant, "seq_len": seq_len, "s_per_step": sec,
                     "tokens_per_s": args.batch_size * seq_len / sec, "peak_gb": max(r["peak_gb"] for r in rs),
                     "all_s_per_step": [round(r["s_per_step"], 2) for r in rs]})
    return rows


def child_flags(args) -> list[str]:
    flags = ["--hidden", args.hidden, "--heads", args.heads, "--kv-heads", args.kv_heads,
             "--intermediate-size", intermediate_of(args), "--draft-vocab", args.draft_vocab, "--vocab", args.vocab,
             "--batch-size", args.batch_size, "--supervised-share", args.supervised_share,
             "--ttt-steps", args.ttt_steps, "--steps", args.steps, "--device", args.device]
    if args.threads:
        flags += ["--threads", args.threads]
    return [str(f) for f in flags]


# ---- part 2: the 04 stage on synthetic upstream folders ----

def synthetic_work_dir(args, seq_len: int, num_samples: int, root: Path) -> Path:
    """A target folder holding only what 04 reads and 02b/03 folders of random bf16 features (the bench's
    shape: a DeepSeek-V3-like config of args' sizes)."""
    target = synthetic_target(root / "target", {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": args.hidden, "num_attention_heads": args.heads,
        "intermediate_size": intermediate_of(args), "vocab_size": args.vocab, "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "num_hidden_layers": 8, "tie_word_embeddings": False})
    return synthetic_upstream(root / "work", target, seq_len, num_samples, args.draft_vocab, args.supervised_share)


def synthetic_target(target: Path, config: dict, prefix: str = "", device: str = "cpu") -> Path:
    """A target folder holding only what 04 reads: `config` as config.json (text fields at its top level
    or under text_config, as Kimi-K2.5 has them), a tokenizer file, and random bf16 embed_tokens and
    lm_head under `prefix` (Kimi-K2.5: "language_model."), drawn on `device` (fast on a GPU)."""
    import torch
    from safetensors.torch import save_file

    from common.target.head import EMBED_NAME, HEAD_NAME
    text = config.get("text_config") or config
    h, v = text["hidden_size"], text["vocab_size"]
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer_config.json").write_text("{}\n")
    g = torch.Generator(device).manual_seed(0)
    embed = torch.randn(v, h, generator=g, device=device).to(torch.bfloat16).cpu()
    head = (torch.randn(v, h, generator=g, device=device) / h ** 0.5 * 4).to(torch.bfloat16).cpu()
    save_file({prefix + EMBED_NAME: embed, prefix + HEAD_NAME: head}, str(target / "model.safetensors"))
    return target


def synthetic_upstream(work: Path, target: Path, seq_len: int, num_samples: int, draft_vocab: int,
                       supervised_share: float, features=None, device: str = "cpu") -> Path:
    """02b shards of `num_samples` random samples of `seq_len` tokens (the last `supervised_share` of each
    supervised) in feature format `features` (default bf16 + final), and a 03 mapping of `draft_vocab`
    random ids, with manifests as 02b and 03 write them, for `target`. A top-k teacher is computed from
    the random final states by the target's lm_head on `device`, as 02b does."""
    import torch
    from safetensors.torch import save_file

    from common.stage import target_identity, tokenizer_identity, write_manifest
    from common.target.capture import default_capture_points
    from common.target.head import load_target_head, read_target_text_config
    from common.target.shards import FeatureFormat, shard_name, write_shard
    text = read_target_text_config(target)
    h, v, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    features = features or FeatureFormat()
    lm_head = (load_target_head(target, torch.bfloat16, device)[1] if features.teacher == "topk" else None)
    ident = {"tokenizer": tokenizer_identity(target), "target": target_identity(target)}
    hs, g = stage_dir(work, EXTRACT), torch.Generator(device).manual_seed(1)
    per_shard = 4
    for s in range(0, num_samples, per_shard):
        samples = [{"id": f"bench/{i}", "input_ids": torch.randint(0, v, (seq_len,), generator=g, device=device).cpu(),
                    "loss_mask": torch.arange(seq_len) >= round((1 - supervised_share) * seq_len),
                    "aux": torch.randn(seq_len, 3 * h, generator=g, device=device).cpu(),
                    "final": torch.randn(seq_len, h, generator=g, device=device).cpu()}
                   for i in range(s, min(s + per_shard, num_samples))]
        write_shard(hs / shard_name(s // per_shard), samples, features=features, lm_head=lm_head)
    write_manifest(hs, EXTRACT, argparse.Namespace(),
                   capture_points=default_capture_points(layers), hidden_size=h, num_hidden_layers=layers,
                   vocab_size=v, feature_format=features.as_dict(), **ident)
    d2t, t2d = random_vocab_mapping(v, draft_vocab, torch.Generator().manual_seed(2))
    vocab_dir = stage_dir(work, VOCAB)
    vocab_dir.mkdir()
    save_file({"d2t": d2t, "t2d": t2d}, str(vocab_dir / "vocab_mapping.safetensors"))
    write_manifest(vocab_dir, VOCAB, argparse.Namespace(), draft_vocab_size=draft_vocab,
                   vocab_size=v, **ident)
    return work


def run_stage(args, work: Path, seq_len: int, samples_per_step: int, prefetch: int, nproc: int,
              threads: int) -> dict:
    """04 on `work` for --stage-steps steps; (median ms/step after the first, tokens/s, peak RSS)."""
    import shutil
    shutil.rmtree(stage_dir(work, TRAIN), ignore_errors=True)
    flags = ["--work-dir", str(work), "--device", "cpu", "--precision", "bf16", "--ttt-steps", str(args.ttt_steps),
             "--batch-tokens", str(samples_per_step * seq_len), "--max-seq-len", str(seq_len),
             "--eval-fraction", "0", "--num-epochs", "1", "--max-steps", str(args.stage_steps + 1), "--log-every", "1",
             "--eval-every", "100000", "--save-every", "100000", "--prefetch-batches", str(prefetch),
             "--draft-num-attention-heads", str(args.heads), "--draft-num-key-value-heads", str(args.kv_heads),
             "--stop-at-step", str(args.stage_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if nproc == 1:
        cmd = [sys.executable, str(REPO / stage_script(TRAIN)), *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / stage_script(TRAIN)), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        print(output[-4000:], file=sys.stderr)
        raise SystemExit(f"04 failed: {' '.join(cmd)}")
    rows = [json.loads(line) for line in (stage_dir(work, TRAIN) / "train_log.jsonl").read_text().splitlines()]
    ms = statistics.median(r["ms_per_step"] for r in rows if r["split"] == "train" and r["step"] > 1)
    return {"ms_per_step": ms, "tokens_per_s": samples_per_step * seq_len / ms * 1000,
            "peak_gb": usage.ru_maxrss * 1024 / 2 ** 30}


def load_ms(work: Path, seq_len: int) -> float:
    """Median ms to read and collate one sample from the synthetic shards: the work the prefetch thread
    takes off the training loop (here from the page cache; from a disk it is larger)."""
    from common.target.shards import list_shards
    from common.training.data import ShardData, load_batch
    data = ShardData(list_shards(stage_dir(work, EXTRACT)))
    lengths = [e[2] for e in data.entries]
    times = []
    for i in range(len(lengths)):
        t0 = time.perf_counter()
        load_batch(data, [i], lengths, seq_len)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def part2(args) -> list[dict]:
    rows = []
    seq_len, cores = args.seq_len[0], args.threads or os.cpu_count()
    with tempfile.TemporaryDirectory(prefix="bench04_") as tmp:
        work = synthetic_work_dir(args, seq_len, 2 * args.stage_steps + 2, Path(tmp))
        print(f"  read + collate one sample: {load_ms(work, seq_len):.1f} ms (median; page cache)")
        for name, per_step, prefetch, nproc, threads in (
                ("1 sample/step, read in the loop", 1, 0, 1, cores),
                ("1 sample/step, prefetch thread", 1, 2, 1, cores),
                (f"2 samples/step, 1 process x {cores} threads", 2, 2, 1, cores),
                ("2 samples/step, 1 process x 1 thread", 2, 2, 1, 1),
                (f"2 samples/step, {cores} processes x 1 thread", 2, 2, cores, 1)):
            r = run_stage(args, work, seq_len, per_step, prefetch, nproc, threads)
            rows.append({"run": name, **r})
            print(f"  {name:42s} {r['ms_per_step'] / 1000:8.2f} s/step {r['tokens_per_s']:9.1f} tok/s "
                  f"peak RSS {r['peak_gb']:.2f} GB", flush=True)
    return rows


def main(argv=None):
    args = build_parser().parse_args(argv)
    # Defaults by device: a scaled Kimi-like draft on a CPU, Kimi-K2.5's real draft shape on a GPU.
    cpu = args.device == "cpu"
    for key, on_cpu, on_gpu in (("hidden", 1024, 7168), ("heads", 8, 56), ("kv_heads", 8, 8),
                                ("seq_len", [2048], [4096, 8192, 16384])):
        if getattr(args, key) is None:
            setattr(args, key, on_cpu if cpu else on_gpu)
    if args.variants is None:
        args.variants = list(VARIANTS) if args.device == "cpu" else ["today", "bf16", "topk"]
    if args.variant:
        print(json.dumps(run_variant(args, args.seq_len[0], args.variant)))
        return
    print(f"04 step benchmark: H {args.hidden}, heads {args.heads}/{args.kv_heads}, MLP {intermediate_of(args)}, "
          f"Dv {args.draft_vocab}, V {args.vocab}, TTT {args.ttt_steps}, {args.batch_size} sample(s) of T "
          f"{args.seq_len} per step, supervised share {args.supervised_share}, device {args.device}, "
          f"{args.rounds} rounds of 1 warm-up + {args.steps} measured step(s), torch threads {args.threads or 'default'}")
    if not args.no_step:
        print("part 1: optimizer steps, one process per variant and round")
        rows = part1(args)
        print("  variant    T      s/step  tokens/s  peak GB  speed-up vs today  (s/step of each round)")
        for seq_len in args.seq_len:
            base = next((r for r in rows if r["seq_len"] == seq_len and r["variant"] == "today"), None)
            for r in (r for r in rows if r["seq_len"] == seq_len):
                up = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
                print(f"  {r['variant']:9s} {seq_len:6d} {r['s_per_step']:8.2f} {r['tokens_per_s']:9.1f} "
                      f"{r['peak_gb']:8.2f}  {up:>17s}  {r['all_s_per_step']}")
    if not args.no_stage and args.device == "cpu":
        print(f"part 2: 04_train.py on synthetic shards (bf16, T {args.seq_len[0]}, {args.stage_steps} steps, "
              "median ms/step from its log after the first step)")
        part2(args)


if __name__ == "__main__":
    main()
