"""Prune a whole model: magnitude, Wanda or SparseGPT on every projection of its blocks.

``prune`` returns a copy whose pruned weights are exact zeros (a plain model: every kernel that
runs the dense model runs it). What it prunes, per output row of each projection W [out, in]:

* ``"magnitude"``: the weights with the smallest |W_ij| (no calibration text);
* ``"wanda"``: the smallest |W_ij| · ‖X_j‖₂ (``scores.wanda_score``), with ‖X_j‖₂ the norm of
  input j over the calibration tokens (Sun et al. 2024);
* ``"sparsegpt"``: the OBS choice and update of ``sparsegpt.sparsegpt_prune`` on the Hessian
  H = XᵀX of the same inputs (Frantar & Alistarh 2023).

The share is ``sparsity`` of every row ("unstructured") or n of every m consecutive inputs kept
("2:4", "4:8", any "n:m", whose share is 1 − n/m).

**Sequential calibration.** Wanda and SparseGPT measure X block by block, like their papers:
the inputs of block l are the calibration tokens as transformed by blocks 0..l−1 *after* they
were pruned (``quant.calibration.sequential_layers``, the loop GPTQ runs), so a block sees the
errors of the blocks before it. The embedding and the LM head are never pruned.

**Plug points.** ``score_fn(weight, x_norm) -> scores`` (x_norm is None for magnitude) and
``mask_fn(scores, sparsity, pattern) -> keep`` (a bool mask) replace the method's score and
its mask (``row_mask`` / ``nm_mask``), so one's own functions run on the whole model;
``select_fn(weight, x_norm, sparsity, pattern) -> keep`` replaces both at once (a function that
scores and selects, such as chapter 12's ``wanda_mask``).

``weight_sparsity`` counts the zeros a model's projections hold.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.model import Transformer, check_tokens
from ..core.plain import BLOCK_PROJECTIONS, check_plain_linears
from ..deprecated import old_name
from ..quant.calibration import LinearGroup, sequential_layers
from ..quant.gptq import hessian
from ..quant.layers import set_weight
from .masks import nm_mask, pattern_nm, row_mask
from .scores import input_norms, magnitude_score, wanda_score
from .sparsegpt import check_settings, check_target, sparsegpt_prune

__all__ = [
    "PRUNE_METHODS",
    "TARGETS",
    "MaskFn",
    "ScoreFn",
    "SelectFn",
    "check_prune_arguments",
    "default_mask",
    "prune",
    "target_names",
    "weight_sparsity",
]

#: The methods ``prune`` knows.
PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")

#: The projections of a block each ``targets`` value prunes.
TARGETS = {"all": BLOCK_PROJECTIONS, "mlp": BLOCK_PROJECTIONS[4:]}

#: (weight [out, in], input norms [in] or None) -> scores [out, in]; low scores are pruned.
ScoreFn = Callable[[Tensor, Tensor | None], Tensor]
#: (scores [out, in], sparsity, pattern) -> bool [out, in], True where a weight is kept.
MaskFn = Callable[[Tensor, float, str], Tensor]
#: (weight [out, in], input norms [in] or None, sparsity, pattern) -> bool [out, in], kept.
SelectFn = Callable[[Tensor, Tensor | None, float, str], Tensor]


def default_mask(scores: Tensor, sparsity: float, pattern: str) -> Tensor:
    """``row_mask`` for "unstructured", ``nm_mask`` for an "n:m" pattern."""
    nm = pattern_nm(pattern)
    return row_mask(scores, sparsity) if nm is None else nm_mask(scores, *nm)


def _magnitude(weight: Tensor, x_norm: Tensor | None) -> Tensor:
    return magnitude_score(weight)


def _wanda(weight: Tensor, x_norm: Tensor | None) -> Tensor:
    assert x_norm is not None
    return wanda_score(weight, x_norm)


def target_names(targets: str) -> tuple[str, ...]:
    """The projections of a block that ``targets`` ("all" or "mlp") names."""
    if targets not in TARGETS:
        raise ValueError(
            f"targets must be one of {tuple(TARGETS)} ('all': q, k, v, o, gate, up, down; "
            f"'mlp': gate, up, down); got {targets!r}."
        )
    return TARGETS[targets]


def check_prune_arguments(
    model: Transformer,
    method: str,
    sparsity: float,
    pattern: str,
    calibration: Tensor | None,
    targets: str,
    score_fn: ScoreFn | None,
    mask_fn: MaskFn | None,
    select_fn: SelectFn | None = None,
) -> tuple[str, ...]:
    """Every check ``prune`` makes before it works; returns the targeted projection names."""
    if method not in PRUNE_METHODS:
        raise ValueError(f"Unknown pruning method {method!r}; use one of {PRUNE_METHODS}.")
    names = target_names(targets)
    check_plain_linears(model, names, "prune")
    for i, layer in enumerate(model.layers):
        for name in names:
            lin = layer.get_submodule(name)
            check_target(sparsity, pattern, lin.in_features, f"layers.{i}.{name}")
    if method == "sparsegpt" and any(f is not None for f in (score_fn, mask_fn, select_fn)):
        raise ValueError(
            "sparsegpt chooses its mask from the inverse Hessian; score_fn, mask_fn and "
            "select_fn apply to method='magnitude' or 'wanda'."
        )
    if select_fn is not None and (score_fn is not None or mask_fn is not None):
        raise ValueError(
            "select_fn scores and selects in one function; pass it alone, or score_fn and "
            "mask_fn without it."
        )
    if method != "magnitude":
        if calibration is None:
            raise ValueError(
                f"method {method!r} measures the inputs of every layer: pass calibration="
                "token_batches(tokenizer, corpus(split='train'), 256, 16) (minisparse.io.data), "
                "or use method='magnitude', which needs none."
            )
        check_tokens(calibration, model.config.vocab_size)
    return names


def _prune_linear_(linear: nn.Module, keep: Tensor, name: str) -> None:
    weight = linear.weight.detach()
    if keep.shape != weight.shape or keep.dtype != torch.bool:
        raise ValueError(
            f"mask_fn (or select_fn) must return a bool mask of the weight's shape "
            f"{list(weight.shape)} for {name}; got {keep.dtype} {list(keep.shape)}."
        )
    set_weight(linear, weight * keep)


def prune(
    model: Transformer,
    method: str = "wanda",
    sparsity: float = 0.5,
    pattern: str = "unstructured",
    calibration: Tensor | None = None,
    *,
    targets: str = "all",
    score_fn: ScoreFn | None = None,
    mask_fn: MaskFn | None = None,
    select_fn: SelectFn | None = None,
    damp: float = 0.01,
    blocksize: int = 128,
) -> Transformer:
    """A pruned copy of ``model`` (the input is left unchanged), pruned weights exact zeros.

    ``method``: "magnitude", "wanda" or "sparsegpt"; ``sparsity``: the share of each row pruned
    (for "n:m" patterns it must be 1 − n/m); ``pattern``: "unstructured" or "n:m";
    ``calibration``: token ids [batch, seq] (Wanda and SparseGPT; magnitude ignores them);
    ``targets``: "all" projections of every block or the "mlp" ones; ``score_fn`` and
    ``mask_fn`` (or ``select_fn``): plug points for magnitude and Wanda (see the module);
    ``damp`` and ``blocksize``: SparseGPT's dampening and lazy block.
    """
    names = check_prune_arguments(
        model, method, sparsity, pattern, calibration, targets, score_fn, mask_fn, select_fn
    )
    if method == "sparsegpt":
        check_settings(blocksize, damp)
    score = score_fn or (_magnitude if method == "magnitude" else _wanda)
    choose = mask_fn or default_mask
    new = copy.deepcopy(model).eval()

    def by_score(layer: nn.Module, linears: Sequence[str], x_norm: Tensor | None) -> None:
        for name in linears:
            linear = layer.get_submodule(name)
            weight = linear.weight.detach()
            if select_fn is not None:
                keep = select_fn(weight, x_norm, sparsity, pattern)
            else:
                keep = choose(score(weight, x_norm), sparsity, pattern)
            _prune_linear_(linear, keep, name)

    def visit(layer: nn.Module, groups: list[LinearGroup], inputs: dict[str, Tensor]) -> None:
        for group in groups:
            linears = [name for name in group.linears if name in names]
            if not linears:
                continue
            x = inputs[group.name]
            if method == "wanda":
                by_score(layer, linears, input_norms(x))
            else:
                _sparsegpt_group(layer, linears, x, sparsity, pattern, blocksize, damp)

    with torch.no_grad():
        if method == "magnitude":
            for layer in new.layers:
                by_score(layer, names, None)
        else:
            assert calibration is not None
            tokens = calibration.to(new.device)
            sequential_layers(new, tokens, visit, f"{method} {pattern}", progress=False)
    return new


def _sparsegpt_group(
    layer: nn.Module,
    linears: Sequence[str],
    x: Tensor,
    sparsity: float,
    pattern: str,
    blocksize: int,
    damp: float,
) -> None:
    """SparseGPT on the linear layers that read the input ``x``: one Hessian, rows stacked
    (each row is pruned on its own, so stacking changes nothing but the loop count)."""
    modules = [layer.get_submodule(name) for name in linears]
    weights = [m.weight.detach() for m in modules]
    pruned = sparsegpt_prune(torch.cat(weights), hessian(x), sparsity, pattern, blocksize, damp)
    for module, part in zip(modules, pruned.split([w.shape[0] for w in weights]), strict=True):
        set_weight(module, part)


def weight_sparsity(model: Transformer) -> dict[str, float]:
    """The share of exact zeros per projection kind ("q_proj" .. "down_proj", over all blocks)
    and over all of them together ("total"); the embedding and the LM head are not counted."""
    zeros: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for layer in model.layers:
        for name in TARGETS["all"]:
            weight = layer.get_submodule(name).weight.detach()
            kind = name.split(".")[-1]
            zeros[kind] = zeros.get(kind, 0) + int((weight == 0).sum())
            sizes[kind] = sizes.get(kind, 0) + weight.numel()
    shares = {kind: zeros[kind] / sizes[kind] for kind in sizes}
    shares["total"] = sum(zeros.values()) / sum(sizes.values())
    return shares


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)
