"""Shared fixtures: a micro Kimi-shaped target (random DeepSeek-V3 + Kimi-special BPE tokenizer)."""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import times  # noqa: E402 (after the path): per-tier durations with TEST_TIMES (its clock starts here)
from tests.paths import tier_of  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: needs the serving engine's venv (build/vllm-venv); every test "
                            "in tests/engine/ gets it, no test elsewhere may have it; `make test-fast` leaves them out")


def pytest_collection_modifyitems(config, items):
    """The engine tier is a folder: its tests are marked `engine` here, and an `engine` test elsewhere is refused
    (it would run in `make test-fast`, which has no engine venv)."""
    strays = []
    for item in items:
        if tier_of(item.path) == "engine":
            item.add_marker(pytest.mark.engine)
        elif item.get_closest_marker("engine"):
            strays.append(item.nodeid)
    if strays:
        raise pytest.UsageError(f"tests marked `engine` outside tests/engine/ (move them there): {strays}")


def pytest_sessionfinish(session, exitstatus):
    """With TEST_TIMES=FILE (.ci/run sets it), add this session's per-tier durations to FILE (tests/times.py)."""
    import os

    # under pytest-xdist the controller records: it gets every worker's reports (a worker has `workerinput`)
    if os.environ.get("TEST_TIMES") and not hasattr(session.config, "workerinput"):
        times.record(session, os.environ["TEST_TIMES"], tier_of)


def pytest_runtest_logreport(report):
    """Each test's setup + call + teardown seconds and outcome, for pytest_sessionfinish (TEST_TIMES)."""
    import os

    if os.environ.get("TEST_TIMES"):
        times.add_report(report)


def stdlib_texts(limit: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def save_random_target(out_dir: str | Path, tokenizer, seed: int = 0, **dims):
    """Initialise a DeepseekV3ForCausalLM (common/worlds/tiny_target.deepseek_v3_config) with `seed`,
    save it (safetensors) with its tokenizer."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from common.worlds.tiny_target import deepseek_v3_config

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(tokenizer, **dims)).eval()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model


def make_micro_target(out_dir: Path, seed: int = 0, vocab_size: int = 600) -> Path:
    from common.worlds.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(stdlib_texts(12), vocab_size, out_dir)
    save_random_target(out_dir, tok, seed=seed, hidden_size=32, num_hidden_layers=8,
                       moe_intermediate_size=32, intermediate_size=64)
    return out_dir


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory) -> Path:
    """A model folder: random 8-layer DeepseekV3 (hidden 32) with a 600-token Kimi-special tokenizer."""
    return make_micro_target(tmp_path_factory.mktemp("micro_target"))


@pytest.fixture(scope="session")
def other_micro_target(tmp_path_factory) -> Path:
    """Same shape, different tokenizer (other vocab size): for mismatch-refusal tests."""
    return make_micro_target(tmp_path_factory.mktemp("other_target"), seed=1, vocab_size=700)


# SmolLM2-135M-Instruct's chat template (ChatML; tools, tool calls and reasoning are not rendered),
# as its GGUF file `tokenizer.chat_template` holds it.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
# A Llama-3-shaped template: turns end with <|eot_id|> (id 4), generation_config stops on [1, 4].
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Plain chat prompts for the non-Kimi micro targets.
CHAT_PROMPTS = ["Write a function that adds two numbers.", "What does len() return?", "Explain a for loop.",
                "def parse(path):", "Summarize: the quick brown fox.", "Name three sorting algorithms.",
                "Why is the sky blue?", "Reverse a string in Python."]


def make_micro_llama_target(out_dir: Path, template: str, specials: tuple[str, ...], bos: str, eos: str,
                            generation_eos: list[int], seed: int = 0, vocab_size: int = 400) -> Path:
    """A random 4-layer LlamaForCausalLM (hidden 32) with tied embeddings and a byte-level BPE tokenizer
    whose first ids are `specials`, chat `template`, eos token `eos` and generation_config eos ids."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(stdlib_texts(6), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, unk_token=specials[0],
                                  pad_token=eos, chat_template=template,
                                  additional_special_tokens=[t for t in specials if t not in (bos, eos, specials[0])])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    torch.manual_seed(seed)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (bos, eos)}
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=ids[bos], eos_token_id=ids[eos], pad_token_id=ids[eos],
                         initializer_range=0.3)  # 0.02 (the default) makes a random model repeat one token
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids[bos], eos_token_id=generation_eos,
                                               pad_token_id=ids[eos])
    model.save_pretrained(str(out_dir))
    return out_dir


def make_micro_chatml_target(out_dir: Path, seed: int = 0) -> Path:
    """SmolLM2-shaped: Llama, tied embeddings, SmolLM2's specials and ChatML template, eos <|im_end|> (2)."""
    return make_micro_llama_target(out_dir, CHATML_TEMPLATE, CHATML_SPECIALS, "<|im_start|>", "<|im_end|>", [2], seed)


def make_stopping(model_dir: Path, out_dir: Path, stop_id: int, prompts: list[str], max_new_tokens: int) -> Path:
    """A copy of a tied-embedding micro target whose `stop_id` row is f x the row of a token it often emits,
    with f the first of a few values that makes some `prompts` stop within `max_new_tokens` and others
    hit the cap, so that both finish paths get exercised."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        shutil.copy(f, out_dir / f.name)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    rendered = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts]
    inputs = [torch.tensor([tok(p, add_special_tokens=False)["input_ids"]]) for p in rendered]

    def greedy(x, n):
        return model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=stop_id, pad_token_id=stop_id)[0, x.shape[1]:].tolist()

    often = greedy(inputs[0], 6)[-1]
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied: the head row moves with it
    base = emb[often].detach().clone()
    for factor in (0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5):
        with torch.no_grad():
            emb[stop_id] = factor * base
        stops = [stop_id in greedy(x, max_new_tokens) for x in inputs]
        if 0 < sum(stops) < len(stops):
            model.save_pretrained(str(out_dir))
            return out_dir
    raise AssertionError("no factor makes the micro target both stop and hit the cap")


@pytest.fixture(scope="session")
def micro_chatml_target(tmp_path_factory) -> Path:
    """A model folder shaped like SmolLM2-135M-Instruct (Llama, tied embeddings, ChatML), tiny and random."""
    return make_micro_chatml_target(tmp_path_factory.mktemp("micro_chatml_target"))


@pytest.fixture(scope="session")
def micro_chatml_stopping_target(micro_chatml_target, tmp_path_factory) -> Path:
    """micro_chatml_target whose greedy answers to CHAT_PROMPTS partly stop (<|im_end|>) within 12 new
    tokens and partly hit that cap."""
    return make_stopping(micro_chatml_target, tmp_path_factory.mktemp("chatml_stopping"), 2, CHAT_PROMPTS, 12)


@pytest.fixture(scope="session")
def micro_llama3_target(tmp_path_factory) -> Path:
    """A Llama-3-shaped micro target (turns end with <|eot_id|>, generation_config eos [1, 4]) whose
    answers to CHAT_PROMPTS partly stop within 12 new tokens."""
    base = make_micro_llama_target(tmp_path_factory.mktemp("micro_llama3_base"), LLAMA3_TEMPLATE, LLAMA3_SPECIALS,
                                   "<|begin_of_text|>", "<|end_of_text|>", [1, 4])
    return make_stopping(base, tmp_path_factory.mktemp("micro_llama3"), 4, CHAT_PROMPTS, 12)


@pytest.fixture(scope="session")
def chat_prompts_file(tmp_path_factory) -> Path:
    """CHAT_PROMPTS as `messages` adapter rows (ids p0..p7)."""
    import json

    path = tmp_path_factory.mktemp("chat_prompts") / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(CHAT_PROMPTS)))
    return path


# The decoding tests' micro model, prompts and thread setting (tests/spec_helpers.py has their helpers).
@pytest.fixture(scope="module")
def one_thread():
    """Batch-1 decoding of a micro model is Python-bound: extra threads only fight (2 shared cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(micro_target, one_thread):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(micro_target):
    from common.text.tokenizer import load_tokenizer
    from tests.spec_helpers import TEXTS

    tok = load_tokenizer(micro_target)
    return [tok.encode(t) for t in TEXTS]
