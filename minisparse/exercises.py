"""Exercises that check the learner's own code: one call compares it with the library.

Each chapter asks the learner to write one of the functions it teaches from a stub, e.g.

    def my_apply_rope(x, cos, sin): ...
    minisparse.exercises.check("rope", my_apply_rope)

``check`` runs the learner's function and the library's on fresh random inputs with odd
shapes (a new seed every call unless one is given), and prints either a pass or the first
mismatch: which input, what was expected, what came back, and a hint. It returns True or False,
so a notebook cell can also ``assert`` it. Worked solutions live in ``notebooks/solutions/``;
the tests check that every solution passes and that a wrong answer fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["EXERCISES", "Exercise", "check"]


@dataclass(frozen=True)
class Exercise:
    chapter: str
    task: str  # what to write: the signature and its meaning
    reference: Callable[..., Any]
    cases: Callable[[torch.Generator], list[tuple[Any, ...]]]  # fresh inputs for one trial
    same: Callable[[Any, Any], bool]
    hint: str


def close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def _rope_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    from .rope import rope_cos_sin, rope_inv_freq

    out = []
    for batch, heads, seq, dim in ((1, 1, 1, 2), (2, 3, 5, 8), (1, 4, 7, 6), (3, 2, 4, 64)):
        x = torch.randn(batch, heads, seq, dim, generator=gen)
        positions = torch.randint(0, 4096, (seq,), generator=gen)
        cos, sin = rope_cos_sin(rope_inv_freq(dim, 10000.0), positions, torch.float32)
        out.append((x, cos, sin))
    return out


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    from .rope import apply_rope

    return apply_rope(x, cos, sin)


def _kv_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    return [(draw(1, 81), draw(1, 65), draw(1, 257), draw(1, 32769), draw(1, 65)) for _ in range(6)]


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, seq: int, batch: int) -> int:
    from .kvcache import kv_cache_bytes

    return kv_cache_bytes(layers, kv_heads, head_dim, seq, batch, 2)


def _threshold_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    sizes, shares = (101, 1000, 4097), (0.1, 0.5, 0.9)
    return [(torch.randn(n, generator=gen) * 3, s) for n in sizes for s in shares]


def _threshold(x: Tensor, sparsity: float) -> float:
    return float(torch.quantile(x.abs().double(), sparsity))


def _quant_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    shapes = ((3, 64, 4, 32), (5, 96, 8, 32), (2, 128, 3, 64), (7, 48, 8, 16))
    return [(torch.randn(r, c, generator=gen), bits, g) for r, c, bits, g in shapes]


def _quantize_groups(x: Tensor, bits: int, group_size: int) -> Tensor:
    from .quant_tensor import QuantSpec, fake_quantize

    return fake_quantize(x, QuantSpec(bits=bits, group_size=group_size))


def _verify_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    out = []
    for k, vocab in ((1, 7), (4, 11), (6, 50), (3, 5)):
        logits = torch.randn(k + 1, vocab, generator=gen)
        best = logits.argmax(-1).tolist()
        agree = int(torch.randint(0, k + 1, (1,), generator=gen))  # drafts right up to here
        drafts = [best[i] if i < agree else (best[i] + 1) % vocab for i in range(k)]
        out.append((logits, drafts))
    return out


def _verify(target_logits: Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    from .speculative import verify_greedy

    return verify_greedy(target_logits, draft_tokens)


def _load_cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    out = []
    for layers, width in ((1, 5), (3, 17), (4, 64)):
        f = [torch.rand(width, generator=gen, dtype=torch.float64) ** 2 for _ in range(layers)]
        hot = [torch.rand(width, generator=gen) < 0.3 for _ in range(layers)]
        out.append((hot, f))
    return out


def _load(hot: list[Tensor], frequencies: list[Tensor]) -> float:
    from .offload import Placement, fast_load

    return fast_load(Placement(hot, 0, 0.0, "exercise", 0), frequencies)


EXERCISES: dict[str, Exercise] = {
    "rope": Exercise(
        "01",
        "apply_rope(x [batch, heads, seq, d], cos [seq, d], sin [seq, d]) -> x rotated",
        _rope,
        _rope_cases,
        close,
        "pair x_i with x_(i + d/2) (rotate half), not neighbours; y = x cos + rotate_half(x) sin",
    ),
    "kv_bytes": Exercise(
        "02",
        "kv_bytes(layers, kv_heads, head_dim, seq, batch) -> bytes of an fp16 KV cache",
        _kv_bytes,
        _kv_cases,
        lambda a, b: int(a) == int(b),
        "keys AND values (x 2), 2 bytes each in fp16, and only the K/V heads (GQA), not all heads",
    ),
    "teal_threshold": Exercise(
        "03",
        "threshold(x, sparsity) -> t with a share `sparsity` of |x| at or below t",
        _threshold,
        _threshold_cases,
        close,  # replaced by a share test in ``check``
        "the s-quantile of |x| (magnitudes, not signed values): torch.quantile(x.abs(), s)",
    ),
    "quantize_groups": Exercise(
        "09",
        "quantize_groups(x [rows, cols], bits, group_size) -> x after a symmetric round trip, "
        "one scale per group of consecutive columns",
        _quantize_groups,
        _quant_cases,
        lambda a, b: close(a, b, 1e-4),
        "per group of group_size columns of a row: scale = max|x| / (2^(bits-1) - 1); "
        "q = round(x / scale), clamped to the signed bits-bit range; x_hat = q * scale",
    ),
    "verify_greedy": Exercise(
        "10",
        "verify(target_logits [k + 1, vocab], draft_tokens [k]) -> (accepted, next_token)",
        _verify,
        _verify_cases,
        lambda a, b: tuple(a) == tuple(b),
        "accept while draft i == argmax of row i; next_token is the argmax of the row after "
        "the last accepted draft (row k when all k are accepted: the bonus token)",
    ),
    "fast_load": Exercise(
        "08",
        "fast_load(hot [per layer bool], frequencies [per layer]) -> share of activations on hot",
        _load,
        _load_cases,
        lambda a, b: abs(float(a) - float(b)) < 1e-9,
        "sum the frequencies of the hot neurons over all layers, divided by the sum of all",
    ),
}


def _share_at_most(x: Tensor, t: float) -> float:
    return float((x.abs() <= t).double().mean())


def check(name: str, fn: Callable[..., Any], trials: int = 3, seed: int | None = None) -> bool:
    """Compare ``fn`` with the library's version of exercise ``name``; print the verdict."""
    if name not in EXERCISES:
        raise ValueError(f"Unknown exercise {name!r}; choose one of {', '.join(EXERCISES)}.")
    ex = EXERCISES[name]
    gen = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    for _ in range(trials):
        for args in ex.cases(gen):
            expected = ex.reference(*args)
            got = fn(*[a.clone() if isinstance(a, Tensor) else a for a in args])
            if name == "teal_threshold":  # any t that leaves the right share below it passes
                x, s = args
                ok = abs(_share_at_most(x, float(got)) - s) <= 1.0 / len(x) + 1e-9
            else:
                ok = ex.same(got, expected)
            if not ok:
                print(f"{name}: mismatch on inputs {_describe(args)}")
                print(f"  expected {_short(expected)}\n  got      {_short(got)}\n  hint: {ex.hint}")
                return False
    print(f"{name}: correct on {trials} rounds of fresh random inputs (chapter {ex.chapter})")
    return True


def _describe(args: tuple[Any, ...]) -> str:
    parts = [f"tensor{tuple(a.shape)}" if isinstance(a, Tensor) else repr(a)[:40] for a in args]
    return "(" + ", ".join(parts) + ")"


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{tuple(value.shape)} {value.flatten()[:4].tolist()}..."
    return repr(value)[:120]
