"""TTT attention: the draft's attention over all TTT steps so far, in the training forward.

Step k's queries see the step-0 keys causally and, of steps 1..k, only the key at the same position
(ttt_attention_mask). ttt_attention computes that without the masked-out work (a causal flash call
plus k per-position dot products, one softmax over both, with a custom backward);
ttt_attention_masked is the plain masked SDPA it is tested against (tests/units/draft/test_eagle3.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """Mask [T, (step+1)*T] (True = attend) of TTT step `step` over keys [step-0 | step-1 | ... | step-k].

    Query (t, k) sees step-0 keys at positions <= t (causal block) and, from each of steps 1..k, ONLY
    the key at the same position t (diagonal blocks): at inference the depth-k draft token sees the
    verified context plus its own chain of ancestors, which sit at the same TTT position t.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diag = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def ttt_attention_masked(q, keys, values, scale: float | None = None):
    """The first TTT attention, kept as the reference of ttt_attention (tests, benchmark): one SDPA over
    the keys of all steps so far under ttt_attention_mask. It scores (k+1) T^2 pairs per head at step k
    where T(T+1)/2 + kT are attended. q [B, nh, T, d]; keys/values: per step j <= k, [B, nkv, T, d];
    scale: the softmax scale (default d^-0.5; MLA under YaRN multiplies it)."""
    rep = q.shape[1] // keys[0].shape[1]
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = ttt_attention_mask(q.shape[2], len(keys) - 1, device=q.device)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)


def ttt_attention(q, keys, values, scale: float | None = None):
    """TTT attention of step k = len(keys) - 1 without masked-out work -> [B, nh, T, d].

    q [B, nh, T, d]; keys/values: per step j <= k, [B, nkv, T, d] (post-RoPE; nh a multiple of nkv).
    Query (t, k) attends to the step-0 keys at positions <= t (a causal SDPA, T(T+1)/2 scores) and to
    the step-1..k keys at position t (k dot products per query), one softmax over both sets: same
    result as ttt_attention_masked, up to float rounding. scale: the softmax scale (default d^-0.5).
    """
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != keys[0].shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _CausalPlusDiagonal.apply(scale, q, keys[0], values[0], *keys[1:], *values[1:])


def _causal_forward(q, k, v, scale: float):
    """Causal attention that also returns its log-sum-exp: (out [B, nh, T, d], lse [B, nh, T] float32,
    extra state for _causal_backward). k/v may have fewer (grouped) heads. This and _causal_backward
    are the only calls of private SDPA kernels; their schemas and autograd formulas are in torch's
    native_functions.yaml / derivatives.yaml (`_scaled_dot_product_flash_attention[_for_cpu]`)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()                  # () = the flash kernel made it; None = the float32 matmuls
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)
    return _causal_forward_math(q, k, v, scale)


def _causal_forward_math(q, k, v, scale: float):
    """The same in plain float32 matmuls, for what the flash kernels do not take (CUDA in float32: 05's
    reference replay and the exactness checks on a GPU). It holds [B, nh, T, T] scores: fine for checks
    and batch-1 replay, not for training at long T (04 trains in bf16 on CUDA)."""
    s = _causal_scores(q, k, scale)                                                    # [B, nh, T, T]
    lse = s.logsumexp(-1)
    out = (s - lse.unsqueeze(-1)).exp_() @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
    return out.to(q.dtype), lse, None


def _causal_scores(q, k, scale: float):
    rep = q.shape[1] // k.shape[1]
    s = (q.float() @ k.repeat_interleave(rep, dim=1).float().transpose(-1, -2)) * scale
    t = q.shape[2]
    return s.masked_fill_(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))


def _causal_backward(dout, q, k, v, out, lse, extra, scale: float):
    """(dq, dk, dv) of causal attention for the given softmax normaliser `lse` and output `out`."""
    if q.device.type == "cpu" and extra is not None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale)
    if extra is None:
        return _causal_backward_math(dout, q, k, v, out, lse, scale)
    cum_q, cum_k, max_q, max_k, rng, unused = extra
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)


def _causal_backward_math(dout, q, k, v, out, lse, scale: float):
    """_causal_backward in float32 matmuls: P = exp(S - lse), dS = P (dout . v^T - rowsum(dout * out)),
    the same formula the flash backward applies to the joint `out` and `lse`; grouped heads summed back."""
    b, nkv, t, d = k.shape
    rep = q.shape[1] // nkv
    p = (_causal_scores(q, k, scale) - lse.unsqueeze(-1)).exp_()                        # [B, nh, T, T]
    g = dout.float()
    ds = p * (g @ v.repeat_interleave(rep, dim=1).float().transpose(-1, -2)
              - torch.linalg.vecdot(g, out.float()).unsqueeze(-1))
    dq = ds @ k.repeat_interleave(rep, dim=1).float() * scale
    dk = (ds.transpose(-1, -2) @ q.float() * scale).view(b, nkv, rep, t, d).sum(2)
    dv = (p.transpose(-1, -2) @ g).view(b, nkv, rep, t, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CausalPlusDiagonal(torch.autograd.Function):
    """softmax over [causal step-0 keys | same-position keys of steps 1..k], without a mask.

    Forward: (o_c, L_c) = causal attention over step 0 (flash kernel, with its log-sum-exp), diagonal
    scores s_j = q_t . k_j[t] * scale (j = 1..k); the joint normaliser L = logaddexp(L_c, logsumexp_j s_j)
    and out = exp(L_c - L) o_c + sum_j exp(s_j - L) v_j[t].
    Backward: for one softmax over a union of key sets, each set's score gradient is
    dS = P (dout . v - D) with P = exp(S - L) under the JOINT L and D = rowsum(dout * out) of the JOINT
    out (the split ring attention uses). The flash backward computes exactly that when handed the joint
    out and L instead of its own, so the causal block costs one kernel call; the k diagonal terms are
    per-position dot products in float32 (vecdot/addcmul: measured faster on a CPU than batched tiny
    matmuls over stacked keys). Grouped heads: views [B, nkv, rep, T, .], query head h = kv head h // rep.
    """

    @staticmethod
    def forward(ctx, scale, q, k0, v0, *diag):
        n, nkv = len(diag) // 2, k0.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            out_c, lse_c, extra = _causal_forward(q, k0, v0, scale)
            qg, lse_cg = _grouped(q.float(), nkv), _grouped(lse_c, nkv)               # [B, nkv, rep, T(, d)]
            s = torch.stack([torch.linalg.vecdot(qg, _kv(kj)) for kj in diag[:n]], -1) * scale   # [.., T, k]
            lse = torch.logaddexp(lse_cg, s.logsumexp(-1))                              # [B, nkv, rep, T]
            p = (s - lse.unsqueeze(-1)).exp_()                                          # diagonal weights
            out = _grouped(out_c.float(), nkv) * (lse_cg - lse).exp_().unsqueeze(-1)
            for j, vj in enumerate(diag[n:]):
                out.addcmul_(p[..., j, None], _kv(vj))
            out, lse = out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)               # [B, nh, T(, d)]
        ctx.save_for_backward(q, k0, v0, out, lse, p, *diag)
        ctx.extra, ctx.scale = extra, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, p, *diag = ctx.saved_tensors
        n, scale, nkv = len(diag) // 2, ctx.scale, k0.shape[1]
        dout = dout.contiguous()
        with torch.autocast(q.device.type, enabled=False):
            dq, dk0, dv0 = _causal_backward(dout, q, k0, v0, out, lse, ctx.extra, scale)
            g, qg = _grouped(dout.float(), nkv), _grouped(q.float(), nkv)
            big_d = torch.linalg.vecdot(g, _grouped(out.float(), nkv))                 # D [B, nkv, rep, T]
            dq = _grouped(dq.float(), nkv)
            grads_k, grads_v = [], []
            for j, (kj, vj) in enumerate(zip(diag[:n], diag[n:])):
                kf, pj = _kv(kj), p[..., j]
                ds = (pj * (torch.linalg.vecdot(g, _kv(vj)) - big_d) * scale).unsqueeze(-1)   # dS * scale
                dq.addcmul_(ds, kf)
                grads_k.append((ds * qg).sum(2).to(kj.dtype))                        # sum over the group
                grads_v.append((pj.unsqueeze(-1) * g).sum(2).to(vj.dtype))
        return (None, dq.flatten(1, 2).to(q.dtype), dk0, dv0, *grads_k, *grads_v)


def _grouped(x, nkv: int):
    """Query heads grouped by kv head: [B, nh, ...] -> [B, nkv, rep, ...] (a view)."""
    return x.unflatten(1, (nkv, -1))


def _kv(x):
    """A step's keys or values [B, nkv, T, d] -> float32 [B, nkv, 1, T, d], broadcast over the group."""
    return x.float().unsqueeze(2)
