"""The EAGLE-3 draft: the model (draft step and TTT forward), its TTT attention kernel, its two
exports (SGLang layout, speculators), and the reader of drafts made elsewhere (imported.py: public
drafts, SpecForge output, either export, checked against a target). Used by 04 (trains it) and 05
(measures it). Imports only the stage contract."""
