"""The EAGLE-3 draft: the model (draft step and TTT forward), its TTT attention kernel, its two
exports (SGLang layout, speculators), and the reader of drafts made elsewhere (imported.py: public
drafts, SpecForge output, either export, checked against a target), and 04's manifest as 05, 05b and
the benchmarks read it (manifest.py). Used by 04 (trains it) and 05 (measures it). Imports only the
stage contract."""

# How 04's export is named among the drafts 05 replays and 05b serves (05's --draft NAME=PATH names the
# others). Here, below both benchmark stages, so that neither has to import the other to name it.
OURS = "04"
