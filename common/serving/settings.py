"""A speculative setting as --spec-settings writes it: 'steps,topk,num_draft_tokens', or a chain with
',adaptive' (SGLang's --speculative-adaptive), checked under SGLang's constraints, the widest of the engines
(trees, adaptive steps). An engine that serves less narrows it in its own parse_setting (vLLM: chains only).
"""
from __future__ import annotations

from common.stage import StageError

# --speculative-adaptive (a `,adaptive` setting): the steps it may start from (the union of the default
# config's per-batch-size candidate steps, sglang 0.5.14 adaptive_spec_params.py, 0 = no drafting).
ADAPTIVE = "adaptive"
ADAPTIVE_STEPS = (1, 3, 7)


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
    adaptive = len(parts) == 4 and parts[3].strip() == ADAPTIVE
    try:
        steps, topk, ndt = (int(x) for x in parts[:3] if len(parts) == 3 or adaptive)
    except ValueError:
        raise StageError(f"--spec-settings entry {text!r}: expected 'steps,topk,num_draft_tokens' or "
                         "'steps,1,steps+1,adaptive', e.g. 3,1,4") from None
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
    return (steps, topk, ndt, ADAPTIVE) if adaptive else (steps, topk, ndt)


def is_adaptive(setting) -> bool:
    return setting is not None and len(setting) == 4 and setting[3] == ADAPTIVE
