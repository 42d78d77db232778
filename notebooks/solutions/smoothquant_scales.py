"""Chapter 09: SmoothQuant's per-channel scales, which move outliers from x into W."""

import torch


def smoothquant_scales(x: torch.Tensor, weights: list, alpha: float) -> torch.Tensor:
    x_max = x.abs().amax(dim=0)  # per input channel, over the tokens
    w_max = torch.cat(weights).abs().amax(dim=0)  # per input channel, over every weight's rows
    s = x_max**alpha / w_max ** (1 - alpha)
    s = torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))  # nothing to balance
    return s.clamp_min(1e-5)
