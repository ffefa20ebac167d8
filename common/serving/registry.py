"""The engines 05b can sweep, by the name --engine takes: ENGINES, and what builds one from 05b's flags
(`engine_from_args`) or decides which declared drafts it can serve (`check_servable`).
"""
from __future__ import annotations

from pathlib import Path

from common.serving import vllm
from common.serving.engine import ServedDraft
from common.serving.sglang import SGLangEngine
from common.serving.vllm import VllmEngine
from common.stage import StageError, stage_dir
from common.target.head import read_target_text_config

ENGINES = ("sglang", "vllm")
ENGINE_LABELS = {"sglang": "SGLang", "vllm": "vLLM"}


def engine_from_args(args, export_dir: Path, m02b: dict, m04: dict, target_dir: Path, work_dir: Path,
                     foreign: list[ServedDraft] = ()):
    """05's flags -> the Engine that serves this run (`foreign`: the declared drafts, check_servable's)."""

    if args.engine == "sglang":
        return SGLangEngine(target_dir, export_dir, m02b, m04, tp_size=args.sglang_tp_size,
                                    mem_fraction=args.mem_fraction_static, python=args.sglang_python,
                                    extra_args=list(args.server_extra_args),
                                    min_accept_length=args.min_accept_length,
                                    draft_attention_backend=args.sglang_draft_attention_backend,
                                    foreign=list(foreign))
    draft_dir = (export_dir if args.draft_format == "sglang"
                 else stage_dir(work_dir, "04_train") / "export_speculators")
    if not (draft_dir / "config.json").is_file():
        raise StageError(f"{draft_dir} has no config.json: re-run `python 04_train.py --overwrite`")
    settings = vllm.VllmSettings(python=args.vllm_python, dtype=args.vllm_dtype,
                                 kv_cache_space_gib=args.vllm_kv_cache_space, threads=args.vllm_threads,
                                 thread_binding=args.vllm_thread_binding, max_model_len=args.vllm_max_model_len,
                                 preload_iomp=args.vllm_preload_iomp, extra_args=tuple(args.server_extra_args),
                                 fix_sampling=args.vllm_fix_sampling)
    return VllmEngine(target_dir, export_dir, draft_dir, m02b, m04, settings,
                              min_accept_length=args.min_accept_length, foreign=list(foreign))


def check_servable(engine: str, checked: dict, target_dir: Path) -> list[ServedDraft]:
    """The declared drafts (compare.check_drafts: {name: (ImportedDraft, capture points)}) as `engine` will
    serve them; one line refusing a draft it cannot serve as checked, before anything launches.

    SGLang loads its own layout only (`LlamaForCausalLMEagle3`) and reads the capture points from
    `eagle_config.eagle_aux_hidden_state_layer_ids` (its default without them). vLLM reads the top-level
    `eagle_aux_hidden_state_layer_ids` as the points, and without them takes eagle_config's ids AS GIVEN
    (common/serving/vllm.py): an SGLang-layout folder whose ids are not the points themselves (Llama's
    points - 1, DeepSeek's [1, ...]) would be fed other layers. Without any declaration both engines
    use [2, N//2, N-3], which check_draft assumes too."""
    n = int(read_target_text_config(target_dir)["num_hidden_layers"])
    default = [2, n // 2, n - 3]
    served = []
    for name, (d, points) in checked.items():
        where = f"--draft {name} ({d.path}): {ENGINE_LABELS[engine]}"
        if engine == "sglang" and d.layout != "sglang":
            raise StageError(f"{where} loads EAGLE-3 drafts in its own layout (LlamaForCausalLMEagle3) only, this "
                             f"one is in the {d.layout} layout: give the draft's SGLang-layout folder")
        if engine == "sglang" and d.sglang_ids is None and list(points) != default:
            raise StageError(f"{where} would feed it h{default} (no eagle_config.eagle_aux_hidden_state_layer_ids: "
                             f"its default), but it reads h{list(points)}: add eagle_config's ids to its config.json")
        if engine == "vllm" and d.vllm_points is None and d.sglang_ids is not None and d.sglang_ids != list(points):
            raise StageError(f"{where} would feed it h{d.sglang_ids} (no top-level eagle_aux_hidden_state_layer_ids: "
                             f"it takes eagle_config's ids as the points), but it reads h{list(points)}: add "
                             f"top-level eagle_aux_hidden_state_layer_ids {list(points)} to its config.json")
        served.append(ServedDraft(name, Path(d.path), tuple(points)))
    return served
