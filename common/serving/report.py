"""05b's report (report.md) and plots (tokens_per_s.png, accept_length.png; the break-even map's through
breakeven.plot), written from the sweep's metrics (common/serving/sweep.py) after it ran: the measured runs' table
per prompt bucket, the agreement with replay, and the deploy section (common/serving/deploy.py). It reads
metrics["runs"] for the measured tables; the break-even map's runs only through breakeven.report_lines.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.benchmark.formatting import fmt
from common.draft import OURS
from common.serving import breakeven, deploy
from common.serving.context import SHORT, bucket_words
from common.serving.registry import engine_class
from common.serving.sweep import cells


def write_report(out: Path, metrics: dict, reference: dict | None = None) -> None:
    """report.md; its deploy section (common/serving/deploy.py) from metrics["deploy"], computed here
    when absent (`reference`: 05 reference metrics of the same draft, for the per-depth tau)."""
    engine = metrics.get("engine", "sglang")
    label, tau_note = engine_class(engine).label, engine_class(engine).server_tau_note
    if "deploy" not in metrics:
        metrics["deploy"] = deploy.summary(metrics, reference)   # metrics["runs"] only: never the map's
    if "map" in metrics:
        metrics["map"]["breakeven"] = breakeven.summary(metrics, reference)
    drafts = metrics.get("drafts") or {}
    shown = (f"drafts {', '.join(f'{n} `{p}`' for n, p in drafts.items())} (each at every setting, against the "
             "same baseline)" if len(drafts) > 1 else f"draft `{metrics['draft']}`")
    lines = [f"# 05 server benchmark ({label})", "",
             f"Target `{metrics['target']}`, {shown}, {metrics['num_prompts']} timed prompts, "
             f"max {metrics['max_new_tokens']} new tokens, {sweep_words(metrics)} Preflight: "
             f"`{json.dumps(metrics.get('preflight', {}))}`."
             + (f" Engine fixes loaded: {'; '.join(metrics['engine_fixes'])}." if metrics.get("engine_fixes") else ""),
             ""]
    refused = []
    buckets = metrics.get("context_buckets") or {}
    for ctx in [SHORT, *[b for b in buckets if b != SHORT]]:
        if len(buckets) > 1:  # one table per prompt bucket once the sweep has several
            lines += [f"### Timed on {bucket_words(ctx, buckets.get(ctx))}", ""]
        lines += run_table(metrics, ctx, refused) + [""]
    if refused:
        lines += [f"* {r}" for r in refused] + [""]
    lines += ["tau = completion_tokens / verify rounds per request (the bonus token and the prefill token "
              "included: SGLang's definition); " + tau_note + " Launch commands: `commands.json`."]
    if metrics.get("agreement"):
        lines += ["", "## Agreement with replay", "",
                  "Each EAGLE-3 server answered the warm-up prompts one at a time; its per-round accepted counts "
                  "are compared with replay of the same draft on the same tokens (common/serving/agreement.py). "
                  "tau here = 1 + accepted / rounds (the engine's definition)."
                  + (" 04's draft only: the declared drafts are not replayed here." if len(drafts) > 1 else ""), "",
                  "| setting | prompts | rounds (engine / replay) | accepted per position (engine) | (replay) "
                  "| tau (engine / replay) | every round equal |", "|---|---|---|---|---|---|---|"]
        for key, a in metrics["agreement"].items():
            if not a.get("judged", True):
                lines.append(f"| {key} | {a['prompts']} | not judged: {a['why']} | | | | |")
                continue
            e, r = a["engine"], a["replay"]
            lines.append(f"| {key} | {len(a['per_prompt'])} | {e['num_rounds']} / {r['num_rounds']} | "
                         f"{e['accepted_per_position'] or '-'} | {r['accepted_per_position']} | {e['tau']:.4f} / "
                         f"{r['tau']:.4f} | {'yes' if a['exact'] else 'no'} |")
        lines += sampled_agreement_lines(metrics["agreement"])
    lines += deploy.report_lines(metrics["deploy"], label)
    lines += breakeven.report_lines(metrics)   # its own section: the measured tables above never read it
    (out / "report.md").write_text("\n".join(lines) + "\n")


def run_table(metrics: dict, ctx: str, refused: list[str]) -> list[str]:
    """The measurements of one prompt bucket, a row per (run, T, concurrency); a refused ratio's reason is
    added to `refused` (the footnotes)."""
    lines = ["| draft | setting | T | concurrency | output tok/s | x baseline | 95% CI (passes) | TTFT mean (s) "
             "| tau (mean) | tau (pooled) | server tau | retried requests |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    where = "" if ctx == SHORT else f" context {ctx}"
    for key, entry in metrics["runs"].items():
        draft = "-" if key.startswith("baseline") else entry.get("draft", OURS)
        setting = key if draft in ("-", OURS) else key[len(draft) + 1:]
        for t, _, c, s in (x for x in cells(entry) if x[1] == ctx):
            ratio = fmt(s.get("speed_ratio")) if "ratio_refused" not in s else "refused*"
            ci = s.get("speed_ratio_ci95")
            if "ratio_refused" in s:
                refused.append(f"{key} T={t}{where} c={c}: {s['ratio_refused']}")
            lines.append(f"| {draft} | {setting} | {t} | {c} | {fmt(s['output_tokens_per_s'], 1)} | {ratio} "
                         f"| {f'[{fmt(ci[0])}, {fmt(ci[1])}]' if ci else '-'} "
                         f"| {fmt(s['ttft_mean_s'], 3)} | {fmt(s['accept_length_mean'])} "
                         f"| {fmt(s['accept_length_pooled'])} | {fmt(s.get('server_accept_length'))} "
                         f"| {s.get('retried_requests', 0)} |")
    return lines


def sweep_words(metrics: dict) -> str:
    """How the sweep timed its runs, in one sentence for the report's head."""
    temps = metrics.get("temperatures") or ["0"]
    sampled = [t for t in temps if float(t) > 0]
    instant = metrics.get("instant_temperature")
    return ("greedy" + (f" and at T {', '.join(sampled)} (top-p {fmt(metrics.get('top_p'))}, top-k and min-p off, "
                        "repetition penalty 1, a fixed seed per request"
                        + (f"; thinking-off prompts at T {instant:g}" if instant is not None else "") + ")"
                        if sampled else "")
            + f", {metrics.get('repeats', 1)} timed passes of each (setting, T, concurrency), prefix caching off on "
            "every server, the same warm-up on every server, on prompts never timed.")


def sampled_agreement_lines(agreement: dict) -> list[str]:
    """The sampled half of the agreement check (agreement.check_sampled_answers), one row per setting and
    temperature, with the engine defect that voids a row when the engine has one."""
    rows = [(key, t, x) for key, a in agreement.items() for t, x in (a.get("sampled") or {}).items()]
    if not rows:
        return []
    lines = ["", "Sampled (a seed per request): the engine's tau against the sampled replay's prediction on the "
             "same prompts, with its paired 95% interval (reported, not enforced); the probability gate along the "
             "engine's own answers (enforced: drafts accepted against sum p(d), z, z outside the band, the deviation "
             "it resolves; docs/serving.md, 'The probability gate'), and the spread of the prompts' own z.", "",
             "| setting | T | top-p | engine tau | replay tau | difference [95% CI] | verdict | gate: accepted / "
             "expected | z (outside band) | resolves | z per prompt (min, max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, t, x in rows:
        e, g = x["expected"], x["expected"]["along_answers"]
        verdict = "agree" if e["agree"] else ("engine defect*" if x.get("engine_defect") else "DISAGREE")
        zs = [r["z"] for r in x.get("per_prompt", []) if r.get("z") is not None]
        lines.append(f"| {key} | {t} | {fmt(x.get('top_p'))} | {fmt(e['engine_tau'], 3)} | {fmt(e['replay_tau'], 3)} | "
                     f"{e['difference']:+.3f} [{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}] | {verdict} | "
                     f"{sum(g['accepted'])} / {sum(g['expected']):.1f} | {fmt(g['z'])} ({fmt(g.get('z_band'))}, "
                     f"band +-{g.get('band', 0):.0%}) | "
                     f"{'-' if g.get('resolution') is None else format(g['resolution'], '.0%')} | "
                     f"{f'{min(zs):+.1f}, {max(zs):+.1f}' if zs else '-'} |")
    defects = dict.fromkeys(x["engine_defect"] for _, _, x in rows if x.get("engine_defect"))
    return lines + [f"\n*{d}" for d in defects]


def plot(out: Path, metrics: dict) -> None:
    """tokens_per_s.png (bars per setting, one group per concurrency) and accept_length.png, at the serving
    temperature (the level the recommendation comes from), of the measured runs; the break-even map's own
    (breakeven.plot) when the map ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = deploy.serving_level(deploy.temperature_levels(metrics))
    runs = deploy.at_temperature(metrics, t)["runs"]
    keys = list(runs)
    concs = sorted({int(c) for e in runs.values() for c in e["by_concurrency"]})
    for fname, field, ylabel, only_spec in (("tokens_per_s.png", "output_tokens_per_s", "output tok/s", False),
                                            ("accept_length.png", "accept_length_pooled", "tau", True)):
        shown = [k for k in keys if not (only_spec and k.startswith("baseline"))]
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shown)), 4))
        width = 0.8 / max(1, len(concs))
        for j, c in enumerate(concs):
            vals = [(runs[k]["by_concurrency"].get(str(c)) or {}).get(field) or 0 for k in shown]
            ax.bar([i + j * width for i in range(len(shown))], vals, width, label=f"concurrency {c}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shown))])
        ax.set_xticklabels(shown, rotation=30, ha="right")
        ax.set_ylabel(f"{ylabel} ({'greedy' if t == '0' else f'T {t}'})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
    breakeven.plot(out, metrics)
