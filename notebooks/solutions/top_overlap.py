"""Chapter 08: do two measurements agree on which neurons are hot?"""


def top_overlap(a, b, share: float) -> float:
    k = max(1, round(share * a.numel()))
    # a stable sort keeps equal frequencies in index order
    top_a = set(a.argsort(descending=True, stable=True)[:k].tolist())
    top_b = set(b.argsort(descending=True, stable=True)[:k].tolist())
    return len(top_a & top_b) / k
