"""Kimi-shaped (DeepSeek-V3: MLA + MoE) target models small enough for a CPU."""
from __future__ import annotations


def deepseek_v3_config(tokenizer, hidden_size: int = 64, num_hidden_layers: int = 8,
                       num_attention_heads: int = 4, n_routed_experts: int = 8,
                       num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
                       intermediate_size: int = 128, max_position_embeddings: int = 4096):
    """A DeepseekV3Config with Kimi's structure (MLA, shared + routed experts, first layer dense).

    Special ids come from the tokenizer; eos is `<|im_end|>` (the id the model ends turns with).
    """
    from transformers import DeepseekV3Config

    head = max(8, hidden_size // num_attention_heads)
    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        n_shared_experts=1, n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
        n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
        q_lora_rank=max(16, hidden_size // 2), kv_lora_rank=max(16, hidden_size // 4),
        qk_rope_head_dim=head // 2, qk_nope_head_dim=head // 2, v_head_dim=head,
        max_position_embeddings=max_position_embeddings, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("[PAD]"))
