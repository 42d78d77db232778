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
greedy output. **Sampling** uses the rule of Leviathan et al. (2023) and Chen et al. (2023):
with d_i drawn from the draft's q_i, accept with probability min(1, p_i(d_i) / q_i(d_i));
on rejection draw from the residual r = max(0, p_i − q_i) / Σ max(0, p_i − q_i). The emitted
token then has exactly the target's law:

    P(x) = q(x) min(1, p(x)/q(x)) + (1 − β) r(x) = min(p, q)(x) + max(0, p − q)(x) = p(x),

where β = Σ_x min(p(x), q(x)) = 1 − TV(p, q) is the acceptance probability. A deterministic
draft (prompt lookup) is the special case q = a point mass on its proposal.

**Theory.** With an i.i.d. per-token acceptance α, a target pass yields on average
(1 − α^(γ+1)) / (1 − α) tokens; if a draft step costs c target steps and a pass over γ + 1
tokens costs v(γ) target steps (v = 1 on an ideal memory-bound accelerator), the speedup is
E[tokens] / (γ c + v(γ)).

**Drafts** (``Draft``): any ``Transformer`` with the target's vocabulary (``ModelDraft``);
``early_exit_draft`` (the target's first layers, then its final norm and LM head: no extra
weights); ``sparse_draft`` (the target with chapter 07's calibrated sparse MLPs);
``int8_draft`` (the target with weight-only int8 linears); ``prompt_lookup_draft`` (no model:
copy what followed the last occurrence of the current n-gram in the context; Saxena, 2023).

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (2023); Saxena, "Prompt Lookup Decoding" (2023); Elhoushi et al.,
"LayerSkip" (2024) for early-exit self-speculation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .decode import MAX_TOKENS, Decoder
from .generate import (
    Prompt,
    check_length,
    check_prompt_ids,
    check_sampling,
    check_seed,
    encode_prompt,
    logits_to_probs,
    make_generator,
    stop_ids,
)
from .model import Block, Transformer, check_count, make_cache
from .quant import quantize_model
from .sparse_mlp import calibrate_thresholds, sparse_mlps

# --------------------------------------------------------------------------------------------
# Sampling settings and the verification rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy when ``temperature == 0``, else sampled from p(T, k, p)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """The sampling distribution for ``logits`` [..., vocab] (``generate.logits_to_probs``)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)


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


def point_mass(token: int, like: Tensor) -> Tensor:
    """The distribution of a deterministic proposal: 1 at ``token``, 0 elsewhere."""
    return F.one_hot(torch.tensor(token, device=like.device), like.shape[-1]).to(like.dtype)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """r = max(0, p − q) / Σ max(0, p − q): where the target wants more mass than the draft."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    # Σ max(0, p − q) = 1 − β, zero only when p == q; then no token can be rejected.
    return r / total if total > 0 else p


def acceptance_probability(p: Tensor, q: Tensor) -> Tensor:
    """β = Σ_x min(p(x), q(x)) = 1 − TV(p, q): the chance a draft from q is accepted under p."""
    return torch.minimum(p, q).sum(-1)


def emitted_distribution(p: Tensor, q: Tensor) -> Tensor:
    """The exact law of the token that one accept/reject step emits (it equals p).

    P(x) = q(x) min(1, p(x)/q(x)) + (1 − β) r(x): accepted as the draft's x, or rejected and
    redrawn from the residual r. Written out term by term so a test can check it against p.
    """
    ratio = torch.where(q > 0, p / q, torch.ones_like(p))
    accepted = q * ratio.clamp(max=1.0)
    return accepted + (1 - acceptance_probability(p, q)) * residual_distribution(p, q)


def verify_sampled(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Sequence[int],
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)).

    ``target_probs`` [k + 1, vocab] (p_1..p_{k+1}), ``draft_probs`` [k, vocab] (q_1..q_k; None
    for a deterministic draft, i.e. point masses). At the first rejection the next token is
    drawn from ``residual_distribution(p_i, q_i)``; after k acceptances from p_{k+1}.
    Returns (n_accepted, next_token).
    """
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q = point_mass(token, p) if draft_probs is None else draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[token] < p[token]:  # u < p/q without dividing (q[token] > 0: it was drawn)
            continue
        return i, int(torch.multinomial(residual_distribution(p, q), 1, generator=generator))
    last = target_probs[len(draft_tokens)]
    return len(draft_tokens), int(torch.multinomial(last, 1, generator=generator))


# --------------------------------------------------------------------------------------------
# Drafts
# --------------------------------------------------------------------------------------------


class Draft:
    """Proposes up to gamma tokens to follow a context.

    ``propose`` returns the tokens and, for a sampling draft, their distributions q [k, vocab]
    (None when the tokens were chosen deterministically). ``calls`` counts the forward passes
    the draft made since ``reset``.
    """

    name = "draft"
    vocab_size: int | None = None  # None: works with any vocabulary
    tokenizer: Any = None  # the draft's own tokenizer, when it has one (checked against target)

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, max_seq_len: int) -> None:
        """Prepare for a new sequence of at most ``max_seq_len`` tokens."""
        self.calls = 0

    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        raise NotImplementedError


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ModelDraft(Draft):
    """A ``Transformer`` as the draft, with its own static KV cache.

    The cache remembers which tokens it holds; on each call only the tokens after the longest
    common prefix with the new context are fed (after a rejection that is the target's
    correction token, after a full acceptance the last draft token and the bonus token).
    """

    def __init__(self, model: Transformer, tokenizer: Any = None, name: str = "model") -> None:
        super().__init__()
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.vocab_size = model.config.vocab_size
        self.cache: nn.ModuleList | None = None
        self.decoder: Decoder | None = None
        self.cached: list[int] = []

    def reset(self, max_seq_len: int) -> None:
        super().reset(max_seq_len)
        m = self.model
        self.cache = make_cache(m.config, 1, max_seq_len, m.dtype, m.device)
        self.decoder = Decoder(m, self.cache) if Decoder.supports(m) else None
        self.cached = []

    @torch.inference_mode()
    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        if self.cache is None:
            raise RuntimeError(
                "Call reset(max_seq_len) before propose (speculative_generate does)."
            )
        device = self.model.device
        start = min(common_prefix(self.cached, ids), len(ids) - 1)
        tokens = torch.tensor([ids[start:]], device=device)
        pos = torch.arange(start, len(ids), device=device)
        out: list[int] = []
        qs: list[Tensor] = []
        for _ in range(gamma):
            if self.decoder is not None and tokens.shape[1] <= MAX_TOKENS:  # the compiled step
                logits = self.decoder.forward(tokens[0].tolist(), int(pos[0]))[-1]
            else:
                hidden = self.model.hidden_states(tokens, pos, self.cache)
                logits = self.model.lm_head(hidden[0, -1])
            self.calls += 1
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = sampling.probs(logits)
                token = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            out.append(token)
            tokens = torch.tensor([[token]], device=device)
            pos = pos[-1:] + 1
        self.cached = ids + out[:-1]  # the last proposal was never fed
        return out, (torch.stack(qs) if qs else None)


def model_with_layers(model: Transformer, layers: Sequence[nn.Module]) -> Transformer:
    """A ``Transformer`` that shares ``model``'s embedding, final norm and LM head, with ``layers``.

    No weight is copied: the shell is built on the meta device and its modules are replaced by
    the given ones.
    """
    config = dataclasses.replace(model.config, n_layers=len(layers))
    with torch.device("meta"):
        shell = Transformer(config)
    shell.embed, shell.norm, shell.lm_head = model.embed, model.norm, model.lm_head
    shell.layers = nn.ModuleList(layers)
    shell.inv_freq = model.inv_freq
    shell.rope_scale = model.rope_scale
    return shell.eval()


def early_exit_draft(model: Transformer, n_layers: int) -> ModelDraft:
    """The first ``n_layers`` layers of ``model``, then its final norm and LM head.

    A draft step costs about (n_layers / L) of the layers' bytes plus the whole LM head, and
    needs no extra memory. Without training for it (LayerSkip does), early layers predict the
    final token less often, so acceptance grows with ``n_layers``.
    """
    total = model.config.n_layers
    whole = isinstance(n_layers, int) and not isinstance(n_layers, bool)
    if not whole or not 1 <= n_layers <= total:
        raise ValueError(
            f"n_layers must be between 1 and the model's {total} layers, got {n_layers!r}."
        )
    return ModelDraft(
        model_with_layers(model, model.layers[:n_layers]), name=f"early exit {n_layers}"
    )


def sparse_draft(model: Transformer, calibration_tokens: Tensor, sparsity: float) -> ModelDraft:
    """``model`` with chapter 07's sparse MLPs: per-layer thresholds skip ``sparsity`` of neurons.

    Thresholds are calibrated on ``calibration_tokens`` [batch, seq] (``calibrate_thresholds``);
    attention, norms, embedding and LM head are shared with ``model``.
    """
    thresholds = calibrate_thresholds(model, calibration_tokens, sparsity)
    mlps = sparse_mlps(model, thresholds)
    layers = []
    for layer, mlp in zip(model.layers, mlps, strict=True):
        with torch.device("meta"):
            block = Block(model.config)
        block.attn_norm, block.attn, block.mlp_norm = layer.attn_norm, layer.attn, layer.mlp_norm
        block.mlp = mlp
        layers.append(block)
    return ModelDraft(model_with_layers(model, layers), name=f"sparse {sparsity:.0%}")


def int8_draft(model: Transformer) -> ModelDraft:
    """``model`` with weight-only int8 linear layers, LM head included (``quant.Int8Linear``).

    Round-to-nearest with one scale per output channel (chapter 09): close to lossless, so the
    draft agrees with the target almost always, and it streams a quarter of the linear layers'
    bytes.
    """
    return ModelDraft(quantize_model(model, bits=8, packed=True, progress=False), name="int8")


class PromptLookupDraft(Draft):
    """No model: find the last n tokens earlier in the context and propose what followed them.

    Tries n = ``ngram`` down to ``min_ngram`` and uses the most recent earlier occurrence with a
    continuation. When nothing matches it proposes nothing and the target decodes one token as
    usual. Free to run, and strong when the output copies the input (editing, summarising,
    answering from a document, code).
    """

    def __init__(self, ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        check_count(ngram, "ngram", fix="e.g. 3")
        check_count(min_ngram, "min_ngram", fix="e.g. 1")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(
                f"Need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}; "
                "try ngram=3, min_ngram=1."
            )
        self.ngram, self.min_ngram = ngram, min_ngram
        self.name = f"prompt lookup ({ngram}-gram)"

    def lookup(self, ids: Sequence[int], gamma: int) -> list[int]:
        """The up to ``gamma`` tokens after the latest earlier match of ids' last n-gram."""
        for n in range(min(self.ngram, len(ids) - 1), self.min_ngram - 1, -1):
            pattern = list(ids[-n:])
            for start in range(len(ids) - n - 1, -1, -1):  # latest first, excluding the suffix
                if list(ids[start : start + n]) == pattern:
                    return list(ids[start + n : start + n + gamma])
        return []

    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        self.calls += 1
        return self.lookup(ids, gamma), None


def prompt_lookup_draft(ngram: int = 3, min_ngram: int = 1) -> PromptLookupDraft:
    """A ``PromptLookupDraft`` matching n-grams of length ``ngram`` down to ``min_ngram``."""
    return PromptLookupDraft(ngram, min_ngram)


def as_draft(draft: Draft | Transformer) -> Draft:
    """A ``Draft`` from a draft or a plain ``Transformer`` (wrapped in ``ModelDraft``)."""
    if isinstance(draft, Draft):
        return draft
    if isinstance(draft, Transformer):
        return ModelDraft(draft)
    raise TypeError(
        f"draft must be a minisparse Transformer or a Draft (e.g. prompt_lookup_draft()), "
        f"got {type(draft).__name__}."
    )


def check_compatible(target: Transformer, tokenizer: Any, draft: Draft) -> None:
    """A draft must speak the target's vocabulary: same size, and the same tokenizer if known."""
    vocab = target.config.vocab_size
    if draft.vocab_size is not None and draft.vocab_size != vocab:
        raise ValueError(
            f"The draft's vocabulary has {draft.vocab_size} tokens, the target's {vocab}; "
            "use a draft from the same model family (same tokenizer), or prompt_lookup_draft()."
        )
    if draft.tokenizer is not None and tokenizer is not None:
        if draft.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "The draft's tokenizer differs from the target's, so their token ids mean "
                "different things; use a draft that shares the target's tokenizer."
            )


@torch.inference_mode()
def teacher_forced_alpha(
    target: Transformer, draft_model: Transformer, tokens: Tensor, sampling: Sampling | None = None
) -> float:
    """Predicted acceptance α of a model draft on ``tokens`` [batch, seq], from one pass each.

    Greedy (default): the share of positions where the draft's argmax equals the target's.
    Sampling: the mean of β = Σ min(p, q) over positions. Both see the same text rather than
    the draft's own proposals, which is what verification sees after every accepted token.
    """
    sampling = sampling or Sampling()
    p_logits, q_logits = target(tokens), draft_model(tokens)
    if sampling.greedy:
        return float((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean())
    beta = acceptance_probability(sampling.probs(p_logits), sampling.probs(q_logits))
    return float(beta.mean())


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


def check_gamma(gamma: int) -> int:
    """gamma, the draft tokens per target pass: a whole number >= 1."""
    return check_count(gamma, "gamma", fix="draft tokens per target pass, e.g. 4")


@torch.inference_mode()
def speculative_generate(
    target: Transformer,
    tokenizer: Any,
    prompt: Prompt,
    draft: Draft | Transformer,
    gamma: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> tuple[list[int], SpeculativeStats]:
    """Generate like ``generate(target, ...)`` with a draft proposing ``gamma`` tokens per pass.

    Greedy (temperature 0) returns the target's greedy tokens; sampling returns tokens with the
    target's distribution (not the same tokens as ``generate`` for a seed: the random numbers
    are used differently). Stops after an end-of-sequence token (included) or
    ``max_new_tokens``. Returns (new token ids, ``SpeculativeStats``). Sampling without
    ``seed`` draws from torch's global generator. Every argument is checked before any work.
    """
    start_time = time.perf_counter()
    check_gamma(gamma)
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
    stops = stop_ids(target, tokenizer)
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
    stats.target_seconds += time.perf_counter() - t0
    out: list[int] = []
    while len(out) < max_new_tokens:
        # The target adds one token of its own per pass, so propose at most what still fits.
        k = min(gamma, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        proposal, q = draft.propose(ids, k, sampling, generator) if k > 0 else ([], None)
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
        new = [*proposal[:n_ok], token]
        for i, t in enumerate(new):  # cut after an end-of-sequence token
            if t in stops:
                new = new[: i + 1]
                break
        out += new
        ids = ids + new
        if out[-1] in stops:
            break
    stats.draft_calls = draft.calls
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start_time
    return out, stats


# --------------------------------------------------------------------------------------------
# Theory
# --------------------------------------------------------------------------------------------


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """E[tokens per target pass] = (1 − α^(γ+1)) / (1 − α) (= γ + 1 when α = 1).

    Each pass emits the accepted prefix plus one target token; the prefix has length j < γ with
    probability α^j (1 − α) and length γ with probability α^γ, so the expectation is
    Σ_{j=0..γ} α^j.
    """
    check_gamma(gamma)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is a probability, got {alpha}.")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(
    alpha: float, gamma: int, cost_ratio: float, verify_cost: float = 1.0
) -> float:
    """Speedup over plain decoding: E[tokens per pass] / (γ c + v).

    ``cost_ratio`` c: one draft step in units of one target decode step; ``verify_cost`` v: one
    target pass over γ + 1 tokens in the same units (1 on an ideal memory-bound device, where
    the formula is Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γ c + 1))).
    """
    if not 0 <= cost_ratio < math.inf or not 0 < verify_cost < math.inf:  # NaN fails too
        raise ValueError(
            f"cost_ratio must be >= 0 and verify_cost > 0, got {cost_ratio} and {verify_cost}."
        )
    return expected_tokens_per_call(alpha, gamma) / (gamma * cost_ratio + verify_cost)


def best_gamma(
    alpha: float,
    cost_ratio: float,
    verify_cost: Callable[[int], float] | None = None,
    max_gamma: int = 16,
) -> int:
    """The γ in 1..max_gamma with the largest ``expected_speedup`` (``verify_cost(γ)`` or 1)."""
    check_gamma(max_gamma)
    return max(
        range(1, max_gamma + 1),
        key=lambda g: expected_speedup(
            alpha, g, cost_ratio, 1.0 if verify_cost is None else verify_cost(g)
        ),
    )


__all__ = [
    "Draft",
    "ModelDraft",
    "PromptLookupDraft",
    "Sampling",
    "SpeculativeStats",
    "acceptance_probability",
    "best_gamma",
    "early_exit_draft",
    "emitted_distribution",
    "expected_speedup",
    "expected_tokens_per_call",
    "int8_draft",
    "model_with_layers",
    "prompt_lookup_draft",
    "residual_distribution",
    "sparse_draft",
    "speculative_generate",
    "teacher_forced_alpha",
    "verify_greedy",
    "verify_sampled",
]
