"""The embedded CPU worlds the chain is demonstrated and measured on (the tiny Kimi-shaped target).
May import the stage contract, common.data and common.draft; nothing below imports this package."""
