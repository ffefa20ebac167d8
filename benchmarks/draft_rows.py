"""Shared by the draft-comparison benchmarks (ablate_recipe, bench_feature_formats, data_scaling,
warm_start_study, regen_temperature): train one 04 run per row in its own work dir beside a base run,
and measure every row's draft on the same held-out prompts, so rows differ only in what the row changes.

A row's work dir links the base's upstream folders (01c, 02b, 03 - or its own 02b for a format row)
and holds its own 04_draft. Evaluation: `HeldOut` replays greedily in-process (tau at each k with a 95%
bootstrap interval over prompts, paired differences between rows); `evaluate` runs 05 (the reference
benchmark) with every draft side by side (`--draft`), which adds the serving temperatures and the stored pairs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.stage import BENCH, EXTRACT, MERGE, TRAIN, stage_dir  # noqa: E402


def parser(doc: str, base_help: str) -> argparse.ArgumentParser:
    """The flags every comparison benchmark takes (base work dir, output, preset, seed, k values,
    threads); each script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help=base_help)
    p.add_argument("--out", type=Path, required=True, help="output folder (results.json, table.md, its 04 runs)")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2.yaml", help="the preset")
    p.add_argument("--seed", type=int, default=0, help="04's --train-seed (init, data order) for every row")
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[3, 5, 7], help="k values to replay")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def argv_of(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():   # True: a switch (--fc-norm)
        out += [f"--{k}"] if v is True else [f"--{k}", *(v if isinstance(v, list) else [str(v)])]
    return out


def stage(name: str):
    """A numbered stage's module (e.g. TRAIN), to call its main() in this process."""
    return importlib.import_module(name)


def link(base: Path, work: Path, stages: tuple[str, ...]) -> None:
    """Symlink the folders of `stages` (e.g. MERGE) of the base work dir into `work`."""
    work.mkdir(parents=True, exist_ok=True)
    for s in stages:
        if not stage_dir(work, s).exists():
            os.symlink(stage_dir(base, s).resolve(), stage_dir(work, s))


def train(work: Path, config: Path, flags: dict) -> dict:
    """04 in `work` with the preset and `flags` (resumes if killed); returns a summary of the run."""
    t0 = time.time()
    stage(TRAIN).main(["--config", str(config), "--work-dir", str(work), *argv_of(flags)])
    from common.draft.manifest import DraftManifest

    d = stage_dir(work, TRAIN)
    m04 = DraftManifest.read(d)
    log = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]
    train_rows = [r for r in log if r["split"] == "train"]
    ev = m04.final_eval or {}
    return {"steps": m04.num_steps, "num_train_samples": m04.num_train_samples,
            "seconds": round(time.time() - t0, 1),
            "tokens_per_s": sum(r["tokens_per_s"] for r in train_rows) / max(1, len(train_rows)),
            "eval_acc": ev.get("acc"), "eval_tau": ev.get("tau"), "export": str(d / "export_sglang")}


def num_train(work: Path, config: Path) -> int:
    """Training samples of a work dir: all 02b samples but 04's held-out split (by id hash)."""
    m = stage(TRAIN)
    args = m.parse_args(m.build_parser(), ["--config", str(config), "--work-dir", str(work)])
    return m.plan_data(args, stage_dir(work, EXTRACT), False).num_train


class HeldOut:
    """The base run's held-out prompts, the target's greedy answers and features: built once."""

    def __init__(self, base: Path, config: Path, threads: int = 1):
        import torch
        import yaml
        from transformers import AutoModelForCausalLM

        from common.text.target_format import load_target_format
        from common.text.tokenizer import load_tokenizer
        from common.benchmark.reference import ReplaySet, replay_cache_file
        from common.io import iter_jsonl
        from common.target.manifests import HiddenStatesManifest

        torch.set_num_threads(threads)
        cfg = yaml.safe_load(config.read_text())
        m02 = HiddenStatesManifest.read(stage_dir(base, EXTRACT))
        self.target_dir = Path(m02.target["path"])
        self.target = AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=torch.float32).eval()
        tok = load_tokenizer(self.target_dir)
        fmt = load_target_format(self.target_dir, tok)
        eos = set(fmt.stop_ids)
        max_new = int(cfg["benchmark-max-new-tokens"])
        self.prompts = list(iter_jsonl(stage_dir(base, MERGE) / "benchmark_prompts.jsonl"))
        known = None
        if cfg.get("response-cache"):
            stage05 = stage(BENCH)
            known = stage05.known_answers(argparse.Namespace(response_cache=REPO / cfg["response-cache"],
                                                             benchmark_max_new_tokens=max_new),
                                          self.target_dir, tok, fmt)
        cache = replay_cache_file(REPO / "build" / "replay_cache", self.target_dir, max_new, eos)
        t0 = time.time()
        self.replay_set = ReplaySet(self.target, self.prompts, list(m02.capture_points), max_new,
                                    eos, cache, known, desc="[rows] held-out features")
        print(f"[rows] {len(self.prompts)} held-out prompts ready in {time.time() - t0:.0f} s "
              f"(answers: {self.replay_set.sources})", flush=True)

    def evaluate(self, export_dir: str | Path, ks: list[int]) -> dict:
        """{str(k): tau, tau_ci95, per-position acceptance, per-prompt totals} of an exported draft."""
        from common.draft.export_sglang import load_sglang_export
        from common.benchmark.reference import summarize

        draft = load_sglang_export(Path(export_dir), self.target.get_input_embeddings().weight.detach()).eval()
        keys = ("tau", "tau_ci95", "per_position_acceptance", "per_prompt_emitted", "per_prompt_rounds")
        return {str(k): {key: s[key] for key in keys}
                for k, s in ((k, summarize(r, k, seed=0)) for k, r in self.replay_set.replay(draft, ks).items())}


def evaluate(eval_dir: Path, base: Path, ours: Path, drafts: dict[str, Path], args, response_cache: Path) -> dict:
    """05 reference in `eval_dir` (base's 01c, `ours` as 04) with every other draft side by side (`--draft`),
    at args.num_draft_tokens and args.temperatures (None: the preset's); a finished evaluation of the same
    drafts is read back, so a script can evaluate in parts (one process per part) and tabulate later."""
    from common.stage import is_complete

    ref = stage_dir(eval_dir, BENCH)   # where 05 reference writes its metrics and manifest
    if is_complete(ref):
        metrics = json.loads((ref / "metrics.json").read_text())
        if set(metrics["drafts"]) == {"04", *drafts}:
            print(f"[rows] {eval_dir.name}: read back (same drafts)")
            return metrics
    eval_dir.mkdir(parents=True, exist_ok=True)
    link(base, eval_dir, (MERGE,))
    if not stage_dir(eval_dir, TRAIN).exists():
        os.symlink(ours.resolve(), stage_dir(eval_dir, TRAIN))
    specs = [f"{n}={p}" for n, p in drafts.items()]
    stage(BENCH).main([
        "--config", str(args.config), "--work-dir", str(eval_dir), "--overwrite", "--loop-prompts", "0",
        "--acceptance-loop-prompts", "0", "--num-draft-tokens", *map(str, args.num_draft_tokens),
        "--response-cache", str(response_cache), "--cpu-threads", str(args.threads), "--draft", *specs,
        *(["--acceptance-temperatures", *map(str, args.temperatures)] if args.temperatures else [])])
    return json.loads((ref / "metrics.json").read_text())


def target_name(base: Path) -> str:
    """The target of a base work dir: its model folder, from the 02b manifest (e.g. smollm2/target)."""
    from common.target.manifests import HiddenStatesManifest

    path = Path(HiddenStatesManifest.read(stage_dir(base, EXTRACT)).target["path"])
    return f"{path.parent.name}/{path.name}"


def num_prompts(results: dict) -> int:
    """How many held-out prompts the rows of a results file were replayed on."""
    return len(next(iter(results.values()))["replay"]["5"]["per_prompt_emitted"]) if results else 0


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_result(path: Path, name: str, entry: dict) -> dict:
    """Add one row to a results file under an exclusive lock (several processes may run rows of one
    table side by side, one per core); returns all rows."""
    import fcntl

    from common.io import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(path)
        results[name] = entry
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(results, indent=1))
    return results


def paired(a: dict, b: dict) -> dict:
    """Relative tau difference a/b - 1 on the same prompts, with its 95% interval (replay entries of one k)."""
    from common.benchmark.replay import bootstrap_paired_difference

    return bootstrap_paired_difference(a["per_prompt_emitted"], a["per_prompt_rounds"],
                                       b["per_prompt_emitted"], b["per_prompt_rounds"])


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation of two equally long lists (ties get their mean rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def fmt_tau(e: dict, ci_digits: int = 3) -> str:
    lo, hi = e["tau_ci95"]
    return f"{e['tau']:.3f} [{lo:.{ci_digits}f}, {hi:.{ci_digits}f}]"


def fmt_rel(d: dict) -> str:
    return f"{100 * d['relative']:+.1f}% [{100 * d['relative_ci'][0]:+.1f}, {100 * d['relative_ci'][1]:+.1f}]"
