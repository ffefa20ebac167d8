"""Train the EAGLE-3 draft on the stored target hidden states (training-time test), export for SGLang.

The draft (common/draft/model.py) learns, at every position t and TTT step k, the target's distribution at
t+1+k restricted to the draft vocab, from fc(target features at t) (step 0) or its own previous output,
plus the ground-truth token t+1+k. The teacher is the target's lm_head over the stored final hidden
state; only the target's embedding and lm_head are read (common/draft/target_head.py). Samples are streamed
shard by shard in a seeded order and packed into batches by a token budget. Checkpoints hold weights,
optimizer, scheduler, RNG and the data cursor; a re-run resumes from the newest complete one.
Reads:  <work-dir>/02b_hidden_states/shard_*.safetensors (+ manifest.json),
        <work-dir>/03_vocab/vocab_mapping.safetensors (+ manifest.json), the target (02b manifest)
Writes: <work-dir>/04_draft/checkpoints/step_NNNNNN/, train_log.jsonl, export_sglang/,
        export_speculators/ (vLLM speculators layout), manifest.json
Real:   python 04_train.py --config configs/kimi-k2.5.yaml --work-dir /data/eagle3
Tiny:   python 04_train.py --config configs/tiny.yaml --work-dir runs/tiny
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections import OrderedDict
from pathlib import Path

from common.config import base_parser, parse_args
from common.io import JsonlAppender, iter_jsonl, write_json, write_jsonl
from common.stage import (StageError, check_same_tokenizer, manifest_sha256, require_complete,
                          resolve_target, stage_dir, start_stage, write_manifest)

STAGE = "04_train"
CKPT_MARKER = "COMPLETE"
# Flags whose change makes a checkpoint's data cursor or schedule meaningless: resume refuses them.
PLAN_KEYS = ("seed", "batch_tokens", "max_seq_len", "eval_fraction", "num_epochs", "max_steps",
             "ttt_steps", "learning_rate", "warmup_ratio", "draft_num_attention_heads",
             "draft_num_key_value_heads", "draft_intermediate_size")


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("train")
    g.add_argument("--target-path", type=Path, default=None,
                   help="optional: the target model folder; refused if it differs from the 02b one")
    g.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll depth (steps)")
    g.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW peak learning rate")
    g.add_argument("--num-epochs", type=int, default=10, help="passes over the training samples")
    g.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps (the schedule ends there)")
    g.add_argument("--warmup-ratio", type=float, default=0.015, help="share of steps with linear warmup")
    g.add_argument("--grad-clip", type=float, default=0.5, help="global gradient-norm clip")
    g.add_argument("--batch-tokens", type=int, default=4096, help="token budget per batch (padded tokens)")
    g.add_argument("--max-seq-len", type=int, default=4096,
                   help="longest sample used (tokens); 01c drops longer ones, 04 truncates any left")
    g.add_argument("--eval-fraction", type=float, default=0.02,
                   help="share of samples held out for eval, chosen by a hash of the sample id")
    g.add_argument("--eval-every", type=int, default=500, help="held-out eval interval (steps)")
    g.add_argument("--save-every", type=int, default=1000, help="checkpoint interval (steps)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (>= 2)")
    g.add_argument("--log-every", type=int, default=10, help="log interval (steps)")
    g.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and stop at this step without exporting (time-boxed jobs); re-run to go on")
    g.add_argument("--draft-num-attention-heads", type=int, default=None,
                   help="draft attention heads (default: the target's; head_dim = hidden / heads)")
    g.add_argument("--draft-num-key-value-heads", type=int, default=None,
                   help="draft KV heads (default: min(8, heads) when it divides heads, else heads)")
    g.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="draft MLP width (default: the target's dense intermediate_size)")
    g.add_argument("--seed", type=int, default=0, help="seed of the init and the data order")
    g.add_argument("--device", default=None, help="cpu|cuda (default: cuda if available)")
    return p


# ---- data: index, held-out split, seeded shard-by-shard order, token-budget batches ----

def is_eval(sample_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 2 ** 32 < fraction


class ShardData:
    """Sample-level access to all 02b shards, keeping at most `max_open` shards open."""

    def __init__(self, shard_dir: Path, names: list[str], max_open: int = 32):
        from common.draft.shards import ShardReader

        self._open = ShardReader
        self.paths = [shard_dir / n for n in names]
        self.entries = []  # (shard index, index in shard, length, sample id)
        for si, path in enumerate(self.paths):
            shard = self._open(path)
            lengths = (shard.offsets[1:] - shard.offsets[:-1]).tolist()
            self.entries += [(si, i, n, sid) for i, (n, sid) in enumerate(zip(lengths, shard.sample_ids))]
        self.readers, self.max_open = OrderedDict(), max_open

    def _reader(self, si: int):
        if si not in self.readers:
            if len(self.readers) >= self.max_open:
                self.readers.popitem(last=False)
            self.readers[si] = self._open(self.paths[si])
        self.readers.move_to_end(si)
        return self.readers[si]

    def sample(self, i: int, max_len: int) -> dict:
        si, j, _, _ = self.entries[i]
        return self._reader(si).sample(j, max_len)


def epoch_order(entries: list, idx: list[int], seed: int, epoch: int) -> list[int]:
    """Seeded order of sample indices: shards in random order, samples shuffled within each shard
    (so reading stays local to one shard at a time)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    by_shard: dict[int, list[int]] = {}
    for i in idx:
        by_shard.setdefault(entries[i][0], []).append(i)
    order = []
    for si in rng.sample(sorted(by_shard), len(by_shard)):
        group = by_shard[si][:]
        rng.shuffle(group)
        order += group
    return order


def make_batches(order: list[int], lengths: list[int], batch_tokens: int, max_len: int) -> list[list[int]]:
    """Greedy packing in order: a batch grows while (samples x longest) stays within the budget."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(lengths[i], max_len)
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def collate(data: ShardData, batch: list[int], max_len: int, device):
    """Right-padded tensors: aux [B, T, 3H], final [B, T, H], input_ids [B, T], loss_mask [B, T]."""
    import torch
    samples = [data.sample(i, max_len) for i in batch]
    t = max(len(s["input_ids"]) for s in samples)
    out = {"aux": torch.zeros(len(batch), t, samples[0]["aux"].shape[1], dtype=samples[0]["aux"].dtype),
           "final": torch.zeros(len(batch), t, samples[0]["final"].shape[1], dtype=samples[0]["final"].dtype),
           "input_ids": torch.zeros(len(batch), t, dtype=torch.int64),
           "loss_mask": torch.zeros(len(batch), t, dtype=torch.bool)}
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        out["aux"][r, :n], out["final"][r, :n] = s["aux"], s["final"]
        out["input_ids"][r, :n], out["loss_mask"][r, :n] = s["input_ids"], s["loss_mask"].bool()
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}


# ---- checkpoints: step_NNNNNN/ counts only with its COMPLETE marker ----

def complete_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if (p / CKPT_MARKER).is_file())


def save_checkpoint(root: Path, step: int, model, opt, sched, cursor: dict, plan: dict, keep: int) -> Path:
    import torch
    path = root / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    torch.save(model.trainable_state_dict(), path / "model.pt")
    torch.save(opt.state_dict(), path / "optimizer.pt")
    torch.save(sched.state_dict(), path / "scheduler.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, path / "rng.pt")
    write_json(path / "state.json", {"step": step, "cursor": cursor, "plan": plan})
    (path / CKPT_MARKER).write_text("ok\n")          # last: the folder counts from now on
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.glob("step_*"):                 # incomplete leftovers of a killed save
        if not (stale / CKPT_MARKER).is_file() and stale != path:
            shutil.rmtree(stale)
    return path


def load_checkpoint(path: Path, model, opt, sched, device) -> dict:
    import torch
    missing, unexpected = model.load_state_dict(torch.load(path / "model.pt", map_location=device), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    opt.load_state_dict(torch.load(path / "optimizer.pt", map_location=device))
    sched.load_state_dict(torch.load(path / "scheduler.pt"))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())


def cosine_with_warmup(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


# ---- one batch: teacher, TTT unroll, loss ----

def run_batch(model, lm_head, batch: dict, ttt_steps: int, autocast):
    from common.draft.loss import teacher_targets, ttt_loss
    teach = teacher_targets(batch["final"], lm_head, model.d2t, model.t2d)
    with autocast():
        logits = model.forward_ttt(batch["aux"], batch["input_ids"], ttt_steps)
    return ttt_loss(logits, teach, batch["loss_mask"])


def evaluate(model, lm_head, data, batches, args, device, autocast) -> dict | None:
    import torch
    from common.draft.loss import TTTMeter
    if not batches:
        return None
    meter = TTTMeter(args.ttt_steps)
    model.eval()
    with torch.no_grad():
        for b in batches:
            _, stats = run_batch(model, lm_head, collate(data, b, args.max_seq_len, device), args.ttt_steps, autocast)
            meter.add(stats)
    model.train()
    return meter.summary()


def fmt(summary: dict) -> str:
    return (f"loss {summary['loss'][0]:.3f} | acc " + "/".join(f"{a:.2f}" for a in summary["acc"])
            + f" | tau {summary['tau']:.2f}")


def load_inputs(args) -> dict:
    """The 02b and 03 manifests (same tokenizer), their folders and the target folder."""
    hs_dir = stage_dir(args.work_dir, "02b_extract_hidden_states_sglang")
    vocab_dir = stage_dir(args.work_dir, "03_build_vocab_mapping")
    m02 = require_complete(hs_dir, "02b_extract_hidden_states_sglang")
    m03 = require_complete(vocab_dir, "03_build_vocab_mapping")
    check_same_tokenizer(m02["tokenizer"], m03["tokenizer"], vocab_dir, "03_build_vocab_mapping")
    target_path = resolve_target(args.target_path, m02, hs_dir, "02b_extract_hidden_states_sglang")
    return {"hs_dir": hs_dir, "vocab_dir": vocab_dir, "m02": m02, "m03": m03, "target_path": target_path}


def build_draft(args, inputs: dict, device):
    """The draft (seeded init, frozen target embedding, d2t/t2d) and the target's lm_head, on `device`.
    Refuses when the target, 02b and 03 disagree on hidden size or vocabulary."""
    import torch
    from safetensors.torch import load_file

    from common.draft.model import Eagle3DraftModel, draft_config
    from common.draft.target_head import load_target_head, read_target_text_config

    on_gpu = device.type == "cuda"
    target_path, m02 = inputs["target_path"], inputs["m02"]
    tcfg = read_target_text_config(target_path)
    mapping = load_file(str(inputs["vocab_dir"] / "vocab_mapping.safetensors"))
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    embed, lm_head = load_target_head(target_path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    hidden, points = int(m02["hidden_size"]), [int(p) for p in m02["capture_points"]]
    if not (embed.shape[1] == hidden == tcfg["hidden_size"] and lm_head.shape[0] == t2d.shape[0] == tcfg["vocab_size"]):
        raise StageError(f"shapes disagree: 02b hidden {hidden}, target config hidden {tcfg['hidden_size']} "
                         f"vocab {tcfg['vocab_size']}, embedding {tuple(embed.shape)}, t2d {tuple(t2d.shape)}: "
                         "re-run 02b/03 for this target")
    cfg = draft_config(tcfg, int(inputs["m03"]["draft_vocab_size"]), args.draft_num_attention_heads,
                       args.draft_num_key_value_heads, args.draft_intermediate_size)
    torch.manual_seed(args.seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
    model.set_vocab_mapping(d2t, t2d)
    model.to(device)
    if on_gpu:
        model.embed_tokens.to(torch.bfloat16)  # frozen: no fp32 master copy needed
    print(f"[04] target {target_path} (hidden {hidden}, vocab {cfg['vocab_size']}, capture points {points}); "
          f"draft {json.dumps(cfg)}; device {device}")
    return model, lm_head.to(device), cfg


def plan_data(args, hs_dir: Path) -> dict:
    """The held-out split (by sample-id hash) and every epoch's batches, fixed by the seed."""
    from common.draft.shards import list_shards

    data = ShardData(hs_dir, [p.name for p in list_shards(hs_dir)])
    lengths = [e[2] for e in data.entries]
    eval_idx = [i for i, e in enumerate(data.entries) if is_eval(e[3], args.eval_fraction)]
    held = set(eval_idx)
    train_idx = [i for i in range(len(data.entries)) if i not in held]
    if not train_idx:
        raise StageError(f"no training samples in {hs_dir} after holding out {len(eval_idx)} for eval")
    epochs = [make_batches(epoch_order(data.entries, train_idx, args.seed, e), lengths,
                           args.batch_tokens, args.max_seq_len) for e in range(args.num_epochs)]
    total = sum(len(e) for e in epochs)
    total = min(total, args.max_steps) if args.max_steps else total
    eval_batches = make_batches(sorted(eval_idx), lengths, args.batch_tokens, args.max_seq_len)
    print(f"[04] {len(train_idx)} train / {len(eval_idx)} eval samples, {total} steps "
          f"({args.num_epochs} epochs of ~{len(epochs[0])} batches, budget {args.batch_tokens} tokens)")
    return {"data": data, "lengths": lengths, "epochs": epochs, "total": total, "eval_batches": eval_batches,
            "num_train": len(train_idx), "num_eval": len(eval_idx)}


def resume(ckpt_root: Path, log_path: Path, plan: dict, model, opt, sched, device) -> tuple[int, dict]:
    """(step, data cursor) of the newest complete checkpoint, its state loaded, or a fresh start.
    Refuses a checkpoint made with other PLAN_KEYS; drops log rows written after it."""
    step, cursor = 0, {"epoch": 0, "batch": 0, "position": 0}
    done = complete_checkpoints(ckpt_root)
    if done:
        state = json.loads((done[-1] / "state.json").read_text())
        if state["plan"] != plan:
            changed = sorted(k for k in plan if state["plan"].get(k) != plan[k])
            raise StageError(f"{done[-1]} was made with other settings ({', '.join(changed)}); "
                             "use the same flags to resume, or --overwrite to start over")
        state = load_checkpoint(done[-1], model, opt, sched, device)
        step, cursor = state["step"], state["cursor"]
        print(f"[04] resumed from {done[-1]} (step {step}, epoch {cursor['epoch']}, batch {cursor['batch']})")
    if log_path.exists():
        write_jsonl(log_path, [r for r in iter_jsonl(log_path) if r["step"] <= step])
    return step, cursor


def train_loop(args, model, lm_head, opt, sched, params, dp: dict, step: int, cursor: dict, plan: dict,
               out: Path, device, autocast) -> tuple[int, dict | None]:
    """The loop, fresh and resumed runs alike: (last step, final eval or None when stopped early)."""
    import torch
    from tqdm import tqdm

    from common.draft.loss import TTTMeter

    data, lengths, epochs, total = dp["data"], dp["lengths"], dp["epochs"], dp["total"]
    ckpt_root, log_path = out / "checkpoints", out / "train_log.jsonl"
    model.train()
    meter, interval_tokens, t_interval, t_start = TTTMeter(args.ttt_steps), 0, time.time(), time.time()
    start_step = last_log = step
    stop_at = min(total, args.stop_at_step) if args.stop_at_step else total
    bar = tqdm(total=total, initial=step, desc="04 train", unit="step", disable=None)
    with JsonlAppender(log_path) as log:
        epoch, bi = cursor["epoch"], cursor["batch"]
        while step < stop_at:
            if bi >= len(epochs[epoch]):
                epoch, bi = epoch + 1, 0
                continue
            idx = epochs[epoch][bi]
            batch = collate(data, idx, args.max_seq_len, device)
            loss, stats = run_batch(model, lm_head, batch, args.ttt_steps, autocast)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            sched.step()
            step, bi = step + 1, bi + 1
            meter.add(stats)
            interval_tokens += sum(min(lengths[i], args.max_seq_len) for i in idx)  # real tokens
            bar.update(1)
            cursor = {"epoch": epoch, "batch": bi,
                      "position": sum(len(b) for b in epochs[epoch][:bi])}
            if step % args.log_every == 0 or step == stop_at:
                s, dt = meter.summary(), time.time() - t_interval
                elapsed = time.time() - t_start
                eta = elapsed / (step - start_step) * (total - step)
                row = {"step": step, "split": "train", "epoch": epoch, **s,
                       "lr": sched.get_last_lr()[0], "grad_norm": float(grad_norm),
                       "tokens_per_s": interval_tokens / max(dt, 1e-9),
                       "ms_per_step": 1000 * dt / (step - last_log), "eta_s": eta}
                log.write(row)
                tqdm.write(f"step {step}/{total} | {fmt(s)} | lr {row['lr']:.2e} | "
                           f"{row['ms_per_step']:.0f} ms | {row['tokens_per_s']:.0f} tok/s | eta {eta / 60:.1f} m")
                meter, interval_tokens, t_interval = TTTMeter(args.ttt_steps), 0, time.time()
                last_log = step
            if step % args.eval_every == 0 and step < total:
                ev = evaluate(model, lm_head, data, dp["eval_batches"], args, device, autocast)
                if ev:
                    log.write({"step": step, "split": "eval", **ev})
                    tqdm.write(f"eval step {step} | {fmt(ev)}")
            if step % args.save_every == 0 or step == stop_at:
                save_checkpoint(ckpt_root, step, model, opt, sched, cursor, plan, args.keep_checkpoints)
        bar.close()
        if step < total:
            return step, None
        final_eval = evaluate(model, lm_head, data, dp["eval_batches"], args, device, autocast)
        if final_eval:
            log.write({"step": step, "split": "eval", **final_eval})
            print(f"[04] final eval | {fmt(final_eval)}")
    return step, final_eval


def export(args, model, cfg: dict, inputs: dict, dp: dict, final_eval: dict | None, out: Path) -> None:
    """The SGLang and speculators folders, then the manifest (last: it marks the stage complete)."""
    from common.draft.export_speculators import export_speculators
    from common.draft.model import export_sglang

    m02, target_path = inputs["m02"], inputs["target_path"]
    points = [int(p) for p in m02["capture_points"]]
    export_dir = export_sglang(model, out / "export_sglang", points)
    spec_dir = export_speculators(export_dir, out / "export_speculators", points, target_path,
                                  json.loads((Path(target_path) / "config.json").read_text()).get("architectures", []))
    write_manifest(out, STAGE, args, draft_config=cfg, capture_points=points,
                   draft_vocab_size=cfg["draft_vocab_size"], vocab_size=cfg["vocab_size"],
                   num_steps=dp["total"], num_train_samples=dp["num_train"], num_eval_samples=dp["num_eval"],
                   final_eval=final_eval, export_dir=str(export_dir), export_speculators_dir=str(spec_dir),
                   tokenizer=m02["tokenizer"], target=m02["target"],
                   inputs={"02b_hidden_states/manifest.json": manifest_sha256(inputs["hs_dir"]),
                           "03_vocab/manifest.json": manifest_sha256(inputs["vocab_dir"])})
    print(f"[04] exported {export_dir}")


def main(argv=None):
    args = parse_args(build_parser(), argv)
    import contextlib

    import torch

    if args.keep_checkpoints < 2:
        raise StageError("--keep-checkpoints must be >= 2 (never overwrite the only good checkpoint)")
    out = stage_dir(args.work_dir, STAGE)
    inputs = load_inputs(args)
    if args.overwrite and out.exists() and not (out / "manifest.json").exists():
        shutil.rmtree(out)     # --overwrite also drops the checkpoints of an unfinished run
    if not start_stage(out, args.overwrite, "04"):
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)

    model, lm_head, cfg = build_draft(args, inputs, device)
    dp = plan_data(args, inputs["hs_dir"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, round(args.warmup_ratio * dp["total"]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(warmup, dp["total"]))
    plan = {k: getattr(args, k) for k in PLAN_KEYS}

    step, cursor = resume(out / "checkpoints", out / "train_log.jsonl", plan, model, opt, sched, device)
    step, final_eval = train_loop(args, model, lm_head, opt, sched, params, dp, step, cursor, plan,
                                  out, device, autocast)
    if step < dp["total"]:
        print(f"[04] stopped at step {step} of {dp['total']} (--stop-at-step); re-run to resume")
        return
    export(args, model, cfg, inputs, dp, final_eval, out)


if __name__ == "__main__":
    main()
