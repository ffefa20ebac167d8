"""The README's result block of a chain run, printed from 05's own files so it is pasted, never retyped:
where it came from (the metrics file, the commit, the date and the machine from 05's manifest), then
tau per k greedily and at every sampled temperature, the loop's tau, speed ratio and lossless check, tau
by segment and the sampled loop's agreement with the replay. `make demo` and `make bench-real` print it
last.

  python benchmarks/demo_table.py runs/tiny
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.benchmark.formatting import fmt, fmt_ci as ci  # noqa: E402
from common.stage import BENCH, CPU_FEATURES, stage_dir  # noqa: E402


def source_line(ref: Path, manifest: dict) -> str:
    host = manifest.get("host")
    if host:
        features = ", ".join(host["cpu_features"]) or "none of " + "/".join(CPU_FEATURES)
        machine = f"{host['cpu']} ({features}, {host['cores']} cores)"
    else:
        machine = "machine not recorded (a manifest older than its host field)"
    return (f"`{ref / 'metrics.json'}`, commit {str(manifest.get('git_revision'))[:12]}, "
            f"{manifest['created'][:10]}, {machine}")


def table(m: dict) -> list[str]:
    temps = list(m.get("sampled", {}).get("by_temperature", {}))
    loop = m["loop_prompts"]
    head = (f"| k | tau ({m['num_prompts']} prompts) | 95% CI | untrained | loop tau ({loop}) | speed ratio | lossless | "
            + " | ".join(f"tau T={t} | 95% CI" for t in temps) + " |")
    lines = [head, "|---" * (7 + 2 * len(temps)) + "|"]
    for k, e in m["by_num_draft_tokens"].items():
        lossless = "-" if e.get("lossless") is None else ("yes" if e["lossless"] else "NO")
        sampled = [m["sampled"]["by_temperature"][t]["by_num_draft_tokens"][k] for t in temps]
        lines.append(f"| {k} | {fmt(e['tau'])} | {ci(e['tau_ci95'])} | {fmt(e['untrained_tau'])} | "
                     f"{fmt(e.get('loop_tau'))} | {fmt(e.get('speed_ratio'))} | {lossless} | "
                     + " | ".join(f"{fmt(s['tau'])} | {ci(s['tau_ci95'])}" for s in sampled) + " |")
    return lines


def segment_line(m: dict) -> str | None:
    per_k = m["by_num_draft_tokens"]
    k = "5" if "5" in per_k else next(iter(per_k))
    cells = [(s, c) for s, c in per_k[k].get("by_segment", {}).items() if c["num_rounds"]]
    if not cells:
        return None
    return f"By segment (k = {k}): " + ", ".join(f"{s.replace('_', ' ')} {fmt(c['tau'])} {ci(c['tau_ci95'])}"
                                                for s, c in cells) + "."


def sampled_loop_line(m: dict) -> str | None:
    s = m.get("sampled")
    if not s or not s["loop_prompts"]:
        return None
    cells = [(t, k, e) for t, bt in s["by_temperature"].items() for k, e in bt["by_num_draft_tokens"].items()]
    verdict = "agrees" if all(e["loop_agrees"] for _, _, e in cells) else "DISAGREES"
    return (f"The sampled loop ({s['loop_prompts']} prompts) {verdict} with the sampled replay: loop - replay "
            + ", ".join(f"{ci(e['loop_minus_replay_ci95'])} (T={t}, k={k})" for t, k, e in cells) + ".")


def block(work: Path) -> str:
    ref = stage_dir(work, BENCH)
    m = json.loads((ref / "metrics.json").read_text())
    manifest = json.loads((ref / "manifest.json").read_text())
    lines = [f"From {source_line(ref, manifest)}:", "", *table(m), ""]
    lines += [x for x in (segment_line(m), sampled_loop_line(m)) if x]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work_dir", type=Path, help="a work dir whose 05 reference run is complete (runs/tiny)")
    print(block(p.parse_args(argv).work_dir), end="")


if __name__ == "__main__":
    main()
