"""The EAGLE-3 draft (SGLang `LlamaForCausalLMEagle3` layout): inference step and TTT forward.
The TTT attention kernel is common/draft/ttt_attention.py, the SGLang export common/draft/export_sglang.py.

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

import torch
import torch.nn.functional as F
from torch import nn

from common.draft.ttt_attention import ttt_attention, ttt_attention_masked

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
