"""Chapter 06: the logit cutoff that finds a given share of the active neurons."""

import math


def recall_cutoff(logits, active, recall: float) -> float:
    positives = logits[active].float().sort().values  # the active units' logits, ascending
    n = positives.numel()
    if n == 0:
        return math.inf  # nothing to find: let nothing through
    k = int((1 - recall) * n)  # how many active units may be missed
    if k == 0:
        return float(positives[0]) - 1e-6  # just below the smallest: all of them pass
    return float(positives[k - 1])  # units pass when logit > cutoff: the k lowest are missed
