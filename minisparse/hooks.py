"""Capturing intermediate activations with forward hooks.

A forward hook runs after a module's ``forward`` and sees its output; registering one on every
``mlp.act`` module records the MLP activations a(x) = act(W_gate x) of every layer without
changing the model. Hooks are removed when the ``with`` block ends, even after an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def capture_outputs(
    modules: dict[str, nn.Module],
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[dict[str, list[Tensor]]]:
    """Collect each named module's outputs (detached, on CPU) while the block runs.

    ``reduce`` maps an output to what is kept (e.g. a subsample) to bound memory.
    """
    store: dict[str, list[Tensor]] = {name: [] for name in modules}
    handles = []

    def make_hook(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
            out = output.detach()
            store[name].append((reduce(out) if reduce else out).cpu())

        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_hook(make_hook(name)))
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
