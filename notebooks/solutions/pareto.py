"""Chapter 11: the configurations no other one beats on both speed and perplexity."""


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    def beats(o, r):  # o is at least as good in both, and better in one
        return o[0] >= r[0] and o[1] <= r[1] and (o[0] > r[0] or o[1] < r[1])

    return [not any(beats(o, r) for o in points) for r in points]
