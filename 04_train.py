"""Train the EAGLE-3 draft on the stored target hidden states (training-time test), export for SGLang.

Reads:  <work-dir>/02b_hidden_states/shard_*.safetensors (+ manifest.json),
        <work-dir>/03_vocab/vocab_mapping.safetensors (+ manifest.json), the target (02b manifest)
Writes: <work-dir>/04_draft/checkpoints/step_NNNNNN/, train_log.jsonl, train_curves.png, export_sglang/,
        export_speculators/ (vLLM speculators layout; none for an MLA draft), manifest.json
Real:   torchrun --nproc_per_node 8 04_train.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3
Tiny:   python 04_train.py --config configs/tiny.yaml --work-dir runs/tiny

The draft (common/draft/model.py) learns, at every position t and TTT step k, the target's distribution at
t+1+k over the draft vocab, from fc(target features at t) (step 0) or its own previous output, plus the
true token t+1+k. The teacher (common/training/teacher.py) follows 02b's feature format: the stored top-k
logits (the Kimi preset) or the target's lm_head over the stored final state. Samples stream shard by
shard in a seeded order, packed into batches by a token budget (common/training/data.py). Under torchrun
each rank reads a disjoint slice of every batch (DDP, optionally ZeRO-1) and rank 0 alone writes.
Checkpoints hold weights, optimizer, schedule, RNG and the data cursor: a re-run resumes from the newest
complete one whose files match its marker's sizes and sha256, on any number of processes
(common/training/checkpoints.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from common.config import base_parser, parse_args
from common.draft.export_sglang import export_sglang
from common.draft.export_speculators import export_speculators
from common.draft.imported import ImportedDraft, check_draft, read_draft
from common.draft.model import ATTENTIONS, Eagle3DraftModel, draft_config
from common.io import JsonlAppender, iter_jsonl, write_jsonl
from common.stage import (EXTRACT, MERGE, StageError, TRAIN, VOCAB, check_same_tokenizer, file_digests,
                          input_manifests, resolve_target, stage_dir, start_stage, write_manifest)
from common.target.capture import sglang_points_reader, target_architecture
from common.target.head import load_target_head, read_target_text_config
from common.target.manifests import HiddenStatesManifest, VocabManifest
from common.target.shards import list_shards
from common.training.checkpoints import complete_checkpoints, load_checkpoint, newest_verified, save_checkpoint
from common.training.data import (Prefetcher, ShardData, epoch_order, is_eval, load_batch, local_batches,
                                  make_batches, schedule, to_device)
from common.training.distributed import (Ranks, all_max, all_sum, barrier, broadcast_flag, make_optimizer,
                                         optimizer_state, setup, shard_optimizer_wanted, teardown, unwrap, wrap_model)
from common.training.loss import OBJECTIVES, TTTMeter, ttt_loss
from common.training.plot import plot_training_curves
from common.training.precision import choose_bf16
from common.training.selection import (candidate_steps, choose_candidate, drop_candidates, save_candidate,
                                       selection_tau, step0_candidate)
from common.training.teacher import step_counts, teacher_from_topk, teacher_targets
from common.training.warm_start import VOCAB_MODES, WarmStart, anchors, l2sp_penalty, warm_start_model

STAGE = TRAIN
PLAN = "(resume refuses a change)"   # in a group's title: its flags are the plan a checkpoint was made with


class PlanGroup:
    """An argument group whose flags are the plan: a checkpoint's data cursor, schedule or weights mean nothing
    under other values of them, so resume refuses a change. Each flag added is recorded in the parser's
    `plan_keys` (plan_keys)."""

    def __init__(self, parser, title: str):
        self.group = parser.add_argument_group(f"{title} {PLAN}")
        self.keys = vars(parser).setdefault("plan_keys", [])

    def add_argument(self, *names, **kw):
        action = self.group.add_argument(*names, **kw)
        self.keys.append(action.dest)
        return action


def build_parser():
    p = base_parser(__doc__)
    d = PlanGroup(p, "draft shape and init")
    d.add_argument("--draft-attention", choices=ATTENTIONS, default="mha",
                   help="the draft layer's attention: mha = Llama multi-head attention (LlamaForCausalLMEagle3); "
                        "mla = DeepSeek-V2 multi-head latent attention (Eagle3DeepseekV2ForCausalLM, the public "
                        "K2.5 MLA drafts' form: a latent KV cache of kv_lora + qk_rope values per token); its "
                        "dims are the target's when the target is MLA, else common/draft/model.py mla_dims")
    d.add_argument("--fc-norm", action="store_true",
                   help="EAGLE-3.1: an RMSNorm on each captured target state before fc")
    d.add_argument("--norm-output", action="store_true",
                   help="EAGLE-3.1: the next draft step reads the post-norm hidden state (default: pre-norm)")
    d.add_argument("--draft-num-attention-heads", type=int, default=None,
                   help="draft attention heads (default: the target's; head_dim = hidden / heads)")
    d.add_argument("--draft-num-key-value-heads", type=int, default=None,
                   help="draft KV heads (default: min(8, heads) when it divides heads, else heads)")
    d.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="draft MLP width (default: the target's dense intermediate_size)")
    d.add_argument("--init-scheme", choices=("default", "normal"), default="default",
                   help="weights of a from-scratch draft's linear layers: PyTorch's default or normal(0, --init-std)")
    d.add_argument("--init-std", type=float, default=0.02, help="std of --init-scheme normal")
    d.add_argument("--train-seed", type=int, default=0, help="seed of the init and the data order")
    r = PlanGroup(p, "recipe")
    r.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll depth (steps)")
    r.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW peak learning rate")
    r.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.95], metavar=("BETA1", "BETA2"),
                   help="AdamW betas")
    r.add_argument("--grad-clip", type=float, default=0.5, help="global gradient-norm clip")
    r.add_argument("--loss-normalization", choices=("supervised", "batch"), default="supervised",
                   help="divide each TTT step's summed soft-CE by its supervised positions, or by samples x "
                        "padded length of the batch (B*T, as SpecForge)")
    r.add_argument("--loss", choices=OBJECTIVES, default="kl",
                   help="per-position TTT objective: kl = soft cross-entropy against the teacher (EAGLE); the LK "
                        "losses of arXiv 2602.23881 target the acceptance rate alpha = sum_v min(p, q) directly: "
                        "lk_alpha = -log alpha, lk_lambda = lam*KL + (1-lam)*(1-alpha), lam = exp(-3 * mean "
                        "alpha) per step (common/training/loss.py)")
    s = PlanGroup(p, "data and schedule")
    s.add_argument("--num-epochs", type=int, default=10, help="passes over the training samples")
    s.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps (the schedule ends there)")
    s.add_argument("--max-train-samples", type=int, default=None,
                   help="train on this many samples only (count), chosen by a seeded hash of the sample id, so "
                        "smaller sets are subsets of larger ones (data-scaling curves, ablations)")
    s.add_argument("--warmup-ratio", type=float, default=0.015, help="share of steps with linear warmup")
    s.add_argument("--batch-tokens", type=int, default=4096,
                   help="token budget per batch = optimizer step, all ranks together (samples x longest)")
    s.add_argument("--max-samples-per-batch", type=int, default=None,
                   help="cap on samples per batch besides the token budget (1 = one sample per step)")
    s.add_argument("--max-seq-len", type=int, default=4096,
                   help="longest sample used (tokens); 01c drops longer ones, 04 truncates any left")
    s.add_argument("--eval-fraction", type=float, default=0.02,
                   help="share of samples held out for eval, chosen by a hash of the sample id")
    w = PlanGroup(p, "warm start and checkpoint selection (docs/design.md section 12)")
    w.add_argument("--init-from", type=Path, default=None,
                   help="fine-tune this EAGLE-3 draft (SGLang layout, e.g. a public Kimi draft or 04's "
                        "export_sglang/, or the speculators layout); checked against the target and the 02b "
                        "capture points first; the draft's shape and form are the imported one's (--draft-*, "
                        "--fc-norm and --norm-output unused)")
    w.add_argument("--init-vocab", choices=VOCAB_MODES, default="keep",
                   help="with --init-from: keep the imported draft vocab (d2t/t2d), or map its lm_head rows "
                        "onto 03's draft vocab by target token id (missing rows start as the mean row)")
    w.add_argument("--l2sp-weight", type=float, default=0.0,
                   help="with --init-from: loss += weight * sum ||w - w_init||^2 over the trainable weights "
                        "(L2-SP; 0 = off)")
    w.add_argument("--candidates-per-epoch", type=int, default=0,
                   help="keep a candidate this many times per epoch (and at the last step), judge each by "
                        "replay tau on the held-out selection split and export the best (0 = export the last)")
    w.add_argument("--select-num-draft-tokens", type=int, default=3,
                   help="chain length k of the selection's replay tau (the served setting: 3 = SGLang 3,1,4)")
    c = p.add_argument_group("checkpoints and logging")
    c.add_argument("--eval-every", type=int, default=500, help="held-out eval interval (steps)")
    c.add_argument("--save-every", type=int, default=1000, help="checkpoint interval (steps)")
    c.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (>= 2)")
    c.add_argument("--log-every", type=int, default=10, help="log interval (steps)")
    c.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and stop at this step without exporting (time-boxed jobs); re-run to go on")
    rt = p.add_argument_group("runtime")
    rt.add_argument("--target-path", type=Path, default=None,
                    help="optional: the target model folder; refused if it differs from the 02b one")
    rt.add_argument("--device", default=None,
                    help="cpu|cuda (default: cuda if available; torchrun: one GPU per rank)")
    rt.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="bf16: autocast matmuls and attention over fp32 master weights, bf16 teacher head; "
                         "auto = bf16 on CUDA, and on a CPU whose bf16 GEMM is measured fast at start-up "
                         "(common/training/precision.py), else fp32")
    rt.add_argument("--prefetch-batches", type=int, default=2,
                    help="batches read and collated ahead on a background thread (0 = read in the loop)")
    rt.add_argument("--shard-optimizer", choices=("auto", "on", "off"), default="auto",
                    help="ZeRO-1 AdamW state sharding under torchrun; auto = on when the fp32 weights, grads and "
                         "moments would take > 15%% of one GPU")
    return p


def plan_keys(parser) -> tuple[str, ...]:
    """The flags of the PlanGroups (a flag added to such a group is covered)."""
    return tuple(parser.plan_keys)


PLAN_KEYS = plan_keys(build_parser())
PLAN_DEFAULTS = {k: build_parser().get_default(k) for k in PLAN_KEYS}
# Plan keys a checkpoint of an older 04 holds under another name, compared under today's: its state.json
# is sha256-checked by its marker, so it cannot be edited, and refusing it would throw away its steps.
RENAMED_PLAN_KEYS = {"init": "init_scheme"}


def cosine_with_warmup(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


# ---- one batch: teacher, TTT unroll, loss ----

def run_batch(model, lm_head, batch: dict, args, ranks, autocast):
    """(loss to backpropagate, per-step stats) of one batch on this rank. The loss is scaled so that
    DDP's average over ranks is the gradient of the whole global batch's loss."""
    core, mask, k = unwrap(model), batch["loss_mask"], args.ttt_steps
    if "final" in batch:   # 02b feature format teacher "final": the target's lm_head over its last state
        teach = teacher_targets(batch["final"], lm_head, core.d2t, core.t2d, mask)
    else:                  # teacher "topk": the target's stored top-k logits
        teach = teacher_from_topk(batch["topk_ids"], batch["topk_logits"], core.d2t, core.t2d, mask)
    if args.loss_normalization == "supervised":
        denominators = all_sum(step_counts(teach, k), ranks).clamp(min=1)
    else:  # B*T of the global batch: all its samples, padded to its longest
        b = all_sum(torch.tensor(batch["num_samples"], device=mask.device), ranks)
        denominators = (b * all_max(torch.tensor(mask.shape[1], device=mask.device), ranks)).expand(k)
    with autocast():
        hidden = model(batch["aux"], batch["input_ids"], k, start=batch.get("start"))
        loss, stats = ttt_loss(hidden, core.logits, teach, mask, denominators.float(),
                               objective=args.loss,
                               reduce=lambda x: all_sum(x, ranks))     # lk_lambda's lam: the global batch's
    return loss * ranks.world, stats


def evaluate(model, lm_head, data, batches, args, ranks, autocast) -> dict | None:
    """Held-out TTT metrics; each rank evaluates its slices and the counts are summed over ranks."""
    if not batches:
        return None
    core, meter = unwrap(model), TTTMeter(args.ttt_steps)
    core.eval()
    with torch.no_grad():
        for batch in local_batches(data, batches, args.max_seq_len, ranks):
            meter.add(run_batch(core, lm_head, batch, args, Ranks(device=ranks.device), autocast)[1])
    core.train()
    meter.sums = all_sum(meter.sums.to(ranks.device), ranks)
    return meter.summary()


def take_candidate(tr, data, dp, args, step: int, out: Path, log) -> None:
    """Judge the weights at `step` on the selection split, log it, keep them as a candidate (rank 0)."""
    tau = selection_tau(unwrap(tr.model), data, dp.eval_batches, args.max_seq_len, args.select_num_draft_tokens,
                        tr.ranks, tr.autocast)
    if tau is None:
        raise StageError("the selection split holds no answer of 2 or more tokens: raise --eval-fraction")
    ev = evaluate(tr.model, tr.lm_head, data, dp.eval_batches, args, tr.ranks, tr.autocast)
    if tr.ranks.main:
        row = {"step": step, "split": "select", "replay_tau": tau, "sim_tau": ev["tau"] if ev else None,
               "num_draft_tokens": args.select_num_draft_tokens}
        log.write(row)
        save_candidate(out, step, unwrap(tr.model), getattr(torch, tr.export_dtype), {**row, "eval": ev})
        tqdm.write(f"candidate step {step} | replay tau (k={args.select_num_draft_tokens}) {tau:.3f} | "
                   f"simulated tau {row['sim_tau']:.3f}")


def summary_line(summary: dict) -> str:
    return (f"loss {summary['loss'][0]:.3f} | acc " + "/".join(f"{a:.2f}" for a in summary["acc"])
            + f" | tau {summary['tau']:.2f}")


@dataclass
class Inputs:
    """What 04 reads: the 02b and 03 folders, their manifests (same tokenizer) and the target folder."""
    hs_dir: Path
    vocab_dir: Path
    m02b: HiddenStatesManifest
    m03: VocabManifest
    target_path: Path
    reported_ids: set[str]    # 01c's benchmark prompts (05 reports on them): never in the selection split


def load_inputs(args) -> Inputs:
    hs_dir = stage_dir(args.work_dir, EXTRACT)
    vocab_dir = stage_dir(args.work_dir, VOCAB)
    m02b = HiddenStatesManifest.require(hs_dir)
    m03 = VocabManifest.require(vocab_dir)
    check_same_tokenizer(m02b.tokenizer, m03.tokenizer, vocab_dir, VOCAB)
    target_path = resolve_target(args.target_path, m02b.raw, hs_dir, EXTRACT)
    bench = stage_dir(args.work_dir, MERGE) / "benchmark_prompts.jsonl"
    reported = {r["id"] for r in iter_jsonl(bench)} if bench.is_file() else set()
    return Inputs(hs_dir, vocab_dir, m02b, m03, target_path, reported)


def build_draft(args, inputs: Inputs, imported: ImportedDraft | None, device, bf16: bool, verbose: bool):
    """The draft (seeded init or the imported draft, frozen target embedding, d2t/t2d), the target's
    lm_head and, with --init-from, the WarmStart, on `device`.
    Refuses when the target, 02b and 03 disagree on hidden size or vocabulary."""
    target_path, m02b = inputs.target_path, inputs.m02b
    tcfg = read_target_text_config(target_path)
    mapping = load_file(str(inputs.vocab_dir / "vocab_mapping.safetensors"))
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    # A top-k teacher (02b feature format) needs no lm_head: Kimi's is 2.35 GB of GPU memory.
    with_head = m02b.feature_format.teacher == "final"
    embed, lm_head = load_target_head(target_path, dtype=torch.bfloat16 if bf16 else torch.float32,
                                      with_head=with_head)
    hidden, points = m02b.hidden_size, list(m02b.capture_points)
    if not (embed.shape[1] == hidden == tcfg["hidden_size"] and embed.shape[0] == t2d.shape[0] == tcfg["vocab_size"]):
        raise StageError(f"shapes disagree: 02b hidden {hidden}, target config hidden {tcfg['hidden_size']} "
                         f"vocab {tcfg['vocab_size']}, embedding {tuple(embed.shape)}, t2d {tuple(t2d.shape)}: "
                         "re-run 02b/03 for this target")
    warm = None
    if imported is not None:
        model, warm = warm_start(args, imported, inputs, embed, d2t, t2d)
        cfg = dict(model.config)
    else:
        cfg = draft_config(tcfg, inputs.m03.draft_vocab_size, args.draft_num_attention_heads,
                           args.draft_num_key_value_heads, args.draft_intermediate_size,
                           args.draft_attention, args.fc_norm, args.norm_output)
        torch.manual_seed(args.train_seed)
        model = Eagle3DraftModel(cfg)
        if args.init_scheme == "normal":
            model.init_normal_(args.init_std)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed.float())
        model.set_vocab_mapping(d2t, t2d)
    model.to(device)
    if bf16:
        model.embed_tokens.to(torch.bfloat16)  # frozen: no fp32 master copy needed
    if verbose:
        print(f"[04] target {target_path} (hidden {hidden}, vocab {cfg['vocab_size']}, capture points {points}); "
              f"draft {json.dumps(cfg)}; device {device}, {'bf16 autocast' if bf16 else 'fp32'}")
    return model, (lm_head.to(device) if lm_head is not None else None), cfg, warm


def read_imported(args, inputs: Inputs) -> ImportedDraft | None:
    """--init-from read and checked against the target and the 02b capture points, before anything is
    written (a mismatch stops with one line)."""
    if args.init_from is None:
        return None
    d = read_draft(args.init_from)
    arch = target_architecture(json.loads((inputs.target_path / "config.json").read_text()))
    check_draft(d, read_target_text_config(inputs.target_path), sglang_points_reader(arch),
                list(inputs.m02b.capture_points))
    return d


def warm_start(args, d: ImportedDraft, inputs: Inputs, embed, d2t, t2d):
    """The checked imported draft as the init (its vocab kept or mapped onto 03's)."""
    counts_file = inputs.vocab_dir / "token_counts.safetensors"
    counts = load_file(str(counts_file))["counts"] if counts_file.is_file() else None
    model, warm = warm_start_model(d, args.init_vocab, embed, d2t, t2d,
                                   None if counts is None else counts[torch.arange(len(d2t)) + d2t])
    cov = warm.coverage
    form = d.config.get("attention", "mha") + (" + EAGLE-3.1" if d.config.get("fc_norm") or d.config.get("norm_output")
                                               else "")
    print(f"[04] warm start from {d.path} ({d.layout} layout, {d.dtype}, sha256 {d.sha256[:12]}; its form {form} "
          f"and shape, not the flags'); vocab "
          f"{args.init_vocab}: {cov['rows_found']}/{cov['rows']} draft rows from the imported lm_head"
          + (f" ({100 * cov['count_share']:.1f}% of 03's supervised tokens)" if "count_share" in cov else "")
          + "".join(f"; {n}" for n in d.notes))
    return model, warm


@dataclass
class DataPlan:
    """The held-out split (by sample-id hash) and every epoch's batches, fixed by the seed."""
    data: ShardData
    lengths: list[int]
    epochs: list[list[list[int]]]   # epoch -> batch -> sample indices
    total: int                      # optimizer steps of the whole run
    eval_batches: list[list[int]]
    num_train: int
    num_eval: int
    candidates: list[int]           # steps at which a selection candidate is taken (empty: selection off)


def plan_data(args, hs_dir: Path, verbose: bool, reported_ids: set[str] = frozenset()) -> DataPlan:
    data = ShardData(list_shards(hs_dir))
    lengths = [e[2] for e in data.entries]
    eval_idx = [i for i, e in enumerate(data.entries) if is_eval(e[3], args.eval_fraction)]
    seen = sorted({data.entries[i][3] for i in eval_idx} & set(reported_ids))
    if seen:  # 01c holds its benchmark prompts out of the training records; a mixed-up work dir does not
        raise StageError(f"the held-out selection split holds {len(seen)} of 05's benchmark prompts ({seen[:3]}): "
                         "05 would report on prompts the checkpoint was chosen on; re-run 01c and 02b")
    held = set(eval_idx)
    train_idx = [i for i in range(len(data.entries)) if i not in held]
    if args.max_train_samples is not None:  # nested subsets: the first N of one seeded hash order
        rank = lambda i: hashlib.sha256(f"{args.train_seed}:{data.entries[i][3]}".encode()).digest()  # noqa: E731
        train_idx = sorted(sorted(train_idx, key=rank)[:args.max_train_samples])
    if not train_idx:
        raise StageError(f"no training samples in {hs_dir} after holding out {len(eval_idx)} for eval")
    epochs = [make_batches(epoch_order(data.entries, train_idx, args.train_seed, e), lengths, args.batch_tokens,
                           args.max_seq_len, args.max_samples_per_batch) for e in range(args.num_epochs)]
    total = sum(len(e) for e in epochs)
    total = min(total, args.max_steps) if args.max_steps is not None else total
    eval_batches = make_batches(sorted(eval_idx), lengths, args.batch_tokens, args.max_seq_len,
                                args.max_samples_per_batch)
    candidates = candidate_steps([len(e) for e in epochs], args.candidates_per_epoch, total,
                                 with_init=args.init_from is not None) if args.candidates_per_epoch else []
    if candidates and not eval_batches:
        raise StageError("--candidates-per-epoch needs a selection split: raise --eval-fraction above 0")
    if verbose:
        print(f"[04] {len(train_idx)} train / {len(eval_idx)} eval samples, {total} steps "
              f"({args.num_epochs} epochs of ~{len(epochs[0])} batches, budget {args.batch_tokens} tokens"
              + (f", <= {args.max_samples_per_batch} samples" if args.max_samples_per_batch else "") + ")")
    if verbose and candidates:
        print(f"[04] selection: a candidate at steps {candidates}, judged by replay tau at k = "
              f"{args.select_num_draft_tokens} on the {len(eval_idx)} held-out samples"
              + ("; step 0 is the imported draft remapped onto 03's vocab, not the download itself (05 --draft "
                 "measures that)" if 0 in candidates and args.init_vocab == "map" else ""))
    return DataPlan(data, lengths, epochs, total, eval_batches, len(train_idx), len(eval_idx), candidates)


def resume(ckpt_root: Path, log_path: Path, plan: dict, model, opt, sched, ranks) -> tuple[int, dict, bool]:
    """(step, data cursor, resumed?) of the newest checkpoint whose files match its marker, its state
    loaded, or a fresh start. A newer one that does not verify (cut short by a full disk or a power loss)
    is set aside with one line and the one before it taken. Refuses a checkpoint made with other
    PLAN_KEYS; drops log rows written after it (all of them on a fresh start)."""
    step, cursor = 0, {"epoch": 0, "batch": 0, "position": 0}
    found = -1
    if ranks.main:    # rank 0 alone reads the bytes (one read of a shared folder, not one per rank)
        path, failed = newest_verified(ckpt_root)
        if failed:
            print(f"[04] checkpoint {'; '.join(failed)}; "
                  + (f"resuming from {path.name} instead" if path else "no checkpoint verifies: starting at step 0"))
        found = -1 if path is None else int(path.name.split("_")[1])
    # rank 0's pick on every rank: the others send -1 into the maximum
    found = int(all_max(torch.tensor([found], device=ranks.device), ranks)[0])
    if found >= 0:
        path = ckpt_root / f"step_{found:06d}"
        state = json.loads((path / "state.json").read_text())
        made = {**PLAN_DEFAULTS,   # a flag added since then was at its default
                **{RENAMED_PLAN_KEYS.get(k, k): v for k, v in state["plan"].items()}}
        if made != plan:
            changed = sorted(k for k in plan if made.get(k) != plan[k])
            raise StageError(f"{path} was made with other settings ({', '.join(changed)}); "
                             "use the same flags to resume, or --overwrite to start over")
        state = load_checkpoint(path, model, opt, sched, ranks.device)
        step, cursor = state["step"], state["cursor"]
        if ranks.main:
            print(f"[04] resumed from {path} (step {step}, epoch {cursor['epoch']}, batch {cursor['batch']})")
    if log_path.exists() and ranks.main:   # a fresh start keeps no row: they were an earlier attempt's
        write_jsonl(log_path, [r for r in iter_jsonl(log_path) if found >= 0 and r["step"] <= step])
    return step, cursor, found >= 0


@dataclass
class Trainer:
    """What one optimizer step needs: the (DDP-wrapped) draft, the teacher's lm_head (None with a top-k
    teacher), optimizer, schedule, trainable parameters, process group and the autocast context."""
    model: torch.nn.Module
    lm_head: torch.Tensor | None
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    params: list
    ranks: Ranks
    autocast: object
    anchor: list | None = None      # L2-SP: the init's weights (None = off)
    export_dtype: str = "bfloat16"  # the exports' and candidates' weight dtype


def train_loop(args, tr: Trainer, dp: DataPlan, step: int, cursor: dict, plan: dict,
               out: Path) -> tuple[int, dict | None]:
    """The loop, fresh and resumed runs alike: (last step, final eval or None when stopped early)."""
    model, lm_head, opt, sched, params, ranks, autocast = (tr.model, tr.lm_head, tr.opt, tr.sched, tr.params,
                                                           tr.ranks, tr.autocast)
    data, lengths, epochs, total = dp.data, dp.lengths, dp.epochs, dp.total
    ckpt_root, log_path = out / "checkpoints", out / "train_log.jsonl"
    model.train()
    meter, interval_tokens, t_interval, t_start = TTTMeter(args.ttt_steps), 0, time.time(), time.time()
    start_step = last_log = step
    stop_at = min(total, args.stop_at_step) if args.stop_at_step else total
    reader = data.fork()  # the prefetch thread's own open shards
    batches = Prefetcher(lambda job: load_batch(reader, epochs[job[0]][job[1]], lengths, args.max_seq_len,
                                                ranks.rank, ranks.world),
                         schedule(epochs, cursor, stop_at - step), args.prefetch_batches,
                         pin=ranks.device.type == "cuda")
    bar = tqdm(total=total, initial=step, desc="04 train", unit="step", disable=None if ranks.main else True)
    log = JsonlAppender(log_path) if ranks.main else contextlib.nullcontext()
    with log, batches:
        if step == 0 and 0 in dp.candidates:      # the imported draft itself, before any update
            take_candidate(tr, data, dp, args, 0, out, log)
        for (epoch, bi), batch in batches:
            idx = epochs[epoch][bi]
            loss, stats = run_batch(model, lm_head, to_device(batch, ranks.device), args, ranks, autocast)
            if tr.anchor is not None:   # identical on every rank: DDP's average keeps it as is
                loss = loss + args.l2sp_weight * l2sp_penalty(params, tr.anchor)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            sched.step()
            step, bi = step + 1, bi + 1
            meter.add(stats)
            interval_tokens += sum(min(lengths[i], args.max_seq_len) for i in idx)  # real tokens, all ranks
            bar.update(1)
            if step % args.log_every == 0 or step == stop_at:
                meter.sums = all_sum(meter.sums, ranks)
                s, dt = meter.summary(), time.time() - t_interval
                eta = (time.time() - t_start) / (step - start_step) * (total - step)
                row = {"step": step, "split": "train", "epoch": epoch, **s,
                       "lr": sched.get_last_lr()[0], "grad_norm": float(grad_norm),
                       "tokens_per_s": interval_tokens / max(dt, 1e-9),
                       "ms_per_step": 1000 * dt / (step - last_log), "eta_s": eta}
                if ranks.main:
                    log.write(row)
                    tqdm.write(f"step {step}/{total} | {summary_line(s)} | lr {row['lr']:.2e} | {row['ms_per_step']:.0f} ms"
                               f" | {row['tokens_per_s']:.0f} tok/s | eta {eta / 60:.1f} m")
                meter, interval_tokens, t_interval = TTTMeter(args.ttt_steps), 0, time.time()
                last_log = step
            if step % args.eval_every == 0 and step < total:
                ev = evaluate(model, lm_head, data, dp.eval_batches, args, ranks, autocast)
                if ev and ranks.main:
                    log.write({"step": step, "split": "eval", **ev})
                    tqdm.write(f"eval step {step} | {summary_line(ev)}")
            if step in dp.candidates:
                take_candidate(tr, data, dp, args, step, out, log)
            if step % args.save_every == 0 or step == stop_at:
                opt_state = optimizer_state(opt, ranks)    # collective when the optimizer is sharded
                if ranks.main:
                    cursor = {"epoch": epoch, "batch": bi, "position": sum(len(b) for b in epochs[epoch][:bi])}
                    save_checkpoint(ckpt_root, step, unwrap(model), opt_state, sched, cursor, plan,
                                    args.keep_checkpoints)
        bar.close()
        if step < total:
            return step, None
        final_eval = evaluate(model, lm_head, data, dp.eval_batches, args, ranks, autocast)
        if final_eval and ranks.main:
            log.write({"step": step, "split": "eval", **final_eval})
            print(f"[04] final eval | {summary_line(final_eval)}")
    return step, final_eval


def export(args, model, cfg: dict, inputs: Inputs, dp: DataPlan, final_eval: dict | None, out: Path,
           run: dict, warm: WarmStart | None, export_dtype: str) -> None:
    """The best candidate (when this run selects), the SGLang and speculators folders with the size and
    sha256 of every file (05 and 05b check them before use), the training curves, then the manifest (last:
    it marks the stage complete). final_eval describes the exported weights: under selection the chosen
    candidate's held-out eval (the last step's moves to selection.last_step_eval); final_eval_step says
    which step's weights it measured."""
    m02b, target_path = inputs.m02b, inputs.target_path
    points = list(m02b.capture_points)
    selection, eval_step = None, dp.total
    if dp.candidates:   # a run that does not select exports its last step, whatever candidates lie about
        selection, chosen_eval = choose_candidate(out, model, None if warm is None else step0_candidate(warm.vocab))
        selection["last_step_eval"] = final_eval
        if chosen_eval is not None:
            final_eval, eval_step = chosen_eval, selection["chosen_step"]
    export_dir = export_sglang(model, out / "export_sglang", points, torch_dtype=export_dtype,
                               extra_config=None if warm is None else warm.export_config())
    spec_dir = out / "export_speculators"
    if cfg.get("attention", "mha") == "mha":
        export_speculators(export_dir, spec_dir, points, target_path,
                           json.loads((Path(target_path) / "config.json").read_text()).get("architectures", []))
    else:   # no speculators form of an MLA draft in vLLM 0.32 (export_speculators.py): vLLM loads export_sglang/
        shutil.rmtree(spec_dir, ignore_errors=True)
        spec_dir = None
    trained = any(r["split"] == "train" for r in iter_jsonl(out / "train_log.jsonl")) \
        if (out / "train_log.jsonl").exists() else False
    curves = plot_training_curves(out / "train_log.jsonl", out / "train_curves.png",
                                  selection and selection["chosen_step"]) if trained else None
    write_manifest(out, STAGE, args, draft_config=cfg, capture_points=points,
                   draft_vocab_size=cfg["draft_vocab_size"], vocab_size=cfg["vocab_size"],
                   num_steps=dp.total, num_train_samples=dp.num_train, num_eval_samples=dp.num_eval,
                   final_eval=final_eval, final_eval_step=eval_step, export_dir=str(export_dir),
                   export_speculators_dir=None if spec_dir is None else str(spec_dir),
                   export_files={d.name: file_digests(d) for d in (export_dir, spec_dir) if d is not None},
                   train_curves=None if curves is None else str(curves), **run, selection=selection,
                   init_from=None if warm is None else warm.identity(), tokenizer=m02b.tokenizer,
                   target=m02b.target,
                   inputs=input_manifests(args.work_dir, inputs.hs_dir, inputs.vocab_dir))
    print(f"[04] exported {export_dir}")


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if args.keep_checkpoints < 2:
        raise StageError("--keep-checkpoints must be >= 2 (never overwrite the only good checkpoint)")
    if args.max_samples_per_batch is not None and args.max_samples_per_batch < 1:
        raise StageError("--max-samples-per-batch must be >= 1")
    if args.l2sp_weight and args.init_from is None:
        raise StageError("--l2sp-weight pulls toward an imported draft: give --init-from")
    if args.candidates_per_epoch < 0 or args.select_num_draft_tokens < 1:
        raise StageError("--candidates-per-epoch must be >= 0 and --select-num-draft-tokens >= 1")
    ranks = setup(args.device)
    try:
        train(args, ranks)
        barrier(ranks)   # no rank tears the group down while another still talks in it (gloo aborts)
    finally:
        teardown(ranks)


def train(args, ranks) -> None:
    out = stage_dir(args.work_dir, STAGE)
    inputs = load_inputs(args)
    imported = read_imported(args, inputs)
    go = True
    if ranks.main:
        if args.overwrite and out.exists() and not (out / "manifest.json").exists():
            shutil.rmtree(out)     # --overwrite also drops the checkpoints of an unfinished run
        go = start_stage(out, args.overwrite, STAGE)
    if not broadcast_flag(go, ranks):
        return
    bf16, why = choose_bf16(args.precision, ranks.device)
    bf16 = broadcast_flag(bf16, ranks)  # rank 0's measurement decides for all
    if ranks.main:
        print(f"[04] precision {'bf16 autocast' if bf16 else 'fp32'} ({why})")
    autocast = ((lambda: torch.autocast(ranks.device.type, dtype=torch.bfloat16)) if bf16
                else contextlib.nullcontext)

    core, lm_head, cfg, warm = build_draft(args, inputs, imported, ranks.device, bf16, ranks.main)
    dp = plan_data(args, inputs.hs_dir, ranks.main, inputs.reported_ids)
    params = [p for p in core.parameters() if p.requires_grad]
    shard = shard_optimizer_wanted(args.shard_optimizer, params, ranks)
    model = wrap_model(core, ranks)
    opt = make_optimizer(params, args.learning_rate, args.adam_betas, shard, ranks)
    warmup = max(1, round(args.warmup_ratio * dp.total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(warmup, dp.total))
    plan = {k: getattr(args, k) for k in PLAN_KEYS}
    plan["init_from"] = None if warm is None else {"path": str(args.init_from), "sha256": warm.draft.sha256}
    if ranks.main and ranks.world > 1:
        small = sum(len(b) < ranks.world for e in dp.epochs for b in e)
        print(f"[04] {ranks.world} ranks (DDP{', ZeRO-1 optimizer' if shard else ''}); "
              + (f"{small} batches hold fewer samples than ranks (idle ranks compute a zero-weight copy): "
                 "raise --batch-tokens or --max-samples-per-batch" if small else "every batch feeds every rank"))

    anchor = anchors(params) if warm is not None and args.l2sp_weight > 0 else None
    step, cursor, resumed = resume(out / "checkpoints", out / "train_log.jsonl", plan, core, opt, sched, ranks)
    if ranks.main:   # candidates belong to the plan of the checkpoint resumed; a fresh start keeps none
        drop_candidates(out, after=step if resumed else None)
    export_dtype = warm.draft.dtype if warm is not None else "bfloat16"   # zero steps = the imported bytes
    trainer = Trainer(model, lm_head, opt, sched, params, ranks, autocast, anchor, export_dtype)
    step, final_eval = train_loop(args, trainer, dp, step, cursor, plan, out)
    if step < dp.total:
        if ranks.main:
            print(f"[04] stopped at step {step} of {dp.total} (--stop-at-step); re-run to resume")
        return
    if ranks.main:
        export(args, unwrap(model), cfg, inputs, dp, final_eval, out,
               {"world_size": ranks.world, "precision": "bf16" if bf16 else "fp32", "optimizer_sharded": shard},
               warm, export_dtype)


if __name__ == "__main__":
    main()
