"""The MoE MLP: a dense gated MLP cut into experts, each token computing only k of them.

With the neurons grouped into experts e = 1..E of m neurons (``grouping``), the gated MLP

    y = sum_j act(W_gate[j] . x) (W_up[j] . x) W_down[:, j]

splits into a sum of expert MLPs, y = sum_e y_e(x), with y_e the same formula over expert e's
neurons only: W_gate[e], W_up[e] [m, d] and W_down[:, e] [d, m]. MoEfication computes only the
experts its router picks, C(x) = top-k of the router's scores (``routing``):

    y(x) = sum_{e in C(x)} act(W_gate[e] x) * (W_up[e] x) @ W_down[:, e]^T

which is exactly the dense MLP with the neurons outside C(x)'s experts set to zero (the test of
this module). With k = E it is the dense MLP.

``MoEMLP`` stores each expert's rows contiguously ([E, m, d] for gate, up and the transposed
down projection) and, for a batch of tokens, runs one small dense MLP per expert over the
tokens that chose it: a token reads k m (3 d) weights instead of n (3 d), plus its router's
r (d + E) + E. For a single token (decoding) that is the share k / E of the MLP's bytes.

Reference: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.model import MLP
from ..predictors.lowrank import Predictor
from ..sparse.mlp import check_maskable_mlp
from .grouping import check_experts
from .routing import check_top_k, route

__all__ = ["MoEMLP"]


class MoEMLP(nn.Module):
    """A gated MLP as E experts of m neurons; each token computes its router's top ``top_k``.

    Built from a dense ``MLP`` (bias-free, nothing at the down projection's input), the expert
    lists ``experts`` [E, m] (a partition of its neurons) and a ``router`` (a ``Predictor`` with
    E units). The weights are copied, grouped by expert; the dense MLP is left unchanged.
    ``last_chosen``: the experts [tokens, E] the last call computed (for tests and reports).
    """

    def __init__(self, mlp: MLP, experts: Tensor, router: Predictor, top_k: int) -> None:
        super().__init__()
        check_maskable_mlp(mlp, "MoEMLP")
        n_neurons = mlp.gate_proj.weight.shape[0]
        experts = check_experts(experts.cpu(), n_neurons)
        if router.up.out_features != experts.shape[0]:
            raise ValueError(
                f"The router scores {router.up.out_features} experts, the grouping has "
                f"{experts.shape[0]}; train the router on these experts (train_router)."
            )
        self.top_k = check_top_k(top_k, experts.shape[0])
        device = mlp.gate_proj.weight.device
        with torch.no_grad():
            idx = experts.to(device)
            self.register_buffer("gate", mlp.gate_proj.weight[idx].clone())  # [E, m, d]
            self.register_buffer("up", mlp.up_proj.weight[idx].clone())  # [E, m, d]
            self.register_buffer("down_t", mlp.down_proj.weight.T[idx].clone())  # [E, m, d]
        self.register_buffer("experts", experts.to(device))
        self.act = mlp.act
        self.router = router.to(device)
        self.last_chosen: Tensor | None = None

    @property
    def n_experts(self) -> int:
        return self.experts.shape[0]

    def bytes_per_token(self) -> int:
        """Weight bytes one token reads: its k experts' rows of the three matrices + the router."""
        expert = 3 * self.gate[0].numel() * self.gate.element_size()
        router = sum(p.numel() * p.element_size() for p in self.router.parameters())
        return self.top_k * expert + router

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight = self.router.up.weight
        chosen = route(self.router, flat.to(weight.dtype), self.top_k)  # [tokens, E]
        y = torch.zeros_like(flat)
        for e in chosen.any(0).nonzero().flatten().tolist():
            rows = chosen[:, e].nonzero().flatten()
            xe = flat[rows]
            h = self.act(xe @ self.gate[e].T) * (xe @ self.up[e].T)  # [tokens_e, m]
            y.index_add_(0, rows, h @ self.down_t[e])
        self.last_chosen = chosen
        return y.reshape(x.shape)
