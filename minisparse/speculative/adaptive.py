"""An adaptive draft length: before every pass, the γ that the acceptance seen so far pays for.

A fixed γ suits one acceptance rate. Prompt lookup on a prompt that asks for a copy of its input
accepts long runs, and γ = 6 pays; on an open question the same draft is mostly wrong, every
rejected draft token still costs its share of the verification pass, and γ = 4 there is slower
than not speculating at all. The theory (``theory``) says which γ is best for a given α, draft
cost c and verification cost v(γ); ``AdaptiveGamma`` applies it online:

    a ← λ a + accepted,   n ← λ n + judged          (after every pass)
    α̂ = (a + α₀ m) / (n + m)                         (a Beta(α₀ m, (1 − α₀) m) prior)
    γ = choose_gamma(α̂, c, v, γ_max) ∈ {0, .., γ_max}

λ < 1 forgets old passes, so the estimate follows the text (a quoted block, then free prose);
it looks back over about 1 / (1 − λ) judged drafts, and the prior's weight m must be small
beside that, or a draft that is always wrong keeps α̂ ≥ α₀ m (1 − λ) / (1 + m (1 − λ)) and is
never switched off (the defaults, α₀ = 0.8, λ = 0.95 and m = 1, give a floor of 0.038).
The prior is optimistic on purpose: a draft that costs something (c > 0) is only judged when
it drafts, so a prior under which no γ pays would never try it at all; with α₀ = 0.8 it drafts
first, is switched off within a few passes when it is mostly wrong, and is tried again once its
estimate has drifted back up.
γ = 0 means plain decoding: then nothing is judged and the estimate relaxes towards the prior
α₀ at the same rate, so a draft that was switched off is tried again after a while. A draft
that costs nothing (prompt lookup, c = 0) is also judged on the plain steps: its would-be
first token is compared with the target's (``observe``), so it is switched back on as soon as
the text starts to repeat, without paying for a pass.

v(k) is the cost of a target pass over k + 1 tokens in single-step units; measure it on the
machine (``minisparse.bench.speculative.step_costs``) and pass it as ``verify_cost``. Without
it, v(k) = 1 + ``DEFAULT_SLOPE`` k, a conservative line through what the compiled decode step
of SmolLM2 costs on a 2-core CPU with register-tiled passes.

The tokens are the same for every γ under greedy verification; only the speed changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .theory import check_gamma, choose_gamma

__all__ = ["DEFAULT_SLOPE", "AdaptiveGamma", "linear_verify_cost"]

DEFAULT_SLOPE = 0.05  # extra single steps per extra token in a pass (see the module docstring)


def linear_verify_cost(slope: float = DEFAULT_SLOPE) -> Callable[[int], float]:
    """v(k) = 1 + slope k: a pass over k + 1 tokens, in single-token steps."""
    if not 0.0 <= slope < float("inf"):
        raise ValueError(f"slope must be a finite number >= 0, got {slope}.")
    return lambda k: 1.0 + slope * k


@dataclass
class AdaptiveGamma:
    """Chooses the drafts per pass from the acceptance seen so far (module docstring).

    ``max_gamma``: the most drafts in one pass (7 keeps a pass within the compiled decoder's 8
    tokens); ``cost_ratio`` c: one draft step in target steps (0 for prompt lookup);
    ``verify_cost``: v(k) as a function or a mapping {k: v}; ``prior_alpha`` α₀ and
    ``prior_weight`` m: the estimate before any pass; ``memory`` λ in (0, 1].
    """

    max_gamma: int = 7
    cost_ratio: float = 0.0
    verify_cost: Callable[[int], float] | Mapping[int, float] | None = None
    prior_alpha: float = 0.8
    prior_weight: float = 1.0
    memory: float = 0.95
    accepted: float = field(default=0.0, init=False)
    judged: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        check_gamma(self.max_gamma)
        if not 0.0 <= self.cost_ratio < float("inf"):
            raise ValueError(f"cost_ratio must be a finite number >= 0, got {self.cost_ratio}.")
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha is a probability, got {self.prior_alpha}.")
        if not 0.0 < self.prior_weight < float("inf"):
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}.")
        if not 0.0 < self.memory <= 1.0:
            raise ValueError(f"memory must lie in (0, 1], got {self.memory}; e.g. 0.9.")
        if isinstance(self.verify_cost, Mapping):
            missing = [k for k in range(1, self.max_gamma + 1) if k not in self.verify_cost]
            if missing:
                raise ValueError(
                    f"verify_cost has no cost for gamma {missing}; measure every gamma up to "
                    f"max_gamma={self.max_gamma} (bench.speculative.step_costs) or lower it."
                )

    @property
    def free(self) -> bool:
        """True for a draft that costs nothing to run (judged on plain steps too)."""
        return self.cost_ratio == 0.0

    def reset(self) -> None:
        """Forget every pass (a new sequence)."""
        self.accepted = self.judged = 0.0

    @property
    def alpha(self) -> float:
        """α̂ = (a + α₀ m) / (n + m)."""
        m = self.prior_weight
        return (self.accepted + self.prior_alpha * m) / (self.judged + m)

    def cost(self, k: int) -> float:
        """v(k) in single-step units."""
        v = self.verify_cost
        if v is None:
            return linear_verify_cost()(k)
        return float(v[k]) if isinstance(v, Mapping) else float(v(k))

    def next_gamma(self) -> int:
        """The drafts for the next pass: 0 (a plain step) .. max_gamma."""
        return choose_gamma(self.alpha, self.cost_ratio, self.cost, self.max_gamma)

    def update(self, accepted: int, judged: int) -> None:
        """Count a pass (or an observed plain step): ``judged`` drafts ruled on, ``accepted``
        of them taken. A pass without drafts (0, 0) only lets the past fade."""
        if not 0 <= accepted <= judged:
            raise ValueError(f"Need 0 <= accepted <= judged, got {accepted} and {judged}.")
        self.accepted = self.memory * self.accepted + accepted
        self.judged = self.memory * self.judged + judged

    def observe(self, would_be: list[int], token: int) -> None:
        """A plain step of a free draft: its would-be first token against the target's."""
        if would_be:
            self.update(int(would_be[0] == token), 1)
        else:
            self.update(0, 0)
