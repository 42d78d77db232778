"""Exercises that check the learner's own code: one call compares it with the library.

Every chapter asks the learner to write two or three of the functions it teaches from stubs, e.g.

    def my_apply_rope(x, cos, sin): ...
    minisparse.course.exercises.check("rope", my_apply_rope)

``check`` runs the learner's function and the library's on fresh random inputs with odd
shapes (a new seed every call unless one is given), and prints either a pass or the first
mismatch: which input, what was expected, what came back, and a hint. It returns True or False,
so a notebook cell can also ``assert`` it. ``EXERCISES`` holds what each exercise asks (its
chapter, task, hint and how answers are compared); the inputs and the library functions they
are checked against live in ``sets_early`` (chapters 00–05) and
``sets_late`` (06–11). Worked solutions live in ``notebooks/solutions/``; the tests
check that every solution passes and that a wrong answer fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .grading import (
    EXERCISES,
    TIME_LIMIT,
    Exercise,
    check,
    close,
    equal,
    exact,
    loose,
    near,
    register,
)
from .sets_early import CASES as EARLY
from .sets_late import CASES as LATE

__all__ = ["EXERCISES", "TIME_LIMIT", "Exercise", "check"]


def _same_units_pass(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    """Any cutoff that lets exactly the reference's units through (logit > cutoff)."""
    logits = args[0]
    return bool(torch.equal(logits > float(got), logits > float(expected)))


def _exercise(
    name: str,
    chapter: str,
    task: str,
    same: Callable[[Any, Any], bool],
    hint: str,
    accepts: Callable[[tuple[Any, ...], Any, Any], bool] | None = None,
) -> tuple[str, Exercise]:
    reference, cases = {**EARLY, **LATE}[name]
    return name, Exercise(chapter, task, reference, cases, same, hint, accepts)


_ENTRIES: list[tuple[str, Exercise]] = [
        _exercise(
            "rms_norm", "00",
            "rms_norm(x [..., d], weight [d], eps) -> x / sqrt(mean(x^2) + eps) * weight, the "
            "mean over the last axis",
            close,
            "the mean of the squares over the last axis only (keepdim=True), eps inside the "
            "square root, and no mean subtracted first (that would be LayerNorm)",
        ),
        _exercise(
            "sampling_probs", "00",
            "sampling_probs(logits [..., vocab], temperature, top_k) -> softmax(logits / "
            "temperature) over each row's top_k largest logits (all when top_k is None), 0 "
            "elsewhere",
            close,
            "divide by the temperature before the softmax; set the logits below the k-th "
            "largest of their row to -inf (k at most the vocabulary) so the kept ones sum to 1",
        ),
        _exercise(
            "rope", "01",
            "apply_rope(x [batch, heads, seq, d], cos [seq, d], sin [seq, d]) -> x rotated",
            close,
            "pair x_i with x_(i + d/2) (rotate half), not neighbours; "
            "y = x cos + rotate_half(x) sin",
        ),
        _exercise(
            "gqa_attention", "01",
            "gqa_attention(q [b, H, t, d], k [b, G, n, d], v [b, G, n, d]) -> [b, H, t, d]: "
            "causal softmax(q k^T / sqrt(d)) v, query head h reading K/V head h // (H / G); the "
            "t queries are the last t of the n tokens (query i at position n - t + i)",
            loose,
            "repeat each K/V head H/G times next to itself (repeat_interleave on dim 1; repeat "
            "tiles them instead), scale by 1/sqrt(d), hide future keys (key j > n - t + i) with "
            "-inf: with a cache (t < n) the mask is offset, not the square triu of a prompt",
        ),
        _exercise(
            "kv_bytes", "02",
            "kv_bytes(layers, kv_heads, head_dim, seq, batch) -> bytes of an fp16 KV cache",
            exact,
            "keys AND values (x 2), 2 bytes each in fp16, and only the K/V heads (GQA), not all "
            "heads",
        ),
        _exercise(
            "sink_visible", "02",
            "sink_visible(q_pos [t], k_pos [n], n_sink, window) -> bool [t, n]: True where the "
            "query at position p sees the cached key at j: j <= p and (j < n_sink or "
            "j > p - window)",
            equal,
            "broadcast q_pos[:, None] against k_pos[None, :]; the window holds the last `window` "
            "positions p - window + 1 .. p, so its test is the strict j > p - window",
        ),
        _exercise(
            "paged_slots", "02",
            "paged_slots(table [list of physical block ids], block_size, positions [n]) -> "
            "slots [n]: table[p // block_size] * block_size + p % block_size",
            equal,
            "the table maps logical block p // B to a physical *block*: multiply that block "
            "number by block_size before adding the offset p % B",
        ),
        _exercise(
            "top_share", "03",
            "top_share(values [n] >= 0, share) -> the fraction of sum(values) that the "
            "k = round(share * n) largest values carry",
            near,
            "sort descending, sum the first k (k = round(share * n), Python's round), divide by "
            "the total; 0.0 when the total is 0",
        ),
        _exercise(
            "lr_schedule", "04",
            "lr_schedule(step, lr, warmup, steps, min_lr_ratio) -> the learning rate of 0-based "
            "`step`: linear warm-up, then a cosine from lr to min_lr_ratio * lr at `steps`",
            near,
            "lr (step + 1) / warmup while step < warmup; then progress = min((step - warmup) / "
            "max(steps - warmup, 1), 1) and lr (r + (1 - r)(1 + cos(pi progress)) / 2)",
        ),
        _exercise(
            "top_mask", "05",
            "top_mask(scores [..., n], sparsity) -> bool [..., n]: per row, True for the "
            "k = max(1, n - round(sparsity * n)) largest scores",
            equal,
            "sparsity is the share dropped: keep n - round(s n) units per row, never fewer than "
            "1; torch.topk(scores, k, dim=-1).indices gives them",
        ),
        _exercise(
            "drop_heads", "05",
            "drop_heads(x [..., n_heads * d], keep [..., n_heads] bool, n_heads) -> x with the "
            "d channels of every dropped head set to 0",
            equal,
            "head i owns the consecutive channels i*d .. (i+1)*d - 1: view x as "
            "[..., n_heads, d] and multiply by keep[..., None]",
        ),
        _exercise(
            "recall_precision", "06",
            "recall_precision(predicted bool, actual bool) -> (recall, precision), counted over "
            "all entries",
            near,
            "TP = (predicted & actual).sum(); recall = TP / actual.sum(), precision = TP / "
            "predicted.sum(), and 1.0 when that denominator is 0",
        ),
        _exercise(
            "recall_cutoff", "06",
            "recall_cutoff(logits [tokens, n], active bool [tokens, n], recall) -> the highest "
            "cutoff c such that logit > c finds a share >= recall of the active units",
            near,  # replaced by ``accepts``: any c that lets the same units through passes
            "only the N active units' logits count: k = int((1 - recall) * N) of them may fall "
            "at or below c, so c is their k-th smallest; for k = 0 just below the smallest "
            "(min - 1e-6); inf when nothing is active",
            _same_units_pass,
        ),
        _exercise(
            "scatter_gemv", "07",
            "scatter_gemv(W_t [K, N], x [K] or [B, K], threshold) -> [N] or [B, N]: "
            "the sum over the channels with |x_k| > threshold of x_k W_t[k], per row",
            loose,
            "select the rows of W_t of the active channels and leave the others out of the "
            "sum; multiplying them by 0 is not the same when they hold NaN (0 x NaN = NaN)",
        ),
        _exercise(
            "sparse_ffn", "07",
            "sparse_ffn(x, W_gate [N, K], W_up [N, K], W_down_t [N, K], idx [m], act) -> "
            "act(x W_gate[idx]^T) * (x W_up[idx]^T) @ W_down_t[idx]",
            loose,
            "act (silu, relu or exact gelu, as F.gelu) applies to the gate product alone, then "
            "times the up product; only the rows idx of all three matrices; empty idx: zeros",
        ),
        _exercise(
            "fast_load", "08",
            "fast_load(hot [per layer bool], frequencies [per layer]) -> share of activations "
            "on hot",
            lambda a, b: abs(float(a) - float(b)) < 1e-9,
            "sum the frequencies of the hot neurons over all layers, divided by the sum of all",
        ),
        _exercise(
            "top_overlap", "08",
            "top_overlap(a [n], b [n], share) -> |top_a & top_b| / k for the "
            "k = max(1, round(share * n)) most frequent neurons of a and of b",
            near,
            "rank by a stable descending sort (ties: the lower index first); divide the size of "
            "the intersection by k, not by the size of the union",
        ),
        _exercise(
            "quantize_groups", "09",
            "quantize_groups(x [rows, cols], bits, group_size) -> x after a symmetric round "
            "trip, one scale per group of consecutive columns",
            loose,
            "per group of group_size columns of a row: scale = max|x| / (2^(bits-1) - 1); "
            "q = round(x / scale), clamped to the signed bits-bit range; x_hat = q * scale",
        ),
        _exercise(
            "smoothquant_scales", "09",
            "smoothquant_scales(x [tokens, in], weights [list of [out_i, in]], alpha) -> s [in]: "
            "s_j = max|x_j|^alpha / max|W_j|^(1 - alpha)",
            loose,
            "maxima of |.| per input channel: x over its tokens, W over the rows of all the "
            "weights together; s_j = 1 where either maximum is 0, and s >= 1e-5",
        ),
        _exercise(
            "verify_greedy", "10",
            "verify(target_logits [k + 1, vocab], draft_tokens [k]) -> (accepted, next_token)",
            lambda a, b: tuple(a) == tuple(b),
            "accept while draft i == argmax of row i; next_token is the argmax of the row after "
            "the last accepted draft (row k when all k are accepted: the bonus token)",
        ),
        _exercise(
            "residual", "10",
            "residual(p [vocab], q [vocab]) -> max(0, p - q) normalised to sum 1 (p itself when "
            "p == q)",
            close,
            "clamp p - q at 0 (not its absolute value), divide by the sum; when the sum is 0 "
            "(p == q) nothing is ever rejected and the library returns p",
        ),
        _exercise(
            "speculative_speedup", "10",
            "speculative_speedup(alpha, gamma, cost_ratio, verify_cost) -> E[tokens per target "
            "pass] / (gamma * cost_ratio + verify_cost)",
            near,
            "a pass emits the accepted prefix plus the target's own token: E = 1 + alpha + ... "
            "+ alpha^gamma (gamma + 1 at alpha = 1, where the closed form divides by 0)",
        ),
        _exercise(
            "pareto", "11",
            "pareto(points [list of (tokens_per_s, perplexity)]) -> [bool]: True where no other "
            "point is at least as fast and as good, and strictly better in one",
            lambda a, b: [bool(x) for x in a] == list(b),
            "a point equal to another in both numbers does not beat it: dominance needs >= speed "
            "and <= perplexity, and a strict > or < in one of them",
        ),
        _exercise(
            "resident_bytes", "11",
            "resident_bytes(model: nn.Module) -> bytes of all its parameters and buffers, each "
            "tensor counted once",
            exact,
            "numel * element_size of every parameter AND buffer (int8 codes, scales, "
            "non-persistent ones), and a tied weight (embedding = LM head) once",
        ),
]  # fmt: skip

#: small exercises that are also a chapter's core build: ``use`` plugs them into the model
_CORE = {"rms_norm", "rope", "gqa_attention", "sink_visible", "scatter_gemv"}

for _name, _exercise_ in _ENTRIES:
    register(_name, dataclasses.replace(_exercise_, core=_name in _CORE))

from . import builds  # noqa: E402,F401  (the chapters' core builds register themselves)
