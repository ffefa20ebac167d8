"""The stage contract (common/stage.py, common/config.py, common/io.py)."""
import argparse

import pytest

from common import config, io, stage


def test_torn_tail_is_ignored_and_cut(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    assert [r["id"] for r in io.iter_jsonl(p)] == [1, 2]
    with io.JsonlAppender(p) as w:
        w.write({"id": 3})
    assert [r["id"] for r in io.iter_jsonl(p)] == [1, 2, 3]


def test_corrupt_middle_line_raises(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ValueError, match="x.jsonl:2"):
        list(io.iter_jsonl(p))


def test_config_defaults_cli_wins_unknown_key_fails(tmp_path):
    parser = config.base_parser("t")
    parser.add_argument("--num-things", type=int, default=1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("work-dir: /tmp/w\nnum-things: 5\n")
    args = config.parse_args(parser, ["--config", str(cfg)])
    assert args.num_things == 5 and str(args.work_dir) == "/tmp/w"
    args = config.parse_args(parser, ["--config", str(cfg), "--num-things", "7"])
    assert args.num_things == 7
    cfg.write_text("work-dir: /tmp/w\nno-such-flag-anywhere: 1\n")
    with pytest.raises(stage.StageError, match="no-such-flag-anywhere"):
        config.parse_args(parser, ["--config", str(cfg)])


def test_missing_work_dir_is_an_error():
    with pytest.raises(stage.StageError, match="--work-dir"):
        config.parse_args(config.base_parser("t"), [])


def test_start_stage_complete_is_noop_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "s"
    assert stage.start_stage(out, overwrite=False, name="t")
    stage.write_manifest(out, "t", argparse.Namespace(a=1), counts={"n": 1})
    assert not stage.start_stage(out, overwrite=False, name="t")
    assert "nothing to do" in capsys.readouterr().out
    assert stage.start_stage(out, overwrite=True, name="t") and not stage.is_complete(out)


def test_require_complete_names_the_producer(tmp_path):
    with pytest.raises(stage.StageError, match="01b_generate_synthetic.py"):
        stage.require_complete(tmp_path / "missing", "01b_generate_synthetic")
