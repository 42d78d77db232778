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

The chapter meets five pieces, one module each, all importable from here (and ``lowering``:
how the compiled decode step runs a ``LayerSelect``):

1. ``lowrank``: one layer's ``Predictor``, its starts (``init_random``,
   ``init_compressed_gate``), ``fit``, ``calibrate_cutoff`` (with ``recall_cutoff``),
   ``predict_neurons``, ``predict_heads`` and the ``Scores`` of a prediction (``confusion``);
2. ``records``: what layers see and what is predicted (``Target``,
   ``prediction_target``, ``LayerRecord``, ``record_layers``);
3. ``sizing``: ``PredictorConfig`` and the adaptive size (``initial_rank``,
   ``build_predictor``, ``size_layer``);
4. ``collection``: ``Predictors``, one model's set, with ``evaluate``, ``save`` and ``load``
   (and the file checks), and its ``select`` (``LayerSelect`` per layer);
5. ``pipeline``: end to end (``train_predictors``, ``fit_predictors``,
   ``predicted_masks_applied``, ``predicted_quality``, ``mlp_cost``).

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023).
"""

from __future__ import annotations

from . import lowering as lowering  # registers how the compiled step runs a LayerSelect
from .collection import (
    META_KEYS,
    LayerSelect,
    Predictors,
    Selection,
    check_fingerprint,
    check_saved_shape,
    load_part,
    model_fingerprint,
    model_shape,
    read_predictors_file,
)
from .lowrank import (
    KINDS,
    Predictor,
    Scores,
    calibrate_cutoff,
    confusion,
    fit,
    init_compressed_gate,
    init_random,
    predict_heads,
    predict_neurons,
    principal_directions,
    recall_cutoff,
)
from .pipeline import (
    fit_predictors,
    keep_largest,
    mlp_cost,
    predicted_masks_applied,
    predicted_quality,
    train_predictors,
)
from .records import LayerRecord, Target, prediction_target, record_layers
from .sizing import (
    CutoffRule,
    PredictorConfig,
    TrainLoop,
    build_predictor,
    initial_rank,
    size_layer,
)

__all__ = [
    "KINDS",
    "META_KEYS",
    "CutoffRule",
    "LayerRecord",
    "LayerSelect",
    "Predictor",
    "PredictorConfig",
    "Predictors",
    "Scores",
    "Selection",
    "Target",
    "TrainLoop",
    "build_predictor",
    "calibrate_cutoff",
    "check_fingerprint",
    "check_saved_shape",
    "confusion",
    "fit",
    "fit_predictors",
    "init_compressed_gate",
    "init_random",
    "initial_rank",
    "keep_largest",
    "load_part",
    "mlp_cost",
    "model_fingerprint",
    "model_shape",
    "predict_heads",
    "predict_neurons",
    "predicted_masks_applied",
    "predicted_quality",
    "prediction_target",
    "principal_directions",
    "read_predictors_file",
    "recall_cutoff",
    "record_layers",
    "size_layer",
    "train_predictors",
]
