"""The stage contract (common/stage.py, common/config.py, common/io.py)."""
import argparse
import json
from pathlib import Path

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
    cfg.write_text("generation-backend: hf\n")  # a renamed flag: the error names its new name
    with pytest.raises(stage.StageError, match="generation-backend is now generation-engine"):
        config.parse_args(parser, ["--config", str(cfg)])


@pytest.mark.parametrize("given", [["--init", "normal"], ["--init=normal"], "config"])
def test_a_renamed_flag_stops_with_its_new_name(given, tmp_path):
    """04's --init (the weight scheme) is --init-scheme: an old command line or config stops with one line
    naming it, not argparse's "unrecognized arguments"."""
    import importlib

    parser = importlib.import_module(stage.TRAIN).build_parser()
    if given == "config":
        (tmp_path / "c.yaml").write_text("init: normal\n")
        given, match = ["--config", str(tmp_path / "c.yaml")], "init is now init-scheme"
    else:
        match = "--init is now --init-scheme"
    with pytest.raises(stage.StageError, match=match):
        config.parse_args(parser, ["--work-dir", str(tmp_path), *given])


def test_an_abbreviated_flag_is_refused(capsys):
    """`--datasets x` on a stage that has only `--datasets-only` must fail, not run one source."""
    parser = config.base_parser("t")
    parser.add_argument("--datasets-only", nargs="*", default=None)
    with pytest.raises(SystemExit):
        config.parse_args(parser, ["--work-dir", "/tmp/w", "--datasets", "x"])
    assert "unrecognized arguments: --datasets" in capsys.readouterr().err


def test_missing_work_dir_is_an_error():
    with pytest.raises(stage.StageError, match="--work-dir"):
        config.parse_args(config.base_parser("t"), [])


def test_start_stage_complete_is_noop_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "s"
    assert stage.start_stage(out, overwrite=False, stage="09_test")
    stage.write_manifest(out, "t", argparse.Namespace(a=1), counts={"n": 1})
    assert not stage.start_stage(out, overwrite=False, stage="09_test")
    assert "nothing to do" in capsys.readouterr().out
    assert stage.start_stage(out, overwrite=True, stage="09_test") and not stage.is_complete(out)


def test_a_manifest_names_the_machine(tmp_path):
    """Numbers quoted from a manifest name their CPU: the model, the vector features that decide fp32 against
    bf16 speed (two machines with one model name differ there) and the cores."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 sse\n\n"
                       "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 sse\n")
    host = stage.host_info(cpuinfo)
    assert host["cpu"] == "Some Xeon" and host["cpu_features"] == ["avx2", "avx512f", "amx_bf16"]
    m = stage.write_manifest(tmp_path / "s", "t", argparse.Namespace(a=1))
    assert m["host"]["cores"] >= 1 and stage.read_manifest(tmp_path / "s")["host"] == m["host"]


def test_require_complete_names_the_producer(tmp_path):
    with pytest.raises(stage.StageError, match=stage.stage_script(stage.GENERATE)):
        stage.require_complete(tmp_path / "missing", stage.GENERATE)


def test_repeated_config_merges_and_refuses_a_conflict(tmp_path):
    """Two --config files merge key by key; a key they disagree on is refused unless the command line
    sets it; a key both set to the same value is fine."""
    parser = config.base_parser("t")
    parser.add_argument("--num-things", type=int, default=1)
    parser.add_argument("--name", default="x")
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("work-dir: /tmp/w\nnum-things: 5\n")
    b.write_text("work-dir: /tmp/w\nname: b\n")
    args = config.parse_args(parser, ["--config", str(a), "--config", str(b)])
    assert (args.num_things, args.name, [p.name for p in args.config]) == (5, "b", ["a.yaml", "b.yaml"])
    b.write_text("num-things: 6\n")
    with pytest.raises(stage.StageError, match=r"disagree on num-things: .*a.yaml says 5, .*b.yaml says 6"):
        config.parse_args(parser, ["--config", str(a), "--config", str(b)])
    for cli in (["--num-things", "7"], ["--num-things=7"]):
        args = config.parse_args(parser, ["--config", str(a), "--config", str(b), *cli])
        assert args.num_things == 7


def test_stage_flags_are_read_without_running_the_stages():
    """declared_flags (ast over the source) finds exactly the flags each stage's real parser has."""
    import importlib

    for name in stage.STAGE_SCRIPTS:
        real = set(config._flag_names(importlib.import_module(name).build_parser()))
        shared = set(config._flag_names(config.base_parser(None, work_dir=name not in stage.WORLD_BUILDERS)))
        assert config.declared_flags(stage.REPO_ROOT / stage.stage_script(name)) == real - shared, name


REAL_RUN = ["--config", "configs/kimi-k2.5.yaml", "--config", "configs/datasets_v4.yaml"]


def test_the_real_runs_two_presets_combine_on_every_stage(monkeypatch):
    """train_plan_v4.md's CFG (both presets) parses on every stage with no conflicting key, and each
    stage gets the preset's values."""
    import importlib

    monkeypatch.chdir(stage.REPO_ROOT)
    for name in stage.STAGE_DIRS:
        args = config.parse_args(importlib.import_module(name).build_parser(), [*REAL_RUN, "--work-dir", "/w"])
        assert [p.name for p in args.config] == ["kimi-k2.5.yaml", "datasets_v4.yaml"]
    m01b = importlib.import_module(stage.GENERATE)
    args = config.parse_args(m01b.build_parser(), [*REAL_RUN, "--work-dir", "/w"])
    assert (args.concurrency, args.long_context, args.long_concurrency) == (160, 16384, 16)
    mix, kimi = (config.load_config(stage.REPO_ROOT / "configs" / f) for f in ("datasets_v4.yaml", "kimi-k2.5.yaml"))
    assert not set(mix) & set(kimi), "the mix file holds the mix alone; everything else is kimi-k2.5.yaml's"


def test_each_seed_has_one_purpose(monkeypatch, tmp_path):
    """The mix's seed (01's cuts and thinking, 01c's held-out choice) is not the draft's init and data order
    nor 01b's sampling seed: reshuffling the mix in its preset leaves 01b's and 04's seeds alone."""
    import importlib

    monkeypatch.chdir(stage.REPO_ROOT)
    reshuffled = tmp_path / "mix.yaml"
    reshuffled.write_text((stage.REPO_ROOT / "configs" / "datasets_v4.yaml").read_text().replace("mix-seed: 0", "mix-seed: 7"))
    argv = ["--config", "configs/kimi-k2.5.yaml", "--config", str(reshuffled), "--work-dir", "/w"]
    seeds = {}
    for name in stage.STAGE_DIRS:
        args = vars(config.parse_args(importlib.import_module(name).build_parser(), argv))
        seeds[name] = {k: v for k, v in args.items() if k.endswith("seed")}
    assert seeds[stage.PREPARE] == seeds[stage.MERGE] == {"mix_seed": 7}
    assert seeds[stage.GENERATE] == {"generation_seed": 0} and seeds[stage.TRAIN] == {"train_seed": 0}
    assert seeds[stage.BENCH] == seeds[stage.SERVE_BENCH] == {"bench_seed": 0}
    assert not any("mix_seed" in s for n, s in seeds.items() if n not in (stage.PREPARE, stage.MERGE))


@pytest.mark.parametrize("preset", ["tiny.yaml", "smollm2.yaml"])
def test_each_small_preset_parses_on_every_stage(preset, monkeypatch):
    """One preset holds keys for the whole chain: it parses on every stage (each ignores the others' keys), and
    05 and 05b, one script with a --mode until they split, each take the preset's values of their own flags."""
    import importlib

    monkeypatch.chdir(stage.REPO_ROOT)
    cli = ["--config", f"configs/{preset}", "--work-dir", "/w"]
    parsed = {name: config.parse_args(importlib.import_module(name).build_parser(), cli) for name in stage.STAGE_DIRS}
    values = config.load_config(stage.REPO_ROOT / "configs" / preset)
    for name in (stage.BENCH, stage.SERVE_BENCH):
        own = config.declared_flags(stage.REPO_ROOT / stage.stage_script(name))
        for key in set(values) & own:
            got = getattr(parsed[name], key.replace("-", "_"))
            assert (str(got) if isinstance(got, Path) else got) == values[key], (preset, name, key)
    if preset == "smollm2.yaml":   # keys of each half of the old 05, and the keys both read
        assert parsed[stage.BENCH].num_draft_tokens == [3, 5, 7] and parsed[stage.SERVE_BENCH].engine == "vllm"
        for name in (stage.BENCH, stage.SERVE_BENCH):
            assert parsed[name].acceptance_temperatures == [0, 1.0] and parsed[name].benchmark_max_new_tokens == 256


def test_the_plans_commands_repeat_no_preset_value():
    """A flag the presets already set, passed by hand with the preset's own value in train_plan_v4.md's
    real-run commands (those with $CFG), is noise that can drift; the plan passes only what differs."""
    import re
    import shlex

    presets = {}
    for f in ("kimi-k2.5.yaml", "datasets_v4.yaml"):
        presets.update(config.load_config(stage.REPO_ROOT / "configs" / f))
    text = (stage.REPO_ROOT / "train_plan_v4.md").read_text()
    commands = [line for line in text.splitlines() if "$CFG" in line and re.search(r"\d\w*_\w+\.py", line)]
    assert len(commands) >= 8, commands
    for line in commands:
        words = shlex.split(line.replace("$CFG", "CFG"))
        for i, w in enumerate(words):
            key = w[2:] if w.startswith("--") else None
            if key in presets and i + 1 < len(words) and str(presets[key]) == words[i + 1]:
                raise AssertionError(f"{line!r} repeats the preset's {key}: {presets[key]}")


def test_target_identity_ignores_the_writers_version_but_not_the_model(tmp_path):
    """A transformers upgrade re-saving the same config.json (new transformers_version, keys reordered)
    is the same target; a changed model field is not. The shipped response caches depend on this."""
    from common.stage import target_identity

    cfg = {"model_type": "llama", "hidden_size": 576, "rope_parameters": {"rope_theta": 1e5}, "transformers_version": "5.24.0"}
    for name, c in {"a": cfg, "b": {**dict(reversed(list(cfg.items()))), "transformers_version": "5.25.0"},
                    "c": {**cfg, "rope_parameters": {"rope_theta": 1e6}}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(c, indent=2))
    ids = {n: target_identity(tmp_path / n)["config_sha256"] for n in "abc"}
    assert ids["a"] == ids["b"] != ids["c"]
