"""The draft's MLA form and the EAGLE-3.1 options (common/draft/model.py, rope.py): the TTT forward and its
gradients against an independent float64 reference written from the engines' formulas, the absorbed MLA of
inference against the naive one and the TTT chain, where RoPE goes (the last dims, interleaved pairs),
which state norm_output feeds on, fc_norm, the KV bytes, and the MLA export's layout."""
import json
import math

import pytest
import torch
from safetensors import safe_open

from common.draft.export_sglang import export_sglang, export_shapes, load_sglang_export
from common.draft.model import DraftCache, Eagle3DraftModel, draft_config, kv_bytes_per_token
from common.draft.rope import Rope, rope_magnitudes

H, V, DV, T = 16, 40, 24, 11
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_config(yarn=True, fc_norm=False, norm_output=False, **over) -> dict:
    cfg = {"attention": "mla", "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": 12, "kv_lora_rank": 10, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
           "intermediate_size": 2 * H, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "rope_scaling": dict(YARN) if yarn else None, "max_position_embeddings": 256, "vocab_size": V,
           "draft_vocab_size": DV, "fc_norm": fc_norm, "norm_output": norm_output}
    return {**cfg, **over}


def make(cfg: dict, seed=0) -> Eagle3DraftModel:
    """A draft with every weight random, norms included (a norm left at 1 would hide a missing norm)."""
    torch.manual_seed(seed)
    m = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            (p.normal_(1.0, 0.2) if p.dim() == 1 else p.normal_(0.0, 0.3)) if "embed" not in name else p.normal_()
    used = torch.randperm(V)[:DV].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(DV), t2d)
    return m.eval()


def inputs(b=2, t=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, 3 * H, generator=g), torch.randint(0, V, (b, t), generator=g)


# ---- an independent float64 reference of the MLA draft's TTT forward ----

def rms(x, w, eps=1e-5):
    return w * x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def yarn_inv_freq64(dim, theta, s):
    """DeepSeek YaRN inverse frequencies in float64 (SGLang rope_variant.py / vLLM deepseek_scaling_rope.py)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra, inter = 1 / base, 1 / (s["factor"] * base)
    corr = lambda rot: dim * math.log(s["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(corr(s["beta_fast"])), 0), min(math.ceil(corr(s["beta_slow"])), dim - 1)
    high = high + 0.001 if low == high else high
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inter * (1 - keep) + extra * keep


def reference_ttt(model, cfg, aux, ids, steps):
    """Logits of every TTT step, float64, from the weights alone: naive MLA, explicit pair rotation
    (pairs 2i, 2i+1 at angle position * inv_freq[i]), the TTT mask spelled out position by position."""
    P = {n: p.double() for n, p in model.named_parameters()}
    nh, nope, rope, vd, kvl = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                  "v_head_dim", "kv_lora_rank"))
    s = cfg["rope_scaling"]
    inv = yarn_inv_freq64(rope, cfg["rope_theta"], s) if s else \
        1 / cfg["rope_theta"] ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    mag = (0.1 * math.log(s["factor"]) + 1) / (0.1 * math.log(s["factor"]) + 1) if s else 1.0   # mscale == mscale_all_dim
    scale = (nope + rope) ** -0.5 * ((0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1) ** 2 if s else 1.0)

    def rot(x, pos):                                            # x [B, T, (nh,) rope]
        ang = pos[:, None] * inv                                 # [T, rope/2]
        if x.dim() == 4:
            ang = ang[:, None]
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).flatten(-2)
        return out * mag

    b, t = ids.shape
    h = aux.double()
    if cfg["fc_norm"]:
        h = torch.cat([rms(c, P[f"fc_norm.{j}.weight"]) for j, c in enumerate(h.chunk(3, -1))], -1)
    h = h @ P["fc.weight"].T
    keys, vals, logits = [], [], []
    for k in range(steps):
        tok = torch.cat([ids[:, 1 + k:], torch.zeros(b, 1 + k, dtype=ids.dtype)], 1)
        x = torch.cat([rms(P["embed_tokens.weight"][tok], P["midlayer.input_layernorm.weight"]),
                       rms(h, P["midlayer.hidden_norm.weight"])], -1)
        a = "midlayer.self_attn."
        q = (rms(x @ P[a + "q_a_proj.weight"].T, P[a + "q_a_layernorm.weight"]) @ P[a + "q_b_proj.weight"].T)
        q = q.view(b, t, nh, nope + rope)
        kva = x @ P[a + "kv_a_proj_with_mqa.weight"].T
        kv = (rms(kva[..., :kvl], P[a + "kv_a_layernorm.weight"]) @ P[a + "kv_b_proj.weight"].T).view(b, t, nh, nope + vd)
        pos = torch.arange(t, dtype=torch.float64) + k
        qf = torch.cat([q[..., :nope], rot(q[..., nope:], pos)], -1)                      # [B, T, nh, qk]
        kf = torch.cat([kv[..., :nope], rot(kva[..., kvl:], pos)[:, :, None].expand(b, t, nh, rope)], -1)
        keys.append(kf)
        vals.append(kv[..., nope:])
        out = torch.zeros(b, t, nh, vd, dtype=torch.float64)
        for i in range(t):                                       # query (i, k): step-0 keys <= i, then the diagonal
            ks = torch.cat([keys[0][:, :i + 1]] + [kj[:, i:i + 1] for kj in keys[1:]], 1)   # [B, S, nh, qk]
            vs = torch.cat([vals[0][:, :i + 1]] + [vj[:, i:i + 1] for vj in vals[1:]], 1)
            p = (torch.einsum("bhd,bshd->bhs", qf[:, i], ks) * scale).softmax(-1)
            out[:, i] = torch.einsum("bhs,bshd->bhd", p, vs)
        r = h + out.reshape(b, t, nh * vd) @ P[a + "o_proj.weight"].T
        m = rms(r, P["midlayer.post_attention_layernorm.weight"])
        mlp = "midlayer.mlp."
        o = r + (torch.nn.functional.silu(m @ P[mlp + "gate_proj.weight"].T) * (m @ P[mlp + "up_proj.weight"].T)) \
            @ P[mlp + "down_proj.weight"].T
        normed = rms(o, P["norm.weight"])
        logits.append(normed @ P["lm_head.weight"].T)
        h = normed if cfg["norm_output"] else o
    return logits


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}, {"yarn": False}])
def test_mla_ttt_equals_the_float64_reference_forward_and_backward(options):
    cfg = mla_config(**options)
    m = make(cfg).train()
    aux, ids = inputs()
    w = [torch.randn(2, T, DV, generator=torch.Generator().manual_seed(10 + k), dtype=torch.float64) for k in range(4)]
    got = m.forward_ttt(aux, ids, 4)
    sum((lg.double() * wk).sum() for lg, wk in zip(got, w)).backward()
    ref_model = make(cfg)
    for p in ref_model.parameters():
        p.requires_grad_(True)
    ref = reference_ttt(ref_model, cfg, aux, ids, 4)
    params = dict(ref_model.named_parameters())
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum((lg * wk).sum() for lg, wk in zip(ref, w)), [params[n] for n in names])
    for k in range(4):
        assert torch.allclose(got[k].double(), ref[k], atol=2e-5, rtol=1e-5), (k, (got[k].double() - ref[k]).abs().max())
    for n, g_ref in zip(names, grads):
        g = dict(m.named_parameters())[n].grad.double()
        assert g_ref.abs().sum() > 0, n
        assert torch.allclose(g, g_ref.to(g), atol=2e-4, rtol=2e-4), (n, (g - g_ref).abs().max())


def test_mla_absorbed_and_naive_inference_equal_each_other_and_the_ttt_chain():
    """The engines decode with the absorbed MLA over a latent cache; training runs the naive form. The
    draft's step in both forms, token by token and then as a chain from a cropped cache, gives the TTT
    forward's logits."""
    cfg = mla_config(fc_norm=True, norm_output=True)
    m = make(cfg)
    aux, ids = inputs(t=9)
    ttt = m.forward_ttt(aux, ids, 4)
    hidden = m.project(aux)
    runs = {}
    for naive in (False, True):
        cache, outs, logits0 = DraftCache(), [], []
        for i in range(8):
            lg, out = m.step(hidden[:, i:i + 1], ids[:, i + 1:i + 2], torch.full((2, 1), i), cache, naive_mla=naive)
            logits0.append(lg)
            outs.append(out)
        assert cache.keys[0].shape == (2, 1, 8, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])  # the latent
        assert torch.allclose(torch.cat(logits0, 1), ttt[0][:, :8], atol=1e-5)
        chain = []
        for t in (5, 3):
            cache.crop(t + 1)
            h = outs[t]
            for k in range(1, 4):
                if t + 1 + k >= 9:
                    break
                lg, h = m.step(h, ids[:, t + 1 + k:t + 2 + k], torch.full((2, 1), t + k), cache, naive_mla=naive)
                assert torch.allclose(lg[:, 0], ttt[k][:, t], atol=1e-5), (naive, t, k)
                chain.append(lg)
        runs[naive] = torch.cat(logits0 + chain, 1)
    assert torch.allclose(runs[False], runs[True], atol=1e-5)


def test_mla_rope_sits_on_the_last_dims_of_q_and_the_latent_in_interleaved_pairs():
    """q = [q_nope | q_pe] and the latent = [c | k_pe]: RoPE on the LAST qk_rope dims, pairs (2i, 2i+1).
    Rotating the first dims, or halves (i, i + d/2), would give other keys; the test shows both differ."""
    cfg = mla_config(yarn=False)
    attn = make(cfg).midlayer.self_attn
    x = torch.randn(1, 5, 2 * H)
    pos = torch.arange(5)[None] + 3
    q, k, v = attn.qkv(x, pos)
    nope, rope, kvl = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    with torch.no_grad():
        q_raw = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, 5, 4, nope + rope).transpose(1, 2)
        k_pe_raw = attn.kv_a_proj_with_mqa(x)[..., kvl:]                                    # [1, 5, rope]
    inv = 1 / cfg["rope_theta"] ** (torch.arange(0, rope, 2).float() / rope)
    ang = (pos[0, :, None].float() * inv)                                                  # [5, rope/2]

    def pairs(z):   # rotate (2i, 2i+1) by ang[:, i]
        a, b = z[..., 0::2], z[..., 1::2]
        return torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).flatten(-2)

    def halves(z):
        a, b = z[..., :rope // 2], z[..., rope // 2:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    assert torch.allclose(q[..., :nope], q_raw[..., :nope])                                 # q_nope untouched
    assert torch.allclose(q[..., nope:], pairs(q_raw[..., nope:]), atol=1e-6)
    assert torch.allclose(k[0, :, :, nope:], pairs(k_pe_raw[0]).expand(4, 5, rope), atol=1e-6)  # one k_pe, all heads
    assert not torch.allclose(q[..., nope:], halves(q_raw[..., nope:]), atol=1e-3)
    assert not torch.allclose(q[..., :rope], pairs(q_raw[..., :rope]), atol=1e-3)
    assert v.shape[-1] == nope + rope and not v[..., cfg["v_head_dim"]:].any()             # the pad is zero


def test_mha_rope_stays_rotate_half_and_yarn_follows_each_engine():
    """The Llama form rotates halves (NeoX) as before; YaRN's magnitude: SGLang 0.1 ln(f) + 1 for Llama,
    vLLM the mscale ratio when both are set; DeepSeek YaRN: the ratio, and mscale(f, mscale_all_dim)^2 on
    the softmax scale, in both engines."""
    r = Rope.of({"attention": "mha", "head_dim": 8, "rope_theta": 10000.0})
    assert not r.interleaved and r.magnitude == 1.0
    x = torch.randn(1, 1, 3, 8)
    cos, sin = r.cos_sin(torch.arange(3)[None])
    a, b = x[..., :4], x[..., 4:]
    want = torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1)
    assert torch.allclose(r.apply(x, cos, sin), want, atol=1e-6)
    assert rope_magnitudes("mha", YARN, "sglang") == (pytest.approx(0.1 * math.log(8) + 1), 1.0)
    assert rope_magnitudes("mha", YARN, "vllm") == (1.0, 1.0)
    for engine in ("sglang", "vllm"):
        assert rope_magnitudes("mla", YARN, engine) == (1.0, pytest.approx((0.1 * math.log(8) + 1) ** 2))


def test_norm_output_feeds_the_post_norm_state_to_the_next_step():
    """Step 0's logits do not depend on norm_output; the hidden that step 1 reads is norm(out) with it
    and out without it (checked on the input of hidden_norm), for both attention forms."""
    for attention in ("mla", "mha"):
        over = {} if attention == "mla" else {"attention": "mha", "num_key_value_heads": 2, "head_dim": 4,
                                             "rope_scaling": None}
        seen = {}
        for norm_output in (False, True):
            m = make(mla_config(norm_output=norm_output, **over))
            aux, ids = inputs(t=6)
            fed = []
            handle = m.midlayer.hidden_norm.register_forward_hook(lambda _m, i, _o: fed.append(i[0].detach()))
            with torch.no_grad():
                outs = m(aux, ids, 2)
            handle.remove()
            want = m.norm(outs[0]) if norm_output else outs[0]
            assert torch.allclose(fed[1], want, atol=1e-6), (attention, norm_output)
            seen[norm_output] = outs
        assert torch.allclose(seen[False][0], seen[True][0])
        assert not torch.allclose(seen[False][1], seen[True][1], atol=1e-4)


def test_fc_norm_norms_each_captured_state_on_its_own():
    """With fc_norm, fc reads [norm0(h_low) | norm1(h_mid) | norm2(h_high)]: scaling one captured state
    changes nothing (RMSNorm is scale-free); without it, it does."""
    aux, _ = inputs(t=4)
    scaled = aux.clone()
    scaled[..., H:2 * H] *= 7.0
    for fc_norm in (True, False):
        m = make(mla_config(fc_norm=fc_norm))
        with torch.no_grad():
            same = torch.allclose(m.project(aux), m.project(scaled), atol=1e-5)
        assert same == fc_norm
    m = make(mla_config(fc_norm=True))
    with torch.no_grad():
        want = m.fc(torch.cat([m.fc_norm[j](c) for j, c in enumerate(aux.chunk(3, -1))], -1))
        assert torch.allclose(m.project(aux), want)


def test_kv_bytes_per_token_mla_latent_vs_mha_heads():
    """Kimi-sized: the MLA draft caches 512 + 64 values per token (1,152 bytes in bf16); the MHA draft with
    8 KV heads of 112 caches 2 x 8 x 112 (3,584 bytes), the public MHA draft's 64 KV heads of 128: 32 KB."""
    kimi = {"hidden_size": 7168, "num_attention_heads": 64, "vocab_size": 163840, "intermediate_size": 18432,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "rope_theta": 50000.0, "rms_norm_eps": 1e-5}
    assert kv_bytes_per_token(draft_config(kimi, 32000, attention="mla")) == 1152
    assert kv_bytes_per_token(draft_config(kimi, 32000)) == 3584
    assert kv_bytes_per_token({"attention": "mha", "num_key_value_heads": 64, "head_dim": 128}) == 32768


def test_mla_draft_config_takes_the_targets_mla_dims_and_yarn():
    kimi = {"hidden_size": 7168, "num_attention_heads": 64, "vocab_size": 163840, "intermediate_size": 18432,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}}
    cfg = draft_config(kimi, 32000, attention="mla", fc_norm=True)
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
            cfg["v_head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (1536, 512, 128, 64, 128, 64, 64)
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 64.0 and cfg["fc_norm"]
    assert draft_config(kimi, 32000)["rope_scaling"] is None          # the Llama form keeps plain RoPE
    smol = {"hidden_size": 576, "num_attention_heads": 9, "vocab_size": 49152, "intermediate_size": 1536,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
    cfg = draft_config(smol, 8192, attention="mla")
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
            cfg["v_head_dim"]) == (768, 256, 64, 32, 64)


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}])
def test_mla_export_layout_config_and_strict_roundtrip(tmp_path, options):
    cfg = mla_config(**options)
    m = make(cfg)
    out = export_sglang(m, tmp_path / "e", [2, 4, 5], torch_dtype="float32")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "kimi_k2"
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]) == (12, 10, 4) and "head_dim" not in c
    assert c["rope_scaling"] == YARN and c["tie_word_embeddings"] is False and c["num_hidden_layers"] == 1
    assert c.get("fc_norm", False) == options.get("fc_norm", False)
    assert c.get("norm_output", False) == options.get("norm_output", False)
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    want = {("layers.0." + n[len("midlayer."):]) if n.startswith("midlayer.") else n for n in export_shapes(cfg)}
    assert names == want and not any(n.startswith("midlayer.") for n in names)
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in names and "embed_tokens.weight" not in names
    back = load_sglang_export(out, m.embed_tokens.weight.detach())
    aux, ids = inputs(t=6)
    with torch.no_grad():
        for a, b in zip(m.forward_ttt(aux, ids, 3), back.forward_ttt(aux, ids, 3)):
            assert torch.equal(a, b)
