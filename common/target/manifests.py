"""The manifests of the target's side, each read once into a frozen dataclass: 02b's hidden states
(`HiddenStatesManifest`) and 03's draft vocabulary (`VocabManifest`). Stages still WRITE them as plain
JSON (common.stage.write_manifest); these only read. A field an older manifest lacks reads as None (or
empty), as the dict reads did with `.get`; `raw` keeps the whole dict for the fields rarely used.
Imports only the stage contract (and shards' FeatureFormat)."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.stage import EXTRACT, VOCAB, TypedManifest
from common.target.shards import FeatureFormat


def _ints(value) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(p) for p in value)


def _int(value) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class HiddenStatesManifest(TypedManifest):
    """02b's manifest (02b_hidden_states/manifest.json)."""
    STAGE = EXTRACT
    capture_points: tuple[int, ...] | None   # h_i indices, ascending
    hidden_size: int | None
    num_hidden_layers: int | None
    vocab_size: int | None
    feature_format: FeatureFormat            # bf16 + final when the manifest predates formats
    target_architecture: str | None          # None: made by an older 02b
    tokenizer: dict                          # common.stage.tokenizer_identity
    target: dict                             # common.stage.target_identity
    num_samples: int | None = None
    num_tokens: int | None = None            # stored rows
    num_supervised_tokens: int | None = None
    bytes_per_sample_token: float | None = None
    shards: dict = field(default_factory=dict)   # {shard file name: {num_samples, num_tokens}}
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> HiddenStatesManifest:
        return cls(capture_points=_ints(d.get("capture_points")), hidden_size=_int(d.get("hidden_size")),
                   num_hidden_layers=_int(d.get("num_hidden_layers")), vocab_size=_int(d.get("vocab_size")),
                   feature_format=FeatureFormat.from_dict(d.get("feature_format")),
                   target_architecture=d.get("target_architecture"),
                   tokenizer=d.get("tokenizer") or {}, target=d.get("target") or {},
                   num_samples=_int(d.get("num_samples")), num_tokens=_int(d.get("num_tokens")),
                   num_supervised_tokens=_int(d.get("num_supervised_tokens")),
                   bytes_per_sample_token=d.get("bytes_per_sample_token"), shards=dict(d.get("shards") or {}),
                   raw=d)



@dataclass(frozen=True)
class VocabManifest(TypedManifest):
    """03's manifest (03_vocab/manifest.json)."""
    STAGE = VOCAB
    draft_vocab_size: int | None
    vocab_size: int | None
    tokenizer: dict
    target: dict
    coverage: float | None = None
    capture_points: tuple[int, ...] | None = None   # copied from 02b
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> VocabManifest:
        return cls(draft_vocab_size=_int(d.get("draft_vocab_size")), vocab_size=_int(d.get("vocab_size")),
                   tokenizer=d.get("tokenizer") or {}, target=d.get("target") or {}, coverage=d.get("coverage"),
                   capture_points=_ints(d.get("capture_points")), raw=d)

