"""train_plan_v4.md's numbers from an 01 -> 01b -> 01c run (the pilot or the full run).

It scales each source's measured means (prompt and response tokens per sample, decode and prefill
tokens per generated record) to the mix's counts (`max-records`: what 01 writes and 01b generates;
`dataset-caps`: what trains), and prints the table of section 2.1, the feature storage of the reference
format, and the generation and training hours for the throughputs you measured.

  python scripts/plan_v4_calc.py --work-dir /data/eagle3-pilot --config configs/datasets_v4.yaml \
      --decode-tok-s D --prefill-tok-s P --train-tok-s T
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.stage import GENERATE, MERGE, PREPARE, stage_dir  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="the run's work dir (01, 01b and 01c complete)")
    p.add_argument("--config", type=Path, default=Path("configs/datasets_v4.yaml"),
                   help="the mix: its `datasets` (max-records) and `dataset-caps`")
    p.add_argument("--hidden-size", type=int, default=7168, help="the target's hidden size (Kimi-K2.5: 7168)")
    p.add_argument("--decode-tok-s", type=float, default=None,
                   help="MEASURE: 01b manifest this_run.completion_tokens_per_s")
    p.add_argument("--prefill-tok-s", type=float, default=None, help="MEASURE: SGLang log, prefill input tok/s")
    p.add_argument("--train-tok-s", type=float, default=None, help="MEASURE: 04 train_log.jsonl tokens_per_s")
    p.add_argument("--epochs", type=float, default=10)
    p.add_argument("--kv-tokens", type=float, default=None,
                   help="MEASURE: the server's KV pool in tokens (SGLang /get_server_info max_total_num_tokens)")
    p.add_argument("--concurrency", type=int, default=160, help="01b's --concurrency (the preset's)")
    return p


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def project(work: Path, mix: dict) -> tuple[list[tuple], dict]:
    """Per-source rows (name, samples, prompt mean, response mean, tokens, long share) and the totals
    (samples, tokens, supervised, decode and prefill tokens to generate) at the mix's counts."""
    caps = mix.get("dataset-caps") or {}
    gen_records = {d["name"]: d.get("max-records") for d in mix["datasets"]}
    m01 = read_json(stage_dir(work, PREPARE) / "manifest.json")["counts"]
    m01b = read_json(stage_dir(work, GENERATE) / "manifest.json")["counts"]
    stats = read_json(stage_dir(work, MERGE) / "stats.json")["per_source"]
    rows, tot = [], dict(samples=0, tokens=0, sup=0, dec=0, pre=0, records=0)
    for name, s in stats.items():
        if not s.get("num_samples"):
            continue
        n = caps.get(name, s["num_samples"])          # samples that train
        g = gen_records.get(name) or n                # records 01 writes, 01b generates
        pm, rm = s["num_prompt_tokens"] / s["num_samples"], s["num_response_tokens"] / s["num_samples"]
        c = m01b[name]
        done = max(c["generated"] + c["passed_through"], 1)
        parts = m01[name].get("partitions", {})
        rows.append((name, n, pm, rm, n * (pm + rm), parts.get("long", 0) / max(m01[name]["num_records"], 1)))
        for k, v in (("samples", n), ("tokens", n * (pm + rm)), ("sup", n * rm),
                     ("dec", g * c["completion_tokens"] / done), ("pre", g * c["prompt_tokens"] / done),
                     ("records", g)):
            tot[k] += v
    return rows, tot


def running_line(tot: dict, kv_tokens: float, concurrency: int) -> str:
    """How many of 01b's requests the server runs at once: a request holds its prompt and, averaged over
    its life, half its answer (train_plan_v4.md section 2.4); the rest wait in the server's queue."""
    held = (tot["pre"] + tot["dec"] / 2) / max(tot["records"], 1)
    running = min(concurrency, kv_tokens / held)
    return (f"server capacity: {kv_tokens:,.0f} KV tokens / {held:,.0f} tokens held per request = about "
            f"{running:,.0f} of --concurrency {concurrency} run at once, {max(concurrency - running, 0):,.0f} queue")


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    rows, tot = project(a.work_dir, yaml.safe_load(a.config.read_text()))
    bpt = 8 * a.hidden_size + 9  # 02b bytes/token, reference format: aux 3H bf16 + final H bf16 + int64 id + mask
    print("| source | samples | prompt tok (mean) | response tok (mean) | tokens | long share |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, pm, rm, t, ls in rows:
        print(f"| {name} | {n:,} | {pm:,.0f} | {rm:,.0f} | {t / 1e6:,.2f} M | {ls:.0%} |")
    print(f"| **total** | {tot['samples']:,} | | | {tot['tokens'] / 1e6:,.2f} M ({tot['sup'] / 1e6:,.2f} M supervised) | |")
    print(f"\nfeature storage: {bpt:,} B/token x {tot['tokens'] / 1e6:,.2f} M tokens = {bpt * tot['tokens'] / 1e12:,.2f} TB")
    if a.kv_tokens:
        print(running_line(tot, a.kv_tokens, a.concurrency))
    if a.decode_tok_s:
        t_gen = tot["dec"] / a.decode_tok_s + (tot["pre"] / a.prefill_tok_s if a.prefill_tok_s else 0)
        print(f"generation: {tot['dec'] / 1e6:,.1f} M decode tok / {a.decode_tok_s:,.0f} tok/s"
              + (f" + {tot['pre'] / 1e6:,.1f} M prefill tok / {a.prefill_tok_s:,.0f} tok/s" if a.prefill_tok_s else "")
              + f" = {t_gen / 3600:,.1f} h")
    if a.train_tok_s:
        print(f"training: {a.epochs:g} epochs x {tot['tokens'] / 1e6:,.2f} M tok / {a.train_tok_s:,.0f} tok/s"
              f" = {a.epochs * tot['tokens'] / a.train_tok_s / 3600:,.1f} h")


if __name__ == "__main__":
    main()
