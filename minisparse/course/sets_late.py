"""Inputs and library references for the checked exercises of chapters 06 to 11.

``CASES`` maps each exercise name of ``minisparse.course.exercises`` to a pair (reference,
cases), as in ``sets_early``: the library's own function, called, and fresh random inputs for one
round of the check, edge cases included (empty index sets, nothing active, a draft equal to the
target, duplicate points on a Pareto front).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .grading import draw_int

__all__ = ["CASES"]

Cases = list[tuple[Any, ...]]


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand(1, generator=gen, dtype=torch.float64))


# --- 06 predictors ----------------------------------------------------------------------------


def _confusion_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for shape, p_true, p_false in (((50,), 0.3, 0.1), ((4, 30), 0.1, 0.2), ((3, 7, 11), 0.5, 0.3)):
        actual = torch.rand(*shape, generator=gen) < p_true
        found = actual & (torch.rand(*shape, generator=gen) < 0.85)  # misses some
        out.append((found | (torch.rand(*shape, generator=gen) < p_false), actual))
    actual = torch.rand(6, 6, generator=gen) < 0.4
    out.append((torch.zeros(6, 6, dtype=torch.bool), actual))  # predicts nothing
    out.append((torch.rand(20, generator=gen) < 0.3, torch.zeros(20, dtype=torch.bool)))
    out.append((actual.clone(), actual))
    return out


def _recall_precision(predicted: Tensor, actual: Tensor) -> tuple[float, float]:
    from ..predictors.lowrank import confusion

    scores = confusion(predicted, actual)
    return scores.recall, scores.precision


class _GivenLogits(nn.Module):
    """A predictor whose logits are its input, with the cutoff buffer of ``Predictor``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cutoff", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        return x


def _cutoff_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for tokens, units, recall in ((1, 3, 1.0), (4, 20, 0.9), (16, 64, 0.99), (8, 50, 0.5)):
        logits = torch.randn(tokens, units, generator=gen) * 2
        # mostly the units with high logits are active, as for a trained predictor
        active = torch.rand(tokens, units, generator=gen) < torch.sigmoid(2 * logits)
        out.append((logits, active, recall))
    out.append((torch.randn(3, 10, generator=gen), torch.zeros(3, 10, dtype=torch.bool), 0.9))
    return out


def _recall_cutoff(logits: Tensor, active: Tensor, recall: float) -> float:
    from ..predictors.lowrank import calibrate_cutoff

    return float(calibrate_cutoff(_GivenLogits(), logits, active, recall).cutoff)


# --- 07 sparse kernels ------------------------------------------------------------------------


def _vector(gen: torch.Generator, batch: int | None, k: int) -> Tensor:
    return torch.randn(k, generator=gen) if batch is None else torch.randn(batch, k, generator=gen)


def _scatter_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    settings = ((1, 1, None, 0.0), (9, 5, None, 0.5), (40, 17, 3, 1.0), (16, 8, 2, 0.0))
    for k, n, batch, threshold in (*settings, (12, 6, None, 10.0)):  # 10: nothing is active
        x = _vector(gen, batch, k)
        x = x.relu() if threshold == 0.0 else x  # exact zeros, as after a ReLU
        out.append((torch.randn(k, n, generator=gen), x, threshold))
    x = _vector(gen, 2, 10)
    x[:, ::3] = 0.0
    W_t = torch.randn(10, 4, generator=gen)
    W_t[::3] = math.nan  # rows of inactive channels are never read: their NaN must not appear
    out.append((W_t, x, 0.0))
    return out


def _scatter_gemv(W_t: Tensor, x: Tensor, threshold: float) -> Tensor:
    from ..kernels.reference import scatter_gemv_ref

    return scatter_gemv_ref(W_t, x, threshold=threshold)


def _ffn_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    settings = ((1, 1, 1, None, "silu"), (8, 20, 5, None, "relu"), (16, 40, 40, 2, "gelu"))
    for dim, ffn, m, batch, act in (*settings, (12, 30, 0, None, "silu"), (6, 11, 7, 3, "silu")):
        W_gate = torch.randn(ffn, dim, generator=gen) / dim**0.5
        W_up = torch.randn(ffn, dim, generator=gen) / dim**0.5
        W_down_t = torch.randn(ffn, dim, generator=gen) / ffn**0.5
        idx = torch.randperm(ffn, generator=gen)[:m]
        out.append((_vector(gen, batch, dim), W_gate, W_up, W_down_t, idx, act))
    return out


def _sparse_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str
) -> Tensor:
    from ..kernels.reference import sparse_ffn_ref

    return sparse_ffn_ref(x, W_gate, W_up, W_down_t, idx, act)


# --- 08 hot/cold offload ----------------------------------------------------------------------


def _load_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for layers, width in ((1, 5), (3, 17), (4, 64)):
        f = [torch.rand(width, generator=gen, dtype=torch.float64) ** 2 for _ in range(layers)]
        hot = [torch.rand(width, generator=gen) < 0.3 for _ in range(layers)]
        out.append((hot, f))
    return out


def _fast_load(hot: list[Tensor], frequencies: list[Tensor]) -> float:
    from ..offload.placement import Placement, fast_load

    return fast_load(Placement(hot, 0, 0.0, "exercise", 0), frequencies)


def _overlap_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for n, share in ((1, 0.5), (10, 0.2), (50, 0.2), (200, 0.1), (37, 0.4)):
        counts = torch.randint(0, 6, (n,), generator=gen)  # activation counts: many ties
        other = (counts + torch.randint(-1, 2, (n,), generator=gen)).clamp(0, 5)
        out.append((counts.double() / 5, other.double() / 5, share))
    return out


def _top_overlap(a: Tensor, b: Tensor, share: float) -> float:
    from ..offload.placement import top_overlap

    return top_overlap(a, b, share)


# --- 09 quantization --------------------------------------------------------------------------


def _quant_cases(gen: torch.Generator) -> Cases:
    shapes = ((3, 64, 4, 32), (5, 96, 8, 32), (2, 128, 3, 64), (7, 48, 8, 16))
    return [(torch.randn(r, c, generator=gen), bits, g) for r, c, bits, g in shapes]


def _quantize_groups(x: Tensor, bits: int, group_size: int) -> Tensor:
    from ..quant.tensor import QuantSpec, fake_quantize

    return fake_quantize(x, QuantSpec(bits=bits, group_size=group_size))


def _smooth_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    settings = ((1, 1, (1,), 0.5), (16, 12, (8,), 0.5), (32, 20, (6, 6, 10), 0.8))
    for tokens, channels, outs, alpha in (*settings, (8, 9, (4,), 0.0), (5, 7, (3, 2), 1.0)):
        spread = torch.rand(channels, generator=gen) * 10  # a few outlier channels
        x = torch.randn(tokens, channels, generator=gen) * spread
        out.append((x, [torch.randn(o, channels, generator=gen) for o in outs], alpha))
    x, weights = torch.randn(4, 6, generator=gen), [torch.randn(3, 6, generator=gen)]
    x[:, 2], weights[0][:, 5] = 0.0, 0.0  # a silent channel, a zero weight column
    out.append((x, weights, 0.5))
    return out


def _smoothquant_scales(x: Tensor, weights: list[Tensor], alpha: float) -> Tensor:
    from ..quant.calibration import LinearGroup
    from ..quant.smoothing import smoothquant_scales

    group = LinearGroup("exercise", tuple(f"linear{i}" for i in range(len(weights))), "norm")
    return smoothquant_scales(x, weights, group, alpha)


# --- 10 speculative decoding ------------------------------------------------------------------


def _verify_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for k, vocab in ((1, 7), (4, 11), (6, 50), (3, 5)):
        logits = torch.randn(k + 1, vocab, generator=gen)
        best = logits.argmax(-1).tolist()
        agree = draw_int(gen, 0, k + 1)  # drafts right up to here
        drafts = [best[i] if i < agree else (best[i] + 1) % vocab for i in range(k)]
        out.append((logits, drafts))
    return out


def _verify(target_logits: Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    from ..speculative.loop import verify_greedy

    return verify_greedy(target_logits, draft_tokens)


def _residual_cases(gen: torch.Generator) -> Cases:
    def dist(vocab: int) -> Tensor:
        return torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)

    out: Cases = [(dist(v), dist(v)) for v in (2, 5, 17, 50)]
    p = dist(9)
    out.append((p, p.clone()))  # the draft is the target: nothing is ever rejected
    out.append((p, F.one_hot(torch.tensor(draw_int(gen, 0, 9)), 9).float()))  # prompt lookup
    return out


def _residual(p: Tensor, q: Tensor) -> Tensor:
    from ..speculative.sampling import residual_distribution

    return residual_distribution(p, q)


def _speedup_cases(gen: torch.Generator) -> Cases:
    alphas = (0.0, 1.0, 0.5, 0.9, _uniform(gen, 0.0, 1.0))
    return [(a, draw_int(gen, 1, 9), _uniform(gen, 0, 0.5), _uniform(gen, 1, 3)) for a in alphas]


def _speedup(alpha: float, gamma: int, cost_ratio: float, verify_cost: float) -> float:
    from ..speculative.theory import expected_speedup

    return expected_speedup(alpha, gamma, cost_ratio, verify_cost)


# --- 11 putting it together -------------------------------------------------------------------


def _pareto_cases(gen: torch.Generator) -> Cases:
    out: Cases = [([],)]
    for n in (1, 3, 8, 12):
        speed = (torch.rand(n, generator=gen) * 40 + 5).round()  # whole tokens/s: ties happen
        ppl = (torch.rand(n, generator=gen) * 5 + 10).round(decimals=1)
        points = list(zip(speed.tolist(), ppl.tolist(), strict=True))
        best = max(points, key=lambda p: (p[0], -p[1]))  # the fastest is on the front
        twice = [*points, (best[0], best[1])]  # measured twice: both copies stay on the front
        out.append((twice if n > 1 else points,))
    return out


def _pareto(points: list[tuple[float, float]]) -> list[bool]:
    from ..engine.pareto import pareto_front

    return pareto_front(points)


def _toy_model(gen: torch.Generator, dtype: torch.dtype, tied: bool, int8: bool) -> nn.Module:
    dim, vocab, layers = draw_int(gen, 2, 33), draw_int(gen, 5, 65), draw_int(gen, 1, 4)
    skip = nn.utils.skip_init  # shapes are all that matter: no random init
    model = nn.Module()
    model.embed = skip(nn.Embedding, vocab, dim)
    model.layers = nn.ModuleList(skip(nn.Linear, dim, dim, bias=i % 2 == 1) for i in range(layers))
    model.lm_head = skip(nn.Linear, dim, vocab, bias=False)
    if tied:
        model.lm_head.weight = model.embed.weight
    model.register_buffer("inv_freq", torch.ones(dim // 2 + 1), persistent=False)
    model.to(dtype)
    if int8:  # int8 codes and one fp16 scale per row, as buffers
        model.register_buffer("codes", torch.zeros(vocab, dim, dtype=torch.int8))
        model.register_buffer("scales", torch.ones(vocab, dtype=torch.float16))
    return model


def _resident_cases(gen: torch.Generator) -> Cases:
    settings = ((torch.float32, False, False), (torch.float16, True, False))
    more = ((torch.bfloat16, True, True), (torch.float32, False, True))
    return [(_toy_model(gen, *s),) for s in (*settings, *more)]


def _resident_bytes(model: nn.Module) -> int:
    from ..engine.compose import Engine, EngineConfig

    return Engine(EngineConfig(), model, tokenizer=None).resident_bytes()  # type: ignore[arg-type]


#: exercise name -> (the library's reference, fresh inputs for one round)
CASES: dict[str, tuple[Callable[..., Any], Callable[[torch.Generator], Cases]]] = {
    "recall_precision": (_recall_precision, _confusion_cases),
    "recall_cutoff": (_recall_cutoff, _cutoff_cases),
    "scatter_gemv": (_scatter_gemv, _scatter_cases),
    "sparse_ffn": (_sparse_ffn, _ffn_cases),
    "fast_load": (_fast_load, _load_cases),
    "top_overlap": (_top_overlap, _overlap_cases),
    "quantize_groups": (_quantize_groups, _quant_cases),
    "smoothquant_scales": (_smoothquant_scales, _smooth_cases),
    "verify_greedy": (_verify, _verify_cases),
    "residual": (_residual, _residual_cases),
    "speculative_speedup": (_speedup, _speedup_cases),
    "pareto": (_pareto, _pareto_cases),
    "resident_bytes": (_resident_bytes, _resident_cases),
}
