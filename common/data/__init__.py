"""Data: dataset adapters, the chat format, tokenizers (Kimi offline, any HF folder) and 01b's
generation: its jobs, run loops and clients (OpenAI-compatible server pool, in-process HF). Imports only
the stage contract."""
