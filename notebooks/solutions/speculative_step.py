"""Chapter 10: one speculative-sampling step with its uniform random numbers given."""

import torch


def draw(probs, u):
    """The token whose slice of the cumulative distribution holds u (inverse CDF)."""
    cdf = probs.cumsum(0)
    token = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    return min(token, len(probs) - 1)


def speculative_step(p, q, drafts, u):
    k = len(drafts)
    for i, d in enumerate(drafts):
        if u[i] * q[i, d] < p[i, d]:  # accepted with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0)  # where the target wants more than the draft gave
        if residual.sum() == 0:
            residual = p[i]
        return i, draw(residual, u[k])
    return k, draw(p[k], u[k])  # every draft accepted: the bonus token from p[k]
