"""Chapter 01's builds run inside the real model: the learner's RoPE and attention.

``attention_with(model, rope=..., attend=...)`` puts the learner's functions into every layer's
attention for the duration of a ``with`` block: ``rope(x, cos, sin)`` rotates queries and keys
([batch, heads, seq, head_dim]) and ``attend(q, k, v)`` is causal grouped-query attention whose t
queries are the last t of the n keys (a prompt: t = n; a decode step with a cache: t = 1). The
projections are the model's own (shared, not copied). Such an attention is not the core type, so
the compiled decode step runs it as torch and ``generate`` works unchanged. The graded builds
themselves are ``rope`` and ``gqa_attention`` (registered with the small exercises; their cases
in ``course.sets_early``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor

from ...core.model import Attention, Transformer

__all__ = ["CourseAttention", "attention_with"]

Rope = Callable[[Tensor, Tensor, Tensor], Tensor]
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class CourseAttention(Attention):
    """The model's attention with the rotation and/or the attention core given as functions."""

    def __init__(self, attn: Attention, rope: Rope | None, attend: Attend | None) -> None:
        super(Attention, self).__init__()  # nn.Module only: the projections are attn's own
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        )  # fmt: skip
        self.rope_fn, self.attend_fn = rope, attend

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return super().rotate(x, cos, sin) if self.rope_fn is None else self.rope_fn(x, cos, sin)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        if self.attend_fn is None:
            return super().attend(q, k, v, input_pos)
        n, t = k.shape[2], q.shape[2]
        if int(input_pos[0]) != n - t:
            raise ValueError(
                f"attend(q, k, v) takes queries that are the last {t} of the {n} keys; these "
                f"start at position {int(input_pos[0])}. Use a cache that returns positions "
                "0 .. n - 1 (the static or the paged one)."
            )
        return self.attend_fn(q, k, v)


@contextlib.contextmanager
def attention_with(
    model: Transformer, rope: Rope | None = None, attend: Attend | None = None
) -> Iterator[Transformer]:
    """Within the block, every layer of ``model`` rotates with ``rope`` and attends with
    ``attend`` (None: the model's own); the model's attention modules come back afterwards."""
    layers = list(model.layers)
    originals = [layer.attn for layer in layers]
    try:
        for layer, attn in zip(layers, originals, strict=True):
            layer.attn = CourseAttention(attn, rope, attend)
        yield model
    finally:
        for layer, attn in zip(layers, originals, strict=True):
            layer.attn = attn
