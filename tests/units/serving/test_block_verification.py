"""vLLM's block verification (rejection_sample_method 'block', Sun et al. 2024) as one more setting: launched,
read back, timed only at the sampled levels, kept out of the cost and load models, refused where vLLM 0.32 does not
verify by blocks (the V1 model runner, the CPU build's), and judged by the agreement check, whose probability gate
still holds: with one-hot drafts (vLLM's default greedy draft) block verification accepts with exactly the law of
token-by-token verification, checked here on the kernel's own formulas."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from common.serving import settings, vllm
from common.serving.agreement import AgreementCheck
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.stage import StageError
from tests.units.serving.test_sweep import NO_MANIFESTS
from tests import paths

FIXTURES = paths.FIXTURES / "vllm"


def block_acceptance_law(p: list[float]) -> list[float]:
    """P(at least m drafts accepted), m = 1..len(p), under vLLM 0.32's block verification of a one-hot draft chain
    whose drafts the target gives probabilities p (v1/worker/gpu/spec_decode/rejection_sampler_utils.py): the
    running ratio P_i = p_1...p_i (_compute_cumulative_log_p_kernel, log q = 0), the residual mass of the next
    position P_i (1 - p_{i+1}) (one-hot closed form), h_i = rm / (rm + 1 - P_i), h_last = P_last, and the accepted
    length the LAST i with u_i <= h_i (_rejection_kernel), u independent: P(acc >= m) = 1 - prod_{i>=m} (1 - h_i)."""
    cum = [math.prod(p[:i + 1]) for i in range(len(p))]
    h = []
    for i in range(len(p)):
        if i < len(p) - 1:
            rm = cum[i] * (1 - p[i + 1])
            h.append(rm / (rm + 1 - cum[i]) if rm + 1 - cum[i] > 0 else 1.0)
        else:
            h.append(cum[i])
    return [1 - math.prod(1 - x for x in h[m - 1:]) for m in range(1, len(p) + 1)]


def test_block_verification_of_one_hot_drafts_accepts_with_the_token_wise_law():
    """So the probability gate's expectation (each draft accepted with p(d) given its accepted prefix) holds for it:
    its gain (the public +4.5% tau at T 1.0) needs a sampled draft, which 05b never launches (block_fault)."""
    rng = random.Random(0)
    for _ in range(200):
        p = [rng.uniform(0.01, 0.99) for _ in range(rng.randint(1, 7))]
        assert block_acceptance_law(p) == pytest.approx([math.prod(p[:m]) for m in range(1, len(p) + 1)], abs=1e-12)


def test_block_is_a_vllm_setting_launched_read_back_and_timed_at_the_sampled_levels():
    block = settings.parse_spec_setting("3,1,4,block")
    assert block == (3, 1, 4, "block") and settings.is_block(block) and not settings.fixed_chain(block)
    assert settings.timed_levels(block, [0.0, 1.0], 1.0) == [1.0]
    assert settings.timed_levels((3, 1, 4), [0.0, 1.0], 1.0) == [0.0, 1.0]
    with pytest.raises(StageError, match="chains only"):
        settings.parse_spec_setting("3,2,6,block")
    with pytest.raises(StageError, match="block verification is vLLM's"):
        SGLangEngine(Path("t"), Path("e"), *NO_MANIFESTS).parse_setting("3,1,4,block")
    v = VllmEngine(Path("t"), Path("e"), Path("d"), *NO_MANIFESTS)
    assert v.parse_setting("3,1,4,block") == block
    argv = vllm.server_command("/m", 1, vllm.VllmSettings(python="py"), True, "/d", 3, verify=vllm.verify_config(block))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["rejection_sample_method"] == "block" and vllm.lossy_or_simulated(argv) == []  # lossless
    assert AgreementCheck.judges(block) is None and AgreementCheck.judges((3, 1, 4, "adaptive"))


def test_block_is_refused_where_vllm_does_not_verify_by_blocks(tmp_path):
    info = json.loads((FIXTURES / "server_info_eagle3.json").read_text())["vllm_config"]
    info["speculative_config"]["rejection_sample_method"] = "block"
    v1 = FIXTURES / "aux_layers.log"   # a CPU server's log: the V1 runner
    assert "no 'Using V2 Model Runner'" in vllm.block_fault(info, v1)
    v2 = tmp_path / "v2.log"
    v2.write_text(v1.read_text() + "INFO [gpu_worker.py:518] Using V2 Model Runner\n")
    assert vllm.block_fault(info, v2) is None
    assert vllm.runner_in_log(v2)["model_runner"] == "V2"
    assert "attached" in vllm.block_fault(info, None)
    info["speculative_config"]["draft_sample_method"] = "probabilistic"
    assert "probability gate cannot judge it" in vllm.block_fault(info, v2)
    # and it is kept out of the fits of fixed chains, as an adaptive setting is
    from common.serving import deploy
    req = [{"latency_s": 1.0, "ttft_s": 0.1, "completion_tokens": 40, "spec_verify_ct": 20}]
    run = {"cuda_graph": True, "setting": [3, 1, 4, "block"], "by_concurrency": {"1": {
        "requests": req, "accept_length_pooled": 2.0, "output_tokens_per_s": 40.0}}}
    assert deploy.cost_models({"runs": {"3-1-4-block/graph": run}}, None) == []
