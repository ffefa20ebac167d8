"""Kimi-shaped (DeepSeek-V3: MLA + MoE) target models small enough for a CPU."""
from __future__ import annotations

# Kimi-K2.5's MLA latent (config.json text_config: kv_lora_rank 512, qk_rope_head_dim 64). A served tiny
# target needs exactly these: vLLM 0.32's CPU MLA kernel takes only a 576-feature latent
# (v1/attention/backends/mla/cpu_mla.py get_supported_head_sizes; other widths die at the first request,
# "Head dimension 80 is not supported by MLA").
KIMI_KV_LORA_RANK = 512
KIMI_QK_ROPE_HEAD_DIM = 64
# Kimi-K2.5's router (text_config): sigmoid scores, the expert choice made on score + e_score_correction_bias
# ("noaux_tc"), the chosen experts' unbiased scores renormalised and scaled by routed_scaling_factor. HF's
# DeepseekV3TopkRouter always computes this; vLLM computes it only when the config names it (deepseek_v2.py
# DeepseekV2MoE: no e_score_correction_bias parameter, hence no load, without topk_method noaux_tc;
# softmax scores without scoring_func sigmoid; routed_scaling_factor 1.0 when missing).
KIMI_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
                "topk_group": 1}
KIMI_ROUTED_SCALING_FACTOR = 2.827  # K2.5's; transformers' DeepseekV3Config default (the micro targets') is 2.5


def deepseek_v3_config(tokenizer, hidden_size: int = 64, num_hidden_layers: int = 8,
                       num_attention_heads: int = 4, n_routed_experts: int = 8,
                       num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
                       intermediate_size: int = 128, max_position_embeddings: int = 4096,
                       kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None,
                       qk_nope_head_dim: int | None = None, v_head_dim: int | None = None,
                       q_lora_rank: int | None = None, routed_scaling_factor: float = 2.5):
    """A DeepseekV3Config with Kimi's structure (MLA, shared + routed experts, first layer dense, Kimi's
    router) and no MTP layer (K2.5 has none).

    MLA widths left None scale with the width (fast micro targets for tests); the tiny world passes Kimi's
    latent (KIMI_KV_LORA_RANK, KIMI_QK_ROPE_HEAD_DIM) so that vLLM's CPU MLA kernel serves it, and Kimi's
    routed_scaling_factor (the micro targets keep transformers' 2.5: tests rely on how their random weights
    answer). Special ids come from the tokenizer; eos is `<|im_end|>` (the id the model ends turns with).
    """
    from transformers import DeepseekV3Config

    head = max(8, hidden_size // num_attention_heads)
    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        n_shared_experts=1, n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
        first_k_dense_replace=1, **KIMI_ROUTING, routed_scaling_factor=routed_scaling_factor,
        q_lora_rank=q_lora_rank or max(16, hidden_size // 2),
        kv_lora_rank=kv_lora_rank or max(16, hidden_size // 4),
        qk_rope_head_dim=qk_rope_head_dim or head // 2, qk_nope_head_dim=qk_nope_head_dim or head // 2,
        v_head_dim=v_head_dim or head, num_mtp_layers=0,
        max_position_embeddings=max_position_embeddings, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("[PAD]"))
