"""The EAGLE-3 draft (SGLang `LlamaForCausalLMEagle3` layout): inference step, TTT forward, export/load.

Layout and names follow SGLang `python/sglang/srt/models/llama_eagle3.py` (read at 03d5a777) so the
export is a rename-free dump of our state dict:
  fc: Linear(3*Ht -> H) over [h_low | h_mid | h_high]
  midlayer: e = input_layernorm(embed(tok)); h' = hidden_norm(h); x = cat(e, h') [.., 2H] (embedding
    FIRST) -> q/k/v (in 2H); o_proj -> H; residual = un-normed h; then post_attention_layernorm +
    SwiGLU MLP + residual. SGLang's fused `post_attention_layernorm(h, residual)` and final
    `norm(h, residual)` are add-then-norm, i.e. out = r + mlp(ln(r)), r = h + attn(x); the PRE-norm
    `out` is the hidden state of the next draft step, logits = lm_head(norm(out)).
  RoPE: SGLang llama.py builds `get_rope(head_dim, base=rope_theta, is_neox_style=True)` (the default
    `rope_is_neox_style`), i.e. the Llama rotate_half form; head_dim = config.head_dim or H // heads.
  RMSNorm: computed in float32, cast back to the input dtype, then scaled by the weight (SGLang
    RMSNorm.forward_native / HF LlamaRMSNorm).
`embed_tokens` is the target's, frozen, never exported (SGLang's eagle worker calls set_embed).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from common.io import atomic_path, write_json

CONFIG_KEYS = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta",
               "max_position_embeddings", "vocab_size", "draft_vocab_size")


def draft_config(target_cfg: dict, draft_vocab_size: int, num_attention_heads: int | None = None,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None) -> dict:
    """The draft's config, derived from the target's text config.

    Defaults: H = target hidden; heads = target heads; KV heads = min(8, heads) when it divides heads,
    else heads; head_dim = H // heads; intermediate = target `intermediate_size` (the dense MLP width;
    18432 for Kimi, SpecForge's DeepSeek-V3 draft uses 40960); theta/eps/max positions from the target.
    """
    hidden = int(target_cfg["hidden_size"])
    heads = int(num_attention_heads or target_cfg["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} attention heads")
    kv = num_key_value_heads or (min(8, heads) if heads % min(8, heads) == 0 else heads)
    if heads % kv:
        raise ValueError(f"{heads} attention heads are not a multiple of {kv} KV heads")
    theta = target_cfg.get("rope_theta", (target_cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
    return {
        "hidden_size": hidden, "target_hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": int(kv), "head_dim": hidden // heads,
        "intermediate_size": int(intermediate_size or target_cfg.get("intermediate_size") or 4 * hidden),
        "rms_norm_eps": float(target_cfg.get("rms_norm_eps", 1e-5)), "rope_theta": float(theta),
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "vocab_size": int(target_cfg["vocab_size"]), "draft_vocab_size": int(draft_vocab_size),
    }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)  # stays in x's dtype under autocast (bf16 in, bf16 out)


def rope_cos_sin(position_ids, head_dim: int, theta: float):
    """cos, sin [B, T, head_dim] for the rotate_half (neox) form."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, heads, T, d]; cos/sin [B, T, d]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.theta = cfg["rope_theta"]
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)   # input = cat(embed, hidden), 2H
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def qkv(self, x, position_ids):
        """x [B, T, 2H] -> q [B, nh, T, d], k/v [B, nkv, T, d] with RoPE at position_ids [B, T]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """q [B, nh, Tq, d], k/v [B, nkv, S, d], mask [Tq, S] bool (True = may attend) -> [B, Tq, H]."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return self.output(F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask))

    def output(self, heads):
        """Per-head attention output [B, nh, T, d] -> o_proj of the merged heads [B, T, H]."""
        b, _, t, _ = heads.shape
        return self.o_proj(heads.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(cfg)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(h, eps)   # on the token embedding
        self.hidden_norm = RMSNorm(h, eps)       # on the incoming hidden state
        self.post_attention_layernorm = RMSNorm(h, eps)

    def attn_input(self, embeds, hidden):
        """cat(input_layernorm(e), hidden_norm(h)) [B, T, 2H]: embedding first (SGLang, official)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out, residual):
        """Residual = the un-normed incoming hidden; returns the PRE-norm layer output [B, T, H]."""
        r = residual + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))


class DraftCache:
    """Per-layer k/v [B, nkv, L, d] (post-RoPE) of the draft for inference; `crop(n)` rolls back."""

    def __init__(self):
        self.keys: list[torch.Tensor | None] = [None]
        self.values: list[torch.Tensor | None] = [None]

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def update(self, layer: int, k, v):
        """Append this call's k/v and return the whole cache of the layer."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens)."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :n], self.values[i][:, :, :n]


def ttt_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """Mask [T, (step+1)*T] (True = attend) of TTT step `step` over keys [step-0 | step-1 | ... | step-k].

    Query (t, k) sees step-0 keys at positions <= t (causal block) and, from each of steps 1..k, ONLY
    the key at the same position t (diagonal blocks): at inference the depth-k draft token sees the
    verified context plus its own chain of ancestors, which sit at the same TTT position t.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diag = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


def ttt_attention_masked(q, keys, values):
    """The first TTT attention, kept as the reference of ttt_attention (tests, benchmark): one SDPA over
    the keys of all steps so far under ttt_attention_mask. It scores (k+1) T^2 pairs per head at step k
    where T(T+1)/2 + kT are attended. q [B, nh, T, d]; keys/values: per step j <= k, [B, nkv, T, d]."""
    rep = q.shape[1] // keys[0].shape[1]
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = ttt_attention_mask(q.shape[2], len(keys) - 1, device=q.device)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)


def ttt_attention(q, keys, values):
    """TTT attention of step k = len(keys) - 1 without masked-out work -> [B, nh, T, d].

    q [B, nh, T, d]; keys/values: per step j <= k, [B, nkv, T, d] (post-RoPE; nh a multiple of nkv).
    Query (t, k) attends to the step-0 keys at positions <= t (a causal SDPA, T(T+1)/2 scores) and to
    the step-1..k keys at position t (k dot products per query), one softmax over both sets: same
    result as ttt_attention_masked, up to float rounding.
    """
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True,
                                              enable_gqa=q.shape[1] != keys[0].shape[1])
    return _CausalPlusDiagonal.apply(q, keys[0], values[0], *keys[1:], *values[1:])


def _causal_forward(q, k, v, scale: float):
    """Causal attention that also returns its log-sum-exp: (out [B, nh, T, d], lse [B, nh, T] float32,
    extra state for _causal_backward). k/v may have fewer (grouped) heads. This and _causal_backward
    are the only calls of private SDPA kernels; their schemas and autograd formulas are in torch's
    native_functions.yaml / derivatives.yaml (`_scaled_dot_product_flash_attention[_for_cpu]`)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)
    raise ValueError(f"TTT attention runs on CPU, or on CUDA in bf16/fp16; got {q.device.type} {q.dtype} "
                     "(use --precision bf16 on CUDA)")


def _causal_backward(dout, q, k, v, out, lse, extra, scale: float):
    """(dq, dk, dv) of causal attention for the given softmax normaliser `lse` and output `out`."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale)
    cum_q, cum_k, max_q, max_k, rng, unused = extra
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)


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
    def forward(ctx, q, k0, v0, *diag):
        n, scale, nkv = len(diag) // 2, q.shape[-1] ** -0.5, k0.shape[1]
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
        return (dq.flatten(1, 2).to(q.dtype), dk0, dv0, *grads_k, *grads_v)


def _grouped(x, nkv: int):
    """Query heads grouped by kv head: [B, nh, ...] -> [B, nkv, rep, ...] (a view)."""
    return x.unflatten(1, (nkv, -1))


def _kv(x):
    """A step's keys or values [B, nkv, T, d] -> float32 [B, nkv, 1, T, d], broadcast over the group."""
    return x.float().unsqueeze(2)


def shift_left(x, n: int, fill=0):
    """x [B, T, ...] -> x[:, n:] padded at the end with `fill` back to length T."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        cfg = {k: config[k] for k in CONFIG_KEYS if k in config}
        cfg.setdefault("target_hidden_size", cfg["hidden_size"])
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        self.config = cfg
        h = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))

    @torch.no_grad()
    def init_normal_(self, std: float) -> None:
        """Every trainable linear weight ~ normal(0, std) (HF/SpecForge `initializer_range` init; norms
        stay at one, the frozen embedding is the target's). The default is PyTorch's Linear init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)

    def set_vocab_mapping(self, d2t, t2d) -> None:
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape, (d2t.shape, t2d.shape)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux):
        """aux [B, T, 3Ht] (target states at the capture points, low|mid|high) -> [B, T, H]."""
        if not torch.is_autocast_enabled(aux.device.type):   # under autocast fc casts aux itself
            aux = aux.to(self.fc.weight.dtype)
        return self.fc(aux)

    def embed(self, input_ids, like):
        return self.embed_tokens(input_ids).to(like.dtype)

    def logits(self, out):
        """Pre-norm layer output [B, T, H] -> draft logits [B, T, Dv]."""
        return self.lm_head(self.norm(out))

    def step(self, hidden, input_ids, position_ids, cache: DraftCache | None = None):
        """One draft forward for inference (and step 0 of training, same code).

        hidden [B, T, H]: fc-projected target features or the draft's previous pre-norm output;
        input_ids [B, T] target ids; position_ids [B, T]. Attention is causal over (cache + these T);
        with a cache the new k/v are appended. Returns (logits [B, T, Dv], out_hidden [B, T, H]).
        """
        layer = self.midlayer
        x = layer.attn_input(self.embed(input_ids, hidden), hidden)
        q, k, v = layer.self_attn.qkv(x, position_ids)
        if cache is not None:
            k, v = cache.update(0, k, v)
        t, s = q.shape[2], k.shape[2]
        # new query i (absolute s - t + i) sees every cached key and the new keys up to itself
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        out = layer.finish(layer.self_attn.attend(q, k, v, mask), hidden)
        return self.logits(out), out

    def forward(self, aux, input_ids, ttt_steps: int, masked_attention: bool = False, start=None):
        """Training-time-test unroll (the training forward). aux [B, T, 3Ht], input_ids [B, T] (unshifted).

        Step k at row t: token input = input_ids[t+1+k] (teacher forced), RoPE position start+t+k (start
        [B]: the true position of row 0, > 0 when 02b stored only a prompt-tail window; default 0),
        hidden = fc(aux[t]) for k = 0, else the step k-1 pre-norm output at t; label (in the loss) =
        the target distribution at t+1+k. Positions past the end get token 0 and no loss.
        Returns the pre-norm output of every step: a list of K tensors [B, T, H] (logits = self.logits).
        masked_attention: use the reference ttt_attention_masked (tests and the benchmark only).
        """
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        if start is not None:
            pos = pos + start.view(b, 1)                    # [B, T] true positions
        hidden = self.project(aux)                         # [B, T, H]
        layer, keys, values, outs = self.midlayer, [], [], []
        attend = ttt_attention_masked if masked_attention else ttt_attention
        for k in range(ttt_steps):
            ids = shift_left(input_ids, 1 + k, 0)          # token t+1+k
            x = layer.attn_input(self.embed(ids, hidden), hidden)
            q, kk, vv = layer.self_attn.qkv(x, pos + k)
            keys.append(kk)
            values.append(vv)
            attn = layer.self_attn.output(attend(q, keys, values))
            hidden = layer.finish(attn, hidden)            # pre-norm output -> next step's hidden
            outs.append(hidden)
        return outs

    def forward_ttt(self, aux, input_ids, ttt_steps: int, masked_attention: bool = False):
        """Draft logits of every TTT step: a list of K tensors [B, T, Dv] (see forward)."""
        return [self.logits(h) for h in self(aux, input_ids, ttt_steps, masked_attention)]

    def draft_to_target(self, draft_ids):
        """Draft vocab ids -> target ids (target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict:
        """Everything but the frozen embedding: exactly the export key set."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


def export_shapes(cfg: dict) -> dict[str, tuple]:
    """The exact key set and shapes of the SGLang export (docs/design.md section 4)."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    ht = cfg.get("target_hidden_size", h)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        "fc.weight": (h, 3 * ht),
        "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * d),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        "d2t": (cfg["draft_vocab_size"],),
        "t2d": (cfg["vocab_size"],),
    }


def sglang_config(cfg: dict, capture_points: list[int], torch_dtype: str = "bfloat16") -> dict:
    """config.json of the export. SGLang's eagle_config ids mean OUTPUT of layer j (it adds +1), so
    ids = capture points - 1; vLLM's top-level ids mean INPUT of layer i: the points themselves."""
    points = sorted(int(p) for p in capture_points)
    out = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "intermediate_size": cfg["intermediate_size"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"], "max_position_embeddings": cfg["max_position_embeddings"],
        "num_hidden_layers": 1, "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["draft_vocab_size"], "tie_word_embeddings": False,
        "torch_dtype": torch_dtype, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [p - 1 for p in points],
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": points,
    }
    if cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    return out


def export_sglang(model: Eagle3DraftModel, out_dir, capture_points: list[int],
                  torch_dtype: str = "bfloat16", extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors that SGLang's LlamaForCausalLMEagle3 loads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, torch_dtype)
    tensors = {}
    for name, t in model.trainable_state_dict().items():
        t = t.detach().cpu()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    # SGLang silently skips unknown names and leaves missing ones random: insist on the exact set.
    want = export_shapes(model.config)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    assert got == want, f"export keys/shapes differ: {sorted(set(got) ^ set(want))} {got} {want}"
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", {**sglang_config(model.config, capture_points, torch_dtype),
                                         **(extra_config or {})})
    return out_dir


def load_sglang_export(export_dir, embed_weight: torch.Tensor) -> Eagle3DraftModel:
    """Rebuild the draft from an export (strict: the file must hold exactly the export key set)."""
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    model = Eagle3DraftModel(cfg)
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    want = export_shapes(model.config)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        raise ValueError(f"{export_dir}: keys/shapes differ from the EAGLE-3 export set: "
                         f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}, "
                         f"shape mismatches {sorted(k for k in want if k in got and got[k] != want[k])}")
    if tuple(embed_weight.shape) != (cfg["vocab_size"], cfg["hidden_size"]):
        raise ValueError(f"embedding {tuple(embed_weight.shape)} does not match the draft "
                         f"({cfg['vocab_size']}, {cfg['hidden_size']})")
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    state["embed_tokens.weight"] = embed_weight.float()
    model.load_state_dict(state, strict=True)
    return model.eval()
