"""The text core every stage shares: the chat format (records -> rendered text with reasoning and tool
calls), tokenizers (Kimi offline, any HF folder), the target's text format (stop ids, templates) and the
repetition-loop check of answers.
Imports only the stage contract."""
