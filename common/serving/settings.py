"""A speculative setting as --spec-settings writes it: 'steps,topk,num_draft_tokens', or a chain with
',adaptive' (SGLang's --speculative-adaptive) or ',block' (vLLM's block verification), checked under SGLang's
constraints, the widest of the engines (trees, adaptive steps). An engine that serves less narrows it in its
own parse_setting (vLLM: chains, block verification; SGLang: no block verification).

A simulated setting (05b --simulate-accept-lengths: common/serving/breakeven.py) is a chain with a 4th item
"simL", the accept length every verify round is made to commit (`simulated`, `simulated_length`); 05b makes
them itself, never from --spec-settings, and keeps their runs apart from every measured one.
"""
from __future__ import annotations

from common.stage import StageError

# --speculative-adaptive (a `,adaptive` setting): the steps it may start from (the union of the default
# config's per-batch-size candidate steps, sglang 0.5.14 adaptive_spec_params.py, 0 = no drafting).
ADAPTIVE = "adaptive"
ADAPTIVE_STEPS = (1, 3, 7)
# ',block': vLLM's `rejection_sample_method: "block"` (block verification, Sun et al. 2024) for the chain
BLOCK = "block"
SIM = "sim"


def parse_spec_setting(text: str) -> tuple:
    """'steps,topk,num_draft_tokens[,adaptive]' -> (steps, topk, ndt) or (steps, topk, ndt, "adaptive"),
    checked the way SGLang constrains them.

    topk 1 (a chain): SGLang forces num_draft_tokens = steps + 1, so anything else is refused here
    rather than silently changed. topk > 1 (a tree): at most 1 + topk + (steps-1)*topk^2 candidates.
    `adaptive` = `--speculative-adaptive` starting from that chain (SGLang then moves the steps between
    ADAPTIVE_STEPS by batch size and an EMA of accept length); its rules are checked here, not left to
    SGLang, which drops the flag with a warning when they fail (speculative_hook.py
    `_maybe_disable_adaptive`) or refuses the start.
    """
    parts = str(text).split(",")
    tail = parts[3].strip() if len(parts) == 4 else None
    try:
        steps, topk, ndt = (int(x) for x in parts[:3] if len(parts) == 3 or tail in (ADAPTIVE, BLOCK))
    except ValueError:
        raise StageError(f"--spec-settings entry {text!r}: expected 'steps,topk,num_draft_tokens', "
                         "'steps,1,steps+1,adaptive' or 'steps,1,steps+1,block', e.g. 3,1,4") from None
    adaptive = tail == ADAPTIVE
    if tail == BLOCK and topk != 1:
        raise StageError(f"--spec-settings {text!r}: block verification is vLLM's, which drafts chains only (topk 1)")
    if adaptive and (topk != 1 or steps not in ADAPTIVE_STEPS):
        raise StageError(f"--spec-settings {text!r}: --speculative-adaptive runs chains only (topk 1) and "
                         f"starts from one of its candidate steps {list(ADAPTIVE_STEPS)} (sglang 0.5.14 "
                         "adaptive_spec_params.py DEFAULT_ADAPTIVE_CONFIG)")
    if steps < 1 or topk < 1 or ndt < 2:
        raise StageError(f"--spec-settings {text!r}: steps >= 1, topk >= 1, num_draft_tokens >= 2")
    if topk == 1 and ndt != steps + 1:
        raise StageError(f"--spec-settings {text!r}: with topk 1 SGLang uses num_draft_tokens = steps + 1 "
                         f"= {steps + 1}")
    if topk > 1 and ndt > 1 + topk + (steps - 1) * topk * topk:
        raise StageError(f"--spec-settings {text!r}: a tree of {steps} steps x topk {topk} has fewer "
                         f"than {ndt - 1} draft tokens")
    return (steps, topk, ndt, tail) if tail else (steps, topk, ndt)


def is_adaptive(setting) -> bool:
    return setting is not None and len(setting) == 4 and setting[3] == ADAPTIVE


def is_block(setting) -> bool:
    return setting is not None and len(setting) == 4 and setting[3] == BLOCK


def simulated(setting, length: float) -> tuple:
    """The chain `setting` with every verify round made to commit `length` tokens on average (05b makes it)."""
    steps, topk, ndt = setting[:3]
    return steps, topk, ndt, f"{SIM}{float(length):g}"


def simulated_length(setting) -> float | None:
    """The simulated accept length of a setting `simulated` made, None for any other setting."""
    if setting is None or len(setting) != 4 or not str(setting[3]).startswith(SIM):
        return None
    return float(str(setting[3])[len(SIM):])


def fixed_chain(setting) -> bool:
    """A setting whose every round drafts and verifies the same shape with the engine's usual verify (no
    adaptive steps, no block verification, no simulation): what the cost and load models fit."""
    return setting is not None and len(setting) == 3


def timed_levels(setting, levels: list[float], serving: float) -> list[float]:
    """The temperature levels a run of `setting` is timed at: every level; block verification only above 0
    (greedily it is the engine's argmax check, the plain chain's); a simulated setting only at `serving`, the
    level the break-even map is drawn at."""
    if simulated_length(setting) is not None:
        return [serving]
    return [t for t in levels if t > 0] if is_block(setting) else list(levels)
