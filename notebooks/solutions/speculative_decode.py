"""Chapter 10: greedy speculative decoding with a draft model, both KV caches rolled back."""

import torch

from minisparse.core.model import make_cache


def speculative_decode(target, draft, prompt, gamma, max_new_tokens):
    length = len(prompt) + max_new_tokens  # no position is ever written beyond this
    target_cache = make_cache(target.config, 1, length, target.dtype)
    draft_cache = make_cache(draft.config, 1, length, draft.dtype)

    def run(model, cache, tokens, start):
        """Logits [len(tokens), vocab]; the tokens are written at positions start, start + 1, .."""
        positions = torch.arange(start, start + len(tokens))
        return model(torch.tensor([tokens]), positions, cache)[0]

    ids, passes, emitted = list(prompt), [], 0
    drafted = 0  # the draft's cache holds ids[:drafted]; what lies beyond is stale
    with torch.no_grad():
        if len(ids) > 1:
            run(target, target_cache, ids[:-1], 0)  # the target's cache: every token but the last
        while emitted < max_new_tokens:
            k = min(gamma, max_new_tokens - emitted - 1)  # the target adds one token of its own
            # 1. the draft proposes k tokens, first feeding what its cache lacks
            proposal, feed, start = [], ids[drafted:], drafted
            for _ in range(k):
                token = int(run(draft, draft_cache, feed, start)[-1].argmax())
                proposal.append(token)
                start, feed = start + len(feed), [token]
            # 2. one target pass over the last token and the proposal
            choice = run(target, target_cache, [ids[-1], *proposal], len(ids) - 1).argmax(-1)
            # 3. accept while the draft agrees; the target's own token follows (the bonus after k)
            n = 0
            while n < k and proposal[n] == int(choice[n]):
                n += 1
            new = [*proposal[:n], int(choice[n])]
            # 4. roll back: the draft fed ids and proposal[:-1]; only the accepted ones stay valid.
            # The target needs nothing: its next pass writes from len(ids) - 1 on, over the
            # rejected entries, and attention reads only up to the last position written.
            if k > 0:
                drafted = len(ids) + min(n, k - 1)
            passes.append(new)
            ids += new
            emitted += len(new)
    return passes
