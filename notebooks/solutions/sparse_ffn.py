"""Chapter 07: the gated FFN computed over the active neurons only."""

import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def sparse_ffn(x, W_gate, W_up, W_down_t, idx, act: str):
    gate = x @ W_gate[idx].T  # [m] (or [B, m]): only the active neurons' rows
    up = x @ W_up[idx].T
    h = ACTIVATIONS[act](gate) * up
    return h @ W_down_t[idx]  # each active neuron adds its row of W_down^T, scaled by h_j
