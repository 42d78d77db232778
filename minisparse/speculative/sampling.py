"""Speculative sampling: the accept/reject rule that keeps the target's distribution exactly.

A draft proposes a token d drawn from its distribution q; the target's distribution at the same
position is p. The rule of Leviathan et al. (2023) and Chen et al. (2023):

* accept d with probability min(1, p(d) / q(d));
* on rejection, draw a replacement from the **residual**

      r = max(0, p − q) / Σ max(0, p − q),

  the part of p that q under-covers.

The emitted token then has exactly the target's law. With β = Σ_x min(p(x), q(x)) = 1 − TV(p, q)
the probability that a draft is accepted,

    P(x) = q(x) min(1, p(x)/q(x)) + (1 − β) r(x)
         = min(p, q)(x) + max(0, p − q)(x)
         = p(x),

because Σ max(0, p − q) = 1 − Σ min(p, q) = 1 − β. So a draft can only change how *fast*
tokens come, never *which* tokens come (in distribution). A deterministic draft (greedy, or
prompt lookup) is the special case q = a point mass on its proposal: accept with probability
p(d), else draw from p with d removed and renormalised.

This module holds the pieces of that rule as small functions; ``speculative.verify_sampled``
applies them left to right over a block of draft tokens. ``Sampling`` carries the temperature,
top-k and top-p that turn logits into p and q (``generate.logits_to_probs``).

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023). Both prove the rule exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.sampling import check_sampling, logits_to_probs


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


def point_mass(token: int, like: Tensor) -> Tensor:
    """The distribution of a deterministic proposal: 1 at ``token``, 0 elsewhere."""
    return F.one_hot(torch.tensor(token, device=like.device), like.shape[-1]).to(like.dtype)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """r = max(0, p − q) / Σ max(0, p − q): where the target wants more mass than the draft."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    # Σ max(0, p − q) = 1 − β, zero only when p == q; then no token can be rejected.
    return r / total if total > 0 else p


def sample_with(probs: Tensor, u: Tensor | float) -> int:
    """The token that the uniform number ``u`` in [0, 1) picks from ``probs`` [vocab] (inverse
    CDF): the smallest x with Σ_{y <= x} probs(y) > u · Σ probs. The same ``u``, the same token;
    a token of probability 0 is never picked."""
    cdf = probs.cumsum(-1)
    target = torch.as_tensor(u, dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, target[None], right=True)), probs.shape[-1] - 1)


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


__all__ = [
    "Sampling",
    "acceptance_probability",
    "emitted_distribution",
    "point_mass",
    "residual_distribution",
    "sample_with",
]
