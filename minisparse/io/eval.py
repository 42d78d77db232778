"""Evaluating language-model quality: cross-entropy and perplexity.

For tokens t_1..t_N cut into windows, the model predicts each token from the ones before it in
its window:

    NLL = -(1/M) sum_i log p(t_i | t_<i)        over the M predicted tokens
    PPL = exp(NLL)

Windows do not overlap, so every window starts without context; this is the usual, slightly
pessimistic, protocol. Compare perplexities only at the same ``seq_len`` and text.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

__all__ = ["mean_nll", "perplexity", "windows"]


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
def mean_nll(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> float:
    """Mean next-token negative log-likelihood (nats) over windows of ``seq_len`` tokens."""
    batches = windows(token_ids, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    chunks = batches.split(batch_size)
    for chunk in tqdm(chunks, desc="perplexity", disable=not progress, leave=False):
        chunk = chunk.to(device)
        logits = model(chunk)[:, :-1].float()
        targets = chunk[:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += targets.numel()
    return total / count


def perplexity(
    model: torch.nn.Module,
    token_ids: Tensor,
    seq_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> float:
    """exp(mean NLL) of ``model`` on ``token_ids`` (1-D ids or [n, seq_len] windows)."""
    return math.exp(mean_nll(model, token_ids, seq_len, batch_size, progress))
