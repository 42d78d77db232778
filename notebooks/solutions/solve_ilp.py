"""Chapter 08: PowerInfer's neuron placement as an integer program, solved by scipy's milp."""

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp


def solve_ilp(frequencies, neuron_bytes, budget, group_size, min_per_layer):
    # a layer's neurons, most frequent first, cut into groups: one 0/1 variable a per group
    groups = [f.argsort(descending=True, stable=True).split(group_size) for f in frequencies]
    n_groups, n_layers = sum(len(g) for g in groups), len(frequencies)
    n_vars = n_groups + n_layers  # the a's, then one y per layer (1: the layer uses the device)
    gain = np.zeros(n_vars)  # activations a variable brings to the fast device
    cost = np.zeros(n_vars)  # its bytes
    at_least = np.zeros((n_layers, n_vars))  # neurons of layer l - C y_l >= 0
    at_most = np.zeros((n_layers, n_vars))  # neurons of layer l - n_l y_l <= 0
    k = 0
    for layer, (f, layer_groups) in enumerate(zip(frequencies, groups)):
        for g in layer_groups:
            gain[k] = float(f[g].sum())
            cost[k] = len(g) * neuron_bytes[layer]
            at_least[layer, k] = at_most[layer, k] = len(g)
            k += 1
        at_least[layer, n_groups + layer] = -min_per_layer
        at_most[layer, n_groups + layer] = -len(f)
    result = milp(
        -gain,  # milp minimises
        constraints=[
            LinearConstraint(cost[None, :], -np.inf, budget),
            LinearConstraint(at_least, 0, np.inf),
            LinearConstraint(at_most, -np.inf, 0),
        ],
        integrality=np.ones(n_vars),  # every variable a whole number: 0 or 1 within the bounds
        bounds=Bounds(0, 1),
    )
    chosen = result.x[:n_groups] > 0.5
    hot, k = [], 0
    for f, layer_groups in zip(frequencies, groups):
        mask = torch.zeros(len(f), dtype=torch.bool)
        for g in layer_groups:
            mask[g] = bool(chosen[k])
            k += 1
        hot.append(mask)
    return hot
