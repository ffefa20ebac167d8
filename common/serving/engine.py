"""One interface over the serving engines 05b measures: SGLang (the GPU box) and vLLM (its CPU build
serves the CPU worlds here). 05b's sweep (sweep.py) only talks to an `Engine`; each engine's module defines
its subclass (sglang.SGLangEngine, vllm.VllmEngine) and registry.py names them for --engine.

What differs between them, and where each answer comes from:
                     SGLang (common/serving/sglang.py)          vLLM (common/serving/vllm.py)
  launch             python -m sglang.launch_server ...         python -m vllm.entrypoints.openai.api_server
  what it serves     GET /server_info                           GET /server_info?config_format=json (dev mode)
  algorithm          speculative_algorithm == "EAGLE3"          speculative_config.method == "eagle3"
  aux layers         draft config ids checked against 02b       the engine's own log line, = capture points
  requests           POST /generate (input_ids)                 POST /v1/completions (prompt = ids)
  per-request tau    meta_info.spec_verify_ct                   metrics.speculative_decoding (per round)
  run-level tau      reset + windowed avg_spec_accept_length    /metrics counters, differenced
  prefix caching     off: --disable-radix-cache                 off: --no-enable-prefix-caching
  sampling defaults  sampling_defaults, preferred_sampling_params  generation_config (+ its log line)
  simulated (map)    env SGLANG_SIMULATE_ACC_LEN (+ _METHOD)        speculative_config rejection_sample_method synthetic
Every server 05b launches has prefix caching off, and an attached one must have it off too (its info document
says): the sweep times repeated passes over the same prompts (common/serving/sweep.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.draft import OURS
from common.draft.manifest import DraftManifest
from common.serving.drafts import served_draft
from common.serving.settings import parse_spec_setting
from common.stage import StageError
from common.target.manifests import HiddenStatesManifest


@dataclass(frozen=True)
class ServedDraft:
    """A draft the sweep serves: 04's (`name` OURS) or a declared --draft NAME. `path`: the folder the
    server loads; `points`: the capture points the engine must feed it."""
    name: str
    path: Path
    points: tuple[int, ...] = ()

    @property
    def ours(self) -> bool:
        return self.name == OURS


class Engine:
    """What 05's sweep needs from an engine. `setting` = (steps, topk, num_draft_tokens), or with a 4th
    item "adaptive" for SGLang's --speculative-adaptive started from that chain. `draft` = one of
    `drafts` (04's first); None = 04's."""
    name: str
    label: str
    # decode iterations from outside a run that window_end's server tau may hold (and of the run's own
    # that it may miss); 05 holds the run's counts against it only over runs many times longer
    server_tau_slop = 0
    server_tau_note = ""  # how report.md says where the server's own tau comes from, and what it may hold
    # How the engine simulates acceptance (05b --simulate-accept-lengths, common/serving/breakeven.py): the
    # knob its `command` sets for a simulated setting (settings.simulated), in words for the report and docs
    simulates = ""
    # What 05 adds to this engine's servers for its own measurement, not for serving (deploy.launch_line drops
    # them from the line it recommends): {flag: number of values after it}, and environment variable names
    measurement_flags: dict[str, int] = {}
    measurement_env: tuple[str, ...] = ()

    @classmethod
    def add_flags(cls, group) -> None:
        """Declare this engine's own 05b flags in `group` (05b gives each engine of registry.ENGINES an argument
        group, "<label> servers (--engine <name>)"); `from_args` reads them. None by default."""

    @classmethod
    def from_args(cls, args, export_dir: Path, m02b: HiddenStatesManifest, m04: DraftManifest,
                  target_dir: Path, work_dir: Path, foreign: list[ServedDraft]) -> Engine:
        """This engine as 05b's flags set it up (registry.engine_from_args): 04's SGLang export and the
        manifests, the target, the work dir, and the declared drafts served next to 04's."""
        raise NotImplementedError

    @classmethod
    def target_server(cls, target: Path, port: int, python: str, served_name: str, context_length: int,
                      memory_share: float) -> tuple[list[str], dict]:
        """(argv, environment) of a server of `target` alone, no draft, started from `python`, named `served_name`
        in its OpenAI API and admitting `context_length` tokens; `memory_share`: of the GPU's memory (0-1; an
        engine on the CPU ignores it). What the smoke run's 01b generates against (scripts/box_smoke.py)."""
        raise NotImplementedError

    @classmethod
    def refuse_unservable(cls, where: str, draft, points: list[int], default: list[int]) -> None:
        """One StageError (starting with `where`) when this engine would not serve the declared `draft`
        (common/draft/imported.ImportedDraft) as checked: its layout, or other capture points than `points`
        (`default`: the engines' points when a draft declares none). Called before anything launches."""

    @staticmethod
    def check_launch_line(argv: list[str]) -> None:
        """ValueError unless `argv` (a speculative launch line as deploy.launch_line shows it) runs EAGLE-3:
        the deploy section never recommends a line that would serve the draft at chance."""
        raise NotImplementedError

    @staticmethod
    def lossy(argv=(), env: dict | None = None, info: dict | None = None) -> list[str]:
        """Why a server of this engine launched with `argv` and environment `env`, or reporting the info
        document `info` (as the engine's check reads it), accepts drafts its verify would not accept as a sample
        of the target, or simulates acceptance: one reason a setting, [] when none. 05b refuses such a server
        in any measurement (refuse_lossy); a simulation of acceptance is one by this test."""
        return []

    @staticmethod
    def simulation_reasons(argv=(), env: dict | None = None, info: dict | None = None) -> list[str]:
        """Of `lossy`'s reasons, those that say the server simulates acceptance (the rest make a verify lossy)."""
        return []

    @staticmethod
    def simulated_length(argv=(), env: dict | None = None, info: dict | None = None) -> float | None:
        """The accept length a launch line and environment, or an info document, tell the server to simulate
        (None: none it says; the info document of an engine that does not report it says nothing)."""
        return None

    @staticmethod
    def setting_note(log: Path | None) -> str | None:
        """What a launched server's log says about why it runs another setting than the one launched (SGLang turns
        --speculative-adaptive off at start-up and says so), None when it says nothing."""
        return None

    def parse_setting(self, text: str) -> tuple:
        return parse_spec_setting(text)

    @property
    def drafts(self) -> list[ServedDraft]:
        """04's draft (what this engine loads of 04's exports; none when 05b runs without 04), then the
        declared ones."""
        ours = [] if self.draft_dir is None else [ServedDraft(OURS, Path(self.draft_dir),
                                                              self.m02b.capture_points or ())]
        return [*ours, *self.foreign]

    def identify(self, reported: str | None, drafts: list[ServedDraft]) -> ServedDraft:
        """Which of `drafts` a server that passed its check serves (by folder or content)."""
        name = served_draft(reported, {d.name: d.path for d in drafts})
        return next(d for d in drafts if d.name == name)

    def command(self, port: int, graph: bool, setting, draft: ServedDraft | None = None) -> tuple[list[str], dict]:
        raise NotImplementedError

    def check_baseline(self, url: str) -> bool:
        """Refuse a baseline that speculates or serves another target; returns its graph mode."""
        raise NotImplementedError

    def check_eagle3(self, url: str, drafts: list[ServedDraft] | None = None,
                     simulated: float | None = None) -> tuple[bool, tuple, ServedDraft]:
        """Refuse a speculative server that is not EAGLE-3 with one of `drafts` (default: all of them) and
        our target, or that is lossy or simulated; returns (graph mode, setting, the draft it serves).
        `simulated` L: 05b launched it to simulate accept length L (confirm_simulated): refused unless its info
        document allows that (nothing lossy; the length where the engine reports one), and its setting says so."""
        raise NotImplementedError

    def preflight(self, url: str, log: Path | None, warmup_fn, draft: ServedDraft | None = None,
                  simulated: float | None = None) -> dict:
        """The checks before a server is measured; `simulated` L: its warm-up must commit L tokens a round
        (check_simulated_tau) instead of clearing the acceptance floor."""
        raise NotImplementedError

    def request(self, url: str, ids: list[int], max_new_tokens: int, timeout: float,
                sampling: dict | None = None, logprobs: int | None = None) -> dict:
        """One answer, greedy or sampled with sampling={temperature, top_p, seed}; every other sampling
        parameter is set too (request_params.pinned). `logprobs` N (where engine_probabilities says the server
        can): the answer's "logprobs" hold, per answer token, {token id: logprob} of the distribution it verified
        against, its top N and the token it committed."""
        raise NotImplementedError

    def engine_probabilities(self, url: str) -> str | None:
        """Why the server's answers cannot carry the probabilities its verify used (request(..., logprobs=N)),
        None when they can: the agreement check then compares them with replay's p(d) draft by draft."""
        return f"05b reads no verify probabilities from {self.label}'s answers"

    def sampling_defaults(self, url: str, log: Path | None) -> dict:
        """What the server fills in for a sampling parameter a request leaves out, where it says (05's
        requests leave none out; reported so that a person sees what a client that does would get)."""
        return {}

    def fixes(self) -> list[str]:
        """Changes 05 loads into the engine's servers (the report names them)."""
        return []

    def sampling_defect(self) -> str | None:
        """Why this engine build cannot verify sampled drafts correctly (then its sampled tau says nothing
        about the draft), None when it can or nothing is known against it."""
        return None

    def context_length(self) -> tuple[int, str]:
        """(tokens of prompt + answer a launched server of this engine admits, where that number comes from),
        for 05's refusal before launch (sweep.check_context_fits)."""
        raise NotImplementedError

    def window_start(self, url: str):
        """Called right before a measured run; its result goes to window_end."""
        return None

    def window_end(self, url: str, start) -> dict:
        """The server's own acceptance over the run: {"server_accept_length", ...}."""
        return {"server_accept_length": None}


def confirm_simulated(engine, where: str, length: float, argv=(), env: dict | None = None,
                      info: dict | None = None, reported: bool = True) -> None:
    """One line refusing a server 05b launched to simulate accept length `length` unless it is simulated, by the
    very test that refuses simulation in a real measurement (`engine.lossy`, e.g. sglang.lossy_or_simulated):
    that test must find the simulation, nothing else (no lossy verify on top), and the length the launch or the
    info document asks for must be `length` (`reported` False: an info document of an engine that does not
    report the simulation, which then must find nothing at all)."""
    why = engine.lossy(argv, env, info)
    sim = engine.simulation_reasons(argv, env, info)
    other = [w for w in why if w not in sim]
    if other:
        raise StageError(f"{where} was launched to simulate accept length {length:g}, but it is also lossy: "
                         f"{'; '.join(other)}")
    if not reported:
        return
    if not sim:
        raise StageError(f"{where} was to simulate accept length {length:g}, but {engine.label}'s own test finds no "
                         f"simulation in it ({engine.simulates}): its rows would time a real verify")
    got = engine.simulated_length(argv, env, info)
    if got is None or abs(got - length) > 1e-6:
        raise StageError(f"{where} simulates accept length {got}, not the {length:g} 05b asked for: {'; '.join(sim)}")


def check_simulated_tau(where: str, length: float, answers: list[dict], steps: int) -> float:
    """The per-round tau a simulated server's warm-up `answers` show, refused unless within SIMULATED_TAU_SLACK
    of `length` (clipped to what a round of `steps` drafts can commit): an engine may ignore or misread its knob,
    and the map would then time another acceptance. Per round: 1 + the drafts each round accepted where the
    answers carry them (vLLM's per_step_accepted: exact), else the committed tokens without each answer's prefill
    token over its verify rounds (SGLang's totals; a last round cut at the budget pulls it down a little)."""
    rounds = sum(r.get("spec_verify_ct") or 0 for r in answers)
    if not rounds:
        raise StageError(f"{where} reports no verify rounds: not a speculative server")
    per_step = [r.get("per_step_accepted") for r in answers]
    if all(isinstance(p, list) for p in per_step):
        tokens = sum(1 + a for p in per_step for a in p)
        rounds = sum(len(p) for p in per_step)
    else:
        tokens = sum(r["completion_tokens"] - 1 for r in answers)
    tau, want = tokens / rounds, min(max(length, 1.0), steps + 1.0)
    if abs(tau - want) > SIMULATED_TAU_SLACK * want:
        raise StageError(f"{where} was made to simulate accept length {length:g}, but its warm-up committed "
                         f"{tau:.2f} tokens a verify round ({tokens} in {rounds}): the engine does not simulate as "
                         "asked, so its rows would not be a break-even map")
    return tau


SIMULATED_TAU_SLACK = 0.15  # relative: ~100 warm-up rounds of a random length each, and the cut last rounds


def refuse_lossy(where: str, reasons: list[str]) -> None:
    """One line refusing a lossy or simulated server or launch (Engine.lossy's reasons), else nothing."""
    if reasons:
        raise StageError(f"{where} is lossy or simulated: {'; '.join(reasons)}. Its tau would credit the draft with "
                         "acceptances a lossless verify does not make: measure without it (docs/serving.md, "
                         "'Lossy and simulated settings')")
