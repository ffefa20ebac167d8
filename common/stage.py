"""The stage contract: fixed folders under one work dir, manifest.json as completion marker."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from common.io import read_json, write_json

# The stage registry. A stage is the script <name>.py at the repo root (stage_script); STAGE_DIRS gives
# its folder under --work-dir (stage_dir, stage_folder; per-dataset stages hold one sub-folder per
# dataset). Code names a stage by its constant, never by the literal:
#   constant       script                              folder under --work-dir
#   PREPARE        01_prepare_datasets                 01_prepared/<dataset>
#   GENERATE       01b_generate_synthetic              01b_generated/<dataset>
#   MERGE          01c_merge_datasets                  01c_merged
#   EXTRACT        02b_extract_hidden_states_sglang    02b_hidden_states
#   VOCAB          03_build_vocab_mapping              03_vocab
#   TRAIN          04_train                            04_draft
#   BENCH          05_benchmark                        05_benchmark/reference
#   SERVE_BENCH    05b_serve_benchmark                 05_benchmark/server
#   TINY_WORLD     00_build_tiny_world                 (none: build/ and a target folder)
#   SMOLLM2_WORLD  00_build_smollm2_world              (none: build/ and a target folder)
# The world builders write build/ and a target folder, not a stage folder, but share the flag namespace
# of the presets. 05 and 05b were one script with a --mode; each keeps the sub-folder of 05_benchmark/
# its mode wrote, so results, reports and the scripts that read them stay where they were.
PREPARE = "01_prepare_datasets"
GENERATE = "01b_generate_synthetic"
MERGE = "01c_merge_datasets"
EXTRACT = "02b_extract_hidden_states_sglang"
VOCAB = "03_build_vocab_mapping"
TRAIN = "04_train"
BENCH = "05_benchmark"
SERVE_BENCH = "05b_serve_benchmark"
TINY_WORLD = "00_build_tiny_world"
SMOLLM2_WORLD = "00_build_smollm2_world"
STAGE_DIRS = {
    PREPARE: "01_prepared",
    GENERATE: "01b_generated",
    MERGE: "01c_merged",
    EXTRACT: "02b_hidden_states",
    VOCAB: "03_vocab",
    TRAIN: "04_draft",
    BENCH: "05_benchmark/reference",
    SERVE_BENCH: "05_benchmark/server",
}
WORLD_BUILDERS = (TINY_WORLD, SMOLLM2_WORLD)
STAGE_SCRIPTS = WORLD_BUILDERS + tuple(STAGE_DIRS)
MANIFEST = "manifest.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
TRACKED_PACKAGES = ("torch", "transformers", "tokenizers", "datasets", "safetensors", "openai", "sglang",
                    "specforge")
# Files that define how text becomes ids; their hash is the tokenizer's identity.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model",
                   "chat_template.jinja", "special_tokens_map.json", "tokenization_kimi.py")


class StageError(SystemExit):
    """A user-facing stop: missing or mismatched upstream input, bad flags.

    Uncaught, Python prints `error: <message>` to stderr and exits with status 1.
    """

    def __init__(self, message: str):
        super().__init__(f"error: {message}")
        self.message = message

    def __reduce__(self):  # raised in a worker process (common/parallel.py), re-raised in its parent
        return type(self), (self.message,)

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU thread count is n inside the block and restored after it (tests call main() in-process)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stage_script(stage: str) -> str:
    """The file of a stage (or world builder), relative to the repo root: e.g. TRAIN -> "04_train.py"."""
    return f"{stage}.py"


def stage_folder(stage: str) -> str:
    """The folder of a stage relative to the work dir, e.g. TRAIN -> "04_draft" (for relative paths)."""
    return STAGE_DIRS[stage]


def stage_dir(work_dir: str | Path, stage: str, dataset: str | None = None) -> Path:
    """The folder of a stage under `work_dir` (a dataset's sub-folder of it when `dataset`)."""
    path = Path(work_dir) / stage_folder(stage)
    return path / dataset if dataset else path


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    return read_json(Path(path) / MANIFEST)


def manifest_sha256(path: str | Path) -> str:
    return hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()


def input_manifests(work_dir: str | Path, *dirs: str | Path) -> dict[str, str]:
    """A manifest's `inputs`: the sha256 of each upstream manifest it was made from, keyed by that
    manifest's path under the work dir (e.g. "02b_hidden_states/manifest.json")."""
    return {(Path(d) / MANIFEST).relative_to(work_dir).as_posix(): manifest_sha256(d) for d in dirs}


def require_complete(path: str | Path, producer: str) -> dict:
    """Return the manifest of an upstream folder, or stop with the command that makes it."""
    path = Path(path)
    if not is_complete(path):
        what = "is missing" if not path.exists() else "is incomplete (no manifest.json)"
        raise StageError(f"{path} {what}: run `python {stage_script(producer)}` for this --work-dir first")
    return read_manifest(path)


class TypedManifest:
    """Base of the typed manifests (common.target.manifests, common.draft.manifest): a frozen dataclass
    that names its stage in STAGE and builds itself with from_dict; these two read it."""
    STAGE = ""

    @classmethod
    def read(cls, path: str | Path):
        """From the stage's folder, its manifest.json, or a work dir (the stage's folder under it)."""
        path = Path(path)
        if path.name == MANIFEST:
            path = path.parent
        return cls.from_dict(read_manifest(path if is_complete(path) else stage_dir(path, cls.STAGE)))

    @classmethod
    def require(cls, path: str | Path):
        """From the stage folder `path`, or stop with the command that makes it (require_complete)."""
        return cls.from_dict(require_complete(path, cls.STAGE))


def stage_tag(stage: str) -> str:
    """The log tag of a stage: its number, e.g. "04_train" -> "[04]"."""
    return f"[{stage.split('_', 1)[0]}]"


def start_stage(out_dir: str | Path, overwrite: bool, stage: str) -> bool:
    """Prepare `out_dir` for `stage` (its name, e.g. "04_train"). Returns False when it is already
    complete (caller exits).

    A complete folder is left alone unless `overwrite`; an incomplete one is kept, so that a
    resumable stage can pick up where it stopped.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        if not overwrite:
            print(f"{stage_tag(stage)} {out_dir} is complete (manifest.json exists); nothing to do. "
                  "Pass --overwrite to redo it.")
            return False
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return True


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_digests(folder: str | Path) -> dict[str, dict]:
    """{name: {"size": bytes, "sha256"}} of every file directly in `folder`, by name: what a writer
    records (04's checkpoint markers, its manifest's exports) so that a reader can tell the bytes it finds
    from the bytes that were written (a file cut short by a full disk, edited or swapped since)."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(Path(folder).iterdir()) if p.is_file()}


def changed_file(folder: str | Path, recorded: dict[str, dict]) -> str | None:
    """The first file of `recorded` (file_digests) whose bytes in `folder` differ, as a phrase naming it
    ("<path> is 12 bytes where 34 were written"), or None when every one matches. Sizes first: a torn
    file costs no hashing."""
    folder = Path(folder)
    for name, want in recorded.items():
        f = folder / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != want["size"]:
            return f"{f} is {f.stat().st_size:,} bytes where {want['size']:,} were written"
    for name, want in recorded.items():
        try:
            got = sha256_file(folder / name)
        except OSError as e:   # an unreadable sector reads as a changed file, not as a traceback
            return f"{folder / name} cannot be read ({e.strerror or e})"
        if got != want["sha256"]:
            return f"{folder / name} has sha256 {got[:12]} where {want['sha256'][:12]} was written"
    return None


def tokenizer_identity(model_dir: str | Path) -> dict:
    """Identity of the tokenizer in a model folder: path plus a hash over its defining files."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    found = []
    for name in TOKENIZER_FILES:
        f = model_dir / name
        if f.is_file():
            found.append(name)
            h.update(name.encode() + b"\0" + sha256_file(f).encode())
    if not found:
        raise StageError(f"{model_dir} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    return {"path": str(model_dir.resolve()), "sha256": h.hexdigest(), "files": found}


# Keys a config.json gets from the library release that wrote it, not from the model: a transformers
# upgrade re-saving the same model must not make it "another target" (and void every cache made for it).
WRITER_KEYS = ("transformers_version",)


def config_sha256(path: str | Path) -> str:
    """sha256 of a config.json's content: keys sorted, the writer's keys (WRITER_KEYS) left out."""
    cfg = json.loads(Path(path).read_text())
    for key in WRITER_KEYS:
        cfg.pop(key, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def target_identity(model_dir: str | Path) -> dict:
    """Identity of the target model: path plus the hash of its config.json's content (config_sha256)."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        raise StageError(f"{model_dir} has no config.json: --target-path must be a model folder")
    return {"path": str(Path(model_dir).resolve()), "config_sha256": config_sha256(cfg)}


def check_same_tokenizer(upstream: dict, current: dict, upstream_dir: str | Path, producer: str) -> None:
    """Stop when an upstream artifact was made with another tokenizer than the current one."""
    if upstream.get("sha256") != current["sha256"]:
        raise StageError(
            f"{upstream_dir} was made with tokenizer {upstream.get('path')} "
            f"(sha256 {str(upstream.get('sha256'))[:12]}), but this run uses {current['path']} "
            f"(sha256 {current['sha256'][:12]}). Re-run `python {stage_script(producer)} --overwrite` "
            "with the same target, or point --target-path at the model it was made with.")


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    rev = out.stdout.strip()
    return (rev + ("+dirty" if dirty else "")) if out.returncode == 0 and rev else None


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")   # what decides fp32 vs bf16 speed on a CPU


def host_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The machine a stage ran on: CPU model, its vector features that matter here and the core count, so
    a number quoted from a manifest names its CPU (the same model name may or may not have AVX-512 bf16)."""
    name, flags = None, set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name or platform.processor() or platform.machine(), "machine": platform.machine(),
            "cores": os.cpu_count(), "cpu_features": [f for f in CPU_FEATURES if f in flags]}


def write_manifest(out_dir: str | Path, stage: str, args, **fields) -> dict:
    """Write manifest.json last: the marker that the stage finished. Returns what was written."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    manifest = {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        **fields,
        "versions": package_versions(),
        "git_revision": git_revision(),
        "host": host_info(),
    }
    write_json(Path(out_dir) / MANIFEST, json.loads(json.dumps(manifest, default=str)))
    return manifest


def resolve_target(target_path: str | Path | None, upstream: dict, upstream_dir: str | Path,
                   producer: str) -> Path:
    """The target a stage uses: `--target-path` when given, else the one upstream was made with.

    A given path must have the same tokenizer and config.json identity as upstream's, else stop.
    """
    target = Path(target_path) if target_path else Path(upstream["target"]["path"])
    check_same_tokenizer(upstream["tokenizer"], tokenizer_identity(target), upstream_dir, producer)
    if target_identity(target)["config_sha256"] != upstream["target"].get("config_sha256"):
        raise StageError(f"{upstream_dir} was made for target {upstream['target'].get('path')}, whose "
                         f"config.json differs from {target}'s. Re-run `python {stage_script(producer)} --overwrite` "
                         "with this target, or point --target-path at the one it was made for.")
    return target
