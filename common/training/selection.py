"""04's checkpoint selection: candidates during training, judged by replay tau on the selection split.

Why: served tau can peak after a few epochs and fall while the simulated training metric (1 + sum of
products of per-step accuracies) keeps rising (DeepSpec issue 84: EAGLE-3 on Qwen3-4B, peak at 4.6
epochs, -4.9% by epoch 10). So 04 keeps a candidate at `--candidates-per-epoch` points of every epoch
(and at the last step), measures each by replaying greedy chain drafting along the held-out samples'
stored answers, and exports the best.

Replay along the stored answers. For a sample with stored target features, every contiguous run of
supervised positions [s0, s1) is an answer the target wrote. A round starts with the pending token
x[n] (n = s0 first: the target's own first answer token), anchor t = n - 1; the draft's chain step j
proposes x[t+2+j] given the true tokens up to t+1+j, which is exactly the TTT unroll's teacher-forced
step j at row t (common/benchmark/replay.py says why); the round accepts the longest prefix of
proposals equal to the stored tokens and commits it plus one target token. So one TTT forward gives
every round. When the stored answers are the target's greedy answers and the features are exact (the
bf16 format), this is 05's replay tau; with sampled answers (01b at T > 0) it is the greedy-draft
acceptance along the target's own sampled text, and with fp8/top-k features an approximation of it.
The split is 04's held-out eval split (by sample-id hash), drawn from 01c's training records, which
never hold 01c's benchmark prompts (the ones 05 reports on): selection never sees the reported prompts.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from common.io import read_json, write_json
from common.stage import StageError
from common.training.checkpoints import CKPT_MARKER, complete_checkpoints, marker_problem, set_aside, write_marker
from common.training.data import local_batches
from common.training.distributed import all_sum

CANDIDATE_DIR = "candidates"   # step_NNNNNN folders that count once CKPT_MARKER exists, as checkpoints do


def candidate_steps(epoch_lengths: list[int], per_epoch: int, total: int, with_init: bool = False) -> list[int]:
    """Optimizer steps at which a candidate is taken: per_epoch evenly spaced points of every epoch
    (the last at the epoch's end) and the run's last step; none past `total`. with_init: step 0 too (a
    warm start's weights before any update compete, so the export is never worse on the selection split
    than the draft it started from: the download under --init-vocab keep, the download remapped onto
    03's vocab under map (step0_candidate); a zero-step run measures it on the user's data)."""
    steps, start = {total}, 0
    for n in epoch_lengths:
        steps |= {start + round(i * n / per_epoch) for i in range(1, per_epoch + 1)}
        start += n
    return ([0] if with_init else []) + sorted(s for s in steps if 0 < s <= total)


def accept_lengths(pred: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """pred [K, B, T] target ids (draft proposals: row j, column t proposes token t+2+j), ids [B, T] ->
    [B, T]: how many leading proposals at anchor t equal the stored tokens (0..K)."""
    k, _, t = pred.shape
    hits = torch.zeros_like(pred, dtype=torch.bool)
    for j in range(k):
        if t > j + 2:
            hits[j, :, :t - 2 - j] = pred[j, :, :t - 2 - j] == ids[:, 2 + j:]
    return hits.to(torch.int64).cumprod(0).sum(0)


def walk_rounds(acc: list[int], mask: list[bool], k: int) -> tuple[int, int]:
    """(tokens committed in rounds, rounds) of chain drafting with k tokens per round along every
    supervised run of one sample; acc = accept_lengths of its anchors."""
    emitted = rounds = 0
    t, n = 0, len(mask)
    while t < n:
        if not mask[t] or t == 0:
            t += 1
            continue
        s1 = t
        while s1 < n and mask[s1]:
            s1 += 1
        pos = t                           # the pending token: the target's first token of this run
        while pos + 1 < s1:
            k_eff = min(k, s1 - pos - 2)  # the round's own target token always commits
            a = min(acc[pos - 1], k_eff)
            emitted, rounds, pos = emitted + a + 1, rounds + 1, pos + a + 1
        t = s1
    return emitted, rounds


@torch.no_grad()
def replay_counts(core, batch: dict, k: int) -> torch.Tensor:
    """[2] float (committed tokens, rounds) of the batch's samples at chain length k."""
    outs = core(batch["aux"], batch["input_ids"], k, start=batch.get("start"))
    pred = torch.stack([core.draft_to_target(core.logits(h).argmax(-1)) for h in outs])   # [K, B, T]
    acc = accept_lengths(pred, batch["input_ids"]).tolist()
    mask = batch["loss_mask"].tolist()
    total = [0, 0]
    for a, m in zip(acc, mask):
        e, r = walk_rounds(a, m, k)
        total[0], total[1] = total[0] + e, total[1] + r
    return torch.tensor(total, dtype=torch.float64)


def selection_tau(core, data, batches: list[list[int]], max_seq_len: int, k: int, ranks, autocast) -> float | None:
    """Replay tau at chain length k over the selection split's batches, each rank over its slices, the
    counts summed over ranks (None when no answer has 2 or more tokens)."""
    sums = torch.zeros(2, dtype=torch.float64)
    core.eval()
    for batch in local_batches(data, batches, max_seq_len, ranks):
        with autocast():
            sums += replay_counts(core, batch, k)
    core.train()
    sums = all_sum(sums.to(ranks.device), ranks)
    return float(sums[0] / sums[1]) if sums[1] > 0 else None


def save_candidate(root: Path, step: int, model, dtype: torch.dtype, meta: dict) -> Path:
    """root/candidates/step_NNNNNN/{model.pt, meta.json, COMPLETE}: the trainable weights in the export
    dtype (what the export would write anyway); the marker records the files' bytes, as a checkpoint's."""
    path = root / CANDIDATE_DIR / f"step_{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    state = {n: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu()
             for n, t in model.trainable_state_dict().items()}
    torch.save(state, path / "model.pt")
    write_json(path / "meta.json", {"step": step, **meta})
    write_marker(path)
    return path


def drop_candidates(root: Path, after: int | None) -> None:
    """A resumed run redoes the steps after its checkpoint (`after`): their candidates (and half-written
    ones) go. A fresh start (after None) drops them all, step 0's too: they were taken under a plan no
    checkpoint vouches for (a run killed before its first checkpoint, maybe with another --init-from or
    none), and a kept one would compete in, or be exported by, a run that never made it."""
    for p in (root / CANDIDATE_DIR).glob("step_*"):
        if after is None or int(p.name.split("_")[1]) > after or not (p / CKPT_MARKER).is_file():
            shutil.rmtree(p)


def load_candidate(path: Path, model) -> None:
    missing, unexpected = model.load_state_dict(torch.load(path / "model.pt"), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)


def choose_candidate(root: Path, model, step0: str | None = None) -> tuple[dict, dict | None]:
    """Load the candidate with the best replay tau into `model` (the latest on a tie). Called only when
    this run selects. Every candidate's files are checked against its marker first: one that does not
    verify is set aside with one line and does not compete. Returns (the selection record for the
    manifest, the held-out TTT eval of the chosen weights: None for a candidate saved before candidates
    kept it). step0: what candidate 0 is (step0_candidate), when there is one."""
    cands, metas = [], []
    for c in complete_checkpoints(root / CANDIDATE_DIR):
        problem = marker_problem(c)
        if problem is not None:
            set_aside(c)
            print(f"[04] selection: candidate {c.name} does not verify ({problem}): set aside, not judged")
            continue
        cands.append(c)
        metas.append(read_json(c / "meta.json"))
    if not cands:
        raise StageError(f"no selection candidate in {root / CANDIDATE_DIR} verifies: re-run 04 with --overwrite")
    best = max(range(len(cands)), key=lambda i: (metas[i]["replay_tau"], metas[i]["step"]))
    load_candidate(cands[best], model)
    chosen = metas[best]
    print(f"[04] selection: step {chosen['step']} exported (replay tau {chosen['replay_tau']:.3f} at "
          f"k={chosen['num_draft_tokens']}; last candidate, step {metas[-1]['step']}: {metas[-1]['replay_tau']:.3f})")
    record = {"num_draft_tokens": chosen["num_draft_tokens"], "chosen_step": chosen["step"],
              "chosen_replay_tau": chosen["replay_tau"], "step_0": step0 if metas[0]["step"] == 0 else None,
              "candidates": [{k: v for k, v in m.items() if k != "eval"} for m in metas]}
    return record, chosen.get("eval")


def step0_candidate(vocab: str) -> str:
    """What candidate 0 of a warm start is (the manifest's selection.step_0), so that "never worse than the
    start" says which start. Under --init-vocab map the imported lm_head has been moved onto 03's draft
    vocab, rows it lacked started as the mean row: that remapped draft competes, not the download itself,
    whose own vocab would need its own export (05 --draft replays the download as given)."""
    if vocab == "keep":
        return "the imported draft as given (--init-vocab keep): its own weights and vocab"
    return ("the imported draft remapped onto 03's draft vocab (--init-vocab map), not the download itself: "
            "the export is never worse on the selection split than this remapped draft; 05 --draft measures "
            "the download as given")
