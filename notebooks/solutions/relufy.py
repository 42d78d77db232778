"""Chapter 04: ReLUfication's swap: a copy of the model with ReLU activations (stage 1 in the MLPs,
stage 2 also after both norms of every layer); the input model is left as it was."""

import copy
import dataclasses

from torch import nn


def relufy(model, stage):
    new = copy.deepcopy(model)  # its own weights: training it must not train `model`
    new.config = dataclasses.replace(model.config, hidden_act="relu")  # export reads this
    for layer in new.layers:
        layer.mlp.act = nn.ReLU()  # stage 1: a = ReLU(W_gate x)
        if stage == 2:  # the inputs of q/k/v and of gate/up become sparse too
            layer.attn_in_act = nn.ReLU()
            layer.mlp_in_act = nn.ReLU()
    return new
