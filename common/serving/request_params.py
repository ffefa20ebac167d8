"""The sampling parameters of every request 05b sends, stated in full.

A server fills in what a request leaves out from its own defaults: vLLM from the model's
`generation_config.json` (`--generation-config auto`, its default: it logs "Default vLLM sampling parameters
have been overridden"), SGLang from `--preferred-sampling-params` / `--sampling-defaults model`. A Kimi
snapshot's generation config may set temperature, top-p or a repetition penalty, so a request that says only
"temperature 1" could be timed under another distribution on one server than on the next. Every request
therefore sets temperature, top-p, top-k (off), min-p (off), repetition penalty (off) and a seed.

Seeds are derived as sampled.prompt_seed derives its own (05b's --bench-seed, the prompt's ids, T, top-p, a stream
name), never from a prompt's place in the list or the clock, so every server and every rerun sends the same
seed with the same prompt at the same temperature.
"""
from __future__ import annotations

from types import SimpleNamespace

# Off in both engines: top_k -1 (vLLM 0.32: 0 or -1, `sampling_params.py`; SGLang: -1 = the whole vocabulary),
# min_p 0, repetition_penalty 1.
OFF = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
SEED_RANGE = 2 ** 31  # the agreement check's range (agreement.AgreementCheck.sampled): fits either engine


def pinned(sampling: dict | None) -> dict:
    """{temperature, top_p, top_k, min_p, repetition_penalty, seed} of one request: `sampling`'s temperature,
    top-p and seed (greedy, top-p 1 and seed 0 without them), every other parameter off; `ignore_eos` (both
    engines' name) when `sampling` asks for it: the break-even map's answers all run to the budget
    (common/serving/breakeven.py), a simulated SGLang server's never end anyway."""
    s = sampling or {}
    t = float(s.get("temperature", 0.0))
    return {"temperature": t, "top_p": float(s.get("top_p", 1.0)) if t > 0 else 1.0, **OFF,
            "seed": int(s.get("seed", 0)), **({"ignore_eos": True} if s.get("ignore_eos") else {})}


def request_seed(seed: int, ids: list[int], temperature: float, top_p: float, stream: str = "serve") -> int:
    """sampled.prompt_seed of one request (stream "serve": the sweep's timed requests; "engine": the
    agreement check's), in the engines' seed range."""
    from common.benchmark.sampled import prompt_seed

    params = SimpleNamespace(temperature=float(temperature), top_p=float(top_p))
    return prompt_seed(seed, list(ids), params, stream) % SEED_RANGE


def timed_sampling(prompts: list[list[int]], tags: list[dict | None], level: float, top_p: float,
                   instant: float | None, seed: int) -> list[dict]:
    """Each timed request's pinned parameters at temperature level `level`: greedy at 0; above it `level`
    and `top_p`, except that a thinking-off prompt (its tag) is sampled at `instant` when the preset gives
    the model's own instant-mode temperature."""
    out = []
    for ids, tag in zip(prompts, tags):
        t = instant if level > 0 and instant is not None and (tag or {}).get("thinking") is False else level
        p = top_p if t > 0 else 1.0
        out.append(pinned({"temperature": t, "top_p": p, "seed": request_seed(seed, ids, t, p)}))
    return out
