"""Input checks shared by every backend, so bad input fails the same clear way everywhere."""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import ACTIVATIONS


def check_matrix(name: str, W: Tensor) -> None:
    if W.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(W.shape)}.")
    if not W.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {W.dtype}.")


def check_vector(x: Tensor, width: int, what: str) -> None:
    """x is [K] or [B, K] with K == width."""
    if x.dim() not in (1, 2) or x.shape[-1] != width:
        raise ValueError(
            f"x must have shape [{width}] or [batch, {width}] to match {what}, "
            f"got {tuple(x.shape)}; reshape x or pass the matching weight."
        )
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}.")


def check_indices(idx: Tensor, size: int, what: str) -> None:
    """idx is a 1-D integer tensor with values in [0, size)."""
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(
            f"idx must be a 1-D integer tensor of {what} indices, got dtype {idx.dtype} and "
            f"shape {tuple(idx.shape)}; use mask.nonzero().flatten() to turn a mask into indices."
        )
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise ValueError(
            f"idx holds values outside [0, {size}) ({what} indices): min {int(idx.min())}, "
            f"max {int(idx.max())}; drop or clamp the out-of-range entries."
        )


def check_same_device(*tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"All tensors must be on one device, got {sorted(map(str, devices))}; move them "
            "with .to(device)."
        )


def check_threshold(threshold: float | None, idx: Tensor | None) -> None:
    if (threshold is None) == (idx is None):
        raise ValueError(
            "Give exactly one of threshold= (in-kernel magnitude test) or idx= (active channel "
            "indices)."
        )
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold}.")


def check_activation(act: str) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {act!r}; use one of {ACTIVATIONS}.")


def check_gather(W: Tensor, x: Tensor, idx: Tensor) -> None:
    check_matrix("W", W)
    check_vector(x, W.shape[1], f"W's {W.shape[1]} columns")
    check_indices(idx, W.shape[0], "row")
    check_same_device(W, x, idx)


def check_sparse_input(W_t: Tensor, x: Tensor, threshold: float | None, idx: Tensor | None) -> None:
    check_matrix("W_t", W_t)
    check_vector(x, W_t.shape[0], f"W_t's {W_t.shape[0]} rows (W_t is W transposed, [in, out])")
    check_threshold(threshold, idx)
    if idx is not None:
        check_indices(idx, W_t.shape[0], "input channel")
        check_same_device(W_t, x, idx)
    else:
        check_same_device(W_t, x)


def check_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str
) -> None:
    for name, W in (("W_gate", W_gate), ("W_up", W_up), ("W_down_t", W_down_t)):
        check_matrix(name, W)
    if not (W_gate.shape == W_up.shape == W_down_t.shape):
        raise ValueError(
            "W_gate, W_up and W_down_t must all be [ffn, dim] (W_down_t is down_proj.weight.T), "
            f"got {tuple(W_gate.shape)}, {tuple(W_up.shape)}, {tuple(W_down_t.shape)}."
        )
    check_vector(x, W_gate.shape[1], f"the FFN's model dim {W_gate.shape[1]}")
    check_indices(idx, W_gate.shape[0], "neuron")
    check_activation(act)
    check_same_device(x, W_gate, W_up, W_down_t, idx)
