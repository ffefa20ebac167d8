"""Training and quality gates of the tiny world's target (a Kimi-shaped DeepSeek-V3 on CPU)."""
from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from common.text.chat_format import render_completion, render_prompt

IGNORE = -100


def encode_samples(tokenizer, samples: list[dict], max_len: int) -> list[dict]:
    """Render each sample exactly as the target would see and emit it, tokenize, drop long ones.

    Returns dicts {ids: [int], num_prompt_tokens, family, qualname}. The prompt ends with a special
    token (`<think>` or `</think>`), so tokenizing prompt and completion apart equals tokenizing
    their concatenation.
    """
    prompts = [render_prompt(tokenizer, s["messages"], s["tools"], s["thinking"]) for s in samples]
    completions = [render_completion(s["final"], s["thinking"]) for s in samples]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    out = []
    for s, p, c in zip(samples, p_ids, c_ids):
        if len(p) + len(c) <= max_len:
            out.append({"ids": p + c, "num_prompt_tokens": len(p), "family": s["family"],
                        "qualname": s["qualname"]})
    return out


def _collate(seqs: list[dict], pad_id: int, prompt_labels: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded batch. Labels are the completion tokens, plus the prompt's if `prompt_labels`."""
    width = max(len(s["ids"]) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        n, p = len(s["ids"]), s["num_prompt_tokens"]
        ids[i, :n] = torch.tensor(s["ids"])
        first = 1 if prompt_labels else p
        labels[i, first:n] = ids[i, first:n]
        mask[i, :n] = 1
    return ids, labels, mask


def batches(seqs: list[dict], batch_size: int, generator: torch.Generator):
    """Endless batches: shuffle, sort each window of 8 batches by length (less padding), shuffle them."""
    while True:
        order = torch.randperm(len(seqs), generator=generator).tolist()
        window = 8 * batch_size
        epoch = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda i: len(seqs[i]["ids"]))
            epoch += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
        for k in torch.randperm(len(epoch), generator=generator).tolist():
            yield [seqs[i] for i in epoch[k]]


def completion_nll(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (completion) positions.

    The lm_head and softmax run on those positions only: most tokens are prompt, and the vocab
    projection is a large share of a tiny model's compute.
    """
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]  # [B, T-1, H]
    target = labels[:, 1:]  # [B, T-1]: position t predicts token t+1
    keep = target != IGNORE
    logits = model.lm_head(hidden[keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of `lr`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def init_latent_norm(model, weight: float) -> None:
    """Start every MLA latent's RMSNorm (kv_a_layernorm) at `weight` instead of 1.

    With Adam each kv_b_proj weight moves by about the learning rate per step, so its outputs (keys and
    values) move in proportion to the summed size of the latent it reads: a 512-wide latent at weight 1 moves
    them 8x as far per step as a 64-wide one. Started at 64/512 the wide latent learns as fast as the narrow
    one did (measured on the tiny world, LOG.md 2026-12-04: loss 2.5 at step 100 instead of 4.6-5.4).
    """
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "kv_a_layernorm"):
                module.kv_a_layernorm.weight.fill_(weight)


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing (DeepSeek-V3 technical report, section 2.1.2): after
    each step every router's `e_score_correction_bias` moves by `speed` toward balance, down for an expert
    that took more than the mean number of tokens, up for one that took fewer. The bias only steers which
    experts are chosen (noaux_tc: the weights are the unbiased scores), as in Kimi-K2.5, whose router
    carries the same bias; a trained, nonzero bias is what makes a served tiny target prove that the engine
    applies it. HF never updates the buffer itself.
    """

    def __init__(self, model, speed: float):
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]  # [E] tokens
        self.mask: torch.Tensor | None = None  # [B*T] bool: the real (non-pad) tokens of the batch
        self.hooks = [r.register_forward_hook(self._count(i)) for i, r in enumerate(self.routers)]

    def _count(self, i: int):
        def hook(_module, _inputs, output):
            if self.mask is not None:
                chosen = output[-1][self.mask]  # [N, top_k] expert ids of the real tokens
                self.loads[i] += torch.bincount(chosen.flatten(), minlength=self.loads[i].numel())
        return hook

    @torch.no_grad()
    def step(self) -> None:
        """Move each bias by `speed` * sign(mean load - load); reset the counts."""
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            load.zero_()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def train_target(model, seqs: list[dict], pad_id: int, steps: int, batch_size: int, lr: float,
                 seed: int, loss_on: str = "all", log_every: int = 50, bias_speed: float = 0.0) -> dict:
    """AdamW on `seqs` for `steps` steps, the routers' bias balanced at `bias_speed` per step
    (RouterBalancer; 0 = left at zero). Returns {losses, seconds, router_bias_max_abs}.

    loss_on "all" also trains on the prompt tokens: the prompts repeat names and docstrings that the
    answers copy, which teaches the copying (induction) the tasks need much faster than the
    completion tokens alone; "completion" trains on what the target will be asked to write only.
    """
    assert loss_on in ("all", "completion"), loss_on
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    model.train()
    stream = batches(seqs, batch_size, generator)
    balancer = RouterBalancer(model, bias_speed) if bias_speed > 0 else None
    losses, t0 = [], time.time()
    bar = tqdm(range(steps), desc="train target", unit="step", mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        ids, labels, mask = _collate(next(stream), pad_id, prompt_labels=loss_on == "all")
        if balancer is not None:
            balancer.mask = mask.flatten().bool()
        loss = completion_nll(model, ids, labels, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if balancer is not None:
            balancer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            elapsed = time.time() - t0
            eta = elapsed / (step + 1) * (steps - step - 1)
            tqdm.write(f"step {step + 1}/{steps} | loss {recent:.3f} | lr {opt.param_groups[0]['lr']:.2e} "
                       f"| {1000 * elapsed / (step + 1):.0f} ms | eta {eta / 60:.1f} m")
    if balancer is not None:
        balancer.remove()
    model.eval()
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    return {"losses": losses, "seconds": time.time() - t0,
            "router_bias_max_abs": max((b.abs().max().item() for b in biases), default=0.0)}


@torch.no_grad()
def completion_loss(model, seqs: list[dict], pad_id: int, batch_size: int = 16) -> dict:
    """Mean cross-entropy (nats/token) over the completion tokens of `seqs`, overall and per family.

    Returns {"loss": float, "by_family": {family: float}}.
    """
    model.eval()
    sums: dict[str, list[float]] = {}  # family -> [nll sum, token count]
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start:start + batch_size]
        ids, labels, mask = _collate(chunk, pad_id)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]  # [B, T-1, H]
        target = labels[:, 1:]  # [B, T-1]
        logits = model.lm_head(hidden).float()  # [B, T-1, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE,
                                                reduction="none")  # [B, T-1], 0 where ignored
        for row, s in enumerate(chunk):
            acc = sums.setdefault(s["family"], [0.0, 0])
            acc[0] += nll[row].sum().item()
            acc[1] += int((target[row] != IGNORE).sum())
    total = sum(v[0] for v in sums.values())
    count = sum(v[1] for v in sums.values())
    return {"loss": total / max(1, count),
            "by_family": {k: round(v[0] / max(1, v[1]), 4) for k, v in sorted(sums.items())}}


def repeated_ngram_rate(ids: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams of one response: a repeat is an n-gram seen earlier in it."""
    seen, repeated = set(), 0
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated, len(grams)


@torch.no_grad()
def greedy_outputs(model, tokenizer, prompts: list[str], eos_id: int, max_new_tokens: int,
                   batch_size: int = 25) -> list[list[int]]:
    """Greedy continuations of `prompts` (left-padded batches), each cut after the first eos."""
    model.eval()
    pad_id = tokenizer.pad_token_id
    outs = []
    for start in range(0, len(prompts), batch_size):
        enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start:start + batch_size]]
        width = max(len(e) for e in enc)
        ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in enc])  # [B, T] left-padded
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
        for row in gen[:, width:].tolist():
            outs.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
    return outs


def diversity(outputs: list[list[int]], eos_id: int) -> dict:
    """Quality gates of greedy outputs: distinct ids, repeated 4-gram rate, share ending with eos."""
    repeated = total = 0
    for ids in outputs:
        r, t = repeated_ngram_rate(ids, 4)
        repeated, total = repeated + r, total + t
    tokens = [t for ids in outputs for t in ids]
    return {"num_responses": len(outputs), "num_tokens": len(tokens),
            "distinct_token_ids": len(set(tokens)),
            "repeated_4gram_rate": round(repeated / max(1, total), 4),
            "ends_with_im_end_share": round(sum(bool(o) and o[-1] == eos_id for o in outputs)
                                            / max(1, len(outputs)), 4),
            "mean_response_tokens": round(len(tokens) / max(1, len(outputs)), 1)}
