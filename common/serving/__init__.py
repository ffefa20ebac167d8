"""Serving engines for 05's server mode and the smoke runs: one interface (`engines.Engine`) over
SGLang (the GPU box; its launch and preflight live in common.sglang.server) and vLLM (`vllm.py`; its
CPU build serves the CPU worlds here), the engine-neutral benchmark (`bench.py`) and the agreement
check between an engine's acceptance and replay's (`agreement.py`).
May import the stage contract, common.data, common.draft and common.sglang; nothing below imports it."""
