"""Chapter 10's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's loop decodes a tiny model like greedy decoding, and the learner's step keeps
the target's law."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_model
from minisparse import speculative as S
from minisparse.core.model import make_cache
from minisparse.course import check
from minisparse.course.builds.ch10 import passes_stats
from minisparse.course.plug import solution
from minisparse.runtime.generate import generate

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
decode = solution("speculative_decode", SOLUTIONS)
step = solution("speculative_step", SOLUTIONS)


def loop(target, draft, prompt, gamma, max_new_tokens, mistake):
    """The worked solution's loop with one of the mistakes a first attempt makes."""
    length = len(prompt) + 2 * max_new_tokens + gamma + 2
    caches = {m: make_cache(m.config, 1, length, m.dtype) for m in (target, draft)}

    def run(model, tokens, start):
        pos = torch.arange(start, start + len(tokens))
        return model(torch.tensor([tokens]), pos, caches[model])[0]

    ids, passes, emitted, drafted, written = list(prompt), [], 0, 0, len(prompt) - 1
    unseen, draft_at = list(prompt), 0  # "draft not rolled back": what it has not fed, where next
    with torch.no_grad():
        if len(ids) > 1:
            run(target, ids[:-1], 0)
        while emitted < max_new_tokens:
            k = min(gamma, max_new_tokens - emitted - 1)
            stale = mistake == "draft not rolled back"
            proposal, feed, start = (
                [],
                unseen if stale else ids[drafted:],
                draft_at if stale else drafted,
            )
            for _ in range(k):
                token = int(run(draft, feed, start)[-1].argmax())
                proposal.append(token)
                start, feed = start + len(feed), [token]
            # no rollback: the target writes after the last position it wrote, rejected or not
            at = written if mistake == "no rollback" else len(ids) - 1
            choice = run(target, [ids[-1], *proposal], at).argmax(-1).tolist()
            written = at + 1 + k
            shift = 1 if mistake == "off by one" else 0  # row i+1 read as the target's choice
            n = 0
            while n < k and n + shift <= k and proposal[n] == choice[n + shift]:
                n += 1
            if mistake == "no bonus" and n == k > 0:
                new = proposal  # every draft accepted, the target's own token dropped
            else:
                new = [*proposal[:n], choice[min(n + shift, k)]]
            if k > 0:
                drafted = len(ids) + min(n, k - 1)
                # without rollback the draft goes on after its own proposals
                unseen, draft_at = (feed + new[k:] if n == k else new[-1:]), start
            else:
                unseen = unseen + new
            passes.append(new)
            ids += new
            emitted += len(new)
    return passes


def loop_with(mistake):
    def wrong(target, draft, prompt, gamma, max_new_tokens):
        return loop(target, draft, prompt, gamma, max_new_tokens, mistake)

    wrong.__name__ = mistake.replace(" ", "_")
    return wrong


def step_with(mistake):
    def wrong(p, q, drafts, u):
        k = len(drafts)
        for i, d in enumerate(drafts):
            accept = u[i] < p[i, d] if mistake == "ignores q" else u[i] * q[i, d] < p[i, d]
            if accept:
                continue
            r = p[i] if mistake == "redraw from p" else (p[i] - q[i]).clamp_min(0)
            if r.sum() == 0:
                r = p[i]
            return i, draw(r, u[i] if mistake == "u of the draft" else u[k])
        return k, draw(p[k], u[k])

    wrong.__name__ = mistake.replace(" ", "_")
    return wrong


def draw(probs, u):
    cdf = probs.cumsum(0)
    return min(int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)), len(probs) - 1)


WRONG = {
    "speculative_decode": [
        loop_with(m) for m in ("no rollback", "off by one", "no bonus", "draft not rolled back")
    ],
    "speculative_step": [step_with(m) for m in ("redraw from p", "ignores q", "u of the draft")],
}


def test_a_loop_without_rollback_is_told_where_its_cache_went_wrong(capsys):
    assert not check("speculative_decode", loop_with("no rollback"), seed=0)
    assert "starts at" in capsys.readouterr().out
    assert not check("speculative_decode", loop_with("draft not rolled back"), seed=0)
    assert "a rejected token" in capsys.readouterr().out


def test_the_learners_loop_decodes_like_greedy_decoding():
    target = tiny_model(seed=0, tie_embeddings=False)
    drafts = {"int8": S.int8_draft(target).model, "early exit": S.early_exit_draft(target, 1).model}
    prompt = [5, 17, 3, 5, 17, 8]
    want = generate(target, None, prompt, max_new_tokens=14, stop_at_eos=False)
    for name, draft in drafts.items():
        passes = decode(target, draft, prompt, 3, 14)
        assert [t for chunk in passes for t in chunk] == want, name
        _, lib = S.speculative_generate(target, None, prompt, draft, 3, 14, stop_at_eos=False)
        ours = passes_stats(passes, 3, 14)
        assert (ours.per_pass, ours.accepted, ours.judged, ours.proposed) == (
            lib.per_pass, lib.accepted, lib.judged, lib.proposed
        ), name  # fmt: skip


def test_the_learners_step_keeps_the_targets_law():
    """One verification step, 20 000 times: the first emitted token has the target's law."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, 0)
    n = 20_000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    u = torch.rand(n, 2, generator=gen, dtype=torch.float64)
    pp, qq = torch.stack([p, p]), q[None]
    counts = torch.zeros(9, dtype=torch.float64)
    for d, uu in zip(drafts, u, strict=True):
        accepted, token = step(pp, qq, [d], uu)
        counts[d if accepted else token] += 1
    stat = ((counts - n * p) ** 2 / (n * p)).sum()
    pvalue = float(torch.special.gammaincc(torch.tensor(4.0, dtype=torch.float64), stat / 2))
    assert pvalue > 1e-3
