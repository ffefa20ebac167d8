"""The text core every stage shares: the chat format (records -> rendered text with reasoning and tool
calls), tokenizers (Kimi offline, any HF folder) and the target's text format (stop ids, templates).
Imports only the stage contract."""
