"""Shared library of the EAGLE-3 pipeline, one package per owner.

The stage contract sits flat at the top (`stage`, `config`, `io`, `parallel`: folders, manifests, flags,
atomic files, per-item work in worker processes) and imports nothing else of `common`. Then:
  shared cores   text      chat format, tokenizers, the target's text format        (every stage)
                 target    capture (HF, SGLang), target head, feature shards        (02b, 03, 04, 05)
                 draft     the draft model, its TTT attention, its exports          (04, 05)
  owned by one   datasets  01's dataset adapters and the v4 mix
  stage          generation 01b's jobs, loops, run state, server pool, HF engine
                 training  04's teachers, loss, batches, DDP, checkpoints
                 benchmark 05: reference loop, replay, sampled acceptance, draft comparison
                 serving   05b: engines (SGLang, vLLM) behind one interface, their launch and preflight,
                           the server sweep, the agreement check, deploy (imports benchmark)
  world          worlds    the embedded CPU worlds (tiny Kimi-shaped target, SmolLM2)  (00)
Imports go downward only and never in a loop; nothing imports a stage script. tests/units/test_layout.py
enforces both.
"""
