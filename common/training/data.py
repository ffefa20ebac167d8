"""04's input: the sample index over the 02b shards, the held-out split, a seeded shard-by-shard order,
token-budget batches, the slice of each batch a data-parallel rank reads, collate, and a prefetcher
that reads and collates the next batches on a background thread while the current one trains.

A batch is the global batch of one optimizer step (all ranks together); the plan of batches does not
depend on the number of ranks, so a run can resume on another number of GPUs and 1 and N processes
train the same steps.
"""
from __future__ import annotations

import hashlib
import queue
import random
import threading
from collections import OrderedDict
from pathlib import Path

import torch


def is_eval(sample_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 2 ** 32 < fraction


class ShardData:
    """Sample-level access to all 02b shards, keeping at most `max_open` shards open (memory-mapped:
    the states stay on disk until a sample is read)."""

    def __init__(self, paths: list[Path], max_open: int = 32, _entries: list | None = None):
        from common.target.shards import ShardReader

        self._open = ShardReader
        self.paths = [Path(p) for p in paths]
        if _entries is None:
            _entries = []  # (shard index, index in shard, length, sample id)
            for si, path in enumerate(self.paths):
                shard = self._open(path)
                lengths = (shard.offsets[1:] - shard.offsets[:-1]).tolist()
                _entries += [(si, i, n, sid) for i, (n, sid) in enumerate(zip(lengths, shard.sample_ids))]
        self.entries = _entries
        self.readers, self.max_open = OrderedDict(), max_open

    def fork(self) -> "ShardData":
        """The same index with its own open readers (one per thread: the reader cache is not shared)."""
        return ShardData(self.paths, self.max_open, _entries=self.entries)

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


def make_batches(order: list[int], lengths: list[int], batch_tokens: int, max_len: int,
                 max_samples: int | None = None) -> list[list[int]]:
    """Greedy packing in order: a batch grows while (samples x longest) stays within the token budget
    and, when `max_samples` is given, while it holds fewer than max_samples samples."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(lengths[i], max_len)
        full = (len(cur) + 1) * max(longest, n) > batch_tokens or (max_samples and len(cur) >= max_samples)
        if cur and full:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def rank_slice(batch: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """The samples of a global batch that `rank` reads: longest first, dealt round-robin (disjoint,
    together the whole batch, tokens balanced). Empty when the batch has fewer samples than ranks."""
    if world == 1:
        return list(batch)
    ranked = sorted(batch, key=lambda i: (-lengths[i], i))
    return ranked[rank::world]


# Per-row tensors of a sample (common/target/shards.py ShardReader.sample) by feature format: the
# draft's input, and the teacher (final hidden state, or the target's top-k logits).
ROW_KEYS = ("aux", "final", "topk_ids", "topk_logits")


def collate(data: ShardData, batch: list[int], max_len: int) -> dict:
    """Right-padded CPU tensors: aux [B, T, 3H], the teacher (final [B, T, H], or topk_ids / topk_logits
    [B, T, k]), input_ids [B, T], loss_mask [B, T], start [B] (true position of row 0: a prompt-tail
    window stores a sample from there on). Padding has loss_mask 0; attention is causal, so it never
    reaches a real position."""
    samples = [data.sample(i, max_len) for i in batch]
    t = max(len(s["input_ids"]) for s in samples)
    out = {key: torch.zeros(len(batch), t, *samples[0][key].shape[1:], dtype=samples[0][key].dtype)
           for key in ROW_KEYS if key in samples[0]}
    out.update({"input_ids": torch.zeros(len(batch), t, dtype=torch.int64),
                "loss_mask": torch.zeros(len(batch), t, dtype=torch.bool),
                "start": torch.tensor([s["start"] for s in samples], dtype=torch.int64)})
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        for key in ROW_KEYS:
            if key in out:
                out[key][r, :n] = s[key]
        out["input_ids"][r, :n], out["loss_mask"][r, :n] = s["input_ids"], s["loss_mask"].bool()
    return out


def load_batch(data: ShardData, idx: list[int], lengths: list[int], max_len: int, rank: int = 0,
               world: int = 1) -> dict:
    """This rank's slice of global batch `idx`, collated on the CPU. A rank left without a sample (a
    batch with fewer samples than ranks) gets a copy of the batch's first sample with no supervised
    position: it takes part in the gradient sum with exactly zero."""
    local = rank_slice(idx, lengths, rank, world)
    batch = collate(data, local or idx[:1], max_len)
    if not local:
        batch["loss_mask"].zero_()
    batch["num_samples"] = len(local)
    return batch


def local_batches(data: ShardData, batches: list[list[int]], max_len: int, ranks):
    """This rank's collated slice of each held-out batch, on its device; batches that hold no sample
    for this rank are skipped (their counts come from the other ranks' all_sum)."""
    lengths = [e[2] for e in data.entries]
    for idx in batches:
        if rank_slice(idx, lengths, ranks.rank, ranks.world):
            yield to_device(load_batch(data, idx, lengths, max_len, ranks.rank, ranks.world), ranks.device)


def schedule(epochs: list, cursor: dict, num_steps: int):
    """(epoch, batch index) of the next `num_steps` optimizer steps from the cursor."""
    epoch, bi = cursor["epoch"], cursor["batch"]
    while num_steps > 0:
        if bi >= len(epochs[epoch]):
            epoch, bi = epoch + 1, 0
            continue
        yield epoch, bi
        bi, num_steps = bi + 1, num_steps - 1


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class Prefetcher:
    """Iterates `(job, load(job))` over `jobs`, loading up to `depth` jobs ahead on a background thread.

    At most `depth` loaded batches wait in the queue (plus the one being loaded), so memory stays
    bounded however long the data is; with `pin` the loaded tensors go to pinned host memory, so their
    copy to the GPU does not block. depth 0 loads in the caller's thread (no overlap). An error in the
    worker is raised in the caller at the batch where it happened. Call close() (or leave the loop
    early through `with`) to stop the worker.
    """

    def __init__(self, load, jobs, depth: int, pin: bool = False):
        self.load, self.jobs, self.depth, self.pin = load, iter(jobs), depth, pin
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name="04-prefetch", daemon=True)
            self._thread.start()

    def _load(self, job):
        batch = self.load(job)
        if self.pin:
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _work(self):
        try:
            for job in self.jobs:
                item = (job, self._load(job))
                while not self._put(item):
                    if self._stop.is_set():
                        return
            self._put_until_stopped(StopIteration())
        except BaseException as e:  # handed to the consumer, raised there
            self._put_until_stopped(e)

    def _put(self, item) -> bool:
        try:
            self._queue.put(item, timeout=0.1)
            return True
        except queue.Full:
            return False

    def _put_until_stopped(self, item) -> None:
        while not self._stop.is_set() and not self._put(item):
            pass

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:
            job = next(self.jobs)
            return job, self._load(job)
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
