"""Speculative decoding: a cheap draft proposes tokens, the target checks them all in one pass.

At batch 1 a decode step is memory-bound: it streams every weight to compute one token. A
forward pass over k + 1 tokens streams the same weights once, so on hardware with spare compute
it costs about as much as one step. Speculative decoding spends that slack:

1. a cheap **draft** proposes gamma tokens d_1..d_gamma after the context x;
2. the **target** runs once over [x_last, d_1, .., d_gamma] and gets its distributions
   p_1..p_{gamma+1} for every one of those positions (its KV cache holds the context);
3. drafts are accepted left to right; at the first rejection the target's own choice replaces
   the draft token, and after gamma acceptances the target adds a bonus token from p_{gamma+1}.

Every target pass yields between 1 and gamma + 1 tokens. The cache "rolls back" by itself:
a static KV cache writes position i in place, and attention reads only up to the last position
written in the current pass, so entries of rejected tokens are ignored and later overwritten.

**Greedy verification** accepts d_i while it equals argmax p_i: the output is the target's
greedy output. **Sampling** (Leviathan et al. 2023; Chen et al. 2023) accepts d_i, drawn from
the draft's q_i, with probability min(1, p_i(d_i) / q_i(d_i)) and on rejection draws from the
residual r = max(0, p_i − q_i) / Σ max(0, p_i − q_i); the emitted token then has exactly the
target's law p_i. A deterministic draft is the special case q = a point mass on its proposal.

This module holds the two verification rules and the decoding loop. The rest of the chapter,
all importable from here:

* ``sampling``: ``Sampling`` and the pieces of the accept/reject rule (residual,
  acceptance probability β = Σ min(p, q), and the proof that the emitted law is p);
* ``drafts``: ``Draft`` and the drafts (``ModelDraft``, ``early_exit_draft``,
  ``sparse_draft``, ``int8_draft``, ``prompt_lookup_draft``);
* ``theory``: expected tokens per pass (1 − α^(γ+1)) / (1 − α), the speedup
  E[tokens] / (γ c + v(γ)), ``best_gamma``, ``choose_gamma`` and ``teacher_forced_alpha``;
* ``adaptive``: ``AdaptiveGamma``, which picks γ before every pass (0: do not draft) from
  the acceptance seen so far, so that a draft never makes decoding slower than plain.

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (2023); Saxena, "Prompt Lookup Decoding" (2023); Elhoushi et al.,
"LayerSkip" (2024) for early-exit self-speculation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.model import Transformer, check_count, make_cache
from ..core.sampling import (
    Prompt,
    check_length,
    check_prompt_ids,
    check_seed,
    encode_prompt,
    make_generator,
    stop_ids,
)
from ..runtime.decoder import MAX_TOKENS, Decoder
from .adaptive import AdaptiveGamma, linear_verify_cost
from .drafts import (
    Draft,
    ModelDraft,
    PromptLookupDraft,
    as_draft,
    check_compatible,
    common_prefix,
    early_exit_draft,
    int8_draft,
    model_with_layers,
    prompt_lookup_draft,
    sparse_draft,
)
from .sampling import (
    Sampling,
    acceptance_probability,
    emitted_distribution,
    point_mass,
    residual_distribution,
    sample_with,
)
from .theory import (
    best_gamma,
    check_gamma,
    choose_gamma,
    expected_speedup,
    expected_tokens_per_call,
    teacher_forced_alpha,
)

# --------------------------------------------------------------------------------------------
# The verification rules
# --------------------------------------------------------------------------------------------
# verify_sampled and speculative_generate look ``residual_distribution`` up in this module, so
# replacing it here (the tests swap in a wrong rule to show the law breaks) changes both.


def verify_greedy(target_logits: Tensor, draft_tokens: Sequence[int]) -> tuple[int, int]:
    """Accept drafts while they equal the target's argmax; return (n_accepted, next_token).

    ``target_logits`` [k + 1, vocab]: row i is the target's prediction for the position of
    draft token i (row k follows the last draft). ``next_token`` is the target's argmax at the
    first mismatch, or the bonus token after k acceptances.
    """
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == choice[n]:
        n += 1
    return n, choice[n]


def verify_sampled(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Sequence[int],
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> tuple[int, int]:
    """Speculative sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)).

    ``target_probs`` [k + 1, vocab] (p_1..p_{k+1}), ``draft_probs`` [k, vocab] (q_1..q_k; None
    for a deterministic draft, i.e. point masses). At the first rejection the next token is
    drawn from ``residual_distribution(p_i, q_i)``; after k acceptances from p_{k+1}.
    Returns (n_accepted, next_token).

    ``uniforms`` [k + 1], when given, are the random numbers instead of ``generator``: u_i
    decides draft i (accepted when u_i q_i(d_i) < p_i(d_i)) and u_{k+1} draws the next token
    by inverse CDF (``sample_with``), so the same uniforms give the same result.
    """
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q = point_mass(token, p) if draft_probs is None else draft_probs[i]
        u = (
            uniforms[i]
            if uniforms is not None
            else torch.rand((), generator=generator, device=p.device)
        )
        if u * q[token] < p[token]:  # u < p/q without dividing (q[token] > 0: it was drawn)
            continue
        return i, _draw(residual_distribution(p, q), generator, uniforms)
    return len(draft_tokens), _draw(target_probs[len(draft_tokens)], generator, uniforms)


def _draw(probs: Tensor, generator: torch.Generator | None, uniforms: Tensor | None) -> int:
    if uniforms is None:
        return int(torch.multinomial(probs, 1, generator=generator))
    return sample_with(probs, uniforms[-1])


# --------------------------------------------------------------------------------------------
# The decoding loop
# --------------------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """What a speculative run did. ``alpha`` is the theory's per-token acceptance rate."""

    new_tokens: int = 0
    target_calls: int = 0  # verification passes (the prompt's prefill is not counted)
    draft_calls: int = 0  # draft forward passes (lookups for prompt lookup)
    proposed: int = 0  # draft tokens offered to the target
    judged: int = 0  # draft tokens the target ruled on (the rest followed a rejection)
    accepted: int = 0
    seconds: float = 0.0
    target_seconds: float = 0.0  # prefill + verification passes
    draft_seconds: float = 0.0
    per_pass: list[int] = field(default_factory=list)  # new tokens of each verification pass
    per_pass_gamma: list[int] = field(default_factory=list)  # drafts each pass verified

    @property
    def alpha(self) -> float:
        """Accepted / judged: the per-token acceptance probability α of the theory."""
        return self.accepted / self.judged if self.judged else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed: the share of all proposed tokens that made it into the output."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_call(self) -> float:
        """New tokens per target pass: 1 for plain decoding, up to gamma + 1."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def other_seconds(self) -> float:
        """Time outside the models: Python bookkeeping, acceptance tests, lookups."""
        return self.seconds - self.target_seconds - self.draft_seconds


@torch.inference_mode()
def speculative_generate(
    target: Transformer,
    tokenizer: Any,
    prompt: Prompt,
    draft: Draft | Transformer,
    gamma: int | AdaptiveGamma = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_at_eos: bool = True,
) -> tuple[list[int], SpeculativeStats]:
    """Generate like ``generate(target, ...)`` with a draft proposing ``gamma`` tokens per pass.

    Greedy (temperature 0) returns the target's greedy tokens; sampling returns tokens with the
    target's distribution (not the same tokens as ``generate`` for a seed: the random numbers
    are used differently). Stops after an end-of-sequence token (included; not with
    ``stop_at_eos=False``) or ``max_new_tokens``. Returns (new token ids, ``SpeculativeStats``).
    Sampling without ``seed`` draws from torch's global generator. Every argument is checked
    before any work.

    ``gamma`` is the drafts per pass, or an ``AdaptiveGamma`` that chooses them before every
    pass from the acceptance seen so far (0: a plain step; ``stats.per_pass_gamma`` records
    the choices). It is reset at the start.
    """
    start_time = time.perf_counter()
    policy = gamma if isinstance(gamma, AdaptiveGamma) else None
    if policy is None:
        check_gamma(gamma)
    else:
        policy.reset()
    draft = as_draft(draft)
    check_compatible(target, tokenizer, draft)
    sampling = Sampling(temperature, top_k, top_p)
    check_count(max_new_tokens, "max_new_tokens", fix="ask for at least 1 new token")
    check_seed(seed)
    ids = encode_prompt(tokenizer, prompt)
    check_prompt_ids(ids, target.config.vocab_size)
    total = check_length(target, len(ids), max_new_tokens)
    device = target.device
    generator = make_generator(device, seed, sampling=not sampling.greedy)
    stops = stop_ids(target, tokenizer) if stop_at_eos else set()
    stats = SpeculativeStats()
    cache = make_cache(target.config, 1, total, target.dtype, device)
    # the compiled decoder verifies gamma + 1 tokens reading each weight once
    decoder = Decoder(target, cache) if Decoder.supports(target) else None
    draft.reset(total)

    # Invariant: the target's cache holds every token of ``ids`` but the last.
    t0 = time.perf_counter()
    if len(ids) > 1:
        prefix = torch.tensor([ids[:-1]], device=device)
        target(prefix, torch.arange(len(ids) - 1, device=device), cache)
    t1 = time.perf_counter()
    draft.prefill(ids)  # a model draft reads the prompt now, not inside its first proposal
    stats.target_seconds += t1 - t0
    stats.draft_seconds += time.perf_counter() - t1
    out: list[int] = []
    while len(out) < max_new_tokens:
        # The target adds one token of its own per pass, so propose at most what still fits.
        want = gamma if policy is None else policy.next_gamma()
        k = min(want, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        proposal, q = draft.propose(ids, k, sampling, generator) if k > 0 else ([], None)
        # a free draft that sits out is still asked for its would-be token (judged below)
        shadow = policy is not None and want == 0 and policy.free and sampling.greedy
        would_be = draft.propose(ids, 1, sampling, generator)[0] if shadow else []
        t1 = time.perf_counter()
        chunk = [ids[-1], *proposal]
        if decoder is not None and len(chunk) <= MAX_TOKENS:
            logits = decoder.forward(chunk, len(ids) - 1)
        else:
            pos = torch.arange(len(ids) - 1, len(ids) - 1 + len(chunk), device=device)
            logits = target(torch.tensor([chunk], device=device), pos, cache)[0]
        if sampling.greedy:
            n_ok, token = verify_greedy(logits, proposal)
        else:
            n_ok, token = verify_sampled(sampling.probs(logits), q, proposal, generator)
        stats.draft_seconds += t1 - t0
        stats.target_seconds += time.perf_counter() - t1
        stats.target_calls += 1
        stats.proposed += len(proposal)
        stats.judged += min(n_ok + 1, len(proposal))
        stats.accepted += n_ok
        stats.per_pass_gamma.append(len(proposal))
        if policy is not None and shadow:
            policy.observe(would_be, token)
        elif policy is not None:
            policy.update(n_ok, min(n_ok + 1, len(proposal)))
        new = [*proposal[:n_ok], token]
        for i, t in enumerate(new):  # cut after an end-of-sequence token
            if t in stops:
                new = new[: i + 1]
                break
        out += new
        stats.per_pass.append(len(new))
        ids = ids + new
        if out[-1] in stops:
            break
    stats.draft_calls = draft.calls
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start_time
    return out, stats


__all__ = [
    "AdaptiveGamma",
    "Draft",
    "ModelDraft",
    "PromptLookupDraft",
    "Sampling",
    "SpeculativeStats",
    "acceptance_probability",
    "as_draft",
    "best_gamma",
    "check_compatible",
    "check_gamma",
    "choose_gamma",
    "common_prefix",
    "early_exit_draft",
    "emitted_distribution",
    "expected_speedup",
    "expected_tokens_per_call",
    "int8_draft",
    "linear_verify_cost",
    "model_with_layers",
    "point_mass",
    "prompt_lookup_draft",
    "residual_distribution",
    "sample_with",
    "sparse_draft",
    "speculative_generate",
    "teacher_forced_alpha",
    "verify_greedy",
    "verify_sampled",
]
