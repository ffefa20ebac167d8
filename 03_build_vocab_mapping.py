"""Choose the draft vocabulary: the `draft_vocab_size` target ids the draft is most often trained to emit.

Reads:  <work-dir>/02b_hidden_states/shard_*.safetensors (input_ids, loss_mask only) + manifest.json
Writes: <work-dir>/03_vocab/vocab_mapping.safetensors, token_counts.safetensors, manifest.json
Real:   python 03_build_vocab_mapping.py --config configs/kimi-k2.5.yaml --config configs/datasets_v4.yaml
            --work-dir /data/eagle3
Tiny:   python 03_build_vocab_mapping.py --config configs/tiny.yaml --work-dir runs/tiny

Counts only loss-masked (supervised) tokens of the 02b shards, the exact data training sees. Keeps the
most frequent ids (ties and padding: lowest target id first, so a corpus with fewer distinct supervised
ids than draft_vocab_size is padded with the lowest unused ids), sorted by target id, as the buffers the
draft carries (docs/design.md section 2): `d2t` int64 [Dv] offsets (target_id = draft_id + d2t[draft_id])
and `t2d` bool [V] membership. Coverage = share of supervised tokens the draft vocab can emit.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import base_parser, parse_args
from common.io import atomic_path
from common.stage import (EXTRACT, StageError, VOCAB, input_manifests, resolve_target, stage_dir,
                          stage_folder, stage_script, start_stage, write_manifest)
from common.target.manifests import HiddenStatesManifest
from common.target.shards import ShardReader, list_shards
from common.text.target_format import load_target_format
from common.text.tokenizer import load_tokenizer

STAGE = VOCAB
UPSTREAM = EXTRACT


def build_parser():
    p = base_parser(__doc__)
    g = p.add_argument_group("vocab")
    g.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="number of target token ids the draft's lm_head can emit (ids)")
    g.add_argument("--target-path", type=Path, default=None,
                   help="target model folder; read from the 02b manifest, and when given it must match")
    return p




def count_supervised(shard_paths: list[Path], vocab_size: int):
    """counts [V] int64: how often each target id appears at a loss-masked position.

    Reads only the input_ids and loss_mask tensors of each shard (never the hidden states).
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in shard_paths:
        shard = ShardReader(path)
        ids = shard.tensor("input_ids")  # [sum_T] int64
        mask = shard.tensor("loss_mask").bool()  # [sum_T]
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def build_mapping(counts, draft_vocab_size: int):
    """(d2t [Dv] int64, t2d [V] bool, kept [Dv] target ids ascending) from supervised counts [V].

    A stable descending sort ranks by count and, among equal counts (zeros included), by ascending
    target id: the padding, when fewer distinct ids were supervised, is the lowest unused ids.
    """
    ranked = torch.sort(counts, descending=True, stable=True).indices  # [V] target ids
    kept = torch.sort(ranked[:draft_vocab_size]).values  # [Dv] draft id i -> target id kept[i]
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)  # target = draft + d2t[draft]
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d, kept


def save_tensors(path: Path, tensors: dict) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))


def main(argv=None):
    args = parse_args(build_parser(), argv)
    src = stage_dir(args.work_dir, UPSTREAM)
    upstream = HiddenStatesManifest.require(src)
    resolve_target(args.target_path, upstream.raw, src, EXTRACT)
    out = stage_dir(args.work_dir, STAGE)
    vocab_size, dv = upstream.vocab_size, args.draft_vocab_size
    if not 1 <= dv <= vocab_size:
        raise StageError(f"--draft-vocab-size {dv} must lie in 1..{vocab_size} (the target vocab size)")
    if not start_stage(out, args.overwrite, STAGE):
        return
    t0 = time.time()

    shards = list_shards(src)
    missing = sorted(set(upstream.shards) - {p.name for p in shards})
    if missing:
        raise StageError(f"{src} lacks shards its manifest lists ({', '.join(missing[:3])}): "
                         f"re-run `python {stage_script(UPSTREAM)}`")
    shards = [p for p in shards if p.name in upstream.shards]
    print(f"[03] counting supervised tokens of {len(shards)} shards in {src} (vocab {vocab_size}, "
          f"draft vocab {dv})")
    counts = count_supervised(shards, vocab_size)  # [V]
    total = int(counts.sum())
    if total == 0:
        raise StageError(f"{src} holds no loss-masked tokens: check 01c's loss_mask")
    if upstream.num_supervised_tokens is not None:
        assert total == upstream.num_supervised_tokens, (total, upstream.num_supervised_tokens)
    d2t, t2d, kept = build_mapping(counts, dv)
    covered = int(counts[kept].sum())
    coverage = covered / total
    distinct = int((counts > 0).sum())

    # The end-of-turn token must be draftable, or the draft can never propose the end of an answer.
    tok = load_tokenizer(upstream.tokenizer["path"])
    text_format = load_target_format(upstream.target["path"], tok)
    end_id = text_format.stop_ids[0]
    end_in = bool(t2d[end_id])

    save_tensors(out / "vocab_mapping.safetensors", {"d2t": d2t, "t2d": t2d})
    save_tensors(out / "token_counts.safetensors", {"counts": counts})
    write_manifest(
        out, STAGE, args, draft_vocab_size=dv, vocab_size=vocab_size, coverage=coverage,
        num_supervised_tokens=total, num_covered_tokens=covered, num_distinct_supervised=distinct,
        num_padding_ids=max(0, dv - distinct), end_of_turn=text_format.end_of_turn, end_of_turn_id=end_id,
        end_of_turn_in_draft_vocab=end_in,
        counted_from=f"{stage_folder(UPSTREAM)} (input_ids, loss_mask)",
        capture_points=list(upstream.capture_points), hidden_size=upstream.hidden_size,
        num_hidden_layers=upstream.num_hidden_layers,
        tokenizer=upstream.tokenizer, target=upstream.target,
        inputs=input_manifests(args.work_dir, src),
        elapsed_s=round(time.time() - t0, 2))
    print(f"[03] coverage {coverage:.4f} ({covered:,} of {total:,} supervised tokens); "
          f"{distinct} distinct supervised ids, {max(0, dv - distinct)} padding ids; "
          f"{text_format.end_of_turn} in draft vocab: {end_in} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
