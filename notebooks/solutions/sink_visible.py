"""Chapter 02: which cached keys a query sees in StreamingLLM (sinks + a recent window)."""

import torch


def sink_visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, n_sink: int, window: int
) -> torch.Tensor:
    p = q_pos[:, None]  # [t, 1]: one row per query
    j = k_pos[None, :]  # [1, n]: one column per cached key
    causal = j <= p
    sink = j < n_sink  # the first tokens stay forever
    recent = j > p - window  # the last `window` positions: p - window + 1 .. p
    return causal & (sink | recent)
