"""The router: per token, which experts to compute.

After the grouping (``grouping``), layer l's n neurons lie in E experts of m neurons. A token
should compute the experts that hold its active neurons. The router reads the MLP's input x [d]
and scores the experts; the k highest scores are computed, the others skipped:

    z = V (U x) + b  in R^E,        chosen(x) = top-k of z,        U: [r, d], V: [E, r]

a chapter-06 ``Predictor`` with E units. At rank r = E (the default) it is a full linear map
d -> E, r (d + E) + E parameters, 19.5 k for d = 576 and E = 32 (a rank-8 neuron predictor over
n = 1536 neurons has 18.4 k).

**Target.** Expert e's score on token t is the share of its neurons that are active,

    s_te = (1/m) sum_{j in expert e} A_tj        in [0, 1],

and the router is fitted to it with the binary cross-entropy on soft labels (``lowrank.fit``,
pos_weight 1):

    loss = -mean_{t,e} [ s_te log sigmoid(z_te) + (1 - s_te) log(1 - sigmoid(z_te)) ],

minimised at sigmoid(z_te) = E[s_te | x_t]: ranking the experts by z ranks them by the expected
number of active neurons they hold, which is what a top-k choice needs. (MoEfication also scores
an expert by what its neurons contribute; the share of active neurons is that score for the
activity rule the rest of the course uses.) The *oracle* router takes the top k of s itself.

**Masks.** The experts chosen [tokens, E] give the neuron mask keep[t, j] = chosen[t, e(j)]
(``expert_mask``); the MoE MLP equals the dense MLP with the other neurons zeroed.

Reference: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022).
"""

from __future__ import annotations

from torch import Tensor

from ..core.checks import check_count
from ..predictors.lowrank import Predictor, fit, init_random
from ..sparsity.contextual import top_k_mask

__all__ = [
    "check_top_k",
    "expert_mask",
    "expert_scores",
    "oracle_experts",
    "route",
    "train_router",
]


def check_top_k(top_k: int, n_experts: int) -> int:
    """``top_k`` if 1 <= top_k <= n_experts, else a ValueError naming the range."""
    top_k = check_count(top_k, "top_k", fix=f"route each token to 1 to {n_experts} experts")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be between 1 and n_experts={n_experts}, got {top_k}.")
    return top_k


def expert_scores(active: Tensor, experts: Tensor) -> Tensor:
    """s [tokens, E]: the share of each expert's neurons active on each token (``active`` bool
    [tokens, n], ``experts`` [E, m])."""
    return active[:, experts].float().mean(-1)


def expert_mask(chosen: Tensor, experts: Tensor) -> Tensor:
    """The neuron mask [tokens, n] of the chosen experts ``chosen`` bool [tokens, E]."""
    n_experts, size = experts.shape
    if chosen.shape[-1] != n_experts:
        raise ValueError(f"chosen has {chosen.shape[-1]} experts per token, experts {n_experts}.")
    keep = chosen.new_zeros(chosen.shape[0], n_experts * size)
    keep[:, experts.flatten().to(chosen.device)] = chosen.repeat_interleave(size, dim=1)
    return keep


def oracle_experts(active: Tensor, experts: Tensor, top_k: int) -> Tensor:
    """The best k experts per token [tokens, E] (bool): those with the most active neurons."""
    return top_k_mask(expert_scores(active, experts), check_top_k(top_k, experts.shape[0]))


def train_router(
    x: Tensor,
    active: Tensor,
    experts: Tensor,
    rank: int | None = None,
    epochs: int = 8,
    batch_size: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
) -> Predictor:
    """A router fitted on MLP inputs ``x`` [tokens, d] to the experts' active shares.

    ``rank``: the bottleneck r (default E, a full linear map). Seeded start, ``epochs`` of
    soft-label BCE with Adam (``lowrank.fit``).
    """
    n_experts = experts.shape[0]
    if x.shape[0] != active.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens, active {active.shape[0]}; pass the same.")
    router = init_random(Predictor(x.shape[1], rank or n_experts, n_experts), seed).to(x.device)
    target = expert_scores(active, experts.to(active.device))
    return fit(router, x.float(), target, epochs, batch_size, lr, pos_weight=1.0, seed=seed)


def route(router: Predictor, x: Tensor, top_k: int) -> Tensor:
    """The experts chosen per token [tokens, E] (bool): the ``top_k`` highest router scores."""
    scores = router(x)
    return top_k_mask(scores, check_top_k(top_k, scores.shape[-1]))
