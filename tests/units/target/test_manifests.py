"""The 02b, 03 and 04 manifests as readers take them: frozen dataclasses read once, tolerant of extra keys,
an older manifest's missing field read as None (the dict reads' `.get` fallback), the JSON still as written."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.draft.manifest import DraftManifest
from common.stage import EXTRACT, TRAIN, VOCAB, StageError, stage_dir, write_manifest
from common.target.manifests import HiddenStatesManifest, VocabManifest
from common.target.shards import FeatureFormat

IDENT = {"tokenizer": {"path": "/t", "sha256": "ab"}, "target": {"path": "/t", "config_sha256": "cd"}}


def test_each_manifest_reads_from_its_folder_its_file_or_the_work_dir(tmp_path):
    fmt = FeatureFormat(aux="fp8", teacher="topk", topk=8)
    write_manifest(stage_dir(tmp_path, EXTRACT), EXTRACT, argparse.Namespace(), capture_points=[2, 4, 5],
                   hidden_size=32, num_hidden_layers=8, vocab_size=600, feature_format=fmt.as_dict(),
                   target_architecture="LlamaForCausalLM", num_samples=3, num_tokens=40,
                   shards={"shard_00000.safetensors": {"num_samples": 3, "num_tokens": 40}}, **IDENT)
    write_manifest(stage_dir(tmp_path, VOCAB), VOCAB, argparse.Namespace(), draft_vocab_size=64, vocab_size=600,
                   coverage=0.9, **IDENT)
    write_manifest(stage_dir(tmp_path, TRAIN), TRAIN, argparse.Namespace(), draft_config={"hidden_size": 32},
                   capture_points=[2, 4, 5], draft_vocab_size=64, vocab_size=600, num_steps=7, **IDENT)
    hs = HiddenStatesManifest.read(tmp_path)
    assert hs == HiddenStatesManifest.read(stage_dir(tmp_path, EXTRACT)) \
        == HiddenStatesManifest.read(stage_dir(tmp_path, EXTRACT) / "manifest.json")
    assert (hs.capture_points, hs.hidden_size, hs.vocab_size, hs.feature_format) == ((2, 4, 5), 32, 600, fmt)
    assert hs.tokenizer == IDENT["tokenizer"] and hs.raw["stage"] == EXTRACT and list(hs.shards) == ["shard_00000.safetensors"]
    assert VocabManifest.require(stage_dir(tmp_path, VOCAB)).draft_vocab_size == 64
    m04 = DraftManifest.read(tmp_path)
    assert (m04.capture_points, m04.draft_vocab_size, m04.num_steps, m04.final_eval) == ((2, 4, 5), 64, 7, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m04.num_steps = 8
    with pytest.raises(StageError, match="run `python 04_train.py`"):
        DraftManifest.require(tmp_path / "elsewhere")


def test_an_older_manifest_reads_with_todays_fallbacks():
    hs = HiddenStatesManifest.from_dict({"capture_points": ["2", 4], "hidden_size": "32", "unknown": 1})
    assert hs.capture_points == (2, 4) and hs.hidden_size == 32
    assert hs.feature_format == FeatureFormat() and hs.target_architecture is None and hs.num_supervised_tokens is None
    m04 = DraftManifest.from_dict({"tokenizer": {}, "something_new": True})
    assert m04.capture_points is None and m04.draft_vocab_size is None and m04.raw["something_new"]


def test_an_older_04_manifests_renamed_key_stops_with_its_new_name():
    """04 once wrote the warm start's identity as `init`, the word --init-scheme also used: today it is
    `init_from`, and a manifest that still says `init` stops with one line naming it."""
    warm = {"path": "/d", "sha256": "ef", "vocab": "keep"}
    assert DraftManifest.from_dict({**IDENT, "init_from": warm}).init_from == warm
    with pytest.raises(StageError, match="`init`, a key now named `init_from`"):
        DraftManifest.from_dict({**IDENT, "init": warm})
