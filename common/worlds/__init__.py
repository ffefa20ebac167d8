"""The embedded CPU worlds the chain is demonstrated and measured on: the tiny Kimi-shaped target and
SmolLM2-135M-Instruct, the real small one. Imports the stage contract, common.text, common.target,
common.draft, common.generation and common.training."""
