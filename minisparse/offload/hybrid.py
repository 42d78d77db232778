"""The hybrid executor: every MLP split into a hot part (fast device) and a cold part (CPU).

A gated MLP is a sum over its neurons, y = sum_j act(W_gate[j] x) (W_up[j] x) W_down[:, j], so
it splits exactly into the sum over the hot neurons plus the sum over the cold ones. Each part
is a ``SparseMLP`` over its own neurons: it computes only the neurons its mask keeps (the
chapter 03 threshold, i.e. the oracle, or a chapter 06 predictor's choice), with the chapter
07 kernels of the device it sits on. The two partial outputs are added on the input's device.

On CUDA the hot part runs on the GPU in a worker thread while the CPU computes the cold part,
and the only traffic is the layer's input going down and the cold part's output coming back,
as in PowerInfer. Without a GPU both parts run on the CPU: the logits are exact and the
fast-device load is measured from the masks each part really used, while the *time* of the
hybrid system comes from ``minisparse.offload.time_model``'s model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from ..core.model import MLP, Transformer
from ..sparse.masks import layer_selector
from ..sparse.mlp import SparseMLP
from ..sparse.swap import swap_mlps_
from ..sparsity import per_layer
from .placement import Placement

__all__ = ["HotColdMLP", "PartSelector", "apply", "executed_load", "neuron_subset"]


def neuron_subset(mlp: MLP, neurons: Tensor) -> MLP:
    """An MLP holding only ``neurons``: its output is the full MLP's sum over those neurons."""
    part = MLP.__new__(MLP)
    nn.Module.__init__(part)
    dim, idx = mlp.gate_proj.in_features, neurons.long()
    part.gate_proj = nn.Linear(dim, len(idx), bias=False)
    part.up_proj = nn.Linear(dim, len(idx), bias=False)
    part.down_proj = nn.Linear(len(idx), dim, bias=False)
    with torch.no_grad():
        part.gate_proj.weight.copy_(mlp.gate_proj.weight[idx])
        part.up_proj.weight.copy_(mlp.up_proj.weight[idx])
        part.down_proj.weight.copy_(mlp.down_proj.weight[:, idx])
    part.act, part.down_in_act = mlp.act, mlp.down_in_act
    return part


class PartSelector:
    """Restrict a selector (x -> active neuron indices of the layer) to one part's neurons."""

    def __init__(self, select: Callable[[Tensor], Tensor], neurons: Tensor, width: int) -> None:
        self.select = select
        self.local = torch.full((width,), -1, dtype=torch.long)
        self.local[neurons.long()] = torch.arange(len(neurons))

    def __call__(self, x: Tensor) -> Tensor:
        idx = self.select(x).long()
        local = self.local.to(idx.device)[idx]
        return local[local >= 0]


class HotColdMLP(nn.Module):
    """An MLP as two ``SparseMLP`` parts: ``hot`` neurons on ``fast_device``, the rest on the CPU.

    Give ``threshold`` (keep |act(gate x)| > threshold: the oracle) or ``select`` (a function of
    the MLP input returning the active neuron indices, e.g.
    ``predictors.select.for_layer(layer)``, which the compiled step runs in C). ``work`` counts,
    over all calls, the active neurons each part computed (summed over tokens).
    """

    def __init__(
        self,
        mlp: MLP,
        hot: Tensor,
        threshold: float | None = None,
        select: Callable[[Tensor], Tensor] | None = None,
        fast_device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        width = mlp.gate_proj.out_features
        if hot.dtype != torch.bool or hot.shape != (width,):
            raise ValueError(f"hot must be a boolean tensor of {width} neurons, got {hot.shape}.")
        self.register_buffer("hot", hot.clone())
        self.fast = self._part(mlp, hot.nonzero().flatten(), threshold, select, width)
        self.slow = self._part(mlp, (~hot).nonzero().flatten(), threshold, select, width)
        if self.fast is not None and fast_device is not None:
            self.fast.to(fast_device)
        self.work = {"fast": 0, "slow": 0}

    @staticmethod
    def _part(
        mlp: MLP,
        neurons: Tensor,
        threshold: float | None,
        select: Callable[[Tensor], Tensor] | None,
        width: int,
    ) -> SparseMLP | None:
        if neurons.numel() == 0:
            return None
        part_select = None if select is None else PartSelector(select, neurons, width)
        return SparseMLP(neuron_subset(mlp, neurons), threshold=threshold, select=part_select)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        parts = {name: p for name, p in (("fast", self.fast), ("slow", self.slow)) if p is not None}

        def run(part: SparseMLP) -> Tensor:
            return part(flat.to(part.W_gate.device)).to(x.device)

        concurrent = "fast" in parts and "slow" in parts
        concurrent = concurrent and parts["fast"].W_gate.device != parts["slow"].W_gate.device
        if concurrent:  # the GPU part in a thread while this one computes the CPU part
            with ThreadPoolExecutor(max_workers=1) as pool:
                fast = pool.submit(run, parts["fast"])
                outputs = [run(parts["slow"]), fast.result()]
        else:
            outputs = [run(p) for p in parts.values()]
        for name, part in parts.items():
            self.work[name] += int(part.last_keep.sum())
        y = outputs[0] if len(outputs) == 1 else outputs[0] + outputs[1]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def keep(self) -> Tensor:
        """The last call's mask over all the layer's neurons [tokens, ffn] (True = computed)."""
        parts = [(self.hot, self.fast), (~self.hot, self.slow)]
        tokens = next(p.last_keep.shape[0] for _, p in parts if p is not None)
        keep = torch.zeros(tokens, self.hot.numel(), dtype=torch.bool)
        for mask, part in parts:
            if part is not None:
                keep[:, mask] = part.last_keep.cpu()
        return keep


def apply(
    model: Transformer,
    placement: Placement,
    thresholds: float | Sequence[float] | None = None,
    select: Callable[[int, Tensor], Tensor] | None = None,
    fast_device: str | torch.device | None = None,
) -> Transformer:
    """A copy of ``model`` whose MLPs are ``HotColdMLP``s split as ``placement`` says.

    ``thresholds`` (one, or one per layer) or ``select(layer, x)`` decides each token's active
    neurons; the argument is left unchanged (no trailing underscore).
    """
    if (thresholds is None) == (select is None):
        raise ValueError("Give exactly one of thresholds= (the oracle) or select= (predictors).")
    n = len(model.layers)
    if len(placement.hot) != n:
        raise ValueError(f"The placement has {len(placement.hot)} layers, the model {n}.")
    limits = [None] * n if thresholds is None else per_layer(thresholds, n)
    new = copy.deepcopy(model)
    mlps = [
        HotColdMLP(
            layer.mlp,
            placement.hot[i],
            threshold=limits[i],
            select=None if select is None else layer_selector(select, i),
            fast_device=fast_device,
        )
        for i, layer in enumerate(new.layers)
    ]
    swap_mlps_(new, mlps)
    return new


def executed_load(model: Transformer) -> float:
    """The fast parts' share of the active neurons computed since the split (all layers)."""
    mlps = [layer.mlp for layer in model.layers if isinstance(layer.mlp, HotColdMLP)]
    fast = sum(m.work["fast"] for m in mlps)
    total = fast + sum(m.work["slow"] for m in mlps)
    return fast / total if total else float("nan")
