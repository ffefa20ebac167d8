"""The draft's RoPE (common/draft/rope.py) against the serving engine's own code: vLLM 0.32's get_rope, run
in the engine venv (build/vllm-venv), rotates the same q/k at the same positions for every form the draft
uses: the Llama form (NeoX halves; YaRN with and without mscale fields) and the MLA form (DeepSeek YaRN,
interleaved pairs). SGLang needs a GPU box; its formulas are the same as vLLM's except Llama YaRN's
magnitude (rope.py names it), which test_draft_mla.py pins."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from common.draft.rope import Rope, rope_magnitudes
from tests.paths import ENGINE_PY

pytestmark = pytest.mark.engine

YARN = {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
CASES = {   # name: (our config, vLLM get_rope arguments)
    "mha": ({"attention": "mha", "head_dim": 16, "rope_theta": 10000.0},
            {"head_size": 16, "is_neox_style": True, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
    "mha_yarn": ({"attention": "mha", "head_dim": 16, "rope_theta": 50000.0, "rope_scaling": {"rope_type": "yarn", **YARN}},
                 {"head_size": 16, "is_neox_style": True,
                  "rope_parameters": {"rope_theta": 50000.0, "rope_type": "yarn", **YARN}}),
    # with both mscale fields vLLM's Llama YaRN takes their ratio (1.0 here) where SGLang keeps 0.1 ln(f) + 1
    "mha_yarn_mscale": ({"attention": "mha", "head_dim": 16, "rope_theta": 50000.0,
                         "rope_scaling": {"rope_type": "yarn", **YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
                        {"head_size": 16, "is_neox_style": True, "rope_parameters": {
                            "rope_theta": 50000.0, "rope_type": "yarn", **YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # the MLA form: vLLM's DeepseekV2MLAAttention turns any scaled rope_type into deepseek_yarn, is_neox False
    "mla_yarn": ({"attention": "mla", "qk_rope_head_dim": 16, "rope_theta": 50000.0,
                  "rope_scaling": {"rope_type": "yarn", **YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
                 {"head_size": 16, "is_neox_style": False,
                  "rope_parameters": {"rope_theta": 50000.0, "rope_type": "deepseek_yarn", **YARN, "mscale": 1.0,
                                      "mscale_all_dim": 1.0}}),
    "mla": ({"attention": "mla", "qk_rope_head_dim": 16, "rope_theta": 10000.0},
            {"head_size": 16, "is_neox_style": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
}
SCRIPT = """
import json, sys, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
cases, data = json.loads(sys.argv[1]), torch.load(sys.argv[2])
out = {}
with set_current_vllm_config(VllmConfig()):
    for name, kw in cases.items():
        rope = get_rope(max_position=4096, dtype=torch.float32, **kw)
        q, k = data["q"].clone(), data["k"].clone()
        out[name] = rope.forward_native(data["positions"], q, k)
torch.save(out, sys.argv[3])
"""


def test_draft_rope_equals_vllms_rotation_for_every_form(tmp_path):
    assert ENGINE_PY.exists(), "the engine venv is missing: make engine"
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 7, 15, 16, 40, 100, 127])
    q, k = torch.randn(len(positions), 3, 16, generator=g), torch.randn(len(positions), 1, 16, generator=g)
    torch.save({"positions": positions, "q": q, "k": k}, tmp_path / "in.pt")
    subprocess.run([str(ENGINE_PY), "-c", SCRIPT, json.dumps({n: c[1] for n, c in CASES.items()}),
                    str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], check=True, capture_output=True,
                   env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    theirs = torch.load(tmp_path / "out.pt")
    for name, (cfg, _) in CASES.items():
        rope = Rope.of(cfg)
        if name == "mha_yarn_mscale":   # the draft follows SGLang; this row checks rope_magnitudes' vLLM rule
            vllm_magnitude = rope_magnitudes("mha", cfg["rope_scaling"], "vllm")[0]
            assert vllm_magnitude != rope.magnitude
            rope = Rope(rope.rotary_dim, rope.theta, rope.interleaved, rope.scaling, vllm_magnitude)
        cos, sin = rope.cos_sin(positions[None])
        ours_q = rope.apply(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)     # [T, heads, d]
        ours_k = rope.apply(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        assert torch.allclose(ours_q, theirs[name][0], atol=1e-5), (name, (ours_q - theirs[name][0]).abs().max())
        assert torch.allclose(ours_k, theirs[name][1], atol=1e-5), name
        # the other pairing would not match: the test can tell interleaved from halves
        other = Rope(rope.rotary_dim, rope.theta, not rope.interleaved, rope.scaling, rope.magnitude)
        assert not torch.allclose(other.apply(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1),
                                  theirs[name][0], atol=1e-3), name
    # the Llama YaRN magnitude without mscale fields: both engines 0.1 ln(f) + 1, as the draft
    assert rope_magnitudes("mha", CASES["mha_yarn"][0]["rope_scaling"], "vllm") == \
        rope_magnitudes("mha", CASES["mha_yarn"][0]["rope_scaling"], "sglang")
