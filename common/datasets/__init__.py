"""01's dataset adapters: HF rows -> chat records (agentic trajectories, function calling, chat and
code), and the mix's per-dataset cuts, thinking ratio and filters (mix.py).
Imports the stage contract and common.text."""
