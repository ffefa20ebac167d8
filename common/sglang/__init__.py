"""SGLang and SpecForge: 02b's capture backend, SGLang server launch and preflight (05's sweep over any
engine lives in common/serving/). May import the stage contract, common.data and common.draft; only
common.serving imports this package."""
