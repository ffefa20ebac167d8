"""The EAGLE-3 draft: the model (draft step and TTT forward), its TTT attention kernel, and its two
exports (SGLang layout, speculators). Used by 04 (trains it) and 05 (measures it).
Imports only the stage contract."""
