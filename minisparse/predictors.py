"""Sparsity predictors: guess each layer's active neurons and heads before computing them.

The oracle of chapter 05 needs the dense activations to know which units matter, which defeats
the purpose. DejaVu (Liu et al. 2023) and PowerInfer (Song et al. 2023) train, per layer, a
small network that reads the layer's input x and outputs one logit per unit:

    low-rank (DejaVu):   z = V (U x) + b            U: [r, d], V: [n, r]
    MLP (PowerInfer):    z = V ReLU(U x + c) + b

Neuron j is predicted active when z_j exceeds a cutoff (0 means sigmoid(z_j) > 1/2). A rank-r
predictor costs r (d + n) + n parameters (+ r for the MLP kind's hidden bias) against 3 d n for
the gated MLP it serves, so r << d keeps it cheap.

**What is predicted.** Neuron j of layer l is *active* on a token when |h_j| > t_l, with
h = act(W_gate x) * (W_up x) the down projection's input. For a ReLU model (chapter 04) t_l = 0:
the active set is exactly the nonzero neurons, and a perfect predictor reproduces the dense
model. For the SiLU model, t_l is chapter 03's calibrated threshold (TEAL on ``down_in``).
A head is active when its output norm is among the top k of its layer (DejaVu's head
predictor); the predicted heads are the top k logits.

**Training** (``train_predictors``): record x and the active sets on training text. A low-rank
predictor can start as the *compressed gate*: with B_r the top-r eigenvectors of E[g g^T],
g = W_gate x, take U = B_r^T W_gate and V = B_r, the best rank-r approximation of g; for a ReLU
model (active iff g_j > 0) this is already a predictor. Otherwise (or then) fit it with a
weighted binary cross-entropy

    loss = -mean_j [ w y_j log sigmoid(z_j) + (1 - y_j) log(1 - sigmoid(z_j)) ]

where w > 1 weighs a missed active neuron more than a false alarm: a miss changes the output,
a false alarm only costs compute. **Recall target**: each layer's cutoff is set on held-out
tokens so that a share ``target_recall`` of the active neurons passes. **Adaptive size**
(PowerInfer): a larger rank then buys precision, i.e. neurons skipped; per layer, walk a ladder
of ranks from a start set by the layer's density and keep the smallest rank whose predicted
sparsity reaches ``min_efficiency`` times the true sparsity. **Look-ahead**: predict layer l's
set from layer l - 1's input, so the predictor can run one layer early, while layer l - 1
computes; the residual stream changes little between layers (chapter 05), at some cost.

**Scores**: recall = TP / (TP + FN) (share of active neurons predicted), precision =
TP / (TP + FP), predicted sparsity = share of neurons predicted inactive.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from .cache import save_tensors_atomic
from .contextual import Tally, drop_heads, keep_count, top_k_mask
from .hooks import capture_inputs
from .model import Transformer
from .sparsity import calibrate_thresholds, check_sparsity, head_norms

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


@torch.no_grad()
def calibrate_cutoff(predictor: Predictor, x: Tensor, active: Tensor, recall: float) -> Predictor:
    """Set the logit cutoff so that a share ``recall`` of the active units in (x, active) pass.

    The cutoff is the (1 - recall)-quantile of the logits of the truly active units: a lower
    cutoff finds more of them and also lets more inactive units through (lower precision).
    """
    positives = predictor(x)[active].float()
    if positives.numel() == 0:  # nothing active: predict nothing
        predictor.cutoff.fill_(float("inf"))
    elif recall >= 1.0:  # every active unit: just below the smallest of their logits
        predictor.cutoff.fill_(float(positives.min()) - 1e-6)
    else:  # units pass when logit > cutoff: drop the k lowest, k <= (1 - recall) * N
        k = int((1 - recall) * positives.numel())
        if k == 0:
            predictor.cutoff.fill_(float(positives.min()) - 1e-6)
        else:
            predictor.cutoff.fill_(float(positives.kthvalue(k).values))
    return predictor


@dataclass
class Target:
    """What the predictors are asked to find: the model and, per layer, the activity threshold.

    Neuron j of layer l is active when |h_j| > ``thresholds[l]`` (all 0 for a ReLU model).
    """

    model: Transformer
    thresholds: list[float]
    description: str


def prediction_target(
    base: Transformer,
    calibration: Tensor,
    sparsity: float = 0.5,
    stage: int = 1,
    site: str = "down_in",
) -> Target:
    """The fine-tuned ReLU model of chapter 04 when the cache has it, else the SiLU model.

    For the SiLU model the active set is |x_j| > t_l at ``site`` with t_l calibrated on
    ``calibration`` at ``sparsity``: chapter 03's TEAL thresholds on the down projection's input
    h (``"down_in"``), or its CATS thresholds on act(W_gate x) (``"mlp_act"``).
    """
    from .relufy import load_relufied, result_dir

    if site not in ("down_in", "mlp_act"):
        raise ValueError(f"site must be 'down_in' or 'mlp_act', got {site!r}.")
    try:
        model, info = load_relufied(base, stage)
    except FileNotFoundError:
        found = calibrate_thresholds(base, calibration, sparsity, (site,), progress=False)
        what = "h" if site == "down_in" else "act(W_gate x)"
        return Target(
            base,
            found[site],
            f"the embedded SiLU model; active = |{what}| above chapter 03's {sparsity:.0%} "
            f"thresholds (no fine-tuned ReLU model in {result_dir(stage, 'mlp').parent})",
        )
    steps = info.get("config", {}).get("steps", "?")
    zeros = info.get("finetuned", {}).get("zeros_mlp_act", float("nan"))
    return Target(
        model,
        [0.0] * len(model.layers),
        f"chapter 04's fine-tuned ReLU model (stage {stage}, {steps} steps, {zeros:.1%} zeros); "
        "active = nonzero",
    )


@dataclass
class LayerRecord:
    """What one layer saw on some tokens: the predictors' inputs and the true sets."""

    mlp_in: Tensor  # [tokens, dim], the MLP's (normed) input
    attn_in: Tensor  # [tokens, dim], the attention's (normed) input
    active: Tensor  # [tokens, ffn] bool, |h| > threshold
    head_norms: Tensor  # [tokens, n_heads], ||o_i||


@torch.inference_mode()
def record_layers(
    model: Transformer,
    windows: Tensor,
    thresholds: Sequence[float],
    batch_size: int = 4,
    progress: bool = False,
) -> list[LayerRecord]:
    """Run the dense model over ``windows`` [n, seq] and keep, per layer, inputs and sets."""
    n_heads = model.config.n_heads
    layers = dict(enumerate(model.layers))

    def per_layer(module: str) -> dict[int, nn.Module]:
        return {i: layer.get_submodule(module) for i, layer in layers.items()}

    def flat(x: Tensor) -> Tensor:
        return x.reshape(-1, x.shape[-1])

    device = next(model.parameters()).device
    with contextlib.ExitStack() as stack:
        mlp_in = stack.enter_context(capture_inputs(per_layer("mlp"), flat))
        attn_in = stack.enter_context(capture_inputs(per_layer("attn"), flat))
        heads = stack.enter_context(
            capture_inputs(per_layer("attn.o_proj"), lambda x: head_norms(x, n_heads))
        )
        active = {  # the down projection's input h, thresholded per layer
            i: stack.enter_context(
                capture_inputs({i: layer.mlp.down_proj}, lambda h, t=t: flat(h.abs() > t))
            )[i]
            for (i, layer), t in zip(layers.items(), thresholds, strict=True)
        }
        for chunk in tqdm(windows.split(batch_size), desc="recording", disable=not progress):
            model(chunk.to(device))
    return [
        LayerRecord(
            torch.cat(mlp_in[i]), torch.cat(attn_in[i]), torch.cat(active[i]), torch.cat(heads[i])
        )
        for i in layers
    ]


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


@torch.no_grad()
def predict_neurons(predictor: Predictor, x: Tensor) -> Tensor:
    """Predicted active neurons: logit > the predictor's cutoff."""
    return predictor(x) > predictor.cutoff


@torch.no_grad()
def predict_heads(predictor: Predictor, x: Tensor, keep: int) -> Tensor:
    """Predicted heads: the ``keep`` largest logits per token."""
    return top_k_mask(predictor(x), keep)


@dataclass
class Predictors:
    """Per-layer neuron predictors (and optional head predictors) with what they were made for.

    ``thresholds[l]``: neuron j of layer l counts as active when |h_j| > thresholds[l].
    ``lookahead``: predictor l reads layer l - 1's MLP input (layer 0 reads its own).
    ``head_keep``: heads kept per layer by the head predictors (0: no head predictors).
    """

    neurons: nn.ModuleList
    thresholds: list[float]
    kind: str
    lookahead: bool = False
    heads: nn.ModuleList | None = None
    head_keep: int = 0
    # per layer, the sizes tried and their validation scores (the cutoffs were set on those tokens)
    history: list[list[dict[str, float]]] = field(default_factory=list)
    # the model they were trained on (``model_fingerprint``), checked when loaded for another
    made_for: dict[str, Any] | None = None

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.neurons]

    def num_parameters(self) -> int:
        heads = sum(p.num_parameters() for p in self.heads) if self.heads is not None else 0
        return sum(p.num_parameters() for p in self.neurons) + heads

    def parameter_share(self, model: Transformer, heads: bool = False) -> float:
        """Neuron predictors' parameters (with ``heads``, head predictors' too) over the MLPs'."""
        mlp = sum(
            m.weight.numel()
            for layer in model.layers
            for m in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        )
        count = sum(p.num_parameters() for p in self.neurons)
        if heads and self.heads is not None:
            count += sum(p.num_parameters() for p in self.heads)
        return count / mlp

    def source_layer(self, layer: int) -> int:
        """The layer whose MLP input predictor ``layer`` reads (with look-ahead: the one before)."""
        return layer - 1 if self.lookahead and layer > 0 else layer

    def neuron_input(self, records: Sequence[LayerRecord], layer: int) -> Tensor:
        return records[self.source_layer(layer)].mlp_in

    def attach_heads(
        self, model: Transformer, records: Sequence[LayerRecord], config: PredictorConfig
    ) -> Predictors:
        """Train head predictors keeping 1 - ``config.head_sparsity`` of the heads; in place.

        Per layer, a ``config.head_rank`` network reads the attention input and is trained
        (``config.head_epochs``, unweighted BCE: the labels are the top-k heads by output
        norm, a balanced set) to rank the heads; the top ``head_keep`` logits are kept.
        """
        if not config.head_sparsity > 0:
            raise ValueError(
                "Set head_sparsity > 0 in the PredictorConfig to train head predictors."
            )
        c = model.config
        self.head_keep = keep_count(c.n_heads, config.head_sparsity)
        self.heads = nn.ModuleList()
        for r in records:
            y = top_k_mask(r.head_norms, self.head_keep)
            p = init_random(Predictor(c.dim, config.head_rank, c.n_heads, config.kind), config.seed)
            p.to(r.attn_in.device)
            epochs, batch = config.head_epochs, config.batch_size
            self.heads.append(fit(p, r.attn_in, y, epochs, batch, config.lr, 1.0, config.seed))
        return self

    def evaluate(self, model: Transformer, windows: Tensor, batch_size: int = 4) -> dict[str, Any]:
        """Recall, precision and sparsity per layer on ``windows`` [n, seq] (dense inputs).

        Each layer's predictor reads the input the *dense* model gives it (as in DejaVu's
        evaluation); ``predicted_quality`` measures what the errors do to the output.
        """
        records = record_layers(model, windows, self.thresholds, batch_size)
        return self.score(model, records)

    def score(self, model: Transformer, records: Sequence[LayerRecord]) -> dict[str, Any]:
        """``evaluate`` on layers already recorded with these predictors' thresholds."""
        per_layer = [
            confusion(predict_neurons(p, self.neuron_input(records, i)), records[i].active)
            for i, p in enumerate(self.neurons)
        ]
        result: dict[str, Any] = {
            key: [getattr(s, key) for s in per_layer] for key in asdict(per_layer[0])
        }
        result["rank"] = self.ranks
        result["param_share"] = self.parameter_share(model)
        if self.heads is not None:
            head_scores = [
                confusion(
                    predict_heads(p, records[i].attn_in, self.head_keep),
                    top_k_mask(records[i].head_norms, self.head_keep),
                )
                for i, p in enumerate(self.heads)
            ]
            result["head_recall"] = [s.recall for s in head_scores]
        for key in [k for k, v in result.items() if isinstance(v, list)]:
            result[f"mean_{key}"] = sum(result[key]) / len(result[key])
        return result

    def save(self, path: str | Path) -> Path:
        """Write the predictors to one safetensors file (weights + a JSON description)."""
        tensors = {f"neurons.{k}": v for k, v in self.neurons.state_dict().items()}
        if self.heads is not None:
            tensors |= {f"heads.{k}": v for k, v in self.heads.state_dict().items()}
        meta = {
            "kind": self.kind,
            "ranks": self.ranks,
            "thresholds": self.thresholds,
            "lookahead": self.lookahead,
            "head_keep": self.head_keep,
            "head_ranks": [p.rank for p in self.heads] if self.heads is not None else [],
            "shape": model_shape(self.neurons, self.heads),
            "history": self.history,
            "made_for": self.made_for,
        }
        path = Path(path)
        save_tensors_atomic(
            {k: v.contiguous() for k, v in tensors.items()}, path, {"predictors": json.dumps(meta)}
        )
        return path

    @classmethod
    def load(cls, path: str | Path, model: Transformer) -> Predictors:
        """Read predictors saved by ``save`` for ``model``; refuse files made for another model.

        The file must be a predictors file (safetensors with its JSON description) whose shape
        (layers, widths, ranks, tensor shapes) fits ``model``; when it records the model it was
        trained on (``model_fingerprint``), that must be ``model`` too (same activation, same
        gate weights to 0.1 %). Anything else is one ValueError saying what to do.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No predictors at {path}; train them with train_predictors.")
        meta, tensors = read_predictors_file(path)
        c = model.config
        check_saved_shape(path, meta, model)
        saved_for = meta.get("made_for")
        if saved_for is not None:
            check_fingerprint(path, saved_for, model_fingerprint(model))
        neurons = nn.ModuleList(Predictor(c.dim, r, c.ffn_dim, meta["kind"]) for r in meta["ranks"])
        heads = None
        if meta["head_ranks"]:
            heads = nn.ModuleList(
                Predictor(c.dim, r, c.n_heads, meta["kind"]) for r in meta["head_ranks"]
            )
        load_part(path, neurons, tensors, "neurons.")
        if heads is not None:
            load_part(path, heads, tensors, "heads.")
        device = model.device
        return cls(
            neurons.requires_grad_(False).to(device),
            [float(t) for t in meta["thresholds"]],
            meta["kind"],
            bool(meta["lookahead"]),
            heads.requires_grad_(False).to(device) if heads is not None else None,
            int(meta["head_keep"]),
            meta["history"],
            saved_for,
        )

    def select(self, layer: int, x: Tensor) -> Tensor:
        """Active neuron indices of ``layer`` for MLP inputs x [tokens, dim] (union over tokens).

        The ``select`` function of ``minisparse.sparse_mlp.sparsify`` (not for look-ahead
        predictors, which read the previous layer's input).
        """
        if self.lookahead:
            raise ValueError(
                "Look-ahead predictors read the previous layer's input; use "
                "predicted_masks_applied instead of a per-layer select."
            )
        return predict_neurons(self.neurons[layer], x).any(0).nonzero().flatten()


META_KEYS = ("kind", "ranks", "thresholds", "lookahead", "head_keep", "head_ranks", "shape")


def read_predictors_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The JSON description and the tensors of a predictors file, or a ValueError saying why not."""
    hint = "train predictors with train_predictors or `minisparse predictors`"
    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("predictors")
        tensors = load_file(str(path))
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); {hint}.") from err
    if raw is None:
        raise ValueError(f"{path} is not a predictors file (no 'predictors' metadata); {hint}.")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} has a damaged predictors description ({err}); {hint}.") from err
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing} in its predictors description; {hint}.")
    meta.setdefault("history", [])
    if meta["kind"] not in KINDS:
        raise ValueError(f"{path} holds predictors of unknown kind {meta['kind']!r}; {hint}.")
    return meta, tensors


def check_saved_shape(path: Path, meta: dict[str, Any], model: Transformer) -> None:
    """The saved predictors' shape must be ``model``'s: layers, widths, one rank per layer."""
    c = model.config
    want = {"n_layers": c.n_layers, "dim": c.dim, "ffn_dim": c.ffn_dim}
    if meta["head_ranks"]:
        want["n_heads"] = c.n_heads
    saved = meta["shape"] if isinstance(meta["shape"], dict) else {}
    counts_ok = (
        len(meta["ranks"]) == c.n_layers
        and len(meta["thresholds"]) == c.n_layers
        and len(meta["head_ranks"]) in (0, c.n_layers)
    )
    if any(saved.get(k) != v for k, v in want.items()) or not counts_ok:
        raise ValueError(
            f"{path} holds predictors for a model of shape {saved}, not this one ({want}); "
            "train predictors for this model with train_predictors or `minisparse predictors`."
        )


def load_part(path: Path, modules: nn.ModuleList, tensors: dict[str, Tensor], prefix: str) -> None:
    """Load the tensors named ``prefix...`` into ``modules``, checking names and shapes first."""
    part = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    expected = modules.state_dict()
    wrong = sorted(set(part) ^ set(expected)) or [
        k for k, v in expected.items() if tuple(part[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise ValueError(
            f"{path} does not match its own description or this model at {prefix}{wrong[0]}; "
            "the file is damaged or was made for another model: train predictors again."
        )
    modules.load_state_dict(part)


def model_fingerprint(model: Transformer) -> dict[str, Any]:
    """What identifies the model predictors were trained on: its activation and gate weights.

    Per layer the mean |W_gate|: any fine-tuning or another checkpoint of the same shape moves
    it, while a cast to bfloat16 or a move to another device does not (to 0.1 %).
    """
    return {
        "hidden_act": model.config.hidden_act,
        "gate_mean_abs": [
            float(layer.mlp.gate_proj.weight.detach().float().abs().mean())
            for layer in model.layers
        ],
    }


def check_fingerprint(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse predictors trained on another model than ``current`` describes."""
    a, b = saved.get("gate_mean_abs", []), current["gate_mean_abs"]
    same = (
        saved.get("hidden_act") == current["hidden_act"]
        and len(a) == len(b)
        and all(abs(x - y) <= 1e-3 * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))
    )
    if not same:
        raise ValueError(
            f"{path} holds predictors trained on another model (activation "
            f"{saved.get('hidden_act')!r}, other weights) than this one "
            f"({current['hidden_act']!r}); load them with the model they were trained on, or "
            "train predictors for this model with train_predictors or `minisparse predictors`."
        )


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
    fit(p, x, y, config.epochs, config.batch_size, config.lr, config.pos_weight, config.seed)
    calibrate_cutoff(p, x_val, y_val, config.target_recall)
    return p, confusion(predict_neurons(p, x_val), y_val)


def model_shape(neurons: nn.ModuleList, heads: nn.ModuleList | None) -> dict[str, int]:
    """The model shape a set of predictors serves (stored with them, checked on load)."""
    first = neurons[0]
    shape = {
        "n_layers": len(neurons),
        "dim": first.down.in_features,
        "ffn_dim": first.up.out_features,
    }
    if heads is not None:
        shape["n_heads"] = heads[0].up.out_features
    return shape


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


def train_predictors(
    model: Transformer,
    token_batches: Tensor,
    target_recall: float = 0.95,
    kind: str = "lowrank",
    thresholds: Sequence[float] | None = None,
    validation: Tensor | None = None,
    config: PredictorConfig | None = None,
    progress: bool = True,
) -> Predictors:
    """Train one neuron predictor per layer (and head predictors if asked), sized adaptively.

    ``token_batches`` [n, seq]: training windows; ``validation``: held-out windows for the
    cutoffs and the size search (default: the last eighth of ``token_batches``).
    ``thresholds``: per-layer activity thresholds (default 0: nonzero, for ReLU models).
    ``config`` overrides ``kind`` and ``target_recall`` when given.
    """
    config = config or PredictorConfig(kind=kind, target_recall=target_recall)
    n_layers = len(model.layers)
    thresholds = [0.0] * n_layers if thresholds is None else [float(t) for t in thresholds]
    if len(thresholds) != n_layers:
        raise ValueError(f"Got {len(thresholds)} thresholds for {n_layers} layers.")
    if validation is None:
        if token_batches.shape[0] < 2:
            raise ValueError("Need at least two windows to hold one out, or pass validation=.")
        cut = token_batches.shape[0] - max(1, token_batches.shape[0] // 8)
        token_batches, validation = token_batches[:cut], token_batches[cut:]
    train = record_layers(model, token_batches, thresholds, progress=progress)
    val = record_layers(model, validation, thresholds)
    return fit_predictors(model, train, val, thresholds, config, progress)


def fit_predictors(
    model: Transformer,
    train: Sequence[LayerRecord],
    val: Sequence[LayerRecord],
    thresholds: Sequence[float],
    config: PredictorConfig,
    progress: bool = True,
    directions: Sequence[Tensor] | None = None,
) -> Predictors:
    """``train_predictors`` on already recorded layers (record once, try several configs).

    ``directions``: per layer, the gate's principal directions on ``train`` (computed when
    missing; pass them to reuse them across configs with the same inputs).
    """
    n_layers = len(model.layers)
    result = Predictors(nn.ModuleList(), list(thresholds), config.kind, config.lookahead)
    result.made_for = model_fingerprint(model)
    for i in tqdm(range(n_layers), desc="predictors", disable=not progress):
        gate = model.layers[i].mlp.gate_proj.weight.detach()
        x, x_val = result.neuron_input(train, i), result.neuron_input(val, i)
        known = None if directions is None else directions[i]
        predictor, tried = size_layer(gate, x, train[i].active, x_val, val[i].active, config, known)
        result.neurons.append(predictor)
        result.history.append(tried)
    if config.head_sparsity > 0:
        result.attach_heads(model, train, config)
    return result


@contextlib.contextmanager
def predicted_masks_applied(
    model: Transformer, predictors: Predictors, mode: str = "predicted", heads: bool = True
) -> Iterator[list[Tensor]]:
    """Run a block with every MLP computing only the predicted neurons (masked dense math).

    ``mode``: "predicted" keeps the predicted set; "oracle" keeps, per token, the same number
    of neurons but the largest |h_j| (the best set of that size); "true" keeps the true active
    set |h_j| > t_l. Head predictors, when present and ``heads`` is true, drop the heads they
    do not predict.
    Yields a list that collects each layer's kept share per call (the density).
    """
    if mode not in ("predicted", "oracle", "true"):
        raise ValueError(f"Unknown mode {mode!r}; use 'predicted', 'oracle' or 'true'.")
    n_heads = model.config.n_heads
    densities: list[Tensor] = []
    mlp_in: dict[int, Tensor] = {}  # layer -> its MLP input in this forward pass
    attn_in: dict[int, Tensor] = {}

    def store(inputs: dict[int, Tensor], i: int):
        def pre_hook(_m: nn.Module, args: tuple) -> None:
            inputs[i] = args[0]

        return pre_hook

    def mask_neurons(i: int):
        def hook(_m: nn.Module, _a: tuple, h: Tensor) -> Tensor:
            source = mlp_in[predictors.source_layer(i)]
            predicted = predict_neurons(predictors.neurons[i], source)
            if mode == "true":
                keep = h.abs() > predictors.thresholds[i]
            elif mode == "oracle":
                keep = keep_largest(h.abs(), predicted.sum(-1))
            else:
                keep = predicted
            densities.append(keep.float().mean())
            return h * keep.to(h.dtype)

        return hook

    def mask_heads(i: int):
        def pre_hook(_m: nn.Module, args: tuple) -> tuple:
            keep = predict_heads(predictors.heads[i], attn_in[i], predictors.head_keep)
            return (drop_heads(args[0], keep, n_heads),)

        return pre_hook

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(store(mlp_in, i)))
        handles.append(layer.mlp.down_in_act.register_forward_hook(mask_neurons(i)))
        if heads and predictors.heads is not None:
            handles.append(layer.attn.register_forward_pre_hook(store(attn_in, i)))
            handles.append(layer.attn.o_proj.register_forward_pre_hook(mask_heads(i)))
    try:
        yield densities
    finally:
        for h in handles:
            h.remove()


def keep_largest(scores: Tensor, counts: Tensor) -> Tensor:
    """Per row, a mask of the ``counts[row]`` largest entries of ``scores`` [..., n]."""
    order = scores.argsort(dim=-1, descending=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    return ranks < counts[..., None]


@torch.inference_mode()
def predicted_quality(
    model: Transformer,
    predictors: Predictors,
    windows: Tensor,
    modes: Sequence[str] = ("true", "predicted", "oracle"),
    heads: bool = False,
    batch_size: int = 4,
) -> dict[str, dict[str, float]]:
    """End to end: perplexity, agreement with dense and kept-neuron density for each mode.

    ``heads``: also drop the heads the head predictors leave out (in every mode).
    """
    device = next(model.parameters()).device
    tallies = {m: Tally() for m in ("dense", *modes)}
    density: dict[str, list[float]] = {m: [] for m in modes}
    for tokens in windows.split(batch_size):
        tokens = tokens.to(device)
        logits = model(tokens)
        reference = logits[:, :-1].argmax(-1)
        tallies["dense"].add(logits, tokens, reference)
        for m in modes:
            with predicted_masks_applied(model, predictors, m, heads) as kept:
                tallies[m].add(model(tokens), tokens, reference)
            density[m].append(float(torch.stack(kept).mean()))
    out = {"dense": {"ppl": tallies["dense"].ppl, "agreement": 1.0, "density": 1.0}}
    for m in modes:
        t = tallies[m]
        out[m] = {
            "ppl": t.ppl,
            "agreement": t.agree / t.count,
            "density": sum(density[m]) / len(density[m]),
        }
    return out


def mlp_cost(model: Transformer, predictors: Predictors, density: float) -> dict[str, float]:
    """Per-token FLOPs of the MLPs, dense and with predicted sets, with the predictors counted.

    A predicted-sparse MLP reads rows of W_gate, W_up and columns of W_down for a share
    ``density`` of the neurons: 6 d n density FLOPs per layer against 6 d n; a predictor costs
    2 (d r + r n) (weights are read once each, so bytes follow the same ratio at one dtype).
    """
    c = model.config
    dense = 6 * c.dim * c.ffn_dim * c.n_layers
    predictor = 2 * sum(p.num_parameters() for p in predictors.neurons)
    sparse = dense * density
    return {
        "dense_flops": float(dense),
        "sparse_flops": float(sparse),
        "predictor_flops": float(predictor),
        "skipped_share": 1 - (sparse + predictor) / dense,
    }


__all__ = [
    "KINDS",
    "LayerRecord",
    "Predictor",
    "PredictorConfig",
    "Predictors",
    "Scores",
    "Target",
    "build_predictor",
    "calibrate_cutoff",
    "confusion",
    "fit",
    "fit_predictors",
    "init_compressed_gate",
    "init_random",
    "initial_rank",
    "keep_largest",
    "mlp_cost",
    "model_fingerprint",
    "predict_heads",
    "predict_neurons",
    "predicted_masks_applied",
    "predicted_quality",
    "prediction_target",
    "principal_directions",
    "record_layers",
    "size_layer",
    "train_predictors",
]
