"""Chapter 02, challenge: H2O's eviction rule (heavy hitters + the most recent tokens)."""

import torch


def h2o_keep(score, budget, recent):
    n = score.shape[-1]
    if n <= budget:
        return torch.arange(n).expand(score.shape)  # nothing to evict
    old = n - recent  # the newest `recent` entries are kept whatever their score
    heavy = score[..., :old].topk(budget - recent, dim=-1).indices
    heavy = heavy.sort(dim=-1).values  # back to position order
    newest = torch.arange(old, n).expand(*score.shape[:-1], recent)
    return torch.cat([heavy, newest], dim=-1)
