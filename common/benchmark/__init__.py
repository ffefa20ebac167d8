"""The two benchmark stages: 05's reference loop and replay on the CPU/GPU (reference.py, replay.py,
spec_decode.py; where the draft fails by segment, position and source: segments.py) and 05b's server
sweep over any engine (engines.Engine over SGLang and vLLM, server_bench.py, vllm.py; its prompt-length
buckets: context.py) with the agreement check between the two (agreement.py), and what to deploy from it
(deploy.py; the verify cost against load: load_model.py); what both read and check first: inputs.py.
Imports the stage contract, common.text, common.target, common.draft and common.sglang."""
