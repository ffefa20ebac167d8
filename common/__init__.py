"""Shared library of the EAGLE-3 pipeline: what two or more stages use.

The stage contract sits flat at the top (`stage`, `config`, `io`: folders, manifests, flags, atomic
files) and imports nothing else of `common`. Everything else lives in one package per concern:
  data    datasets -> chat records -> rendered, tokenized text; the 01b generation clients
  draft   the EAGLE-3 draft: capture convention, shards, model, loss, target head, spec decoding, exports
  sglang  SGLang- and SpecForge-side code: capture backend, SGLang server launch/preflight
  serving 05's server mode over any engine (SGLang, vLLM): the sweep and the agreement check
  worlds  the embedded CPU worlds (the tiny Kimi-shaped target)
Imports go downward only: data and draft use the contract; sglang and worlds may use data and draft;
serving may use sglang too; nothing imports a stage script. tests/test_layout.py enforces it.
"""
