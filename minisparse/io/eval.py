"""Evaluating language-model quality: cross-entropy and perplexity.

For tokens t_1..t_N cut into windows, the model predicts each token from the ones before it in
its window:

    NLL = -(1/M) sum_i log p(t_i | t_<i)        over the M predicted tokens
    PPL = exp(NLL)

Windows do not overlap, so every window starts without context; this is the usual, slightly
pessimistic, protocol. Compare perplexities only at the same ``seq_len`` and text.

A perplexity over a few thousand tokens is known only so well: ``perplexity_interval`` adds a
bootstrap interval over the windows (resample the windows with replacement, take the
perplexity of each resample, keep the central 95 %), so two models are told apart only when
their intervals do not overlap (``minisparse.measure.compare.verdict``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..measure.compare import Interval

__all__ = [
    "bootstrap_perplexity",
    "mean_nll",
    "perplexity",
    "perplexity_interval",
    "perplexity_ratio",
    "token_nlls",
    "window_nlls",
    "windows",
]


def windows(token_ids: Tensor, seq_len: int) -> Tensor:
    """Non-overlapping [n, seq_len] windows of a 1-D id tensor (a 2-D tensor is used as is)."""
    if token_ids.dim() == 2:
        return token_ids
    n = token_ids.numel() // seq_len
    if n == 0:
        raise ValueError(
            f"Need at least seq_len={seq_len} tokens, got {token_ids.numel()}; "
            "pass more text or a smaller seq_len."
        )
    return token_ids[: n * seq_len].view(n, seq_len)


@torch.inference_mode()
def token_nlls(logits: Tensor, tokens: Tensor) -> Tensor:
    """The NLL (nats) of each next token: ``logits`` [B, T, V] of ``tokens`` [B, T] predict
    tokens[:, 1:], so the result is [B, T - 1] (float32 or wider)."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), tokens[:, 1:], reduction="none")


def window_nlls(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> Tensor:
    """Per window of ``seq_len`` tokens, its mean next-token NLL (nats): float64 [windows]."""
    batches = windows(token_ids, seq_len)
    device = next(model.parameters()).device
    out = []
    for chunk in tqdm(
        batches.split(batch_size), desc="perplexity", disable=not progress, leave=False
    ):
        chunk = chunk.to(device)
        out.append(token_nlls(model(chunk), chunk).double().mean(1).cpu())
    return torch.cat(out)


def mean_nll(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> float:
    """Mean next-token negative log-likelihood (nats) over windows of ``seq_len`` tokens."""
    return float(window_nlls(model, token_ids, seq_len, batch_size, progress).mean())


def perplexity(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> float:
    """exp(mean NLL) of ``model`` on ``token_ids`` (1-D ids or [n, seq_len] windows)."""
    return math.exp(mean_nll(model, token_ids, seq_len, batch_size, progress))


def perplexity_interval(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    rounds: int = 2000,
    seed: int = 0,
    progress: bool = True,
) -> Interval:
    """The perplexity with a 95 % bootstrap interval over the windows it was measured on."""
    nll = window_nlls(model, token_ids, seq_len, batch_size, progress)
    return bootstrap_perplexity(nll, rounds, seed)


def bootstrap_perplexity(nll: Tensor, rounds: int = 2000, seed: int = 0) -> Interval:
    """exp(mean) of per-window NLLs within the 2.5 % and 97.5 % quantiles of exp(mean) over
    ``rounds`` resamples of the windows (with replacement, seeded)."""
    return _bootstrap_exp_mean(nll, rounds, seed)


def perplexity_ratio(nll: Tensor, reference: Tensor, rounds: int = 2000, seed: int = 0) -> Interval:
    """Perplexity of one model over another's on the same windows (per-window NLLs of each),
    with a 95 % *paired* bootstrap interval: the windows are resampled together, so what both
    models find hard cancels out, and a small change is told apart where the two separate
    intervals would overlap."""
    if nll.shape != reference.shape:
        shapes = f"{tuple(nll.shape)} and {tuple(reference.shape)}"
        raise ValueError(f"Compare NLLs of the same windows, got {shapes}.")
    return _bootstrap_exp_mean(nll.double() - reference.double(), rounds, seed)


def _bootstrap_exp_mean(values: Tensor, rounds: int, seed: int) -> Interval:
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(values), (rounds, len(values)), generator=gen)
    means = values.double()[picks].mean(1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64))
    mid = float(values.double().mean())
    return Interval(math.exp(mid), math.exp(min(float(low), mid)), math.exp(max(float(high), mid)))
