"""05's reference benchmark on the CPU/GPU: the reference loop and replay (reference.py, replay.py,
spec_decode.py; sampled acceptance: sampled.py; where the draft fails by segment, position and source:
segments.py), other drafts compared with 04's (compare.py), and what both benchmark stages read and check
first (inputs.py) and print (formatting.py). 05b's server sweep lives in common/serving/ and reuses these.
Imports the stage contract, common.text, common.target and common.draft."""
