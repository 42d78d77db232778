"""Chapter 00: the distribution a sampled token is drawn from: temperature, then top-k."""

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    z = logits.float() / temperature  # T < 1 sharpens, T > 1 flattens
    if top_k is not None:
        k = min(top_k, z.shape[-1])
        kth_largest = z.topk(k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth_largest, float("-inf"))  # exp(-inf) = 0: never drawn
    return torch.softmax(z, dim=-1)  # the kept logits share all of the probability
