"""The EAGLE-3 draft in its two served forms: inference step and TTT forward.
The TTT attention kernel is common/draft/ttt_attention.py, RoPE common/draft/rope.py, the exports
common/draft/export_sglang.py.

Layout and names follow the engines' draft classes, so the export is a rename-free dump of our state dict:
  fc: Linear(3*Ht -> H) over [h_low | h_mid | h_high]; with `fc_norm` (EAGLE-3.1) each captured state
    first goes through its own RMSNorm `fc_norm.{0,1,2}` (SGLang llama_eagle3.py / kimi_k25_eagle3.py
    `fc_norm` or legacy `use_aux_norm`; vLLM llama_eagle3.py / deepseek_eagle3.py `fc_norm`).
  midlayer: e = input_layernorm(embed(tok)); h' = hidden_norm(h); x = cat(e, h') [.., 2H] (embedding
    FIRST) -> attention; residual = un-normed h; then post_attention_layernorm + SwiGLU MLP + residual.
    SGLang's fused `post_attention_layernorm(h, residual)` and final `norm(h, residual)` are
    add-then-norm, i.e. out = r + mlp(ln(r)), r = h + attn(x); logits = lm_head(norm(out)). The next
    draft step's hidden is the PRE-norm `out`, or with `norm_output` (EAGLE-3.1) the post-norm norm(out)
    (both engines: `aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux`).
  attention "mha" (`LlamaForCausalLMEagle3`, SGLang llama_eagle3.py at 03d5a777): q/k/v (in 2H) with
    grouped KV heads, o_proj -> H, RoPE rotate_half over head_dim.
  attention "mla" (`Eagle3DeepseekV2ForCausalLM`, SGLang 0.5.14 kimi_k25_eagle3.py + DeepseekV2AttentionMLA,
    vLLM 0.32 deepseek_eagle3.py): DeepSeek-V2 multi-head latent attention over x [2H]:
      q = q_b_proj(q_a_layernorm(q_a_proj(x))) -> per head [q_nope (qk_nope) | q_pe (qk_rope)]
      kv_a_proj_with_mqa(x) -> [c (kv_lora) | k_pe (qk_rope)]: ONE k_pe shared by all heads
      kv_b_proj(kv_a_layernorm(c)) -> per head [k_nope (qk_nope) | v (v_head)]
      RoPE (interleaved pairs) on q_pe and k_pe only: the rope dims are the LAST ones of q and of the latent.
      softmax scale (qk_nope + qk_rope)^-0.5, times YaRN's mscale^2 when scaled (rope.py).
    Training runs the naive form above (per-head keys); inference (`step`) runs the absorbed form the
    engines run at decode: the cache holds the latent [kv_a_layernorm(c) | RoPE(k_pe)] (kv_lora + qk_rope
    values per token), q_nope is folded through kv_b_proj's key half, v through its value half.
  RMSNorm: computed in float32, cast back to the input dtype, then scaled by the weight (SGLang
    RMSNorm.forward_native / HF LlamaRMSNorm).
`embed_tokens` is the target's, frozen, never exported (SGLang's eagle worker calls set_embed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.draft.rope import Rope, rope_magnitudes
from common.draft.ttt_attention import ttt_attention, ttt_attention_masked

ATTENTIONS = ("mha", "mla")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
CONFIG_KEYS = ("attention", "hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", *MLA_KEYS, "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "vocab_size", "draft_vocab_size", "fc_norm", "norm_output")


def mla_dims(target_cfg: dict, heads: int) -> dict:
    """MLA dims of a draft: the target's own when the target is MLA (Kimi-K2.5: q_lora_rank 1536,
    kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128); for other targets Kimi's proportions to a head of
    d = H / heads (SmolLM2: d 64): qk_nope = v = d, qk_rope = d / 2, kv_lora = 4 d, q_lora = 12 d."""
    if target_cfg.get("kv_lora_rank"):
        return {k: int(target_cfg[k]) for k in MLA_KEYS}
    d = int(target_cfg["hidden_size"]) // heads
    return {"q_lora_rank": 12 * d, "kv_lora_rank": 4 * d, "qk_nope_head_dim": d,
            "qk_rope_head_dim": d // 2, "v_head_dim": d}


def target_rope(target_cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, YaRN fields or None) of a target's text config, from rope_theta/rope_scaling or
    transformers 5's rope_parameters (common/draft/config.py reads a draft's the same way)."""
    params = target_cfg.get("rope_parameters") or {}
    theta = target_cfg.get("rope_theta") or params.get("rope_theta") or 1e4
    scaling = target_cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "yarn":
        return float(theta), None
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    return float(theta), {"rope_type": "yarn", **{k: scaling[k] for k in keep if k in scaling}}


def draft_config(target_cfg: dict, draft_vocab_size: int, num_attention_heads: int | None = None,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 attention: str = "mha", fc_norm: bool = False, norm_output: bool = False) -> dict:
    """The draft's config, derived from the target's text config.

    Defaults: H = target hidden; heads = target heads; KV heads = min(8, heads) when it divides heads,
    else heads (MHA; MLA has no KV heads: num_key_value_heads = heads, as the public MLA drafts say);
    head_dim = H // heads; MLA dims from mla_dims; intermediate = target `intermediate_size` (the dense
    MLP width; 18432 for Kimi, SpecForge's DeepSeek-V3 draft uses 40960); theta, eps and max positions
    from the target, and its YaRN for the MLA form only (applied as DeepSeek applies it).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"draft attention {attention!r}: expected one of {ATTENTIONS}")
    hidden = int(target_cfg["hidden_size"])
    heads = int(num_attention_heads or target_cfg["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} attention heads")
    kv = num_key_value_heads or (min(8, heads) if heads % min(8, heads) == 0 else heads)
    if attention == "mla":
        kv = heads
    if heads % kv:
        raise ValueError(f"{heads} attention heads are not a multiple of {kv} KV heads")
    theta, scaling = target_rope(target_cfg)
    if attention == "mha":
        scaling = None   # the Llama form keeps plain RoPE at the target's theta (the engines disagree on
                         # Llama YaRN's magnitude: rope.py); the MLA form takes the target's YaRN, as DeepSeek
    cfg = {
        "attention": attention, "hidden_size": hidden, "target_hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": int(kv), "head_dim": hidden // heads,
        "intermediate_size": int(intermediate_size or target_cfg.get("intermediate_size") or 4 * hidden),
        "rms_norm_eps": float(target_cfg.get("rms_norm_eps", 1e-5)), "rope_theta": theta, "rope_scaling": scaling,
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "vocab_size": int(target_cfg["vocab_size"]), "draft_vocab_size": int(draft_vocab_size),
        "fc_norm": bool(fc_norm), "norm_output": bool(norm_output),
    }
    if attention == "mla":
        cfg.update(mla_dims(target_cfg, heads))
    return cfg


def full_config(config: dict) -> dict:
    """A draft config with every CONFIG_KEY: older configs (04 manifests before the MLA form) read as
    the MHA form without YaRN or EAGLE-3.1 options."""
    cfg = {k: config[k] for k in CONFIG_KEYS if k in config}
    cfg.setdefault("attention", "mha")
    cfg.setdefault("target_hidden_size", cfg["hidden_size"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("rope_scaling", None)
    cfg.setdefault("fc_norm", False)
    cfg.setdefault("norm_output", False)
    if cfg["attention"] == "mla":
        missing = [k for k in MLA_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"MLA draft config lacks {missing}")
    return cfg


def kv_bytes_per_token(cfg: dict, bytes_per_value: int = 2) -> int:
    """The draft's KV cache per token in the engines (bf16 by default): MHA keeps K and V of every KV
    head; MLA keeps one latent of kv_lora_rank + qk_rope_head_dim values (the engines' MLA cache)."""
    if cfg.get("attention", "mha") == "mla":
        return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * bytes_per_value
    return 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * bytes_per_value


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


def causal_mask(t: int, s: int, device) -> torch.Tensor:
    """[t, s] bool: new query i (absolute s - t + i) sees every cached key and the new keys up to itself."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads (the Llama form)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.rope = Rope.of(cfg)
        self.scale = d ** -0.5
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
        cos, sin = self.rope.cos_sin(position_ids)
        return self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin), v

    def output(self, heads):
        """Per-head attention output [B, nh, T, d] -> o_proj of the merged heads [B, T, H]."""
        b, _, t, _ = heads.shape
        return self.o_proj(heads.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def infer(self, x, position_ids, cache: DraftCache | None):
        """Inference attention of x [B, T, 2H] over (cache + these T), appending to the cache -> [B, T, H]."""
        q, k, v = self.qkv(x, position_ids)
        if cache is not None:
            k, v = cache.update(0, k, v)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
        return self.output(F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask))


class MLAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention over the draft's 2H input (the `Eagle3DeepseekV2ForCausalLM`
    form). Weight names and shapes are the checkpoint's (SGLang fuses q_a_proj with kv_a_proj_with_mqa
    at load, vLLM into fused_qkv_a_proj; both split kv_b_proj into its key and value halves)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.num_heads = cfg["num_attention_heads"]
        self.nope, self.rope_dim, self.v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kv_lora = cfg["kv_lora_rank"]
        self.qk_dim = self.nope + self.rope_dim
        self.rope = Rope.of(cfg)
        self.scale = self.qk_dim ** -0.5 * rope_magnitudes("mla", cfg.get("rope_scaling"))[1]
        self.q_a_proj = nn.Linear(2 * h, cfg["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(cfg["q_lora_rank"], self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)

    def query(self, x, cos, sin):
        """x [B, T, 2H] -> q_nope [B, nh, T, qk_nope], q_pe [B, nh, T, qk_rope] (RoPE applied)."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        return q_nope, self.rope.apply(q_pe, cos, sin)

    def latent(self, x, cos, sin):
        """x [B, T, 2H] -> the cached latent [B, 1, T, kv_lora + qk_rope] = [kv_a_layernorm(c) | RoPE(k_pe)]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), self.rope.apply(k_pe[:, None], cos, sin)[:, 0]], -1)[:, None]

    def qkv(self, x, position_ids):
        """The naive form, for training: q/k/v [B, nh, T, qk_nope + qk_rope]; k = [k_nope | shared k_pe];
        v zero-padded from v_head_dim to the q/k width (one kernel for both forms; `output` drops the pad)."""
        cos, sin = self.rope.cos_sin(position_ids)
        q_nope, q_pe = self.query(x, cos, sin)
        lat = self.latent(x, cos, sin)                                           # [B, 1, T, kv_lora + rope]
        b, _, t, _ = lat.shape
        kv = self.kv_b_proj(lat[:, 0, :, :self.kv_lora]).view(b, t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)   # [B, nh, T, .]
        k = torch.cat([k_nope, lat[..., self.kv_lora:].expand(b, self.num_heads, t, self.rope_dim)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        return q, k, F.pad(v, (0, self.qk_dim - self.v_dim))

    def output(self, heads):
        """Per-head output [B, nh, T, >= v_head_dim] (the pad dropped) -> o_proj [B, T, H]."""
        b, _, t, _ = heads.shape
        return self.o_proj(heads[..., :self.v_dim].transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))

    def absorbed(self):
        """kv_b_proj's halves per head: w_k [nh, qk_nope, kv_lora], w_v [nh, v_head, kv_lora]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, :self.nope], w[:, self.nope:]

    def infer(self, x, position_ids, cache: DraftCache | None, naive: bool = False):
        """Inference attention over (cache + these T) -> [B, T, H]. The absorbed form (default, the
        engines' decode): scores = (q_nope w_k) . c + q_pe . k_pe over the cached latent, out = (p . c) w_v^T.
        naive=True expands every cached latent through kv_b_proj instead (the same numbers; a test checks)."""
        cos, sin = self.rope.cos_sin(position_ids)
        q_nope, q_pe = self.query(x, cos, sin)
        lat = self.latent(x, cos, sin)
        if cache is not None:
            lat, _ = cache.update(0, lat, None)
        mask = causal_mask(q_nope.shape[2], lat.shape[2], x.device)
        c, k_pe = lat[..., :self.kv_lora].to(q_nope.dtype), lat[..., self.kv_lora:].to(q_nope.dtype)  # [B, 1, S, .]
        w_k, w_v = (w.to(q_nope.dtype) for w in self.absorbed())
        if naive:
            k_nope, v = torch.einsum("bzsc,hdc->bhsd", c, w_k), torch.einsum("bzsc,hdc->bhsd", c, w_v)
            scores = q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)     # [B, nh, T, S]
            p = (scores * self.scale).masked_fill(~mask, float("-inf")).softmax(-1)
            return self.output(p @ v)
        q_lat = torch.einsum("bhtd,hdc->bhtc", q_nope, w_k)                                 # [B, nh, T, kv_lora]
        scores = q_lat @ c.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)                # [B, nh, T, S]
        p = (scores * self.scale).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.output(torch.einsum("bhtc,hdc->bhtd", p @ c, w_v))


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
        self.self_attn = MLAttention(cfg) if cfg["attention"] == "mla" else Attention(cfg)
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
    """Per-layer cache of the draft for inference: k/v [B, nkv, L, d] (post-RoPE) of the MHA form, or the
    latent [B, 1, L, kv_lora + qk_rope] of the MLA form (values None). `crop(n)` rolls back."""

    def __init__(self):
        self.keys: list[torch.Tensor | None] = [None]
        self.values: list[torch.Tensor | None] = [None]

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def update(self, layer: int, k, v):
        """Append this call's k/v (v may be None) and return the whole cache of the layer."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            if v is not None:
                self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens)."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :n]
                if self.values[i] is not None:
                    self.values[i] = self.values[i][:, :, :n]


def shift_left(x, n: int, fill=0):
    """x [B, T, ...] -> x[:, n:] padded at the end with `fill` back to length T."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        cfg = full_config(config)
        self.config = cfg
        h, ht = cfg["hidden_size"], cfg["target_hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc_norm = nn.ModuleList([RMSNorm(ht, cfg["rms_norm_eps"]) for _ in range(3)]) if cfg["fc_norm"] else None
        self.fc = nn.Linear(3 * ht, h, bias=False)
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
        """aux [B, T, 3Ht] (target states at the capture points, low|mid|high) -> [B, T, H]; with fc_norm
        each Ht-wide chunk is normed on its own first (EAGLE-3.1)."""
        if not torch.is_autocast_enabled(aux.device.type):   # under autocast fc casts aux itself
            aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def embed(self, input_ids, like):
        return self.embed_tokens(input_ids).to(like.dtype)

    def logits(self, out):
        """Pre-norm layer output [B, T, H] -> draft logits [B, T, Dv]."""
        return self.lm_head(self.norm(out))

    def recurrent(self, out):
        """The hidden the next draft step reads: the pre-norm output, or norm(out) with norm_output."""
        return self.norm(out) if self.config["norm_output"] else out

    def step(self, hidden, input_ids, position_ids, cache: DraftCache | None = None, naive_mla: bool = False):
        """One draft forward for inference (and step 0 of training, same code).

        hidden [B, T, H]: fc-projected target features or the draft's previous recurrent hidden;
        input_ids [B, T] target ids; position_ids [B, T]. Attention is causal over (cache + these T);
        with a cache the new keys (MHA) or latents (MLA) are appended. Returns (logits [B, T, Dv],
        the next step's hidden [B, T, H]). naive_mla: MLA without absorption (tests).
        """
        layer = self.midlayer
        x = layer.attn_input(self.embed(input_ids, hidden), hidden)
        attn = layer.self_attn
        attended = attn.infer(x, position_ids, cache, naive=True) if naive_mla else attn.infer(x, position_ids, cache)
        out = layer.finish(attended, hidden)
        return self.logits(out), self.recurrent(out)

    def forward(self, aux, input_ids, ttt_steps: int, masked_attention: bool = False, start=None):
        """Training-time-test unroll (the training forward). aux [B, T, 3Ht], input_ids [B, T] (unshifted).

        Step k at row t: token input = input_ids[t+1+k] (teacher forced), RoPE position start+t+k (start
        [B]: the true position of row 0, > 0 when 02b stored only a prompt-tail window; default 0),
        hidden = fc(aux[t]) for k = 0, else the step k-1 recurrent hidden at t (its pre-norm output, or
        norm(output) with norm_output); label (in the loss) =
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
            attn = layer.self_attn.output(attend(q, keys, values, scale=layer.self_attn.scale))
            out = layer.finish(attn, hidden)               # pre-norm output: this step's logits
            outs.append(out)
            hidden = self.recurrent(out)                   # -> next step's hidden
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
