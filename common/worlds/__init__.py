"""The embedded CPU worlds the chain is demonstrated and measured on: the tiny Kimi-shaped target and
SmolLM2-135M-Instruct, the real small one. May import the stage contract, common.data and common.draft."""
