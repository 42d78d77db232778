"""What speculative decoding costs on this machine: the target's passes and the drafts' steps.

The theory of chapter 10 (``speculative.theory``) needs two costs in units of one single-token
target step: c, one step of a model draft, and v(γ), one target pass over γ + 1 tokens.
``step_costs`` times them side by side on a filled cache (``minisparse.measure.timing``'s
rules: interleaved, warm-up, median of repeats). ``verify_cost`` reads v(k) from those
timings for any k (interpolated between measured lengths), and ``predicted_from_passes`` applies
the theory to the draft counts a run actually used (an adaptive γ changes them every pass).

On a GPU v ≈ 1; on a CPU the compiled pass reads each weight once for all γ + 1 tokens but does
γ + 1 times the arithmetic of a step, so v grows with γ as far as the loop cannot hide that
arithmetic behind the memory reads (``minisparse/kernels/matvec.h``, ``DOT_TILE``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.model import Transformer, check_count, make_cache
from ..measure.timing import interleaved_medians
from ..runtime.decoder import MAX_TOKENS, Decoder
from ..speculative.loop import Draft, ModelDraft, expected_tokens_per_call

__all__ = ["predicted_from_passes", "step_costs", "verify_cost"]


@torch.inference_mode()
def step_costs(
    target: Transformer,
    drafts: dict[str, Draft],
    gammas: tuple[int, ...] = (1, 2, 4, 6),
    context: int = 64,
    repeats: int = 9,
    warmup: int = 2,
) -> dict[str, float]:
    """Costs in units of one single-token target step, timed side by side after ``context`` tokens.

    Keys: ``"target step ms"``, ``"verify {γ}"`` (a target pass over γ + 1 tokens) and one key
    per model draft (its single-token step, c). Drafts without a model cost ~0 and are left out.
    """
    for g in gammas:
        check_count(g, "gamma")
    check_count(context, "context")
    check_count(repeats, "repeats")
    check_count(warmup, "warmup", minimum=0)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prefix = torch.randint(0, vocab, (1, context), generator=gen)
    positions = torch.arange(context)
    fns = {}

    def filled(model: Transformer) -> tuple[Any, Decoder | None]:
        cache = make_cache(model.config, 1, context + max(gammas) + 1, model.dtype, model.device)
        model(prefix, positions, cache)
        return cache, (Decoder(model, cache) if Decoder.supports(model) else None)

    def one_step(model: Transformer) -> Any:  # the step decoding takes (generate, drafts)
        cache, decoder = filled(model)
        if decoder is not None:
            return lambda: decoder.step(int(prefix[0, -1]), context)
        token, pos = prefix[:, -1:], positions[-1:] + 1
        return lambda: model.lm_head(model.hidden_states(token, pos, cache)[0, -1])

    fns["target"] = one_step(target)
    for name, draft in drafts.items():
        if isinstance(draft, ModelDraft):
            fns[name] = one_step(draft.model)
    cache, decoder = filled(target)
    for g in gammas:  # the verification pass, as speculative_generate runs it
        chunk = torch.randint(0, vocab, (1, g + 1), generator=gen)
        pos = torch.arange(context, context + g + 1)
        if decoder is not None and g + 1 <= MAX_TOKENS:
            fns[f"verify {g}"] = lambda chunk=chunk: decoder.forward(chunk[0].tolist(), context)
        else:
            fns[f"verify {g}"] = lambda chunk=chunk, pos=pos: target(chunk, pos, cache)
    times = interleaved_medians(fns, repeats=repeats, warmup=warmup)
    step = times.pop("target")
    return {"target step ms": step * 1e3, **{k: t / step for k, t in times.items()}}


def verify_cost(k: int, costs: dict[str, float]) -> float:
    """v(k), a target pass over k + 1 tokens in single steps: ``costs["verify k"]`` when it
    was measured, 1 for k = 0 (a plain step), else the line from (0, 1) to the nearest
    measured pass above k (or the longest one measured)."""
    if k == 0:
        return 1.0
    if f"verify {k}" in costs:
        return costs[f"verify {k}"]
    measured = sorted(int(key.split()[1]) for key in costs if key.startswith("verify "))
    if not measured:
        raise ValueError("costs hold no verification pass; measure one with step_costs.")
    g = next((m for m in measured if m > k), measured[-1])
    return 1.0 + (costs[f"verify {g}"] - 1.0) * k / g


def predicted_from_passes(
    alpha: float, gammas: list[int], cost_ratio: float, costs: dict[str, float]
) -> float:
    """The theory's speedup for passes that drafted ``gammas`` (0: a plain step):
    Σ E[tokens](α, k) / Σ (k c + v(k)), v(0) = 1."""
    if not gammas:
        return 1.0
    tokens = sum(1.0 if k == 0 else expected_tokens_per_call(alpha, k) for k in gammas)
    cost = sum(k * cost_ratio + verify_cost(k, costs) for k in gammas)
    return tokens / cost
