"""SGLang servers: launch, readiness and preflight (05's sweep over any engine lives in
common/benchmark/). Imports the stage contract, common.text, common.target and common.draft."""
