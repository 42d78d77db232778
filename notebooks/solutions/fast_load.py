"""Chapter 08: the fast device's share of the activated-neuron work."""


def fast_load(hot, frequencies) -> float:
    total = sum(float(f.sum()) for f in frequencies)
    return sum(float(f[h].sum()) for f, h in zip(frequencies, hot, strict=True)) / total
