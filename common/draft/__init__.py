"""The EAGLE-3 draft: capture convention and HF capture, feature shards, model, TTT loss, target head,
speculative decoding and the SGLang/speculators exports. Imports only the stage contract."""
