"""Capturing intermediate activations (and layer inputs) with forward hooks.

A forward hook runs after a module's ``forward`` and sees its output; registering one on every
``mlp.act`` module records the MLP activations a(x) = act(W_gate x) of every layer without
changing the model. A forward *pre*-hook runs before ``forward`` and sees the inputs
(``capture_inputs``): the calibration data of a linear layer. Hooks are removed when the
``with`` block ends, even after an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "capture_inputs",
    "capture_outputs",
    "mlp_activation_modules",
    "mlp_activations",
    "zero_fraction",
]


@contextmanager
def capture_outputs(
    modules: dict[str, nn.Module],
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[dict[str, list[Tensor]]]:
    """Collect each named module's outputs (detached, on CPU) while the block runs.

    ``reduce`` maps an output to what is kept (e.g. a subsample) to bound memory.
    """
    with _capture(modules, reduce, inputs=False) as store:
        yield store


@contextmanager
def capture_inputs(
    modules: dict[str, nn.Module],
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[dict[str, list[Tensor]]]:
    """Collect each named module's first positional input (detached, on its device).

    A forward pre-hook sees what a layer receives: the calibration data of a linear layer whose
    input is not the output of any module (o_proj, down_proj).
    """
    with _capture(modules, reduce, inputs=True) as store:
        yield store


@contextmanager
def _capture(
    modules: dict[str, nn.Module],
    reduce: Callable[[Tensor], Tensor] | None,
    inputs: bool,
) -> Iterator[dict[str, list[Tensor]]]:
    store: dict[str, list[Tensor]] = {name: [] for name in modules}
    handles = []

    def keep(name: str, x: Tensor) -> None:
        x = x.detach()
        x = reduce(x) if reduce else x
        store[name].append(x if inputs else x.cpu())

    def make_hook(name: str) -> Callable[..., None]:
        if inputs:
            return lambda _module, args: keep(name, args[0])
        return lambda _module, _args, output: keep(name, output)

    for name, module in modules.items():
        register = module.register_forward_pre_hook if inputs else module.register_forward_hook
        handles.append(register(make_hook(name)))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def mlp_activation_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The ``mlp.act`` module of every layer, keyed ``layer<i>``."""
    return {f"layer{i}": layer.mlp.act for i, layer in enumerate(model.layers)}


@torch.inference_mode()
def mlp_activations(model: nn.Module, tokens: Tensor) -> dict[str, Tensor]:
    """Per layer, the MLP activation act(W_gate x) for ``tokens``: [tokens, ffn_dim] each."""
    with capture_outputs(mlp_activation_modules(model)) as store:
        model(tokens.to(next(model.parameters()).device))
    return {
        name: torch.cat([o.reshape(-1, o.shape[-1]) for o in outs]) for name, outs in store.items()
    }


def zero_fraction(x: Tensor, below: float = 0.0) -> float:
    """Share of entries with |x| <= below (below = 0 counts exact zeros)."""
    return float((x.abs() <= below).float().mean())
