"""01b's generation helpers: progress bars and log lines, latency percentiles, and the in-process
backend.
  Progress    a tqdm bar per partition with tokens/s and errors by kind, a log line, the manifest totals.
  HFBackend   batched `generate_batch(prompt_texts, max_new_tokens)` in-process with transformers
              (the tiny world, tests); same result dicts as common/data/server_pool.ServerPool, plus
              `completion_ids` (the ids the target emitted, end-of-turn id included when it stopped).
"""
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
        self.tokens = self.done = self.failed = self.in_flight = 0
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

    def line(self) -> str:
        """One dense line for log files."""
        dt = max(time.time() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{eta / 3600:.1f} h" if eta > 5400 else f"{eta / 60:.1f} min" if eta > 90 else f"{eta:.0f} s"
        err = ",".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "0"
        return (f"[01b] {self.name} {self.done}/{self.total} | {rate:.2f} req/s | {self.tokens / dt:.0f} tok/s | "
                f"in flight {self.in_flight} | failed {self.failed} | errors {err} | eta {eta}")

    def close(self) -> float:
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.close()
        return time.time() - self.t0


class HFBackend:
    """Left-padded batched generation with transformers (fp32 on CPU, bf16 on CUDA).

    `stop_ids`: the ids that end a turn (common/data/target_format.TargetFormat.stop_ids); the first one
    also pads when the tokenizer has no pad token. `generator` names what decides the greedy answers
    (backend and dtype), for the response cache's identity.
    """

    name = "hf"

    def __init__(self, model_path, tokenizer, stop_ids, device: str = "cpu", temperature: float = 0.0,
                 seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.tok, self.device = torch, tokenizer, device
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.generator = hf_generator(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
        self.temperature, self.seed = temperature, seed
        self.stop_ids = [int(i) for i in stop_ids]
        assert self.stop_ids, "HFBackend needs at least one stop id"
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def generate_batch(self, prompt_texts: list[str], max_new_tokens: list[int]) -> list[dict]:
        torch = self.torch
        ids = self.tok(prompt_texts, add_special_tokens=False)["input_ids"]
        width = max(len(x) for x in ids)
        # Left padding: every prompt ends at the same column, so generated tokens line up.
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)  # [B, T]
        attention = torch.zeros((len(ids), width), dtype=torch.long)                # [B, T]
        for i, x in enumerate(ids):
            input_ids[i, width - len(x):] = torch.tensor(x)
            attention[i, width - len(x):] = 1
        sample = self.temperature > 0
        if sample:
            torch.manual_seed(self.seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                max_new_tokens=max(max_new_tokens), do_sample=sample,
                temperature=self.temperature if sample else None, top_p=None, top_k=None,
                eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        gen = out[:, width:].tolist()                                                  # [B, new]
        stops = set(self.stop_ids)
        results = []
        for x, row, cap in zip(ids, gen, max_new_tokens):
            row = row[:cap]
            finish = "length"
            end = next((k for k, t in enumerate(row) if t in stops), None)
            if end is not None:  # the turn ended: keep the stop id (the draft learns to predict it)
                row, finish = row[:end + 1], "stop"
            results.append({"completion": self.tok.decode(row, skip_special_tokens=False),
                            "completion_ids": row, "finish_reason": finish, "num_prompt_tokens": len(x),
                            "num_completion_tokens": len(row)})
        return results


def hf_generator(device: str) -> str:
    """What decides the hf backend's greedy answers besides the model: the dtype its device runs in."""
    return "hf-float32" if device == "cpu" else "hf-bfloat16"
