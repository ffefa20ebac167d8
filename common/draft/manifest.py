"""04's manifest (04_draft/manifest.json) read once into a frozen dataclass, `DraftManifest`, for 05, 05b
and the benchmarks. 04 still WRITES it as plain JSON (common.stage.write_manifest). A field an older
manifest lacks reads as None, as the dict reads did with `.get`; `raw` keeps the whole dict. A key since
renamed stops with its new name.
Imports only the stage contract."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.stage import StageError, TRAIN, TypedManifest


@dataclass(frozen=True)
class DraftManifest(TypedManifest):
    """04's manifest (04_draft/manifest.json)."""
    STAGE = TRAIN
    draft_config: dict
    capture_points: tuple[int, ...] | None   # None: made before 04 recorded them
    draft_vocab_size: int | None
    vocab_size: int | None
    tokenizer: dict                          # common.stage.tokenizer_identity (02b's)
    target: dict                             # common.stage.target_identity (02b's)
    num_steps: int | None = None
    num_train_samples: int | None = None
    num_eval_samples: int | None = None
    final_eval: dict | None = None
    export_dir: str | None = None            # export_sglang/
    export_speculators_dir: str | None = None
    selection: dict | None = None
    init_from: dict | None = None            # --init-from's identity (the warm start); None from scratch
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> DraftManifest:
        if "init" in d:   # an older 04's name: "init" also named the --init-scheme of the linear layers
            raise StageError("04_draft/manifest.json says `init`, a key now named `init_from`: rename it there "
                             "(an older 04 wrote it), or re-run 04_train.py --overwrite")
        points, dv, v = d.get("capture_points"), d.get("draft_vocab_size"), d.get("vocab_size")
        return cls(draft_config=dict(d.get("draft_config") or {}),
                   capture_points=None if points is None else tuple(int(p) for p in points),
                   draft_vocab_size=None if dv is None else int(dv), vocab_size=None if v is None else int(v),
                   tokenizer=d.get("tokenizer") or {}, target=d.get("target") or {},
                   num_steps=d.get("num_steps"), num_train_samples=d.get("num_train_samples"),
                   num_eval_samples=d.get("num_eval_samples"), final_eval=d.get("final_eval"),
                   export_dir=d.get("export_dir"), export_speculators_dir=d.get("export_speculators_dir"),
                   selection=d.get("selection"), init_from=d.get("init_from"), raw=d)

