"""The predictors of one model: one per layer, scored, saved to a file and checked on load.

``Predictors`` holds a neuron predictor per layer (and optionally a head predictor per layer)
with what they were made for: the thresholds t_l that define "active", the kind, look-ahead and
the model they were trained on.

**Look-ahead.** Predictor l may read layer l - 1's MLP input instead of its own, so it can run
one layer early, while layer l - 1 computes; the residual stream changes little between layers
(chapter 05), at some cost in recall and precision.

**Cost.** The neuron predictors' share of the MLP parameters is
sum_l [r_l (d + n) + n] / (3 d n L) (+ r_l per layer for the MLP kind); ``evaluate`` reports it
with each layer's recall, precision and predicted sparsity on held-out text.

**Head predictors** (DejaVu): per layer, a network reads the attention input and is trained
(unweighted BCE) on the top-k heads by output norm; the top ``head_keep`` logits are kept.

**The file.** One safetensors file: the tensors ``neurons.<layer>.<name>`` (and
``heads.<layer>.<name>``), and under the metadata key ``predictors`` a JSON description: kind,
ranks, thresholds, lookahead, head_keep, head_ranks, the model shape (layers, widths) and
``made_for``, a fingerprint of the model (activation, per layer mean |W_gate|). ``load``
refuses, with one clear error, a file that is not readable, lacks its description, has the
wrong shape, does not record ``made_for``, or was trained on another model (mean |W_gate| off
by more than 0.1 %).

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from ..core.model import Transformer
from ..files.cache import save_tensors_atomic
from ..sparsity.contextual import keep_count, top_k_mask
from .lowrank import KINDS, Predictor, confusion, init_random, predict_heads, predict_neurons
from .records import LayerRecord, record_layers
from .sizing import PredictorConfig

__all__ = [
    "META_KEYS",
    "LayerSelect",
    "Predictors",
    "Selection",
    "check_fingerprint",
    "check_saved_shape",
    "load_part",
    "model_fingerprint",
    "model_shape",
    "read_predictors_file",
]


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
            p = config.train_loop(p, r.attn_in, y, epochs, batch, config.lr, 1.0, config.seed)
            self.heads.append(p.eval().requires_grad_(False))
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
        (layers, widths, ranks, tensor shapes) fits ``model``, and the model it records it was
        trained on (``made_for``, a ``model_fingerprint``) must be ``model`` (same activation,
        same gate weights to 0.1 %); a file that records none is refused. Anything else is one
        ValueError saying what to do.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No predictors at {path}; train them with train_predictors.")
        meta, tensors = read_predictors_file(path)
        c = model.config
        check_saved_shape(path, meta, model)
        saved_for = meta.get("made_for")
        if saved_for is None:  # nothing to check the model against: refuse rather than trust
            raise ValueError(
                f"{path} does not record the model its predictors were trained on, so they "
                "cannot be checked against this one; train them with train_predictors or "
                "`minisparse predictors` (which record it), or set predictors.made_for = "
                "model_fingerprint(model) before saving predictors you made yourself."
            )
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

    @property
    def select(self) -> Selection:
        """The neuron selector ``select(layer, x)``: active neuron indices of ``layer`` for MLP
        inputs x [tokens, dim] (union over tokens). What ``minisparse.sparse.sparsify(model,
        select=predictors.select)`` takes; ``select.for_layer(layer)`` is one layer's selector
        (a ``LayerSelect``, which the compiled decode step runs in C). Not for look-ahead
        predictors, which read the previous layer's input.
        """
        return Selection(self)


@dataclass(eq=False)
class LayerSelect:
    """One layer's selector: x [tokens, dim] -> the union of the predicted active neurons."""

    owner: Predictors
    layer: int

    @property
    def predictor(self) -> Predictor:
        return self.owner.neurons[self.layer]

    def __call__(self, x: Tensor) -> Tensor:
        return predict_neurons(self.predictor, x).any(0).nonzero().flatten()


@dataclass(eq=False)
class Selection:
    """``Predictors.select``: called as ``select(layer, x)``, or bound with ``for_layer``."""

    owner: Predictors

    def for_layer(self, layer: int) -> LayerSelect:
        if self.owner.lookahead:
            raise ValueError(
                "Look-ahead predictors read the previous layer's input; use "
                "predicted_masks_applied instead of a per-layer select."
            )
        return LayerSelect(self.owner, layer)

    def __call__(self, layer: int, x: Tensor) -> Tensor:
        return self.for_layer(layer)(x)


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
    types = {"lookahead": bool, "head_keep": int, "made_for": (dict, type(None))}
    for key, kind in types.items():
        value = meta.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"{path} has {key}={value!r} in its predictors description, which is not a "
                f"{'true/false' if kind is bool else 'valid'} value; {hint}."
            )
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
    bad = [k for k, v in part.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:  # NaN scores compare False with every cutoff: no neuron would ever be chosen
        raise ValueError(
            f"{path} holds NaN or infinite values in {prefix}{bad[0]}; the predictors are "
            "damaged (or their training diverged): train them again."
        )
    modules.load_state_dict(part)
