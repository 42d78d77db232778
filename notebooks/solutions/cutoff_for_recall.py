"""Chapter 06: the cutoff that keeps a recall target (each layer's, set on held-out tokens)."""

import math


def cutoff_for_recall(logits, active, recall):
    positives = logits[active].float()  # only the truly active units decide the cutoff
    if positives.numel() == 0:
        return math.inf  # nothing to find: predict nothing
    k = int((1 - recall) * positives.numel())  # how many of them may be missed
    if k == 0:  # every active unit must pass logit > cutoff
        return float(positives.min()) - 1e-6
    return float(positives.kthvalue(k).values)  # the k lowest are at or below it
