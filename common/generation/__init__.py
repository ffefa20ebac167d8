"""01b's generation: its jobs, run loops and resumable run state, the OpenAI-compatible server pool, its
start-up checks and the servers' capacity (the in-flight limit), the in-process HF engine, the shipped
response cache, progress lines.
Imports the stage contract and common.text."""
