"""The bytes a batch-1 decode step reads: the number every roofline of the course divides by.

A dense step reads each weight once, in its own format's bytes (``quant.streamed_bytes``:
float32 4 bytes, int8 1 byte plus its scales, int4 half a byte plus its scales). A sparse MLP
(``SparseMLP``) reads only its active neurons, so its count follows the density it ran at.
The engine, chapter 08's calibration and the benchmarks all count bytes with ``step_bytes``.
"""

from __future__ import annotations

from ..core.model import Transformer
from ..quant.apply import streamed_bytes
from .mlp import SparseMLP

__all__ = ["step_bytes"]


def step_bytes(model: Transformer) -> float:
    """Weight bytes one batch-1 decode step reads, sparse MLPs at their last density.

    Every weight is read once (``quant.streamed_bytes``), except in a ``SparseMLP``: with a
    threshold it reads its gate densely and the active share d of up and down,
    (1 + 2 d) / 3 of its bytes; with a selector, d of all three. d is the mean share the
    module read over its one-token calls so far (``step_density``: the decode steps it ran);
    before any, the mean per-token share of its last call's mask (``last_keep``). A
    verification pass over several tokens reads the union of their neurons, more than this.
    Projections whose inputs pass a magnitude threshold (TEAL) are counted in full: the rows
    they skip depend on each token's zeros, which the model does not record
    (``minisparse bench sparse-decode`` measures them).
    """
    total = float(streamed_bytes(model))
    for m in model.modules():
        if not isinstance(m, SparseMLP):
            continue
        counted = streamed_bytes(m)
        own = sum(t.numel() * t.element_size() for t in m.buffers())
        summed, steps = m.step_density
        keep = m.last_keep
        if steps:
            d = summed / steps
        else:
            d = float(keep.float().mean()) if keep is not None else m.last_density
        share = (1 + 2 * d) / 3 if m.threshold is not None else d
        total += own * share - counted
    return total
