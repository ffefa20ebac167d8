"""Test helpers of the decoding tests (05, replay, sampled, segments): the micro target's capture points
and prompt texts, an exported random draft, a 01c + 04 chain as those stages write it, and a planted draft.
Their fixtures (`target`, `prompts`, `one_thread`) are in conftest.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.benchmark import spec_decode as sd
from common.draft.export_sglang import export_sglang, load_sglang_export
from common.draft.model import Eagle3DraftModel, draft_config
from common.io import write_jsonl
from common.stage import MERGE, TRAIN, stage_dir, target_identity, tokenizer_identity, write_manifest

POINTS = [2, 4, 6]  # capture points h_i of the 8-layer micro target
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.path.join('a', 'b'))",
         "class Point:\n    def __init__(self, x):", "for i in range(10):\n    total += i"]


def random_draft(target, out_dir: Path, draft_vocab_size: int = 64, seed: int = 0) -> Eagle3DraftModel:
    """An untrained draft with a non-trivial d2t (sorted random subset), exported and reloaded."""
    torch.manual_seed(seed)
    cfg = draft_config(target.config.to_dict(), draft_vocab_size, num_attention_heads=4)
    m = Eagle3DraftModel(cfg)
    v = cfg["vocab_size"]
    used = torch.randperm(v)[:draft_vocab_size].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(draft_vocab_size), t2d)
    export_sglang(m, out_dir, POINTS, torch_dtype="float32")
    return load_sglang_export(out_dir, target.get_input_embeddings().weight.detach()).eval()


def make_chain(work: Path, micro_target: Path, target, prompts) -> None:
    """01c (benchmark prompts) + 04 (export) folders with manifests, as those stages write them."""
    ident = {"tokenizer": tokenizer_identity(micro_target), "target": target_identity(micro_target)}
    merged = stage_dir(work, MERGE)
    write_jsonl(merged / "benchmark_prompts.jsonl",
                [{"id": f"bench/{i}", "source": "bench", "prompt": t, "prompt_ids": p}
                 for i, (t, p) in enumerate(zip(TEXTS, prompts))])
    write_manifest(merged, MERGE, argparse.Namespace(), **ident)
    random_draft(target, stage_dir(work, TRAIN) / "export_sglang", seed=3)
    write_manifest(stage_dir(work, TRAIN), TRAIN, argparse.Namespace(), capture_points=POINTS, **ident)


class PlantedDraft:
    """Both surfaces of a draft (the loop's `step`, the TTT `forward` + `logits`) proposing, for token
    position q, the target's greedy token seq[q] - except at `wrong` positions, where it proposes
    another token. Its proposals depend on the position only, so loop and replay must count the same
    rounds; anything else is an accounting difference.

    `step` also checks the EAGLE-3 alignment it is fed: positions continue the draft cache; with `aux`
    (the target's aux states over seq), a target-backed row at position p carries token p+1 and the aux
    state of position p, and a chain row carries this draft's own previous proposal."""

    def __init__(self, seq, vocab, wrong=frozenset(), aux=None):
        self.seq, self.vocab, self.wrong, self.aux = seq, vocab, set(wrong), aux

    def propose(self, q):
        tok = self.seq[q] if q < len(self.seq) else 0
        return (tok + 1) % self.vocab if q in self.wrong else tok

    def project(self, aux):
        return aux

    def draft_to_target(self, ids):
        return ids

    def step(self, hidden, input_ids, position_ids, cache):
        pos = position_ids[0].tolist()
        assert pos == list(range(cache.length, cache.length + len(pos)))
        for row, p in enumerate(pos):
            if self.aux is None:
                break
            tok = int(input_ids[0, row])
            if hidden[0, row].abs().sum() > 0:  # target-backed row (a feed)
                assert torch.allclose(hidden[0, row], self.aux[0, p], atol=1e-4), p
                assert tok == self.seq[p + 1], (p, tok)
            else:  # chain row: its token is this draft's own previous proposal
                assert tok == self.propose(p + 1), (p, tok)
        marks = torch.zeros(1, 1, len(pos), 1)
        cache.update(0, marks, marks)
        logits = torch.zeros(1, len(pos), self.vocab)
        logits[0, torch.arange(len(pos)), [self.propose(p + 2) for p in pos]] = 1.0  # RoPE pos p -> token p+2
        return logits, torch.zeros_like(hidden)

    def __call__(self, aux, ids, num_steps):
        t = ids.shape[1]
        return [torch.full((1, t, 1), float(k)) for k in range(num_steps)]   # step k, every anchor

    def logits(self, h):
        k, t = int(h[0, 0, 0]), h.shape[1]
        out = torch.zeros(1, t, self.vocab)
        out[0, torch.arange(t), [self.propose(a + 2 + k) for a in range(t)]] = 1.0  # anchor a, step k
        return out


def oracle_draft(target, prompt, max_new, wrong=frozenset()) -> PlantedDraft:
    """A PlantedDraft on the target's own greedy continuation (no end of turn), checking its feeds."""
    seq = prompt + sd.greedy_decode(target, prompt, max_new, set())[0]
    _, aux = sd.target_forward(target, torch.tensor([seq]), sd.new_target_cache(target), POINTS)
    return PlantedDraft(seq, target.config.vocab_size, wrong, aux)
