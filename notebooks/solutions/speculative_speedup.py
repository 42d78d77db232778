"""Chapter 10: the speedup speculative decoding promises, from alpha, gamma and the costs."""


def speculative_speedup(alpha: float, gamma: int, cost_ratio: float, verify_cost: float) -> float:
    # a pass emits j accepted drafts plus one target token; P(at least j accepted) = alpha^j
    tokens = sum(alpha**j for j in range(gamma + 1))
    return tokens / (gamma * cost_ratio + verify_cost)  # gamma draft steps, one target pass
