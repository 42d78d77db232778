"""Chapter 09: AWQ's search of the per-channel scale s = mean|x|^alpha that minimises the
layer's output error after rounding the scaled weights."""

import torch


def fake_quantize(w, bits, group_size):
    """Round w [rows, cols] to the asymmetric grid of each row's groups, and back."""
    out = torch.empty_like(w)
    g = w.shape[1] if group_size is None else group_size
    for start in range(0, w.shape[1], g):
        part = w[:, start : start + g]
        lo, hi = part.amin(1, keepdim=True), part.amax(1, keepdim=True)
        scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-30)
        q = torch.round((part - lo) / scale).clamp(0, 2**bits - 1)
        out[:, start : start + g] = q * scale + lo
    return out


def awq_search(x, w, bits, group_size, n_grid):
    x_mean = x.abs().mean(0)
    h = x.T @ x  # ||x d^T||^2 = d H d^T: the error without the n x rows products
    best, best_loss, losses = None, float("inf"), []
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        diff = w - fake_quantize(w * s, bits, group_size) / s  # scale up, round, scale back
        loss = float(((diff @ h) * diff).sum() / (x.shape[0] * w.shape[0]))
        losses.append(loss)
        if loss <= best_loss:
            best, best_loss = s, loss
    return best, torch.tensor(losses)
