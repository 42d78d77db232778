"""Chapter 10: the distribution a rejected draft token is redrawn from."""


def residual(p, q):
    r = (p - q).clamp_min(0)  # where the target wants more mass than the draft gave
    total = r.sum()
    return r / total if total > 0 else p  # p == q: nothing is ever rejected
