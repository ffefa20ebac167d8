"""05b's serving side: the engines (SGLang, vLLM) behind one interface, their launch and preflight, the
server sweep, the agreement check with 05's replay, and what to deploy. Imports the stage contract,
common.text, common.target, common.draft and common.benchmark (05's replay, sampling and formatting)."""
