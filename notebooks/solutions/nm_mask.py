"""Chapter 12: the N:M mask, n kept in every group of m consecutive inputs."""

import torch


def nm_mask(scores, n, m):
    rows, cols = scores.shape
    groups = scores.reshape(rows, cols // m, m)  # columns 0..m-1, m..2m-1, ...
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.reshape(rows, cols)
