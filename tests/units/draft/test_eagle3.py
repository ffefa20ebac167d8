"""The EAGLE-3 draft (common/draft/model.py), its TTT loss (common/training/loss.py), the target head loader."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.training.loss import TTTMeter, simulated_tau, soft_cross_entropy, ttt_loss

from common.training.teacher import step_counts, teacher_targets
from common.draft.export_sglang import export_sglang, export_shapes, load_sglang_export
from common.draft.model import DraftCache, Eagle3DraftModel, draft_config
from common.draft.ttt_attention import ttt_attention, ttt_attention_masked
from common.stage import StageError
from common.target.head import load_target_head, read_target_text_config
from tests.paths import REPO

H, V, DV = 16, 40, 24


def small_model(seed=0, heads=4, kv=2, dv=DV, v=V, h=H) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = {"hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv,
           "intermediate_size": 2 * h, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "vocab_size": v, "draft_vocab_size": dv}
    m = Eagle3DraftModel(cfg)
    torch.nn.init.normal_(m.embed_tokens.weight)
    used = torch.randperm(v)[:dv].sort().values           # draft vocab = a sorted subset of target ids
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    m.set_vocab_mapping(used - torch.arange(dv), t2d)
    return m.eval()


def batch(b=2, t=10, seed=1, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, 3 * h, generator=g), torch.randint(0, v, (b, t), generator=g)


def test_ttt_no_step_output_depends_on_later_positions():
    m = small_model()
    aux, ids = batch()
    base = m.forward_ttt(aux, ids, 4)
    t = 4
    aux2 = aux.clone()
    aux2[:, t + 1] += 3.0                     # the target features at position t+1
    pert = m.forward_ttt(aux2, ids, 4)
    for k in range(4):
        assert torch.allclose(base[k][:, : t + 1], pert[k][:, : t + 1], atol=1e-6), k
        assert not torch.allclose(base[k][:, t + 1], pert[k][:, t + 1], atol=1e-4), k
    # token m is fed at step k to query position m-1-k: nothing before that may change
    mpos = 7
    ids2 = ids.clone()
    ids2[:, mpos] = (ids[:, mpos] + 1) % V
    pert = m.forward_ttt(aux, ids2, 4)
    for k in range(4):
        p = mpos - 1 - k
        assert torch.allclose(base[k][:, :p], pert[k][:, :p], atol=1e-6), k
        assert not torch.allclose(base[k][:, p], pert[k][:, p], atol=1e-4), k


def test_ttt_step_k_sees_only_same_position_keys_of_steps_1_to_k():
    """Perturb the key of TTT step j at one position q; step k >= j at position t may only change
    when q == t (the diagonal). A causal mask over all steps' keys would fail this."""
    m = small_model()
    aux, ids = batch(b=1, t=8)
    base = m.forward_ttt(aux, ids, 4)

    def run_with_key_noise(step_j, pos_q):
        calls = {"n": 0}

        def hook(_mod, _inp, out):
            if calls["n"] == step_j:
                out = out.clone()
                out[:, pos_q] += 5.0
            calls["n"] += 1
            return out
        handle = m.midlayer.self_attn.k_proj.register_forward_hook(hook)
        try:
            return m.forward_ttt(aux, ids, 4)
        finally:
            handle.remove()

    for j in (1, 2):
        out = run_with_key_noise(j, 2)
        for k in range(4):
            same = torch.allclose(out[k], base[k], atol=1e-6)
            assert same == (k < j), (j, k)        # steps before j never see step j's keys
            if k >= j:
                changed = ~torch.isclose(out[k][0], base[k][0], atol=1e-6).all(-1)   # [T]
                assert changed.nonzero().flatten().tolist() == [2], (j, k)


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2)])
def test_ttt_attention_equals_masked_reference_outputs_and_gradients(heads, kv):
    """The causal block + diagonal terms merged by log-sum-exp (ttt_attention) against the first
    implementation, one SDPA over all steps' keys under the [T, (k+1)T] mask: every step's logits and
    the gradient of every trainable parameter agree to float tolerance."""
    m = small_model(heads=heads, kv=kv, h=32).train()
    aux, ids = batch(b=2, t=13, h=32)
    w = [torch.randn(2, 13, DV, generator=torch.Generator().manual_seed(k)) for k in range(5)]
    results = []
    for masked in (True, False):
        m.zero_grad()
        logits = m.forward_ttt(aux, ids, 5, masked_attention=masked)
        sum((lg * wk).sum() for lg, wk in zip(logits, w)).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        results.append((logits, grads))
    (ref_logits, ref_grads), (new_logits, new_grads) = results
    for k in range(5):
        assert torch.allclose(ref_logits[k], new_logits[k], atol=1e-5), k
    for n in ref_grads:
        assert torch.allclose(ref_grads[n], new_grads[n], atol=1e-4, rtol=1e-4), n
        assert ref_grads[n].abs().sum() > 0, n


def test_ttt_attention_kernel_level_fp32_and_bf16():
    """ttt_attention against the masked reference on raw q/k/v (grouped heads), float32 and bfloat16;
    a mask that forgot the diagonal (causal only) would differ."""
    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q = torch.randn(2, 8, 17, 16, generator=g).to(dtype).requires_grad_()
        keys = [torch.randn(2, 2, 17, 16, generator=g).to(dtype).requires_grad_() for _ in range(4)]
        values = [torch.randn(2, 2, 17, 16, generator=g).to(dtype).requires_grad_() for _ in range(4)]
        up = torch.randn(2, 8, 17, 16, generator=g)
        got = ttt_attention(q, keys, values)
        want = ttt_attention_masked(q, keys, values)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tol)
        causal_only = ttt_attention_masked(q, keys[:1], values[:1])
        assert not torch.allclose(got.float(), causal_only.float(), atol=0.1)
        g_got = torch.autograd.grad((got.float() * up).sum(), [q, *keys, *values])
        g_want = torch.autograd.grad((want.float() * up).sum(), [q, *keys, *values])
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a.float(), b.float(), atol=tol * 4), dtype


def test_step_with_cache_equals_ttt_step0_and_the_chain_equals_ttt_steps():
    m = small_model()
    aux, ids = batch(b=2, t=9)
    ttt = m.forward_ttt(aux, ids, 4)
    hidden = m.project(aux)
    cache, outs, logits0 = DraftCache(), [], []
    for i in range(8):                        # token by token: features at i + token i+1, RoPE i
        pos = torch.full((2, 1), i)
        lg, out = m.step(hidden[:, i:i + 1], ids[:, i + 1:i + 2], pos, cache)
        logits0.append(lg)
        outs.append(out)
    assert cache.length == 8
    assert torch.allclose(torch.cat(logits0, 1), ttt[0][:, :8], atol=1e-5)
    # whole-sequence step (no cache) is the same computation
    lg_all, _ = m.step(hidden[:, :8], ids[:, 1:9], torch.arange(8).expand(2, 8))
    assert torch.allclose(lg_all, ttt[0][:, :8], atol=1e-5)
    # inference chain from context 0..t: draft step k at t feeds token t+1+k at RoPE t+k
    for t in (5, 3):                          # longest context first: crop only shortens
        cache.crop(t + 1)
        h = outs[t]
        for k in range(1, 4):
            if t + 1 + k >= 9:
                break
            lg, h = m.step(h, ids[:, t + 1 + k:t + 2 + k], torch.full((2, 1), t + k), cache)
            assert torch.allclose(lg[:, 0], ttt[k][:, t], atol=1e-5), (t, k)


def test_step0_alignment_hand_built():
    """Features at t + token t+1 -> target distribution at t+1, on an example built by hand.

    Attention and MLP outputs are zeroed, fc copies h_low, lm_head is the identity: the draft's argmax
    at t is exactly argmax(aux[t]). The target (identity lm_head) at s puts its mass on c_{s-1}, so
    only the pairing (draft at t) <-> (target at t+1) scores full accuracy.
    """
    n = 8
    m = small_model(h=n, heads=2, kv=2, v=n, dv=n)
    m.set_vocab_mapping(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool))
    with torch.no_grad():
        m.fc.weight.zero_()
        m.fc.weight[:, :n] = torch.eye(n)
        m.midlayer.self_attn.o_proj.weight.zero_()
        m.midlayer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(torch.eye(n))
    c = torch.tensor([3, 1, 4, 1, 5, 2, 6, 5, 3, 0])
    t_len = len(c)
    aux = torch.zeros(1, t_len, 3 * n)
    aux[0, torch.arange(t_len), c] = 4.0                     # draft at t says c_t
    final = torch.zeros(1, t_len, n)
    final[0, torch.arange(1, t_len), c[:-1]] = 8.0           # target at s says c_{s-1}
    ids = torch.arange(t_len).view(1, -1) % n
    recorded = []
    handle = m.embed_tokens.register_forward_hook(lambda _m, inp, _o: recorded.append(inp[0].clone()))
    hidden = m(aux, ids, 1)
    handle.remove()
    assert recorded[0][0, :-1].tolist() == ids[0, 1:].tolist()   # row t embeds token t+1
    mask = torch.ones(1, t_len, dtype=torch.bool)
    teach = teacher_targets(final, torch.eye(n), m.d2t, m.t2d, mask)
    _, stats = ttt_loss(hidden, m.logits, teach, mask, step_counts(teach, 1))
    assert stats["correct"][0] == stats["num_acc"][0] == t_len - 1
    logits = [m.logits(h) for h in hidden]
    # the off-by-one pairing (draft at t vs target at t) would score almost nothing
    misaligned = (logits[0][0, 1:].argmax(-1) == teach["target_arg"][0, 1:]).sum()
    assert misaligned <= 2


@pytest.mark.parametrize("normalization", ["supervised", "batch"])
def test_loss_equals_direct_per_position_computation_and_drops_oov(normalization):
    """ttt_loss (teacher on supervised rows only, head on the rows that have a label, fused soft-CE)
    against a position-by-position loop over full logits: value, counts and gradients."""
    torch.manual_seed(0)
    m = small_model()
    b, t, k_steps, hd = 2, 7, 3, 5
    final = torch.randn(b, t, H) * 3
    lm_head = torch.randn(V, H)
    # force some positions' argmax outside the draft vocab
    oov_id = int((~m.t2d).nonzero()[0])
    final[0, 3] = lm_head[oov_id] * 10
    final[1, 5] = lm_head[oov_id] * 10
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :2] = False
    mask[0, 5] = False
    hidden = [torch.randn(b, t, hd, requires_grad=True) for _ in range(k_steps)]
    w_head = torch.randn(DV, hd, requires_grad=True)
    teach = teacher_targets(final, lm_head, m.d2t, m.t2d, mask, chunk_rows=3)
    assert teach["target_p"].shape == (int(mask.sum()), DV) and teach["row"][0, 5] == -1
    assert not teach["in_vocab"][0, 3] and not teach["in_vocab"][1, 5]
    if normalization == "supervised":
        denominators = step_counts(teach, k_steps).clamp(min=1)
    else:
        denominators = torch.full((k_steps,), b * t)
    total, stats = ttt_loss(hidden, lambda x: x @ w_head.T, teach, mask, denominators.float())
    draft_cols = (torch.arange(DV) + m.d2t).tolist()
    want_total = 0.0
    for k in range(k_steps):
        logits = hidden[k] @ w_head.T                             # [B, T, Dv], every position
        terms, correct, num_acc = [], 0, 0
        for bi in range(b):
            for pos in range(t - 1 - k):
                s = pos + 1 + k
                full = lm_head @ final[bi, s]
                if not mask[bi, s]:
                    continue
                num_acc += 1
                if not m.t2d[full.argmax()]:
                    continue                                  # dropped: target argmax not draftable
                p = torch.softmax(full[draft_cols], 0)
                terms.append(-(p * torch.log_softmax(logits[bi, pos], 0)).sum())
                correct += int(draft_cols[int(logits[bi, pos].argmax())] == int(full.argmax()))
        denom = len(terms) if normalization == "supervised" else b * t
        want_total += 0.8 ** k * torch.stack(terms).sum() / denom
        assert int(stats["correct"][k]) == correct and int(stats["num_acc"][k]) == num_acc
        assert int(stats["num_loss"][k]) == len(terms) == int(step_counts(teach, k_steps)[k])
    assert torch.allclose(total, want_total, atol=1e-5)
    got = torch.autograd.grad(total, [*hidden, w_head])
    want = torch.autograd.grad(want_total, [*hidden, w_head])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)
    assert got[0][0, 2].abs().sum() == 0                  # step 0, label position 3 is OOV: no gradient
    assert got[0][0, 4].abs().sum() == 0                  # label position 5 is not supervised
    inv = int(teach["in_vocab"][0, 1:].nonzero()[0])
    assert got[0][0, inv].abs().sum() > 0                 # an in-vocab supervised label does


def test_soft_cross_entropy_gradient_and_bf16():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6, 50) * 2, -1)
    cases = ((torch.tensor([5, 0, 3, 3]), torch.float32, 1e-5), (torch.tensor([5, 0, 3, 3]), torch.bfloat16, 2e-2),
             (torch.tensor([1, 2, 3, 4]), torch.float32, 1e-5),      # a contiguous range: read as a view
             (torch.tensor([0, 0, 2, 3]), torch.float32, 1e-5))      # first..last spans 4 but is no range
    for rows, dtype, tol in cases:
        logits = (torch.randn(4, 50) * 3).to(dtype).requires_grad_()
        ce, arg = soft_cross_entropy(logits, p, rows)
        ref = -(p[rows] * torch.log_softmax(logits.float(), -1)).sum(-1)
        assert torch.allclose(ce, ref, atol=tol) and torch.equal(arg, logits.float().argmax(-1))
        w = torch.tensor([1.0, 0.0, 2.0, 0.5])
        g, = torch.autograd.grad((ce * w).sum(), logits)
        g_ref, = torch.autograd.grad((ref * w).sum(), logits)
        assert g.dtype == dtype and torch.allclose(g.float(), g_ref.float(), atol=tol)


def test_meter_sums_steps_and_batches():
    meter = TTTMeter(2)
    meter.add({"loss_sum": [torch.tensor(4.0), torch.tensor(1.0)], "num_loss": [torch.tensor(2), torch.tensor(1)],
               "correct": [torch.tensor(1), torch.tensor(0)], "num_acc": [torch.tensor(2), torch.tensor(2)]})
    meter.add({"loss_sum": [torch.tensor(2.0), torch.tensor(3.0)], "num_loss": [torch.tensor(2), torch.tensor(1)],
               "correct": [torch.tensor(2), torch.tensor(1)], "num_acc": [torch.tensor(2), torch.tensor(2)]})
    s = meter.summary()
    assert s["loss"] == [1.5, 2.0] and s["acc"] == [0.75, 0.25] and s["num_supervised"] == 4
    assert abs(s["tau"] - (1 + 0.75 + 0.75 * 0.25)) < 1e-12


def test_simulated_tau():
    assert simulated_tau([0.0, 1.0]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert abs(simulated_tau([0.5, 0.5]) - 1.75) < 1e-9


def test_export_exact_keys_shapes_config_and_strict_roundtrip(tmp_path):
    m = small_model(h=32, heads=4, kv=2)
    out = export_sglang(m, tmp_path / "exp", capture_points=[2, 4, 5])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == DV and cfg["vocab_size"] == V and cfg["tie_word_embeddings"] is False
    assert "target_hidden_size" not in cfg
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    h, dv = 32, DV
    assert shapes == {
        "fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (32, 2 * h),
        "midlayer.self_attn.k_proj.weight": (16, 2 * h), "midlayer.self_attn.v_proj.weight": (16, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, 32), "midlayer.mlp.gate_proj.weight": (2 * h, h),
        "midlayer.mlp.up_proj.weight": (2 * h, h), "midlayer.mlp.down_proj.weight": (h, 2 * h),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
        "lm_head.weight": (dv, h), "d2t": (dv,), "t2d": (V,)}
    assert shapes == export_shapes(m.config)
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    assert dtypes["fc.weight"] == torch.bfloat16
    back = load_sglang_export(out, m.embed_tokens.weight)
    aux, ids = batch(h=32)
    want = m.forward_ttt(aux, ids, 2)
    got = back.forward_ttt(aux, ids, 2)
    assert torch.allclose(want[1], got[1], atol=0.1)                 # bf16 round trip
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    # a file with an extra key (e.g. embed_tokens) is refused
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["embed_tokens.weight"] = m.embed_tokens.weight.detach().clone()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens"):
        load_sglang_export(out, m.embed_tokens.weight)


def test_export_target_hidden_size_only_when_different(tmp_path):
    cfg = dict(small_model().config, target_hidden_size=24)
    m = Eagle3DraftModel(cfg)
    out = export_sglang(m, tmp_path / "e", capture_points=[5, 2, 4])
    c = json.loads((out / "config.json").read_text())
    assert c["target_hidden_size"] == 24 and c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert export_shapes(m.config)["fc.weight"] == (H, 72)


def test_draft_config_defaults_from_the_real_kimi_k25_config():
    kimi = read_target_text_config(REPO / "assets" / "kimi_k25")
    cfg = draft_config(kimi, 32000, num_attention_heads=56)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (56, 8, 128)
    assert cfg["hidden_size"] == 7168 and cfg["intermediate_size"] == 18432
    assert cfg["rope_theta"] == 50000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["vocab_size"] == 163840 and cfg["draft_vocab_size"] == 32000
    default = draft_config(kimi, 32000)
    assert (default["num_attention_heads"], default["num_key_value_heads"], default["head_dim"]) == (64, 8, 112)


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_target_head_reads_only_embed_and_head_through_index(tmp_path, prefix):
    torch.manual_seed(0)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": H, "vocab_size": V}}))
    save_file({prefix + "model.embed_tokens.weight": embed}, str(tmp_path / "model-00001-of-00003.safetensors"))
    save_file({prefix + "lm_head.weight": head, prefix + "model.norm.weight": torch.ones(H)},
              str(tmp_path / "model-00003-of-00003.safetensors"))
    wmap = {prefix + "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
            prefix + "model.layers.0.mlp.experts.0.weight": "model-00002-of-00003.safetensors",
            prefix + "model.norm.weight": "model-00003-of-00003.safetensors",
            prefix + "lm_head.weight": "model-00003-of-00003.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    # shard 2 (the "experts") does not exist on disk: the loader must never need it
    e, hd = load_target_head(tmp_path)
    assert torch.equal(e, embed) and torch.equal(hd, head)
    assert read_target_text_config(tmp_path)["hidden_size"] == H


def test_target_head_single_file_tied_and_missing(tmp_path):
    embed = torch.randn(V, H)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    e, hd = load_target_head(tmp_path, dtype=torch.bfloat16)
    assert e.dtype == torch.bfloat16 and torch.equal(e, hd)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(StageError, match="lm_head"):
        load_target_head(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(StageError, match="neither"):
        load_target_head(tmp_path)


def test_target_head_of_micro_target(micro_target):
    e, hd = load_target_head(micro_target)
    cfg = read_target_text_config(micro_target)
    assert e.shape == hd.shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert not torch.equal(e, hd)


def test_ttt_attention_float32_matmul_path_equals_the_flash_path(monkeypatch):
    """CUDA in float32 (05's replay, the GPU exactness checks) has no flash kernel: the causal block then
    runs in float32 matmuls with the same joint-normaliser backward. Forced here on the CPU, it gives
    the flash path's output and gradients, grouped heads included."""
    from common.draft import ttt_attention as ta

    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    keys = [torch.randn(2, 2, 9, 8, requires_grad=True) for _ in range(3)]
    values = [torch.randn(2, 2, 9, 8, requires_grad=True) for _ in range(3)]
    leaves = [q, *keys, *values]

    def run():
        out = ta.ttt_attention(q, keys, values)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves)
        return out.detach(), grads

    ref_out, ref_grads = run()
    monkeypatch.setattr(ta, "_causal_forward", ta._causal_forward_math)
    out, grads = run()
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(grads, ref_grads))
