"""Chapter 06: how good a predicted set of active neurons is."""


def recall_precision(predicted, actual) -> tuple[float, float]:
    found = int((predicted & actual).sum())  # true positives
    n_actual, n_predicted = int(actual.sum()), int(predicted.sum())
    recall = found / n_actual if n_actual else 1.0  # nothing to find: nothing missed
    precision = found / n_predicted if n_predicted else 1.0  # nothing predicted: no false alarm
    return recall, precision
