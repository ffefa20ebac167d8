"""The flags 05 and 05b both take are declared once (common/benchmark/inputs.py add_benchmark_flags)."""
import argparse
import ast
import importlib

from common.benchmark.inputs import add_benchmark_flags
from common.config import own_flags
from common.stage import BENCH, REPO_ROOT, SERVE_BENCH, stage_script

SHARED = {"draft", "benchmark-max-new-tokens", "num-prompts", "target-path", "bench-seed",
          "acceptance-temperatures", "acceptance-top-p"}


def declared(action: argparse.Action) -> tuple:
    """What a flag is, its stage's help aside."""
    return (action.option_strings, action.dest, type(action), action.type, action.default, action.nargs,
            action.metavar, action.choices)


def test_05_and_05b_take_the_shared_flags_from_one_declaration():
    """Each stage's parser holds add_benchmark_flags' flags exactly as it declares them (type, default,
    nargs, action), and neither stage script declares one of them itself."""
    group = argparse.ArgumentParser().add_argument_group()
    add_benchmark_flags(group, draft="", num_prompts="", bench_seed="", acceptance_temperatures="")
    shared = group._group_actions
    assert {o[2:] for a in shared for o in a.option_strings} == SHARED
    for name in (BENCH, SERVE_BENCH):
        script = REPO_ROOT / stage_script(name)
        assert not own_flags(ast.parse(script.read_text())) & SHARED, f"{script.name} declares a shared flag itself"
        actions = {a.dest: a for a in importlib.import_module(name).build_parser()._actions}
        for a in shared:
            assert declared(actions[a.dest]) == declared(a), (name, a.dest)
            assert actions[a.dest].help, (name, a.dest)
