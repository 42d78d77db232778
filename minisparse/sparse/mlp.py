"""Sparse FFN execution: a drop-in MLP that computes only the active neurons.

A gated MLP computes, per neuron j,

    h_j = act(W_gate[j] . x) * (W_up[j] . x),        y = sum_j h_j W_down[:, j]

Neurons whose h_j is (close to) zero contribute nothing, so their rows of W_up and W_gate and
their column of W_down need not be read. ``SparseMLP`` names the active neurons A in one of two
ways and runs the sparse kernels of ``minisparse.kernels`` on them:

* ``threshold`` (CATS, Lee et al. 2024): the gate is computed densely, a = act(W_gate x), and
  neuron j is active when |a_j| > t. Up and down then read only the rows of A:
      y = sum_{j in A} a_j (W_up[j] . x) W_down_t[j, :]
  This skips 2/3 of the MLP's bytes at most, and is exact for the masked model.
* ``select`` (DejaVu, Liu et al. 2023; PowerInfer, Song et al. 2023): a function of the MLP
  input returns the neuron indices A (a predictor, an oracle, a fixed hot set); gate, up and
  down are all sparse (``sparse_ffn``, fused on a GPU), so up to all of the MLP's bytes scale
  with |A|.

Either way the result equals the dense MLP with the other neurons' activations set to zero
(the test of this module). For several tokens at once (a prompt, a batch) the kernels read the
union of the tokens' active neurons while each token keeps its own mask, which is why sparsity
pays less as the batch grows.

The backend follows the weights: the Triton kernels on CUDA, the C fast path
(``minisparse.kernels.cpu``) elsewhere. The down projection is stored transposed
(``W_down_t``, [ffn, dim]) so each neuron's down weights are contiguous; on the CPU the three
matrices are placed in huge pages.

An MLP whose projections are chapter 09's ``Int8Linear`` (a model from
``quantize_model(bits=8, packed=True)``, or ``sparse.weights.int8_mlp``) becomes a sparse int8
MLP: the same paths over int8 codes with float32 scales (``minisparse.kernels.cpu_int8``), so
that sparsity and quantization multiply, (1 - s) / 4 of the float32 bytes of the sparse
matrices. Both layouts and their checkpoint names are in ``minisparse.sparse.weights``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from ..core.model import MLP
from ..kernels.cpu_int8 import gather_gemv_i8, scatter_gemv_i8, sparse_ffn_i8
from .masks import (
    MaskedMLP,
    Selector,
    gate_activations,
    masked_mlps,
    same_masks,
)
from .weights import (
    INT8_BUFFERS,
    checkpoint_state,
    checkpoint_targets,
    is_int8_mlp,
    sparse_buffers,
)

__all__ = [
    "ACT_NAMES",
    "BACKENDS",
    "PREFILL_TOKENS",
    "Gather",
    "MaskedMLP",
    "Selector",
    "SparseMLP",
    "activation_name",
    "check_maskable_mlp",
    "gate_activations",
    "kernel_ops",
    "masked_mlps",
    "resolve_backend",
    "same_masks",
]

BACKENDS = ("auto", "cpu", "triton")
Gather = Callable[[Tensor, Tensor, Tensor], Tensor]  # (W [N, K], x [tokens, K], idx) -> [tokens, n]
ACT_NAMES = {nn.SiLU: "silu", nn.ReLU: "relu"}


def activation_name(act: nn.Module) -> str | None:
    """The kernels' name for an activation module, or None when they do not know it."""
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else None
    return ACT_NAMES.get(type(act))


#: More tokens than this in one call (more than a decode step or a verification pass takes) are
#: a prompt's prefill, which reads every neuron through dense matmuls (``SparseMLP``).
PREFILL_TOKENS = 8


def resolve_backend(backend: str, device: torch.device) -> str:
    """The kernels a backend name means for weights on ``device``: "cpu" or "triton".

    "auto" is Triton on CUDA and the C fast path elsewhere. Raises a clear error when the
    kernels cannot run there.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; use one of {BACKENDS}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(
            "backend='cpu' needs the MLP's weights on the CPU; move the model with "
            ".cpu() or use backend='auto'."
        )
    if backend == "triton":
        from ..kernels.interpreter import triton_available, user_setting

        if not triton_available():
            raise ImportError(
                "backend='triton' needs the triton package (Linux: pip install triton); use "
                "backend='cpu' (or 'auto') on this machine."
            )
        if device.type != "cuda" and user_setting() is False:
            raise RuntimeError(
                "backend='triton' needs CUDA, and no CUDA device holds these weights while "
                "TRITON_INTERPRET is set to a false value; use backend='cpu' (or 'auto'), move "
                "the model to a GPU, or unset TRITON_INTERPRET to run the Triton kernels slowly "
                "on the CPU."
            )
    return backend


def kernel_ops(backend: str, device: torch.device) -> ModuleType:
    """The module holding gather_gemv / scatter_gemv / sparse_ffn for a backend."""
    if resolve_backend(backend, device) == "cpu":
        from ..kernels import cpu

        return cpu
    from .. import kernels

    return kernels


def check_maskable_mlp(mlp: MLP, who: str) -> None:
    """What a module that computes a subset of ``mlp``'s neurons needs (``who`` names it in the
    error): no biases (the Llama family), and nothing at the down projection's input, since it
    masks act(gate x) * (up x) itself."""
    if any(p.bias is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        raise ValueError(f"{who} supports bias-free MLPs (the Llama family); this MLP has biases.")
    if not isinstance(mlp.down_in_act, nn.Identity):
        raise ValueError(
            f"{who} masks act(gate x) itself and cannot keep a module at the down projection's "
            "input; take it out first (minisparse.sparsity.remove_thresholds_)."
        )


class SparseMLP(nn.Module):
    """A gated MLP that reads only the weights of its active neurons.

    Build it from a dense ``MLP`` with either ``threshold`` (|act(gate x)| > threshold) or
    ``select`` (a function x [tokens, dim] -> neuron indices). ``backend``: "auto" (Triton on
    CUDA, C fast path on CPU), "cpu" or "triton"; the module keeps the name and picks the
    kernels at each call from where its weights are, so it can be deep-copied, pickled and
    moved between devices.

    More than ``PREFILL_TOKENS`` float32 tokens at once on the CPU (a prompt's prefill) read the
    whole matrices with dense matmuls and mask them: their union is nearly every neuron.

    Its ``state_dict`` is the dense MLP's (``gate_proj.weight``, ``up_proj.weight``,
    ``down_proj.weight`` [dim, ffn]): a sparsified model saves and loads the same checkpoints
    as the dense one.

    ``gather`` (float32 weights only): a function (W [N, K], x [tokens, K], idx [n]) ->
    [tokens, n] that computes the row-sparse products x W[idx]^T in place of the backend's
    ``gather_gemv`` (the up rows in threshold mode; gate and up, unfused, in select mode; a
    CPU prefill reads whole matrices as above). Chapter 07 plugs the reader's own kernel in
    here; such a module runs in torch, never in the compiled decode step. Default None: the
    backend's kernel.

    Given an MLP of ``Int8Linear`` projections it keeps their int8 codes and scales instead
    (``int8`` is True; buffers ``Q_gate``, ``s_gate``, ``Q_up``, ``s_up``, ``Q_down_t``,
    ``s_down``) and runs the int8 kernels, on the CPU (torch elsewhere; there are no Triton int8
    kernels); its ``state_dict`` is then the int8 MLP's (``gate_proj.q``, ``gate_proj.scale``,
    ...).
    """

    def __init__(
        self,
        mlp: MLP,
        threshold: float | None = None,
        select: Selector | None = None,
        backend: str = "auto",
        gather: Gather | None = None,
    ) -> None:
        super().__init__()
        if (threshold is None) == (select is None):
            raise ValueError(
                "Give exactly one of threshold= (mask |act(gate x)| <= threshold) or select= "
                "(a function returning the active neuron indices)."
            )
        if threshold is not None and not threshold >= 0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold}.")
        check_maskable_mlp(mlp, "SparseMLP")
        self.int8 = is_int8_mlp(mlp)
        self.backend = backend
        device = (mlp.gate_proj.q if self.int8 else mlp.gate_proj.weight).device
        if self.int8 and resolve_backend(backend, device) == "triton":
            raise ValueError(
                "There are no Triton kernels for int8 weights: use backend='cpu' or 'auto' (on "
                "a GPU, 'auto' runs the int8 paths through torch)."
            )
        ops = kernel_ops(backend, device)
        place = ops.hugepage_copy if hasattr(ops, "hugepage_copy") else torch.clone
        with torch.no_grad():
            for name, value in sparse_buffers(mlp).items():
                value = place(value) if value.dim() == 2 else value.clone()
                self.register_buffer(name, value, persistent=False)
        self.act = mlp.act
        self.act_name = activation_name(mlp.act)
        self.threshold = threshold
        self.select = select
        if gather is not None and self.int8:
            raise ValueError("gather= computes float32 rows; this MLP holds int8 weights.")
        self.gather = gather
        self.last_density = 1.0  # fraction of neurons read in the last call (for reporting)
        self.last_keep: Tensor | None = None  # the last call's mask [tokens, ffn] (for tests)
        self.step_density = [0.0, 0]  # summed share of neurons read by one-token calls, calls

    @property
    def ops(self) -> ModuleType:
        """The kernels for this module's backend and the device its weights are on now."""
        return kernel_ops(self.backend, self._gate.device)

    @property
    def _gate(self) -> Tensor:
        return self._buffers["Q_gate" if self.int8 else "W_gate"]

    @property
    def ffn_dim(self) -> int:
        return self._gate.shape[0]

    def dense_state(self) -> dict[str, Tensor]:
        """The weights in the dense MLP's names and layouts (down_proj.weight is [dim, ffn]);
        for int8 weights the int8 MLP's (``Int8Linear``'s q and scale of each projection)."""
        return checkpoint_state(self)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        for name, value in self.dense_state().items():
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load the dense MLP's keys into the sparse layout (down_proj.weight transposed)."""
        targets = checkpoint_targets(self)
        for name, target in targets.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, Tensor) or value.shape != target.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape}, the "
                    f"SparseMLP holds {tuple(target.shape)}."
                )
                continue
            with torch.no_grad():
                target.copy_(value)
        if strict:
            for key in state_dict:
                rest = key[len(prefix) :] if key.startswith(prefix) else None
                if (
                    rest is not None
                    and rest not in targets
                    and rest.split(".")[0] not in (self._modules)
                ):
                    unexpected_keys.append(key)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self._many(flat):
            y = self._forward_many(flat)
        elif self.threshold is not None:
            y = self._forward_threshold(flat)
        else:
            y = self._forward_select(flat)
        if flat.shape[0] == 1:  # a decode step: what it read counts towards bytes per token
            self.step_density = [self.step_density[0] + self.last_density, self.step_density[1] + 1]
        return y.reshape(*shape[:-1], y.shape[-1])

    def _many(self, x: Tensor) -> bool:
        """More than ``PREFILL_TOKENS`` float32 tokens at once on the CPU kernels: a prefill."""
        return (
            x.shape[0] > PREFILL_TOKENS
            and not self.int8
            and resolve_backend(self.backend, x.device) == "cpu"
        )

    def _forward_many(self, x: Tensor) -> Tensor:
        """A prompt's prefill: the neurons active for some token of a long prompt are nearly all
        of them, so gathering their rows reads the whole matrices anyway, one token vector at a
        time; torch's dense matmuls read them once for all tokens, blocked for the cache. Each
        token keeps only its own neurons (thresholds) or the union (select), as in the
        gathered paths, so the values are theirs up to float32 rounding."""
        a = self.act(x @ self.W_gate.T)
        if self.threshold is not None:
            keep = a.abs() > self.threshold
            idx = keep.any(0).nonzero().flatten()
        else:
            idx = self.select(x).to(device=x.device, dtype=torch.int64)
            keep = torch.zeros(x.shape[0], self.ffn_dim, dtype=torch.bool, device=x.device)
            keep[:, idx] = True
        self.last_density, self.last_keep = idx.numel() / self.ffn_dim, keep
        h = torch.where(keep, a * (x @ self.W_up.T), torch.zeros((), dtype=x.dtype))
        return h @ self.W_down_t

    def _rows(self, name: str, x: Tensor, idx: Tensor) -> Tensor:
        """x @ W_name[idx].T for name "gate" or "up": [tokens, n]."""
        if self.int8:
            return gather_gemv_i8(self._buffers[f"Q_{name}"], self._buffers[f"s_{name}"], x, idx)
        gather = self.ops.gather_gemv if self.gather is None else self.gather
        return gather(self._buffers[f"W_{name}"], x, idx)

    def _down(self, h: Tensor, idx: Tensor) -> Tensor:
        """The down projection of h [tokens, ffn], reading the rows idx of W_down_t."""
        if self.int8:
            return scatter_gemv_i8(self.Q_down_t, self.s_down, h, idx=idx)
        return self.ops.scatter_gemv(self.W_down_t, h, idx=idx)

    def _forward_threshold(self, x: Tensor) -> Tensor:
        if self.int8:  # dense gate: it decides which neurons run
            a = self.act(self._rows("gate", x, _all_rows(self.ffn_dim, x.device)))
        else:
            a = self.act(x @ self.W_gate.T)
        keep = a.abs() > self.threshold
        idx = keep.any(0).nonzero().flatten()  # union over the tokens
        self.last_density, self.last_keep = idx.numel() / self.ffn_dim, keep
        up = self._rows("up", x, idx)  # [tokens, n]
        h = torch.zeros_like(a)
        h[:, idx] = torch.where(keep[:, idx], a[:, idx] * up, torch.zeros_like(up))
        return self._down(h, idx)

    def _forward_select(self, x: Tensor) -> Tensor:
        idx = self.select(x).to(device=x.device, dtype=torch.int64)
        self.last_density = idx.numel() / self.ffn_dim
        self.last_keep = torch.zeros(x.shape[0], self.ffn_dim, dtype=torch.bool, device=x.device)
        self.last_keep[:, idx] = True
        if self.act_name is not None and self.int8:
            weights = [self._buffers[name] for name in INT8_BUFFERS]
            return sparse_ffn_i8(x, *weights, idx, self.act_name)
        if self.act_name is not None and self.gather is None:
            return self.ops.sparse_ffn(x, self.W_gate, self.W_up, self.W_down_t, idx, self.act_name)
        gate = self.act(self._rows("gate", x, idx))
        h = torch.zeros(x.shape[0], self.ffn_dim, dtype=x.dtype, device=x.device)
        h[:, idx] = gate * self._rows("up", x, idx)
        return self._down(h, idx)


@functools.lru_cache(maxsize=16)
def _all_rows(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device)
