"""05's sampled answers (the target's own, at T 1.0 / top-p 0.95, seeded per prompt), one prompt at a time
(sd.sample_decode, 05 before 2026-12-05) against batches (sd.sample_decode_batch via
sampled.sampled_continuations, 05 now), side by side in one run on the same prompts: seconds, tokens/s, the
speed-up, and whether the answers are the same tokens (they must be, up to float near-ties).

  OMP_NUM_THREADS=1 python benchmarks/bench_batch_sampling.py --num-prompts 16 --batch-sizes 8 16

The prompts: the first --num-prompts of --prompts (05's 01c_merged/benchmark_prompts.jsonl, with prompt_ids),
default SmolLM2's held-out prompts from assets/smollm2/prompts.jsonl.gz through the target's chat template.
--no-single skips the one-at-a-time run (to compare batch sizes on more prompts).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.benchmark import sampled as smp  # noqa: E402
from common.benchmark import spec_decode as sd  # noqa: E402
from common.io import iter_jsonl  # noqa: E402
from common.text.target_format import load_target_format  # noqa: E402
from common.text.tokenizer import load_tokenizer  # noqa: E402

HELD_OUT = REPO / "assets" / "smollm2" / "prompts.jsonl.gz"


def load_prompts(target_dir: Path, prompts: Path | None, n: int) -> list[list[int]]:
    if prompts is not None:
        return [r["prompt_ids"] for r in iter_jsonl(prompts)][:n]
    tok = load_tokenizer(target_dir)
    with gzip.open(HELD_OUT, "rt") as f:
        rows = [json.loads(line) for line in f]
    msgs = [r["messages"] for r in rows if r.get("split") == "held_out"][:n]
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            for m in msgs]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO / "build" / "smollm2" / "target")
    p.add_argument("--prompts", type=Path, default=None, help="a benchmark_prompts.jsonl (prompt_ids)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="05's --bench-seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-single", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    eos = set(load_target_format(args.target, load_tokenizer(args.target)).stop_ids)
    prompts = load_prompts(args.target, args.prompts, args.num_prompts)
    params = sd.SamplingParams(args.temperature, args.top_p)
    rows = [{"prompt_ids": ids} for ids in prompts]
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), T {args.temperature:g}, "
          f"top-p {args.top_p:g}, max {args.max_new_tokens} new tokens, seed {args.seed}, {args.threads} thread(s)")

    results = {}
    if not args.no_single:
        t0 = time.perf_counter()
        single = [sd.sample_decode(target, ids, args.max_new_tokens, eos, params,
                                   smp.generator(target.device, smp.prompt_seed(args.seed, ids, params, "replay")))
                  for ids in prompts]
        results["one at a time"] = (single, time.perf_counter() - t0)
    for b in args.batch_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            conts = smp.sampled_continuations(target, rows, args.max_new_tokens, eos, params, args.seed,
                                              Path(tmp) / "samples.jsonl", batch_size=b)
            results[f"batch {b}"] = (conts, time.perf_counter() - t0)

    base = results.get("one at a time")
    print("| sampling | seconds | tokens | tok/s | x one at a time | answers equal to one at a time |")
    print("|---|---|---|---|---|---|")
    for name, (conts, s) in results.items():
        n = sum(map(len, conts))
        ratio = f"x{base[1] / s:.2f}" if base else "-"
        same = "-"
        if base:
            equal = sum(a == b for a, b in zip(conts, base[0]))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(conts, base[0]) if a != b]
            same = f"{equal}/{len(conts)}" + (f" (others part at tokens {first})" if first else "")
        print(f"| {name} | {s:.1f} | {n} | {n / s:.1f} | {ratio} | {same} |")


if __name__ == "__main__":
    main()
