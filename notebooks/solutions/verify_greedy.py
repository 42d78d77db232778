"""Chapter 10: greedy verification of a draft's tokens."""


def verify(target_logits, draft_tokens):
    best = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == best[n]:
        n += 1
    return n, best[n]
