"""The theory of speculative decoding: tokens per target pass, speedup, the best gamma.

Model the draft as accepted independently at each position with probability α (greedy: the
draft's argmax equals the target's; sampling: β = Σ min(p, q), see ``sampling``).
A target pass over gamma drafts emits the accepted prefix plus one token of the target's own.
The prefix has length j < γ with probability α^j (1 − α) and length γ with probability α^γ, so

    E[tokens per pass] = Σ_{j=0..γ} α^j = (1 − α^(γ+1)) / (1 − α)      (= γ + 1 when α = 1).

If a draft step costs c target decode steps and a target pass over γ + 1 tokens costs v(γ)
(v = 1 on an ideal memory-bound accelerator, where reading the weights once dominates), one
round costs γ c + v(γ) and

    speedup = (1 − α^(γ+1)) / ((1 − α)(γ c + v(γ))).

More drafts help only while the extra expected tokens outweigh their cost: ``best_gamma``
searches γ for a known α, and ``choose_gamma`` also allows γ = 0 (do not draft) when no γ
beats plain decoding, which is what an adaptive loop asks before every pass with the α it
has seen so far (``speculative.loop.AdaptiveGamma``). The real α is not i.i.d. (easy
stretches accept runs, hard ones reject at once); ``teacher_forced_alpha`` predicts it from
one pass of each model over the same text, which is what verification sees after every
accepted token.

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023), for both formulas; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling" (2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..core.model import Transformer, check_count
from .sampling import Sampling, acceptance_probability


def check_gamma(gamma: int) -> int:
    """gamma, the draft tokens per target pass: a whole number >= 1."""
    return check_count(gamma, "gamma", fix="draft tokens per target pass, e.g. 4")


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


def choose_gamma(
    alpha: float,
    cost_ratio: float,
    verify_cost: Callable[[int], float],
    max_gamma: int,
) -> int:
    """The number of drafts k in 0..max_gamma with the most expected tokens per unit of time.

    k = 0 is plain decoding: one token for one step (speedup 1). Any k >= 1 is worth it only
    when ``expected_speedup(α, k, c, v(k))`` beats 1, so a draft whose acceptance has fallen
    low, or a CPU whose passes cost much more than a step, drafts nothing and loses nothing.
    ``verify_cost(k)``: a target pass over k + 1 tokens in single-step units.
    """
    check_gamma(max_gamma)
    best, best_speed = 0, 1.0
    for k in range(1, max_gamma + 1):
        speed = expected_speedup(alpha, k, cost_ratio, verify_cost(k))
        if speed > best_speed:
            best, best_speed = k, speed
    return best


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


__all__ = [
    "best_gamma",
    "check_gamma",
    "choose_gamma",
    "expected_speedup",
    "expected_tokens_per_call",
    "teacher_forced_alpha",
]
