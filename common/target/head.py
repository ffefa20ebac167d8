"""The target's embedding and lm_head (and its text config), read alone through the safetensors index.

The draft needs exactly two tensors of the target: `embed_tokens` (copied, frozen) and `lm_head` (the
teacher: target logits = lm_head(final post-norm hidden)). Kimi-K2.5 is ~1T parameters in ~64 shard
files, so we read `model.safetensors.index.json`, open only the shard(s) holding those two tensors and
read only them (safetensors reads a tensor by offset; other tensors are never touched).
Kimi-K2.5 nests its text model under `language_model.` and its text config under `text_config`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from common.stage import StageError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checked in order; the first prefix under which the embedding exists wins (plain HF, then Kimi-K2.5).
PREFIXES = ("", "language_model.")
EMBED_NAME = "model.embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


def read_target_text_config(target_path: str | Path) -> dict:
    """The target's text-model config as a dict (`text_config` of multimodal wrappers like K2.5)."""
    cfg_file = Path(target_path) / "config.json"
    if not cfg_file.is_file():
        raise StageError(f"{target_path} has no config.json: the target must be a model folder")
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config") or cfg
    # Fields a wrapper keeps at the top level only (tie_word_embeddings in K2.5 exists at both levels).
    for key in ("tie_word_embeddings",):
        if key not in text and key in cfg:
            text = {**text, key: cfg[key]}
    return text


def weight_map(target_path: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index, or from the header of a single-file model."""
    target_path = Path(target_path)
    index = target_path / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_path / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:  # reads the header only
            return {name: SINGLE_FILE for name in f.keys()}
    raise StageError(f"{target_path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def head_tensor_names(target_path: str | Path) -> tuple[str, str, dict[str, str]]:
    """(embedding name, lm_head name, weight map). The lm_head name equals the embedding name when
    the target ties them (no lm_head tensor stored)."""
    wmap = weight_map(target_path)
    for prefix in PREFIXES:
        embed = prefix + EMBED_NAME
        if embed in wmap:
            head = prefix + HEAD_NAME
            if head not in wmap:
                if not read_target_text_config(target_path).get("tie_word_embeddings", False):
                    raise StageError(f"{target_path}: found {embed} but no {head} and the config "
                                     "does not tie the embeddings")
                head = embed
            return embed, head, wmap
    raise StageError(f"{target_path}: no embedding tensor named "
                     + " or ".join(p + EMBED_NAME for p in PREFIXES))


def load_target_head(target_path: str | Path, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu", with_head: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (embed_tokens [V, H], lm_head [V, H]) of the target, reading only those two tensors
    (lm_head None when not `with_head`: a top-k teacher needs no head)."""
    target_path = Path(target_path)
    embed_name, head_name, wmap = head_tensor_names(target_path)
    out = {}
    for name in {embed_name, head_name} if with_head else {embed_name}:
        shard = target_path / wmap[name]
        if not shard.is_file():
            raise StageError(f"{target_path}: the index puts {name} in {wmap[name]}, which is missing")
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            t = f.get_tensor(name)
        out[name] = t.to(dtype) if dtype is not None else t
    embed, head = out[embed_name], out.get(head_name)
    if head is not None and embed.shape != head.shape:
        raise StageError(f"{target_path}: embedding {tuple(embed.shape)} and lm_head "
                         f"{tuple(head.shape)} differ in shape")
    return embed, head


def estimate_num_parameters(cfg: dict) -> int:
    """Parameters of a decoder-only target from its text config (dense or MoE; Llama, Qwen, DeepSeek).

    Attention is counted as q/k/v/o projections (MLA's low-rank factors are smaller: an upper bound);
    MLPs as gated (3 matrices). MoE layers (DeepSeek: after `first_k_dense_replace`; Qwen-MoE: all)
    hold `n_routed_experts` (or `num_experts`) experts of `moe_intermediate_size` plus the shared ones.
    Kimi-K2.5: ~1.03e12. Used to refuse loading what cannot fit, not for accounting.
    """
    h, v, n = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    attn = h * heads * hd * 2 + 2 * h * kv * hd
    dense = 3 * h * int(cfg.get("intermediate_size") or 4 * h)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    if experts:
        moe_i = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
        shared = int(cfg.get("n_shared_experts") or 0)
        moe = 3 * h * moe_i * (experts + shared) + h * experts   # + the router
        num_dense = int(cfg.get("first_k_dense_replace") or 0)
        layers = num_dense * (attn + dense) + (n - num_dense) * (attn + moe)
    else:
        layers = n * (attn + dense)
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    return layers + v * h + head
