"""01b's progress: a tqdm bar per partition with tokens/s and errors by kind (Progress), log lines that
do not break the bars (log), latency percentiles for the manifest totals (percentiles)."""
from __future__ import annotations

import time
from collections import Counter


def log(line: str) -> None:
    """A log line that does not break the tqdm bars (stdout, for log files)."""
    import sys

    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"num": 0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"num": len(s), "mean": round(sum(s) / len(s), 3), "p50": round(pick(0.5), 3),
            "p99": round(pick(0.99), 3), "max": round(s[-1], 3)}


class Progress:
    """01b's progress of one partition: a tqdm bar (requests/s and ETA from tqdm; tokens/s and errors
    by kind in the postfix) plus the totals behind the periodic log line and the manifest."""

    def __init__(self, total: int, name: str, position: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"[01b] {name}", unit="req", smoothing=0.05, position=position,
                        mininterval=1.0, dynamic_ncols=True)
        self.name, self.total = name, total
        self.t0 = self._shown = time.time()
        self.tokens = self.done = self.failed = 0
        self.in_flight = 0                  # requests with a server now (ServerPool.generate counts them)
        self.errors: Counter = Counter()   # attempt errors by kind (retried or not)
        self.latencies: list[float] = []    # s per successful request, retries and waits included

    def update(self, n: int = 1, tokens: int = 0, latency: float | None = None, failed: bool = False):
        self.tokens += tokens
        self.done += n
        self.failed += failed
        if latency is not None:
            self.latencies.append(latency)
        now = time.time()
        if now - self._shown > 0.5:  # formatting the postfix per request would cost CPU at 1000 req/s
            self._shown = now
            self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(n)

    def postfix(self) -> str:
        err = " ".join(f"{k}={v}" for k, v in sorted(self.errors.items()))
        return f"{self.tokens / max(time.time() - self.t0, 1e-9):.0f} tok/s" + (f" | err {err}" if err else "")

    def line(self, limit: int | None = None) -> str:
        """One dense line for log files: `in flight` counts requests with a server (ServerPool.generate), out of
        the `limit` the in-flight limit allows all partitions together."""
        dt = max(time.time() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{eta / 3600:.1f} h" if eta > 5400 else f"{eta / 60:.1f} min" if eta > 90 else f"{eta:.0f} s"
        err = ",".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "0"
        return (f"[01b] {self.name} {self.done}/{self.total} | {rate:.2f} req/s | {self.tokens / dt:.0f} tok/s | "
                f"in flight {self.in_flight}{'' if limit is None else f' (limit {limit}, all partitions)'} | "
                f"failed {self.failed} | errors {err} | eta {eta}")

    def close(self) -> float:
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.close()
        return time.time() - self.t0
