"""Chapter 05: DejaVu's oracle for MLP neurons, from one layer's gate and up projections."""

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def oracle_neuron_mask(gate, up, act, sparsity):
    # what the down projection reads: h = act(W_gate x) * (W_up x); a neuron matters by |h_j|
    scores = (ACTIVATIONS[act](gate) * up).abs()
    n = scores.shape[-1]
    k = max(1, n - round(sparsity * n))  # sparsity is the share dropped; keep at least one
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.topk(k, dim=-1).indices, True)  # per row (token)
