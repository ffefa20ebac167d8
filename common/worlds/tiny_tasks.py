"""Tasks of the tiny world: chat samples made from the Python standard library's own functions.

Why these tasks (docs/design.md section 9): a tiny target pre-trained on raw source collapses into loops,
and a draft trained on loops looks good for the wrong reason. These tasks are varied (every function
differs) but regular (fixed phrasings, short answers that mostly copy from the prompt), so an
8-layer model learns them in CPU minutes and its greedy outputs are real, prompt-dependent text that
ends with `<|im_end|>`. Families:
  body         signature + docstring -> short reasoning, then the function body
  summary      docstring -> one-line summary (some samples with thinking off)
  tool_call    question -> reasoning, then a `get_source` call with a JSON argument
  tool_answer  ... + the tool's result -> a one-line answer
Functions are split by a stable hash of their qualified name into target-train and held-out ones.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from pathlib import Path

FAMILIES = ("body", "summary", "tool_call", "tool_answer")
TOOL_NAME = "get_source"
GET_SOURCE_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Return the Python source of a function in a standard-library module.",
        "parameters": {
            "type": "object",
            "properties": {
                "module": {"type": "string", "description": "module name, e.g. json"},
                "name": {"type": "string", "description": "function name, or Class.method"},
            },
            "required": ["module", "name"],
        },
    },
}
# Limits that keep every sample short (a few hundred tokens) and learnable.
MAX_BODY_LINES, MAX_BODY_CHARS, MAX_DOC_CHARS = 6, 300, 240
MIN_SUMMARY_CHARS, MAX_SUMMARY_CHARS = 12, 120

BODY_ASKS = ("Write the body of this function.", "Implement this function.",
             "Complete the following Python function.")
SUMMARY_ASKS = ("Summarize what `{q}` does in one line.", "In one sentence, what does `{q}` do?",
                "Give a one-line summary of `{q}`.")
TOOL_ASKS = ("What does `{name}` in the `{module}` module do?", "Look up `{local}` from `{module}` and "
             "tell me what it does.", "Explain `{module}.{local}` briefly.")


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules on this machine, sorted (deterministic order)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that does not change between runs (unlike hash())."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def is_held_out(qualname: str, share: float) -> bool:
    """True for the share of functions kept away from target training (stable across runs)."""
    return stable_hash("heldout:" + qualname) % 10_000 < share * 10_000


def _clean(text: str) -> bool:
    # ASCII only and no special-token look-alikes: keeps the tiny vocab and the chat format sane.
    return text.isascii() and "<|" not in text and "<think>" not in text and "</think>" not in text


def _summary(doc: str) -> str | None:
    first = " ".join(doc.split("\n\n")[0].split())
    end = first.find(". ")
    sentence = first if end < 0 else first[:end + 1]
    if not sentence.endswith("."):
        sentence += "."
    if not MIN_SUMMARY_CHARS <= len(sentence) <= MAX_SUMMARY_CHARS:
        return None
    return sentence


def _function_record(module: str, prefix: str, node: ast.FunctionDef) -> dict | None:
    doc = ast.get_docstring(node, clean=True)
    if not doc or len(node.body) < 2:
        return None
    summary = _summary(doc)
    if summary is None:
        return None
    body = "\n".join(ast.unparse(stmt) for stmt in node.body[1:])
    lines = body.splitlines()
    if len(lines) > MAX_BODY_LINES or len(body) > MAX_BODY_CHARS or body.strip() == "pass":
        return None
    doc_text = " ".join(doc.split("\n\n")[0].split())[:MAX_DOC_CHARS]
    args = ast.unparse(node.args)
    local = prefix + node.name
    signature = f"def {node.name}({args}):"
    body_indented = "\n".join("    " + line for line in lines)
    stub = f'{signature}\n    """{doc_text}"""'
    rec = {"module": module, "local": local, "qualname": f"{module}.{local}", "name": node.name,
           "args": args, "signature": signature, "doc": doc_text, "summary": summary,
           "body": body_indented, "num_body_lines": len(lines), "stub": stub,
           "source": stub + "\n" + body_indented}
    return rec if all(_clean(rec[k]) for k in ("qualname", "args", "doc", "body")) else None


def collect_functions(files: list[Path]) -> list[dict]:
    """Module-level functions and methods of module-level classes that have a docstring and a short
    body, from `files` (in order). One record per qualified name (the first definition wins)."""
    out, seen = [], set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are test fixtures or not UTF-8
        module = path.stem
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                candidates = [("", node)]
            elif isinstance(node, ast.ClassDef):
                candidates = [(node.name + ".", n) for n in node.body if isinstance(n, ast.FunctionDef)]
            else:
                continue
            for prefix, fn in candidates:
                rec = _function_record(module, prefix, fn)
                if rec and rec["qualname"] not in seen:
                    seen.add(rec["qualname"])
                    out.append(rec)
    return out


def _args_desc(fn: dict) -> str:
    return f"`{fn['args']}`" if fn["args"] else "no arguments"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def tool_call_message(fn: dict, index: int = 0) -> dict:
    """The assistant turn that calls get_source for `fn` (OpenAI form, Kimi id functions.NAME:IDX)."""
    arguments = json.dumps({"module": fn["module"], "name": fn["local"]})
    return {"role": "assistant", "content": "",
            "reasoning_content": f"I need the source of `{fn['local']}` in `{fn['module']}`. "
                                 f"I will call {TOOL_NAME}.",
            "tool_calls": [{"id": f"functions.{TOOL_NAME}:{index}", "type": "function",
                            "function": {"name": TOOL_NAME, "arguments": arguments}}]}


def conversation(fn: dict, family: str, rng: random.Random) -> dict:
    """One chat sample of `family` for `fn`: {family, qualname, messages (history), tools, final}.

    `messages` ends with a user or tool message; `final` is the assistant turn to write next.
    """
    tools = None
    if family == "body":
        ask = rng.choice(BODY_ASKS)
        messages = [{"role": "user", "content": f"{ask}\n\n```python\n{fn['stub']}\n```"}]
        final = {"role": "assistant",
                 "reasoning_content": f"`{fn['name']}` takes {_args_desc(fn)}. Goal: {fn['summary']} "
                                      f"The body needs {_plural(fn['num_body_lines'], 'line')}.",
                 "content": f"```python\n{fn['signature']}\n{fn['body']}\n```"}
    elif family == "summary":
        ask = rng.choice(SUMMARY_ASKS).format(q=fn["qualname"])
        messages = [{"role": "user", "content": f"{ask}\n\nDocstring: {fn['doc']}"}]
        final = {"role": "assistant",
                 "reasoning_content": f"`{fn['name']}` is defined in `{fn['module']}`. "
                                      "The first sentence of its docstring says what it does.",
                 "content": f"`{fn['name']}`: {fn['summary']}"}
    elif family in ("tool_call", "tool_answer"):
        tools = [GET_SOURCE_TOOL]
        ask = rng.choice(TOOL_ASKS).format(name=fn["name"], module=fn["module"], local=fn["local"])
        messages = [{"role": "user", "content": ask}]
        call = tool_call_message(fn)
        if family == "tool_call":
            final = call
        else:
            messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                                "name": TOOL_NAME, "content": fn["source"]}]
            final = {"role": "assistant",
                     "reasoning_content": f"The tool returned the source of `{fn['local']}`; "
                                          f"its body has {_plural(fn['num_body_lines'], 'line')}.",
                     "content": f"`{fn['module']}.{fn['local']}({fn['args']})`: {fn['summary']}"}
    else:
        raise ValueError(f"unknown task family {family!r}")
    return {"family": family, "qualname": fn["qualname"], "messages": messages, "tools": tools,
            "final": final}


def training_samples(functions: list[dict], seed: int, no_think_share: float = 0.2) -> list[dict]:
    """Every family for every function; `thinking` is off for a stable share of the samples."""
    out = []
    for fn in functions:
        for family in FAMILIES:
            rng = random.Random(stable_hash(f"{seed}:{family}:{fn['qualname']}"))
            sample = conversation(fn, family, rng)
            sample["thinking"] = rng.random() >= no_think_share
            out.append(sample)
    return out


def prompt_rows(functions: list[dict], num_rows: int, seed: int) -> list[dict]:
    """Prompt-only rows (the `messages` dataset schema) from `functions`, families mixed in turn.

    Row i uses function i % len and family (i + i // len) % 4, so with fewer functions than rows a
    function appears again with another family, never twice with the same one (up to 4x).
    """
    assert functions, "no functions to make prompts from"
    order = sorted(functions, key=lambda fn: stable_hash(f"{seed}:order:{fn['qualname']}"))
    rows = []
    for i in range(min(num_rows, 4 * len(order))):
        fn = order[i % len(order)]
        family = FAMILIES[(i + i // len(order)) % len(FAMILIES)]
        sample = conversation(fn, family, random.Random(stable_hash(f"{seed}:{family}:{fn['qualname']}")))
        row = {"id": f"{family}/{fn['qualname']}", "messages": sample["messages"]}
        if sample["tools"]:
            row["tools"] = sample["tools"]
        rows.append(row)
    return rows


def sample_texts(samples: list[dict]) -> list[str]:
    """The plain texts of samples (no special tokens): extra tokenizer-training material."""
    texts = []
    for s in samples:
        if s["tools"]:  # the tool declaration repeats in every tool sample: let BPE merge it
            texts.append(json.dumps(s["tools"], separators=(",", ":")))
        for msg in s["messages"] + [s["final"]]:
            texts += [msg.get("content") or "", msg.get("reasoning_content") or ""]
            texts += [c["function"]["arguments"] for c in msg.get("tool_calls") or []]
    return [t for t in texts if t]
