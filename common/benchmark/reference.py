"""05, the reference benchmark: tau on every held-out prompt by replay, the step-by-step loop on a subset.

1. Continuations: the target's greedy answer to each prompt (spec_decode.greedy_decode, the lossless
   reference), cached in a file keyed by the target's weights and the token budget, so evaluating many
   drafts on one prompt set (ablations, scaling curves) pays for generation once.
2. Replay (common/benchmark/replay.py): one target forward over prompt + continuation gives every
   feature; one TTT forward per draft gives every round's acceptance at every k. Trained and untrained
   drafts, all prompts, all k: tau with a 95% bootstrap interval over prompts, per-position acceptance,
   histogram, tau by prompt family (the id before the first "/"), per-prompt totals for paired
   comparisons between drafts; and, trained draft, tau and per-position acceptance by segment
   (reasoning, answer, code, tool call), output position and source dataset (segments.py).
3. Loop (common/benchmark/spec_decode.py) on the first `loop_prompts` prompts: real speculative decoding
   with KV caches and rollback, checked token for token against target-only greedy decoding
   (lossless), timed against it (speed ratio), and its per-round statistics compared with the
   replay's on the same prompts (they agree exactly, up to float near-ties of the target).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.benchmark import compare as cmp
from common.benchmark import replay as rp
from common.benchmark import sampled as smp
from common.benchmark import segments as sg
from common.benchmark import spec_decode as sd
from common.benchmark.formatting import fmt, fmt_ci
from common.io import atomic_path, iter_jsonl, write_jsonl
from common.parallel import ordered_map
from common.stage import StageError, sha256_file


def weights_key(target_dir: Path, max_new_tokens: int, eos: set[int]) -> str:
    """Identifies the target's greedy behaviour: config, weight file contents, budget, eos, and the torch
    and transformers versions that computed it (a library that dropped the KV cache wrote wrong answers
    once; another version must not read them). Hashing the weights takes ~2 s for 0.5 GB; reference
    mode refuses targets too big to load anyway."""
    import torch
    import transformers

    h = hashlib.sha256((Path(target_dir) / "config.json").read_bytes())
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{sha256_file(f)}".encode())
    h.update(f"{max_new_tokens}:{sorted(eos)}:torch {torch.__version__}:transformers "
             f"{transformers.__version__}".encode())
    return h.hexdigest()[:16]


def replay_cache_file(cache_dir: Path, target_dir: Path, max_new_tokens: int, eos: set[int]) -> Path:
    """The file of the target's greedy answers for this target, token budget and end-of-turn ids."""
    return Path(cache_dir) / f"{weights_key(target_dir, max_new_tokens, eos)}_greedy.jsonl"


def greedy_continuations(target, rows: list[dict], max_new_tokens: int, eos: set[int], cache_file: Path,
                         known=None) -> tuple[list[list[int]], dict]:
    """The target's greedy answer per row: from `known(row)` (e.g. a shipped response cache) when it
    has one, else from `cache_file` (same prompt ids), else generated and added to `cache_file`.
    Returns (answers, counts by source)."""
    from tqdm import tqdm

    def key(ids):
        return hashlib.sha256(json.dumps(ids).encode()).hexdigest()

    cached = {r["prompt_sha256"]: r["continuation"] for r in iter_jsonl(cache_file)} if cache_file.is_file() else {}
    sources = {"response_cache": 0, "replay_cache": 0, "generated": 0}
    origin = {}  # key -> where its answer came from (for the refusal below)
    for r in rows:
        k = key(r["prompt_ids"])
        if k in cached:
            sources["replay_cache"] += 1
            origin[k] = str(cache_file)
        elif known is not None and (ids := known(r)) is not None:
            cached[k] = ids
            sources["response_cache"] += 1
            origin[k] = "--response-cache"
    missing = [r for r in rows if key(r["prompt_ids"]) not in cached]
    sources["generated"] = len(missing)
    for r in tqdm(missing, desc="[05] target greedy answers", unit="prompt", disable=not missing):
        cached[key(r["prompt_ids"])], _ = sd.greedy_decode(target, r["prompt_ids"], max_new_tokens, eos)
    for r in rows:  # replay and the segment split count on it: an answer ends at end of turn or at the budget
        k = key(r["prompt_ids"])
        cont = cached[k]
        if not cont or (cont[-1] not in eos and len(cont) != max_new_tokens) or len(cont) > max_new_tokens:
            raise StageError(f"the target's answer to {r.get('id', '?')} ({len(cont)} tokens, from "
                             f"{origin.get(k, 'generation')}) neither ends at an end-of-turn "
                             f"token nor fills the budget of {max_new_tokens}: a cache made with other stop tokens or "
                             "another budget; delete that cache")
    if missing or sources["response_cache"]:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(cache_file, ({"prompt_sha256": k, "continuation": v} for k, v in cached.items()))
    return [cached[key(r["prompt_ids"])] for r in rows], sources


def summarize(results: list[sd.SpecResult], k: int, seed: int) -> dict:
    stats = sd.acceptance_stats(results, k)
    num, den = rp.prompt_totals(results)
    stats["tau_ci95"] = list(rp.bootstrap_ratio(num, den, seed=seed))
    stats["per_prompt_emitted"], stats["per_prompt_rounds"] = num, den
    return stats


def family_of(row_id: str) -> str:
    return str(row_id).split("/")[0]


class ReplaySet:
    """Held-out prompts with the target's greedy answers and features, computed once, against which
    any number of drafts are replayed (05, ablations, scaling curves). Features are kept in float32
    in memory (120 prompts x 330 tokens x 3 x 576 for SmolLM2: ~0.3 GB)."""

    def __init__(self, target, rows: list[dict], points: list[int], max_new_tokens: int, eos: set[int],
                 cache_file: Path, known=None, desc: str = "[05] target features", workers: int = 1):
        from tqdm import tqdm

        self.rows, self.points, self.max_new_tokens, self.eos = rows, list(points), max_new_tokens, eos
        self.conts, self.sources = greedy_continuations(target, rows, max_new_tokens, eos, cache_file, known)

        def features(row_cont):
            row, cont = row_cont
            seq, n = row["prompt_ids"] + cont, len(row["prompt_ids"])
            aux, argmax = rp.target_features(target, seq, points)
            return seq, aux, sum(a != b for a, b in zip(argmax[n - 1:-1], cont))

        self.seqs, self.aux = [], []
        self.inconsistent = 0  # answer tokens the teacher-forced forward would not pick (float near-ties)
        for seq, aux, inconsistent in tqdm(ordered_map(features, zip(rows, self.conts), workers), total=len(rows),
                                           desc=desc, unit="prompt"):
            self.inconsistent += inconsistent
            self.seqs.append(seq)
            self.aux.append(aux)

    def replay(self, draft, ks: list[int], points: list[int] | None = None) -> dict[int, list[sd.SpecResult]]:
        """{k: one SpecResult per prompt} for `draft` (one TTT forward per prompt covers every k), fed the
        features at `points` (a subset of the set's; default: all of them)."""
        out = {k: [] for k in ks}
        for row, seq, aux in zip(self.rows, self.seqs, self.aux):
            aux = rp.select_points(aux, self.points, self.points if points is None else points)
            pred = rp.draft_predictions(draft, aux, seq, max(ks))
            for k in ks:
                out[k].append(rp.replay(pred, seq, len(row["prompt_ids"]), k, self.max_new_tokens, self.eos))
        return out


def run_reference(args, target, drafts: dict, rows: list[dict], points: list[int], eos: set[int],
                  cache_file: Path, known=None, tok=None, compared: dict | None = None) -> tuple[dict, list[dict]]:
    """Returns (metrics, mismatches). drafts: {"trained": ..., "untrained": ..., more by name}; points: the
    capture points of trained and untrained; known: see greedy_continuations; tok: the target's tokenizer,
    which also splits the trained draft's tau by segment, output position and source (segments.py).
    compared: {name: identity with "capture_points"} of the drafts beyond trained/untrained (05 --draft):
    each is replayed on features at its own points (one target forward per prompt at the union), and
    metrics gets their side-by-side comparison with 04's (common/benchmark/compare.py)."""
    import torch
    from tqdm import tqdm

    ks = sorted(set(args.num_draft_tokens))
    draft_points = {n: c["capture_points"] for n, c in (compared or {}).items()}
    union = rp.union_points(points, draft_points)
    rs = ReplaySet(target, rows, union, args.benchmark_max_new_tokens, eos, cache_file, known,
                   workers=args.benchmark_workers)
    conts, sources, inconsistent = rs.conts, rs.sources, rs.inconsistent
    labels, segments = sg.label_continuations(tok, rows, conts) if tok is not None else (None, None)
    replayed = {(name, k): results for name, draft in drafts.items()
                for k, results in rs.replay(draft, ks, draft_points.get(name, points)).items()}
    del rs
    loop_rows = rows if args.loop_prompts is None else rows[:args.loop_prompts]
    loop_drafts = {n: d for n, d in drafts.items() if n == "trained" or args.loop_untrained}
    loop, mismatches, base_tokens, base_seconds = {(n, k): [] for n in loop_drafts for k in ks}, [], 0, 0.0
    if loop_rows:
        sd.greedy_decode(target, loop_rows[0]["prompt_ids"], 4, eos)  # warm-up: allocator, lazy init
        sd.speculative_decode(target, drafts["trained"], loop_rows[0]["prompt_ids"], ks[0], 4, eos, points)
    for i, row in enumerate(tqdm(loop_rows, desc="[05] loop (lossless, speed)", unit="prompt")):
        ids = row["prompt_ids"]
        ref, secs = sd.greedy_decode(target, ids, args.benchmark_max_new_tokens, eos)
        base_tokens, base_seconds = base_tokens + len(ref), base_seconds + secs
        for (name, k), bucket in loop.items():
            res = sd.speculative_decode(target, drafts[name], ids, k, args.benchmark_max_new_tokens, eos, points)
            bucket.append(res)
            at = first_difference(ref, res.tokens)
            if at is not None:
                with torch.no_grad():
                    logits = target(input_ids=torch.tensor([ids + ref[:at]], device=target.device)).logits[0, -1]
                top = logits.float().topk(2).values
                mismatches.append({"id": row["id"], "draft": name, "num_draft_tokens": k, "first_difference": at,
                                   "target_only": ref[at:at + 16], "speculative": res.tokens[at:at + 16],
                                   "target_top2_logit_margin": float(top[0] - top[1])})
    per_k = {}
    for k in ks:
        t, u = summarize(replayed[("trained", k)], k, args.bench_seed), summarize(replayed[("untrained", k)], k, args.bench_seed)
        entry = {"tau": t["tau"], "tau_ci95": t["tau_ci95"], "untrained_tau": u["tau"],
                 "untrained_tau_ci95": u["tau_ci95"], "per_position_acceptance": t["per_position_acceptance"],
                 "accept_length_histogram": t["accept_length_histogram"], "trained": t, "untrained": u,
                 "tau_by_family": family_tau(rows, replayed[("trained", k)])}
        if labels is not None:
            entry.update(sg.breakdown(replayed[("trained", k)], labels, [r["source"] for r in rows], k, args.bench_seed))
        if loop_rows:
            lt = sd.acceptance_stats(loop[("trained", k)], k)
            same = sum(a.emitted == b.emitted and a.accepted == b.accepted
                       for a, b in zip(loop[("trained", k)], replayed[("trained", k)]))
            entry.update({
                "loop_prompts": len(loop_rows), "loop_tau": lt["tau"],
                "replay_tau_on_loop_prompts": sd.acceptance_stats(replayed[("trained", k)][:len(loop_rows)], k)["tau"],
                "loop_equals_replay_prompts": same,
                "tokens_per_s_speculative": lt["num_generated_tokens"] / lt["seconds"],
                "tokens_per_s_target_only": base_tokens / base_seconds,
                "speed_ratio": (lt["num_generated_tokens"] / lt["seconds"]) / (base_tokens / base_seconds),
                "lossless": not any(m["num_draft_tokens"] == k for m in mismatches)})
            if args.loop_untrained:
                entry["loop_untrained_tau"] = sd.acceptance_stats(loop[("untrained", k)], k)["tau"]
        per_k[str(k)] = entry
    metrics = {
        "mode": "reference", "device": str(target.device), "dtype": "float32", "num_prompts": len(rows),
        "prompt_ids": [r["id"] for r in rows], "max_new_tokens": args.benchmark_max_new_tokens,
        "capture_points": points, "num_draft_tokens": ks,
        **({"feature_capture_points": union} if union != points else {}),
        "num_continuation_tokens": sum(len(c) for c in conts), "continuation_sources": sources,
        "continuation_tokens_not_teacher_forced_argmax": inconsistent,
        "loop_prompts": len(loop_rows), "lossless": not mismatches if loop_rows else None,
        "num_mismatches": len(mismatches),
        "target_only": {"num_generated_tokens": base_tokens, "seconds": base_seconds,
                        "tokens_per_s": base_tokens / base_seconds if base_seconds else None},
        "by_num_draft_tokens": per_k,
    }
    if segments is not None:
        metrics["segments"] = segments
    sampled_totals = {}  # temperature -> name -> k -> per-prompt totals (the comparison's, not metrics')
    if any(t > 0 for t in args.acceptance_temperatures):  # acceptance under sampling (sampled.py)
        metrics["sampled"] = smp.run_sampled(args, target, drafts, rows, points, eos, cache_file, draft_points)
        sampled_totals = {t: bt.pop("prompt_totals") for t, bt in metrics["sampled"]["by_temperature"].items()}
    if compared:
        metrics.update(cmp.compare_drafts(args, replayed, sampled_totals, compared, labels, rows))
    return metrics, mismatches


def family_tau(rows: list[dict], results: list[sd.SpecResult]) -> dict:
    fams: dict[str, list] = {}
    for row, r in zip(rows, results):
        fams.setdefault(family_of(row["id"]), []).append(r)
    if len(fams) < 2:
        return {}
    out = {}
    for fam, rs in sorted(fams.items()):
        num, den = rp.prompt_totals(rs)
        out[fam] = {"tau": sum(num) / sum(den) if sum(den) else None, "num_prompts": len(rs)}
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def write_report(out: Path, metrics: dict, info: dict) -> None:
    m = metrics
    lines = [
        "# EAGLE-3 draft benchmark (reference mode)", "",
        f"Target `{info['target']}`, draft `{info['export']}` (draft vocab {info['draft_vocab_size']}, "
        f"capture points {m['capture_points']}). {m['num_prompts']} held-out prompts, greedy, up to "
        f"{m['max_new_tokens']} new tokens, float32 on {m['device']}.", "",
        "tau = tokens committed per verify round (accepted drafts + 1 bonus/correction; SGLang's accept "
        "length), over all prompts by replay against the target's greedy continuation, with a 95% "
        "bootstrap interval over prompts. Untrained = same shape, random init: the chance level.", "",
        "| k | tau | 95% CI | untrained tau | loop tau | spec tok/s | target tok/s | speed ratio | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, e in m["by_num_draft_tokens"].items():
        lossless = "-" if e.get("lossless") is None else ("yes" if e["lossless"] else "NO")
        lines.append(f"| {k} | {fmt(e['tau'])} | {fmt_ci(e['tau_ci95'])} | {fmt(e['untrained_tau'])} | "
                     f"{fmt(e.get('loop_tau'))} | {fmt(e.get('tokens_per_s_speculative'), 1)} | "
                     f"{fmt(e.get('tokens_per_s_target_only'), 1)} | {fmt(e.get('speed_ratio'))} | {lossless} |")
    lines.append("")
    if m["loop_prompts"]:
        lines += [f"The loop (real speculative decoding, KV caches, rollback) ran on the first "
                  f"{m['loop_prompts']} prompts: "
                  + ("**lossless** - every output equals target-only greedy decoding" if m["lossless"] else
                     f"**NOT lossless** - {m['num_mismatches']} outputs differ (mismatches.json)")
                  + "; its per-round statistics equal the replay's on "
                  + ", ".join(f"{e['loop_equals_replay_prompts']}/{m['loop_prompts']} (k={k})"
                              for k, e in m["by_num_draft_tokens"].items())
                  + " prompts. Speed is transformers eager on CPU: the draft costs a Python-level forward "
                  "per token, so the ratio understates an engine's; tau is the portable number.", ""]
    lines += ["Per-position acceptance P(draft j accepted | drafts 1..j-1 accepted) and the histogram of "
              "accepted drafts per round (0..k), trained draft:", ""]
    for k, e in m["by_num_draft_tokens"].items():
        lines.append(f"- k={k}: per position [{', '.join(fmt(p) for p in e['per_position_acceptance'])}]; "
                     f"histogram {e['accept_length_histogram']} over {e['trained']['num_rounds']} rounds")
        if e["tau_by_family"]:
            lines.append("  - tau by prompt family: " + ", ".join(
                f"{f} {fmt(v['tau'])} ({v['num_prompts']})" for f, v in e["tau_by_family"].items()))
    lines.append("")
    if "sampled" in m:
        lines += smp.report_lines(m)
    if "segments" in m:
        lines += sg.report_lines(m)
    if "drafts" in m:
        lines += cmp.report_lines(m)
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines))


def plot_acceptance(out: Path, metrics: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for c, (k, e) in enumerate(metrics["by_num_draft_tokens"].items()):
        for name, style in (("trained", "-o"), ("untrained", "--x")):  # one colour per k
            acc = [float("nan") if p is None else p for p in e[name]["per_position_acceptance"]]
            ax.plot(range(1, len(acc) + 1), acc, style, color=f"C{c}",
                    label=f"{name} k={k} (tau {fmt(e[name]['tau'])})")
    k_max = max(metrics["num_draft_tokens"])
    ax.set_xticks(range(1, k_max + 1))
    ax.set_xlim(0.5, k_max + 0.5)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("EAGLE-3 per-position acceptance (greedy, reference)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "acceptance.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
