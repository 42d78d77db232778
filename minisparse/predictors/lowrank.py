"""One layer's sparsity predictor: a small network that guesses the active units from x.

A sparse MLP only saves work if it knows *before* computing which neurons will matter. DejaVu
(Liu et al. 2023) and PowerInfer (Song et al. 2023) give every layer a small network that reads
the layer's input x [d] and outputs one logit per unit (n neurons, or heads):

    low-rank (DejaVu):   z = V (U x) + b            U: [r, d], V: [n, r]
    MLP (PowerInfer):    z = V ReLU(U x + c) + b

Unit j is predicted active when z_j exceeds a cutoff (0 means sigmoid(z_j) > 1/2). A rank-r
predictor costs r (d + n) + n parameters (+ r for the MLP kind's hidden bias) against 3 d n for
the gated MLP it serves, so r << d keeps it cheap.

**Compressed-gate start.** With g = W_gate x on recorded tokens and B_r the top-r eigenvectors
of C = E[g g^T], U = B_r^T W_gate and V = B_r give z = B_r B_r^T g, the best rank-r
approximation of g in mean square. For a ReLU model neuron j is active exactly when g_j > 0, so
this start is already a predictor, with no training.

**Fitting.** Otherwise (or then) minimise a weighted binary cross-entropy over the recorded
sets y:

    loss = -mean_j [ w y_j log sigmoid(z_j) + (1 - y_j) log(1 - sigmoid(z_j)) ]

with w > 1: a missed active neuron changes the output, a false alarm only costs compute.

**Cutoff.** To find a share ``recall`` of the active units, the cutoff is the
(1 - recall)-quantile of the truly active units' logits on held-out tokens.

**Scores.** recall = TP / (TP + FN), precision = TP / (TP + FP), predicted sparsity = share of
units predicted inactive.

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..sparsity.contextual import top_k_mask

__all__ = [
    "KINDS",
    "Predictor",
    "Scores",
    "calibrate_cutoff",
    "confusion",
    "fit",
    "init_compressed_gate",
    "init_random",
    "predict_heads",
    "predict_neurons",
    "principal_directions",
    "recall_cutoff",
]

KINDS = ("lowrank", "mlp")


class Predictor(nn.Module):
    """One layer's predictor: x [..., d] -> logits [..., n] through a rank-r bottleneck.

    A unit is predicted active when its logit exceeds ``cutoff`` (0, i.e. sigmoid > 1/2, until
    ``calibrate_cutoff`` moves it to reach a recall target).
    """

    def __init__(self, dim: int, rank: int, units: int, kind: str = "lowrank") -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"Unknown predictor kind {kind!r}; use one of {KINDS}.")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}.")
        self.kind, self.rank = kind, rank
        self.down = nn.Linear(dim, rank, bias=kind == "mlp")
        self.up = nn.Linear(rank, units)
        self.register_buffer("cutoff", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        z = self.down(x)
        return self.up(torch.relu(z) if self.kind == "mlp" else z)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_random(predictor: Predictor, seed: int) -> Predictor:
    """Seeded default initialisation (Kaiming-uniform weights, zero biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in predictor.parameters():
            if p.dim() == 2:
                nn.init.kaiming_uniform_(p, a=5**0.5, generator=gen)
            else:
                p.zero_()
    return predictor


def principal_directions(gate_weight: Tensor, x: Tensor) -> Tensor:
    """Eigenvectors of the gate pre-activations' second moment, largest first: [n, n].

    With g = W_gate x over the recorded tokens, C = E[g g^T]; its top-r eigenvectors B_r
    span the r-dimensional subspace that keeps most of g's energy.
    """
    g = x.float() @ gate_weight.float().T
    _, vectors = torch.linalg.eigh(g.T @ g / g.shape[0])
    return vectors.flip(-1)


@torch.no_grad()
def init_compressed_gate(
    predictor: Predictor, gate_weight: Tensor, directions: Tensor
) -> Predictor:
    """Start a low-rank predictor as the gate compressed to rank r on the data.

    With B = the top-r principal directions of g = W_gate x, z = B B^T W_gate x is the best
    rank-r approximation of g in mean square: U = B^T W_gate [r, d], V = B [n, r]. For a
    ReLU model, neuron j is active exactly when g_j > 0, so z_j > 0 is already a predictor.
    """
    if predictor.kind != "lowrank":
        raise ValueError("The compressed-gate start needs a low-rank (linear) predictor.")
    if predictor.rank > directions.shape[1]:
        raise ValueError(
            f"rank {predictor.rank} exceeds the {directions.shape[1]} principal directions; "
            "use a rank at most min(dim, units)."
        )
    b = directions[:, : predictor.rank]
    predictor.down.weight.copy_(b.T @ gate_weight.float())
    predictor.up.weight.copy_(b)
    predictor.up.bias.zero_()
    return predictor


def fit(
    predictor: Predictor,
    x: Tensor,
    y: Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    pos_weight: float,
    seed: int,
) -> Predictor:
    """Train on inputs x [tokens, d] and boolean sets y [tokens, n]: weighted BCE with Adam.

    Starts from the predictor's current weights; a one-cycle learning-rate schedule.
    """
    if epochs > 0:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(predictor.parameters(), lr=lr)
        steps = epochs * ((x.shape[0] + batch_size - 1) // batch_size)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
        weight = torch.tensor(pos_weight, device=x.device)
        with torch.enable_grad():
            predictor.requires_grad_(True).train()
            for _ in range(epochs):
                for idx in torch.randperm(x.shape[0], generator=gen).split(batch_size):
                    logits = predictor(x[idx])
                    loss = F.binary_cross_entropy_with_logits(
                        logits, y[idx].float(), pos_weight=weight
                    )
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
    return predictor.eval().requires_grad_(False)


def recall_cutoff(logits: Tensor, active: Tensor, recall: float) -> float:
    """The highest cutoff c with a share ``recall`` of the active units' logits above it.

    Units pass when logit > c. Of the N active units, k = int((1 - recall) N) may be missed:
    c is the k-th smallest of their logits, or just below the smallest (min - 1e-6) when
    k = 0 (every active unit must pass); inf when no unit is active (predict nothing).
    """
    positives = logits[active].float()
    if positives.numel() == 0:
        return float("inf")
    k = int((1 - recall) * positives.numel()) if recall < 1.0 else 0
    if k == 0:
        return float(positives.min()) - 1e-6
    return float(positives.kthvalue(k).values)


@torch.no_grad()
def calibrate_cutoff(
    predictor: Predictor,
    x: Tensor,
    active: Tensor,
    recall: float,
    rule: Callable[[Tensor, Tensor, float], float] = recall_cutoff,
) -> Predictor:
    """Set the logit cutoff so that a share ``recall`` of the active units in (x, active) pass.

    The cutoff is the (1 - recall)-quantile of the logits of the truly active units
    (``rule``, by default ``recall_cutoff``): a lower cutoff finds more of them and also lets
    more inactive units through (lower precision).
    """
    predictor.cutoff.fill_(float(rule(predictor(x), active, recall)))
    return predictor


@torch.no_grad()
def predict_neurons(predictor: Predictor, x: Tensor) -> Tensor:
    """Predicted active neurons: logit > the predictor's cutoff."""
    return predictor(x) > predictor.cutoff


@torch.no_grad()
def predict_heads(predictor: Predictor, x: Tensor, keep: int) -> Tensor:
    """Predicted heads: the ``keep`` largest logits per token."""
    return top_k_mask(predictor(x), keep)


@dataclass
class Scores:
    """Recall, precision and predicted sparsity of predicted sets against the true ones."""

    recall: float
    precision: float
    predicted_sparsity: float
    true_sparsity: float


def confusion(predicted: Tensor, actual: Tensor) -> Scores:
    """Scores of boolean ``predicted`` vs ``actual`` sets of the same shape (counted over all)."""
    if predicted.shape != actual.shape:
        raise ValueError(f"Shapes differ: predicted {predicted.shape}, actual {actual.shape}.")
    tp = int((predicted & actual).sum())
    n_pred, n_true = int(predicted.sum()), int(actual.sum())
    return Scores(
        recall=tp / n_true if n_true else 1.0,
        precision=tp / n_pred if n_pred else 1.0,
        predicted_sparsity=1 - n_pred / predicted.numel(),
        true_sparsity=1 - n_true / actual.numel(),
    )
