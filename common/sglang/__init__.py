"""SGLang and SpecForge: 02b's capture backend, server launch and preflight, 05's server benchmark.
May import the stage contract, common.data and common.draft; nothing below imports this package."""
