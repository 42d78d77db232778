"""Chapter 00's build runs inside the real model: the learner's RMSNorm.

``norms_with(model, rms_norm)`` makes every RMSNorm of ``model`` (two per layer and the final
one) call ``rms_norm(x, weight, eps)`` for the duration of a ``with`` block, with the model's own
weights. The compiled decode step does not know such a norm, so it runs those halves as torch;
the parity check against ``transformers`` then tests the learner's function on the real model.
The graded build is ``rms_norm`` (registered with the small exercises, cases in
``course.sets_early``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor, nn

from ...core.model import RMSNorm, Transformer

__all__ = ["CourseNorm", "norms_with"]

Norm = Callable[[Tensor, Tensor, float], Tensor]


class CourseNorm(RMSNorm):
    """An RMSNorm that computes with a given function and the original module's weight."""

    def __init__(self, norm: RMSNorm, fn: Norm) -> None:
        nn.Module.__init__(self)
        self.eps, self.weight, self.fn = norm.eps, norm.weight, fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, self.weight, self.eps)


@contextlib.contextmanager
def norms_with(model: Transformer, rms_norm: Norm) -> Iterator[Transformer]:
    """Within the block, every RMSNorm of ``model`` is ``rms_norm``; the originals come back."""
    slots = [(layer, name) for layer in model.layers for name in ("attn_norm", "mlp_norm")]
    slots.append((model, "norm"))
    originals = [getattr(owner, name) for owner, name in slots]
    try:
        for (owner, name), norm in zip(slots, originals, strict=True):
            setattr(owner, name, CourseNorm(norm, rms_norm))
        yield model
    finally:
        for (owner, name), norm in zip(slots, originals, strict=True):
            setattr(owner, name, norm)
