"""Sizing a predictor: the smallest rank that reaches a recall target and still skips enough.

Every predictor can reach a recall target: its cutoff is lowered until a share
``target_recall`` of the active neurons passes (``calibrate_cutoff``). What a larger rank r buys
is *precision*: fewer inactive neurons pass, so more are skipped. A rank-r predictor costs
r (d + n) + n parameters, so the rank should be as small as the layer allows.

PowerInfer (Song et al. 2023) sizes each layer's predictor by its sparsity: a layer with few
active neurons has fewer to find. Here, per layer:

1. start on a ladder of ranks at the one nearest, in log, to density * d / 2;
2. build a predictor of that rank (compressed-gate start or random, then BCE epochs), set its
   cutoff on held-out tokens and score it there;
3. call the rank *enough* when its predicted sparsity reaches ``min_efficiency`` times the true
   sparsity; walk down the ladder while enough, up while not; keep the smallest enough rank.

``PredictorConfig`` holds every choice (kind, recall target, ladder, start, training), and the
two functions the pipeline runs for every predictor: the training loop (``train_loop``, by
default ``lowrank.fit``) and the cutoff rule (``cutoff_rule``, by default
``lowrank.recall_cutoff``), so that another loop or rule can be put in their place.

References: Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023); Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from torch import Tensor

from ..sparsity import check_sparsity
from .lowrank import (
    KINDS,
    Predictor,
    Scores,
    calibrate_cutoff,
    confusion,
    fit,
    init_compressed_gate,
    init_random,
    predict_neurons,
    principal_directions,
    recall_cutoff,
)

__all__ = [
    "CutoffRule",
    "PredictorConfig",
    "TrainLoop",
    "build_predictor",
    "initial_rank",
    "size_layer",
]

#: (predictor, x, y, epochs, batch_size, lr, pos_weight, seed) -> the trained predictor
TrainLoop = Callable[[Predictor, Tensor, Tensor, int, int, float, float, int], Predictor]
#: (logits, active, recall) -> the cutoff
CutoffRule = Callable[[Tensor, Tensor, float], float]


@dataclass
class PredictorConfig:
    """How predictors are built, trained and sized."""

    kind: str = "lowrank"  # lowrank (DejaVu) or mlp (PowerInfer)
    target_recall: float = 0.95  # each layer's cutoff is set to reach it on held-out tokens
    ranks: tuple[int, ...] = (16, 32, 64, 128, 256)  # the ladder adaptive sizing walks
    start_rank: int | None = None  # None: set by the layer's density (``initial_rank``)
    min_efficiency: float = 0.75  # predicted sparsity / true sparsity a size must reach
    init: str = "gate"  # lowrank only: "gate" (compressed gate) or "random"
    epochs: int | None = None  # weighted-BCE epochs after the start; None: 0 after "gate", else 4
    pos_weight: float = 2.0  # weight of an active neuron in the BCE
    batch_size: int = 256
    lr: float = 3e-3
    seed: int = 0
    lookahead: bool = False
    head_sparsity: float = 0.0  # > 0: also train head predictors keeping 1 - s of the heads
    head_rank: int = 32
    head_epochs: int = 4
    train_loop: TrainLoop = fit  # how every predictor is trained (neurons and heads)
    cutoff_rule: CutoffRule = recall_cutoff  # how every neuron predictor's cutoff is set

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Unknown predictor kind {self.kind!r}; use one of {KINDS}.")
        if not 0.0 < self.target_recall <= 1.0:
            raise ValueError(f"target_recall must be in (0, 1], got {self.target_recall}.")
        if not self.ranks or list(self.ranks) != sorted(set(self.ranks)) or self.ranks[0] < 1:
            raise ValueError(f"ranks must be increasing positive integers, got {self.ranks}.")
        if self.start_rank is not None and self.start_rank not in self.ranks:
            raise ValueError(f"start_rank {self.start_rank} is not on the ladder {self.ranks}.")
        if self.init not in ("gate", "random"):
            raise ValueError(f"init must be 'gate' or 'random', got {self.init!r}.")
        if self.kind == "mlp" and self.init == "gate":
            self.init = "random"  # a ReLU between the factors has no compressed-gate start
        if self.epochs is None:
            self.epochs = 0 if self.init == "gate" else 4
        if self.init == "random" and self.epochs < 1:
            raise ValueError("A randomly initialised predictor needs epochs >= 1.")
        check_sparsity(self.head_sparsity)


def initial_rank(density: float, ranks: Sequence[int], dim: int) -> int:
    """Where the size search starts: the ladder rank nearest (in log) to density * dim / 2.

    A layer with few active neurons has fewer to find (PowerInfer sizes its predictors by the
    layer's sparsity); a denser layer starts larger.
    """
    want = max(density * dim / 2, 1.0)
    return min(ranks, key=lambda r: abs(math.log(r / want)))


def build_predictor(
    rank: int,
    gate_weight: Tensor,
    directions: Tensor | None,
    x: Tensor,
    y: Tensor,
    x_val: Tensor,
    y_val: Tensor,
    config: PredictorConfig,
) -> tuple[Predictor, Scores]:
    """One predictor of a given rank: start, train, set the cutoff on held-out tokens; score."""
    p = Predictor(x.shape[1], rank, y.shape[1], config.kind)
    if config.init == "gate" and directions is not None:
        init_compressed_gate(p, gate_weight, directions)
    else:
        init_random(p, config.seed)  # seeded on the CPU, the same on every device
    p.to(x.device)
    train = config.train_loop
    p = train(p, x, y, config.epochs, config.batch_size, config.lr, config.pos_weight, config.seed)
    p.eval().requires_grad_(False)
    calibrate_cutoff(p, x_val, y_val, config.target_recall, config.cutoff_rule)
    return p, confusion(predict_neurons(p, x_val), y_val)


def size_layer(
    gate_weight: Tensor,
    x: Tensor,
    y: Tensor,
    x_val: Tensor,
    y_val: Tensor,
    config: PredictorConfig,
    directions: Tensor | None = None,
) -> tuple[Predictor, list[dict[str, float]]]:
    """Adaptive size for one layer: the smallest ladder rank that is efficient enough.

    Every predictor meets the recall target by its cutoff; what a larger one buys is
    precision, i.e. predicted sparsity. A rank is *enough* when its predicted sparsity
    reaches ``min_efficiency`` times the layer's true sparsity on the held-out tokens. Walk
    down the ladder from the start while enough, up while not; keep the smallest enough rank
    (or the largest tried); ranks above min(d, n) are left out. Returns the predictor and every
    size tried with its held-out scores.
    ``directions``: ``principal_directions(gate_weight, x)`` when already computed.
    """
    largest = min(x.shape[1], y.shape[1])  # a bottleneck wider than d or n buys nothing
    ranks = [r for r in config.ranks if r <= largest] or [largest]
    if directions is None and config.init == "gate":
        directions = principal_directions(gate_weight, x)
    density = float(y.float().mean())
    start = config.start_rank or initial_rank(density, ranks, x.shape[1])
    i = ranks.index(start) if start in ranks else 0
    tried: dict[int, tuple[Predictor, Scores]] = {}

    def enough(rank: int) -> bool:
        tried[rank] = build_predictor(rank, gate_weight, directions, x, y, x_val, y_val, config)
        s = tried[rank][1]
        return s.predicted_sparsity >= config.min_efficiency * s.true_sparsity

    if enough(ranks[i]):
        while i > 0 and enough(ranks[i - 1]):
            i -= 1
    else:
        while i + 1 < len(ranks) and not enough(ranks[i + 1]):
            i += 1
        i = min(i + 1, len(ranks) - 1)
    history = [{"rank": r, **asdict(s)} for r, (_, s) in sorted(tried.items())]
    return tried[ranks[i]][0], history
