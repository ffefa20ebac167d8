"""04's test inputs: a work dir with 02b shards and a 03 vocab mapping made from the micro target, and
the flags of a seconds-long CPU run (tests of 04, its warm start and its checkpoint selection)."""
import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.stage import EXTRACT, VOCAB, stage_dir, target_identity, tokenizer_identity, write_manifest
from common.target.shards import shard_name, write_shard

POINTS = [2, 4, 5]
DV = 300


def make_upstream(micro_target, work: Path) -> Path:
    """A work dir holding 02b shards and a 03 vocab mapping, made from the micro target.

    aux = the micro target's real states at the capture points. The random target's own next-token
    distribution is almost uniform (nothing to learn), so the stored final state is built by hand to
    make the target confident of the true next token, on sequences that follow a fixed permutation
    chain (next = perm[current]): a draft can learn that, so a working trainer must show progress.
    """
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(micro_target)).eval()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(200, generator=g)
    head = model.lm_head.weight.detach()                             # [V, H]
    hs_dir = stage_dir(work, EXTRACT)
    samples, counts = [], torch.zeros(cfg.vocab_size)
    with torch.no_grad():
        for i in range(24):
            t = int(torch.randint(12, 40, (1,), generator=g))
            ids = [int(torch.randint(0, 200, (1,), generator=g))]
            for _ in range(t - 1):
                ids.append(int(perm[ids[-1]]))
            ids = torch.tensor(ids)
            hs = model(ids[None], output_hidden_states=True).hidden_states
            nxt = torch.cat([ids[1:], ids[:1]])                      # the token after each position
            final = head[nxt] / head[nxt].norm(dim=-1, keepdim=True) * 200.0
            mask = torch.zeros(t, dtype=torch.bool)
            mask[t // 3:] = True
            counts.index_add_(0, ids[mask], torch.ones(int(mask.sum())))
            samples.append({"id": f"micro/{i}", "input_ids": ids, "loss_mask": mask,
                            "aux": torch.cat([hs[p][0] for p in POINTS], -1), "final": final})
    for s in range(3):
        write_shard(hs_dir / shard_name(s), samples[s * 8:(s + 1) * 8])
    ident = {"tokenizer": tokenizer_identity(micro_target), "target": target_identity(micro_target)}
    write_manifest(hs_dir, EXTRACT, argparse.Namespace(),
                   capture_points=POINTS, hidden_size=cfg.hidden_size, num_hidden_layers=8,
                   vocab_size=cfg.vocab_size, **ident)
    used = counts.argsort(descending=True)[:DV].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    vocab_dir = stage_dir(work, VOCAB)
    vocab_dir.mkdir()
    save_file({"d2t": used - torch.arange(DV), "t2d": t2d}, str(vocab_dir / "vocab_mapping.safetensors"))
    write_manifest(vocab_dir, VOCAB, argparse.Namespace(), draft_vocab_size=DV,
                   vocab_size=cfg.vocab_size, **ident)
    return work


def fresh_work(upstream, tmp_path):
    work = tmp_path / "w"
    for s in (EXTRACT, VOCAB):
        shutil.copytree(stage_dir(upstream, s), stage_dir(work, s))
    return work


FLAGS = ["--ttt-steps", "3", "--batch-tokens", "96", "--max-seq-len", "48", "--eval-fraction", "0.15",
         "--learning-rate", "3e-3", "--log-every", "5", "--device", "cpu", "--warmup-ratio", "0.1",
         "--precision", "fp32"]  # exact comparisons; auto may pick bf16 on a CPU with fast bf16


def micro_batch(seed: int = 0):
    """(draft, batch, teacher lm_head) of one run_batch call: a 16-wide draft over a 40-token vocab and a
    3 x 9 batch with the final-state teacher, about 70% of positions supervised."""
    from common.draft.model import Eagle3DraftModel

    torch.manual_seed(seed)
    model = Eagle3DraftModel({"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
                              "intermediate_size": 32, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
                              "max_position_embeddings": 64, "vocab_size": 40, "draft_vocab_size": 40})
    model.set_vocab_mapping(torch.zeros(40, dtype=torch.int64), torch.ones(40, dtype=torch.bool))
    b, t = 3, 9
    batch = {"aux": torch.randn(b, t, 48), "final": torch.randn(b, t, 16), "input_ids": torch.randint(0, 40, (b, t)),
             "loss_mask": torch.rand(b, t) > 0.3, "num_samples": b}
    return model, batch, torch.randn(40, 16)
