"""How much of 01b's --concurrency a server runs at once, and the in-flight limit that adapts to it.

A real engine runs what its KV cache holds and queues the rest, sending nothing to a queued request
(SGLang: ~15-20 of 10K-token requests in a 170-230K-token pool). 01b streams its requests, so a queue
wait is never a timeout (server_pool.py); what is left to decide is how many to keep in flight.

  read_capacity(pool, server)   what the server says it can run, best effort, at start-up:
      SGLang  GET /server_info (older: /get_server_info): `max_total_num_tokens` (the KV pool, per DP
              rank) and `internal_states[i].effective_max_running_requests_per_dp` (else the
              `max_running_requests` server arg), checked against sglang 0.5.x entrypoints/http_server.py
              and managers/scheduler.py get_internal_state;
      vLLM    GET /metrics: `vllm:cache_config_info{num_gpu_blocks, block_size}` per engine (the KV pool
              in tokens); vLLM exposes no max_num_seqs over HTTP, so its running limit stays unknown.
      Anything else: capacity unknown (the run goes on at --concurrency).
  capacity_line(...)            the start-up line: how much of what 01b keeps in flight can run at once,
                                also estimated as KV pool / (prompt + max-new-tokens), a request's
                                size at its end (so a lower bound of what runs).
  InFlightLimit                 AIMD over the requests in flight, as TCP does with its window.
"""
from __future__ import annotations

import asyncio
import re
from collections import deque
from contextlib import asynccontextmanager

INFO_PATHS = ("/server_info", "/get_server_info")  # SGLang: newer name first, older releases the second
LABEL = re.compile(r'(\w+)="([^"]*)"')


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def sglang_capacity(info: dict) -> dict | None:
    """Capacity from SGLang's info document; None when the document is not SGLang's."""
    if not isinstance(info, dict) or "max_total_num_tokens" not in info:
        return None
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    ranks = len(states) or _positive_int(info.get("dp_size")) or 1
    per_rank = next(filter(None, (_positive_int(s.get("effective_max_running_requests_per_dp"))
                                  for s in states)), None)
    running = per_rank * ranks if per_rank else _positive_int(info.get("max_running_requests"))
    tokens = _positive_int(info.get("max_total_num_tokens"))
    # Each DP rank has its own KV pool; the document reports rank 0's.
    return {"engine": "sglang", "max_running_requests": running,
            "max_total_num_tokens": tokens * ranks if tokens else None}


def vllm_capacity(metrics: str) -> dict | None:
    """Capacity from vLLM's Prometheus text (the KV pool, summed over engines); None without it."""
    tokens = 0
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(LABEL.findall(line))
            blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit():
                tokens += int(blocks) * int(size)
    return {"engine": "vllm", "max_running_requests": None, "max_total_num_tokens": tokens} if tokens else None


async def _get(pool, url: str) -> tuple[int, bytes] | None:
    import aiohttp

    try:
        async with pool.session.get(url, timeout=aiohttp.ClientTimeout(total=pool.health_timeout)) as r:
            return r.status, await r.read()
    except (asyncio.TimeoutError, aiohttp.ClientError):
        return None


async def read_capacity(pool, server) -> dict | None:
    """What `server` says it runs at once (module doc), or None when it does not say."""
    import json

    for path in INFO_PATHS:
        got = await _get(pool, server.root + path)
        if got and got[0] == 200:
            try:
                found = sglang_capacity(json.loads(got[1]))
            except ValueError:
                found = None
            if found:
                return {**found, "source": path}
    got = await _get(pool, server.root + "/metrics")
    found = vllm_capacity(got[1].decode("utf-8", "replace")) if got and got[0] == 200 else None
    return {**found, "source": "/metrics"} if found else None


def runs_at_once(cap: dict | None, in_flight: int, mean_need: float) -> int | None:
    """Of `in_flight` requests of `mean_need` tokens each (prompt + max-new-tokens), how many the server
    runs at once: the least of its running limit and its KV pool's share; None when it says neither."""
    if not cap:
        return None
    bounds = [cap.get("max_running_requests")]
    if cap.get("max_total_num_tokens") and mean_need > 0:
        bounds.append(max(1, int(cap["max_total_num_tokens"] // mean_need)))
    bounds = [b for b in bounds if b]
    return min([in_flight, *bounds]) if bounds else None


def capacity_line(url: str, cap: dict | None, in_flight: int, mean_need: float) -> str:
    """The start-up line of one server (module doc)."""
    if not cap:
        return (f"[01b] server {url}: capacity unknown (no SGLang /server_info, no vLLM /metrics KV pool); "
                f"{in_flight} requests in flight on it, their queue time is not timed out (--queue-timeout)")
    parts = []
    if cap.get("max_running_requests"):
        parts.append(f"runs at most {cap['max_running_requests']} requests at once (max_running_requests)")
    if cap.get("max_total_num_tokens"):
        parts.append(f"its KV pool of {cap['max_total_num_tokens']:,} tokens holds "
                     f"~{cap['max_total_num_tokens'] / max(mean_need, 1):,.0f} of this run's requests at full length "
                     f"(prompt + max-new-tokens, mean {mean_need:,.0f} tokens)")
    fits = runs_at_once(cap, in_flight, mean_need)
    return (f"[01b] server {url} ({cap['engine']} {cap['source']}): {', '.join(parts)}; about {fits} of the "
            f"{in_flight} requests in flight on it run at once, the rest wait in its queue (not timed out: "
            "--queue-timeout)")


class InFlightLimit:
    """How many requests the pool lets run at once (AIMD). A timeout from a healthy server says more was
    sent than it serves: the limit halves, down to `floor` (what the servers run at once: below it
    nothing would queue); each `limit` answers after that grow it by one, back up to `ceiling`
    (--concurrency). Only the first timeout of requests sent under one limit halves it (`epoch`), so a
    burst of timeouts from one overload halves it once, as TCP halves once per window.

    Plain numbers, and futures made in the running loop: one limit serves every dataset of a run (each
    runs its own asyncio loop) and keeps what it learned. Waiters are served first come, first served."""

    def __init__(self, ceiling: int, floor: int = 1):
        self.ceiling = max(1, ceiling)
        self.floor = max(1, min(floor, self.ceiling))
        self.limit = self.ceiling
        self.in_flight = self.epoch = self.credit = self.changes = 0
        self.lowest = self.ceiling
        self._woken = 0                  # waiters handed a slot that have not taken it yet
        self._waiters: deque = deque()
        self._logged = self.ceiling      # the limit last reported by a growth line

    def set_ceiling(self, ceiling: int) -> None:
        """The most requests a run can have in flight (its workers: each partition's concurrency, at most its
        jobs; summed, or the larger with the partitions one after the other). A limit nothing has lowered yet
        is the ceiling; a lowered one keeps what it learned, under the new ceiling."""
        fresh = self.changes == 0
        self.ceiling = max(1, ceiling)
        self.limit = self.ceiling if fresh else min(self.limit, self.ceiling)
        self.floor = min(self.floor, self.ceiling)
        self.lowest = self.limit if fresh else min(self.lowest, self.limit)
        self._logged = min(self._logged, self.ceiling) if not fresh else self.ceiling
        self._wake()

    def set_floor(self, floor: int) -> None:
        self.floor = max(1, min(floor, self.ceiling))
        self.limit = max(self.limit, self.floor)

    @asynccontextmanager
    async def slot(self):
        """Hold one place in flight; yields the epoch the request is sent under."""
        await self._acquire()
        try:
            yield self.epoch
        finally:
            self.in_flight -= 1
            self._wake()

    async def _acquire(self) -> None:
        if self._waiters or self.in_flight + self._woken >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # woken, then cancelled: hand the place on
                    self._woken -= 1
                    self._wake()
                elif fut in self._waiters:
                    self._waiters.remove(fut)
                raise
            self._woken -= 1
        self.in_flight += 1

    def _wake(self) -> None:
        while self._waiters and self.in_flight + self._woken < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._woken += 1

    def overload(self, epoch: int) -> str | None:
        """A request sent under `epoch` timed out on a healthy server; the change made, if any."""
        if epoch != self.epoch or self.limit <= self.floor:
            return None
        old, self.limit = self.limit, max(self.floor, self.limit // 2)
        self.epoch, self.credit, self.changes, self._logged = self.epoch + 1, 0, self.changes + 1, self.limit
        self.lowest = min(self.lowest, self.limit)
        return f"in-flight limit {old} -> {self.limit}"

    def answered(self) -> str | None:
        """One answer arrived; the growth to report, if any (every ~1/8 of the way, and at the ceiling)."""
        if self.limit >= self.ceiling:
            return None
        self.credit += 1
        if self.credit < self.limit:
            return None
        self.limit, self.credit, self.changes = self.limit + 1, 0, self.changes + 1
        self._wake()
        if self.limit < self.ceiling and self.limit - self._logged < max(1, self._logged // 8):
            return None
        old, self._logged = self._logged, self.limit
        return f"in-flight limit {old} -> {self.limit}"

    def summary(self) -> dict:
        return {"ceiling": self.ceiling, "floor": self.floor, "final": self.limit, "lowest": self.lowest,
                "changes": self.changes}
