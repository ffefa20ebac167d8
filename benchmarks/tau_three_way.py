"""How far does 04's tau predict served tau? Three numbers per draft, one table, their correlation.

For each draft: (1) 04's simulated tau: 04's own held-out evaluation (`evaluate()` of 04_train.py: the
TTT accuracy per step turned into an expected chain length) on the BASE run's eval split (samples of
the training distribution, not the held-out prompts); (2) replay
tau (05 reference: common/benchmark/replay.py, exact greedy acceptance) at k on all held-out prompts,
and on the first --engine-prompts of them; (3) the real engine's tau: vLLM's CPU build serves the
target with the draft at k and answers those first prompts one at a time (greedy); tau = 1 + accepted
drafts / rounds from its per-round counts (the definition replay uses). The engine's answers are then
replayed round by round (common/serving/agreement.py): every round must be equal, so a draft whose
served tau differs from replay's is caught, not averaged in.

04's number is the one 04 printed where the draft's run evaluated on the base run's eval split (its
train log's eval row at a checkpoint's step, its manifest's final eval: the fp32 master weights); for
any other draft (the untrained one, a run on other data) 04's `evaluate()` is run here on the base's
split, on the SGLang export (bf16, as 04 exports it), which replay and vLLM load too.

Drafts (the cheapest honest set: what runs already left, plus checkpoints of one short run):
  --checkpoints DIR...   04 checkpoint folders (step_*/ with COMPLETE), e.g. a `--save-every 100
                         --keep-checkpoints 10 --stop-at-step 600` run of 04 on the base run's data
  --work-dirs DIR...     complete 04 runs (their 04_draft/export_sglang)
  --untrained            04's step-0 draft (its seeded init): the chance level
Writes: OUT/drafts/<name>/export_sglang, OUT/server_logs/, OUT/results.json (one row per draft; a
        finished row is kept on a re-run), OUT/table.md.
Run:    python benchmarks/tau_three_way.py --base runs/smollm2 --out runs/tau_three_way --untrained \
            --checkpoints runs/tau_three_way/run/04_draft/checkpoints/step_* \
            runs/smollm2/04_draft/checkpoints/step_001400 --work-dirs runs/smollm2 runs/box_smoke
"""
from __future__ import annotations

import importlib
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_rows as dr  # noqa: E402

from common.config import parse_args  # noqa: E402
from common.draft.manifest import DraftManifest  # noqa: E402
from common.serving import process, vllm  # noqa: E402
from common.serving.agreement import check_answers  # noqa: E402
from common.serving.vllm import VllmEngine  # noqa: E402
from common.stage import EXTRACT, MERGE, TRAIN, stage_dir  # noqa: E402
from common.target.manifests import HiddenStatesManifest  # noqa: E402


def pearson(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else float("nan")


def drafts_wanted(args) -> list[tuple[str, str, Path | None]]:
    """[(name, kind, source)]: kind is untrained / checkpoint / export."""
    out = [("untrained", "untrained", None)] if args.untrained else []
    for c in args.checkpoints:
        c = Path(c)
        if not (c / "COMPLETE").is_file():
            raise SystemExit(f"{c} is not a complete 04 checkpoint (no COMPLETE marker)")
        out.append((f"{c.parents[2].name}@{int(c.name.split('_')[1])}", "checkpoint", c))
    for w in args.work_dirs:
        m04 = DraftManifest.read(stage_dir(w, TRAIN))
        out.append((f"{Path(w).name}@{m04.num_steps} (final)", "export", stage_dir(w, TRAIN) / "export_sglang"))
    return out


def logged_eval(kind: str, source: Path | None) -> dict | None:
    """What 04 printed for this draft: the train log's eval row at the checkpoint's step, or a complete
    run's final eval (on that run's own eval split)."""
    if kind == "checkpoint":
        step = int(source.name.split("_")[1])
        rows = [json.loads(x) for x in (source.parents[1] / "train_log.jsonl").read_text().splitlines()]
        hit = [r for r in rows if r["split"] == "eval" and r["step"] == step]
        return {"tau": hit[-1]["tau"], "acc0": hit[-1]["acc"][0], "split": "its run's"} if hit else None
    if kind == "export":
        ev = DraftManifest.read(source.parent).final_eval
        return {"tau": ev["tau"], "acc0": ev["acc"][0], "split": "its run's"} if ev else None
    return None


def same_eval_split(kind: str, source: Path | None, base: Path) -> bool:
    """Was this draft's logged eval taken on the base run's eval split (its run read the base's 02b)?"""
    if kind == "untrained":
        return False
    work = source.parents[2] if kind == "checkpoint" else source.parents[1]
    return stage_dir(work, EXTRACT).resolve() == stage_dir(base, EXTRACT).resolve()


class Stage04Eval:
    """04's held-out evaluation of the base run, callable on any draft of the same shape."""

    def __init__(self, base: Path, config: Path):
        import contextlib

        import torch

        from common.training.precision import choose_bf16

        self.m = importlib.import_module(TRAIN)
        self.args = parse_args(self.m.build_parser(), ["--config", str(config), "--work-dir", str(base)])
        self.inputs = self.m.load_inputs(self.args)
        self.device = torch.device("cpu")
        bf16, why = choose_bf16(self.args.precision, self.device)   # as 04 chose when it trained
        print(f"[tau3] 04 eval precision: {'bf16 autocast' if bf16 else 'fp32'} ({why})", flush=True)
        self.autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext)
        self.initial, self.lm_head, self.cfg, _ = self.m.build_draft(self.args, self.inputs, None, self.device, bf16,
                                                                     False)
        self.plan = self.m.plan_data(self.args, self.inputs.hs_dir, False)
        self.points = list(self.inputs.m02b.capture_points)

    def evaluate(self, draft) -> dict:
        from common.training.distributed import Ranks

        ev = self.m.evaluate(draft, self.lm_head, self.plan.data, self.plan.eval_batches, self.args,
                             Ranks(device=self.device), self.autocast)
        return {"tau": ev["tau"], "acc0": ev["acc"][0], "num_eval_samples": self.plan.num_eval}


def write_export(name: str, kind: str, source: Path | None, s04: Stage04Eval, out: Path) -> Path:
    """The draft as an SGLang export under OUT/drafts (a work dir's export is used where it lies)."""
    import torch

    from common.draft.export_sglang import export_sglang
    from common.draft.model import Eagle3DraftModel

    if kind == "export":
        return source
    dest = out / "drafts" / re.sub(r"[^A-Za-z0-9@._-]", "_", name) / "export_sglang"
    if (dest / "config.json").is_file():
        return dest
    if kind == "untrained":
        model = s04.initial
    else:
        model = Eagle3DraftModel(s04.cfg)
        missing, unexpected = model.load_state_dict(torch.load(source / "model.pt", map_location="cpu"),
                                                    strict=False)
        assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    return export_sglang(model, dest, s04.points)


def serve_and_check(export: Path, held, m02b: HiddenStatesManifest, points: list[int], prompts: list[list[int]], args,
                    log: Path) -> dict:
    """vLLM serves the target with this draft at k; the first prompts answered one at a time, then
    replayed on the engine's own answers round by round."""
    from common.draft.export_sglang import load_sglang_export

    k = args.num_draft_tokens
    settings = vllm.VllmSettings(python=args.vllm_python, threads=1)
    engine = VllmEngine(held.target_dir, export, export, m02b, DraftManifest.from_dict({"capture_points": points}),
                        settings)
    cmd, env = engine.command(args.port, False, (k, 1, k + 1))
    url = f"http://127.0.0.1:{args.port}"
    proc = process.launch_server(cmd, log, env)
    try:
        t0 = time.time()
        process.wait_ready(url, proc, 900, log_path=log)
        ready_s = time.time() - t0
        engine.check_eagle3(url)                           # eagle3, this draft by content, our target
        layers = vllm.check_aux_layers(log, points, url)   # the engine feeds the capture points
        start = engine.window_start(url)
        t0 = time.time()
        answers = [engine.request(url, ids, args.engine_max_new_tokens, 1800) for ids in prompts]
        answer_s = time.time() - t0
        window = engine.window_end(url, start)
    finally:
        process.stop_server(proc)
    draft = load_sglang_export(export, held.target.get_input_embeddings().weight.detach()).eval()
    models = (held.target, draft, held.replay_set.eos, points)
    res = check_answers(models, prompts, answers, k, 0.0)
    tokens = sum(a["completion_tokens"] for a in answers)
    return {"tau": res["engine"]["tau"], "num_rounds": res["engine"]["num_rounds"],
            "accepted_per_position": res["engine"]["accepted_per_position"],
            "replay_on_engine_answers_tau": res["replay"]["tau"], "every_round_equal": res["exact"],
            "counters_equal": window["num_drafts"] == res["engine"]["num_rounds"],
            "aux_layers": layers, "num_prompts": len(prompts), "completion_tokens": tokens,
            "ready_s": round(ready_s, 1), "answer_s": round(answer_s, 1)}


def correlations(rows: list[dict], with_untrained: bool) -> dict:
    rows = [r for r in rows if with_untrained or r["kind"] != "untrained"]
    if len(rows) < 3:
        return {}
    sim = [r["stage04"]["tau"] for r in rows]
    rep = [r["replay_all"]["tau"] for r in rows]
    eng = [r["engine"]["tau"] for r in rows]
    pairs = {"04 sim vs vLLM": (sim, eng), "04 sim vs replay (all)": (sim, rep), "replay (all) vs vLLM": (rep, eng)}
    return {name: {"pearson": pearson(a, b), "spearman": dr.spearman(a, b), "n": len(a)}
            for name, (a, b) in pairs.items()}


def write_table(out: Path, results: dict, args, held_prompts: int) -> str:
    rows = sorted(results.values(), key=lambda r: r["stage04"]["tau"])
    k, n = args.num_draft_tokens, args.engine_prompts
    lines = [f"| draft | 04 printed | 04 sim tau | replay tau k={k}, {held_prompts} prompts | replay, first {n} "
             f"| vLLM k={k}, first {n} | vLLM / 04 sim | rounds (vLLM = replay) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, lg = r["engine"], r.get("logged")
        printed = f"{lg['tau']:.3f}" if lg else "-"
        lines.append(f"| {r['name']} | {printed} | {r['stage04']['tau']:.3f} "
                     f"| {dr.fmt_tau(r['replay_all'])} | {r['replay_first']['tau']:.3f} | {e['tau']:.3f} "
                     f"| {e['tau'] / r['stage04']['tau']:.3f} "
                     f"| {e['num_rounds']} ({'all equal' if e['every_round_equal'] else 'DIFFER'}) |")
    lines.append("")
    for label, with_u in (("all drafts", True), ("trained drafts only", False)):
        c = correlations(rows, with_u)
        if c:
            lines.append(f"Correlation across {label} (n = {next(iter(c.values()))['n']}): " + "; ".join(
                f"{name}: Pearson {v['pearson']:.3f}, Spearman {v['spearman']:.3f}" for name, v in c.items()))
            lines.append("")
    errs = [r["engine"]["tau"] - r["stage04"]["tau"] for r in rows]
    lines.append(f"vLLM tau - 04 sim tau: mean {sum(errs) / len(errs):+.3f}, from {min(errs):+.3f} to {max(errs):+.3f}")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def main(argv=None):
    p = dr.parser(__doc__, "work dir with 01c, 02b, 03 complete (its eval split and held-out prompts are used)")
    p.set_defaults(num_draft_tokens=5)
    p.add_argument("--checkpoints", nargs="*", default=[], help="04 checkpoint folders (step_*)")
    p.add_argument("--work-dirs", nargs="*", default=[], help="work dirs with a complete 04 (their final draft)")
    p.add_argument("--untrained", action="store_true", help="add 04's untrained step-0 draft")
    p.add_argument("--engine-prompts", type=int, default=16,
                   help="held-out prompts (the first N) the engine answers per draft (count)")
    p.add_argument("--engine-max-new-tokens", type=int, default=128, help="the engine's answer budget (tokens)")
    p.add_argument("--vllm-python", default=str(dr.REPO / "build" / "vllm-venv" / "bin" / "python"),
                   help="python of the engine venv (make engine)")
    p.add_argument("--port", type=int, default=30120, help="port of the vLLM servers this script starts")
    args = p.parse_args(argv)
    if isinstance(args.num_draft_tokens, list):
        if len(args.num_draft_tokens) != 1:
            raise SystemExit("--num-draft-tokens: one k (each draft gets one vLLM server)")
        args.num_draft_tokens = args.num_draft_tokens[0]
    k = args.num_draft_tokens
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "results.json"
    wanted = drafts_wanted(args)
    results = dr.load_results(out_json)
    todo = [w for w in wanted if w[0] not in results]
    held = s04 = None
    if todo:
        s04 = Stage04Eval(args.base, args.config)
        held = dr.HeldOut(args.base, args.config, args.threads)
    m02b = HiddenStatesManifest.read(stage_dir(args.base, EXTRACT))
    for name, kind, source in todo:
        t0 = time.time()
        export = write_export(name, kind, source, s04, args.out)
        from common.draft.export_sglang import load_sglang_export

        logged = logged_eval(kind, source)
        if logged and same_eval_split(kind, source, args.base):
            stage04 = {"tau": logged["tau"], "acc0": logged["acc0"], "from": "train log"}
        else:
            draft = load_sglang_export(export, s04.initial.embed_tokens.weight.detach().float()).eval()
            stage04 = {**s04.evaluate(draft), "from": "04 evaluate() on the export"}
        rep = held.evaluate(export, [k])[str(k)]
        n = args.engine_prompts
        first = {"tau": sum(rep["per_prompt_emitted"][:n]) / sum(rep["per_prompt_rounds"][:n]), "num_prompts": n}
        print(f"[tau3] {name}: 04 sim tau {stage04['tau']:.3f}, replay {rep['tau']:.3f} (first {n}: "
              f"{first['tau']:.3f}); serving...", flush=True)
        prompts = [list(r["prompt_ids"]) for r in held.prompts[:n]]
        log = args.out / "server_logs" / (re.sub(r"[^A-Za-z0-9@._-]", "_", name) + ".log")
        engine = serve_and_check(export, held, m02b, s04.points, prompts, args, log)
        row = {"name": name, "kind": kind, "source": str(source) if source else None, "export": str(export),
               "num_draft_tokens": k, "logged": logged, "stage04": stage04,
               "replay_all": {key: rep[key] for key in ("tau", "tau_ci95", "per_position_acceptance")},
               "replay_first": first, "engine": engine, "seconds": round(time.time() - t0, 1)}
        results = dr.save_result(out_json, name, row)
        print(f"[tau3] {name}: vLLM tau {engine['tau']:.3f} on {engine['num_rounds']} rounds "
              f"(every round = replay: {engine['every_round_equal']}) | {row['seconds'] / 60:.1f} min", flush=True)
    num_held = sum(1 for line in (stage_dir(args.base, MERGE) / "benchmark_prompts.jsonl").open() if line.strip())
    print(write_table(args.out, dr.load_results(out_json), args, num_held))


if __name__ == "__main__":
    main()
