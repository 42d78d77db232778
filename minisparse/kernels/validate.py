"""Input checks shared by every backend, so bad input fails the same clear way everywhere.

Every public kernel (Triton, the C fast path, the torch references) checks its arguments here
before it touches memory: a wrong type raises ``TypeError``, a wrong shape, dtype, device or an
index outside the matrix raises ``ValueError`` naming the argument and the fix. What is *not* an
error, and what it means:

* indices in any order, and repeated indices: the kernels sum over the entries of ``idx``, so a
  repeated row or channel is computed (or added) once per occurrence, exactly like the references
  (``W[idx]`` in torch). Pass unique indices (``mask.nonzero().flatten()``) for a masked-dense
  result;
* an empty index set: an empty result (row-sparse) or zeros (column-sparse, FFN);
* NaN or inf in ``x``: the result is torch's dense math on the selected rows and columns, so a
  NaN or inf that dense math would propagate is propagated, and one outside the selection has no
  effect. With a threshold the selection is ``|x| > threshold``, which is false for NaN: a NaN
  input is inactive, exactly as in ``torch.where(x.abs() > t, x, 0) @ W_t``;
* NaN or inf in the weights: a selected row propagates them like dense math; an unselected row
  is not read. (A weight row that another token of the batch selects by threshold is read on
  the CPU path with a zero activation, so there it gives 0 * inf = NaN; weights are assumed
  finite, and dense math with such weights is NaN for every token anyway.)
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "capturing",
    "check_activation",
    "check_ffn",
    "check_float32_cpu",
    "check_gather",
    "check_indices",
    "check_matrix",
    "check_same_device",
    "check_scatter",
    "check_tensor",
    "check_threshold",
    "check_vector",
    "is_index_dtype",
]

ACTIVATIONS = ("silu", "relu", "gelu")


def check_tensor(name: str, t: object) -> None:
    """t is a dense (strided) torch tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(t).__name__}; wrap it with torch.tensor()."
        )
    if t.layout != torch.strided:
        raise ValueError(
            f"{name} must be a dense tensor, got layout {t.layout}; use {name}.to_dense()."
        )


def check_matrix(name: str, W: Tensor) -> None:
    check_tensor(name, W)
    if W.dim() != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix, got shape {tuple(W.shape)}.")
    if not W.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor, got {W.dtype}; use {name}.float()."
        )


def check_vector(x: Tensor, width: int, what: str, name: str = "x") -> None:
    """x is [K] or [B, K] with K == width, floating point."""
    check_tensor(name, x)
    if x.dim() not in (1, 2) or x.shape[-1] != width:
        raise ValueError(
            f"{name} must have shape [{width}] or [batch, {width}] to match {what}, "
            f"got {tuple(x.shape)}; reshape {name} or pass the matching weight."
        )
    if not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor, got {x.dtype}; use {name}.float()."
        )


def is_index_dtype(dtype: torch.dtype) -> bool:
    """Integer dtypes (signed or unsigned); not bool, float or complex."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def capturing(t: Tensor) -> bool:
    """True while ``t``'s CUDA stream is being captured into a CUDA graph.

    A captured graph replays with whatever the index tensor holds at replay time, so a check
    of the values during capture would prove nothing (and reading them back to the host is
    not allowed while capturing): the range check is skipped there, and the code that fills
    the tensor between replays is responsible for it.
    """
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_indices(idx: Tensor, size: int, what: str) -> None:
    """idx is a 1-D integer tensor with values in [0, size)."""
    check_tensor("idx", idx)
    if idx.dim() != 1 or not is_index_dtype(idx.dtype):
        raise ValueError(
            f"idx must be a 1-D integer tensor of {what} indices, got dtype {idx.dtype} and "
            f"shape {tuple(idx.shape)}; use mask.nonzero().flatten() to turn a mask into indices."
        )
    if idx.numel() and not capturing(idx):
        low, high = (int(v) for v in torch.aminmax(idx.to(torch.int64)))
        if low < 0 or high >= size:
            raise ValueError(
                f"idx holds values outside [0, {size}) ({what} indices): min {low}, max {high}; "
                "drop or clamp the out-of-range entries."
            )


def check_same_device(*tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"All tensors must be on one device, got {sorted(map(str, devices))}; move them "
            "with .to(device)."
        )


def check_threshold(threshold: float | None, idx: Tensor | None) -> None:
    """Exactly one of threshold / idx; a threshold is a real number >= 0 (inf allowed)."""
    if (threshold is None) == (idx is None):
        raise ValueError(
            "Give exactly one of threshold= (in-kernel magnitude test) or idx= (active channel "
            "indices)."
        )
    if threshold is None:
        return
    is_scalar_tensor = isinstance(threshold, Tensor) and threshold.numel() == 1
    if isinstance(threshold, bool) or not (isinstance(threshold, numbers.Real) or is_scalar_tensor):
        raise TypeError(f"threshold must be a real number >= 0, got {threshold!r}.")
    if is_scalar_tensor and (threshold.is_complex() or threshold.dtype == torch.bool):
        raise TypeError(f"threshold must be a real number >= 0, got {threshold!r}.")
    if not float(threshold) >= 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold}.")


def check_activation(act: str) -> None:
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {act!r}; use one of {ACTIVATIONS}.")


def check_gather(W: Tensor, x: Tensor, idx: Tensor) -> None:
    check_matrix("W", W)
    check_vector(x, W.shape[1], f"W's {W.shape[1]} columns")
    check_indices(idx, W.shape[0], "row")
    check_same_device(W, x, idx)


def check_scatter(W_t: Tensor, x: Tensor, threshold: float | None, idx: Tensor | None) -> None:
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


def check_float32_cpu(**tensors: Tensor) -> None:
    """The compiled CPU loops read float32 CPU memory: say which argument is not."""
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(
                f"{name} must be on the CPU for the C loops, got {t.device}; use {name}.cpu()."
            )
        if t.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 for the C loops, got {t.dtype}; use {name}.float()."
            )
