"""Data: dataset adapters, the chat format, tokenizers (Kimi offline, any HF folder) and the 01b
generation clients (OpenAI-compatible server pool, in-process HF). Imports only the stage contract."""
