"""Chapter 02's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's code runs inside the real model (tiled attention) and as a paged cache's
bookkeeping."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from conftest import tiny_model
from minisparse.core.model import make_cache
from minisparse.course.builds.ch01 import attention_with
from minisparse.course.plug import solution
from minisparse.kvcache.paged import PagedKVCache

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
tiled = solution("tiled_attention", SOLUTIONS)
Manager = solution("block_manager", SOLUTIONS)


def no_running_max(q, k, v, block):
    """exp(score) directly: right until a score passes ~88, where float32 exp overflows."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, n = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None], float("-inf"))
    p = torch.exp(s)
    return (p @ v) / p.sum(-1, keepdim=True)


def no_rescale(q, k, v, block):
    """The running sums are not rescaled when the maximum grows."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, n = q.shape[2], k.shape[2]
    q = q / math.sqrt(q.shape[-1])
    m = torch.full((*q.shape[:-1], 1), float("-inf"))
    total, a = torch.zeros_like(m), torch.zeros_like(q)
    for start in range(0, n, block):
        s = q @ k[:, :, start : start + block].transpose(-1, -2)
        future = (
            torch.arange(start, min(start + block, n))[None, :] > torch.arange(n - t, n)[:, None]
        )
        s = s.masked_fill(future, float("-inf"))
        m = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m)
        total, a = total + p.sum(-1, keepdim=True), a + p @ v[:, :, start : start + block]
    return a / total


def whole_blocks_only(q, k, v, block):
    """Drops the last, shorter block of keys."""
    n = k.shape[2] // block * block
    if n == 0:
        return torch.zeros_like(q)
    t = min(q.shape[2], n)
    return torch.cat([tiled(q[:, :, :t], k[:, :, :n], v[:, :, :n], block), q[:, :, t:]], 2)


class NoCopyOnWrite(Manager):
    def prepare_write(self, seq, start, end):
        table = self.tables[seq]
        while len(table) * self.block_size < end:
            table.append(self._take())
        return []


class ForkWithoutReferences(Manager):
    def fork(self, seq):
        child = self.add_sequence()
        self.tables[child] = list(self.tables[seq])
        return child


class OneBlockTooMany(Manager):
    def prepare_write(self, seq, start, end):
        table = self.tables[seq]
        while len(table) * self.block_size <= end:
            table.append(self._take())
        return super().prepare_write(seq, start, end)


def heavy_among_all(score, budget, recent):
    """Chooses the heavy hitters among every entry, the newest included (kept twice)."""
    n = score.shape[-1]
    if n <= budget:
        return torch.arange(n).expand(score.shape)
    heavy = score.topk(budget - recent, dim=-1).indices.sort(dim=-1).values
    return torch.cat([heavy, torch.arange(n - recent, n).expand(*score.shape[:-1], recent)], -1)


def no_recent_window(score, budget, recent):
    """The budget largest scores, the newest tokens not protected (they have had little time to
    collect attention, so they are evicted first)."""
    n = score.shape[-1]
    if n <= budget:
        return torch.arange(n).expand(score.shape)
    return score.topk(budget, dim=-1).indices.sort(dim=-1).values


WRONG = {
    "tiled_attention": [no_running_max, no_rescale, whole_blocks_only],
    "block_manager": [NoCopyOnWrite, ForkWithoutReferences, OneBlockTooMany],
    "h2o_keep": [heavy_among_all, no_recent_window],
}


def test_the_learners_tiled_attention_decodes_like_the_model():
    model = tiny_model(n_kv_heads=2)
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = model(tokens)
        with attention_with(model, attend=lambda q, k, v: tiled(q, k, v, 4)):
            got = model(tokens)
            cache = make_cache(model.config, max_seq_len=16)  # prompt, then one decode step
            model(tokens[:, :8], torch.arange(8), cache)
            step = model(tokens[:, 8:], torch.arange(8, 9), cache)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(step[0, -1], want[0, -1], atol=1e-5)
    assert type(model.layers[0].attn).__name__ == "Attention"  # the model's own came back


def test_the_learners_block_manager_runs_a_paged_cache():
    model = tiny_model()
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want = model(tokens)[0, -1]
        cache = PagedKVCache(model.config, n_blocks=8, block_size=4, manager=Manager)
        model(tokens[:, :7], torch.arange(7), cache)
        cache.use(cache.fork())  # a second request sharing the 7-token prompt
        for p in range(7, 12):
            logits = model(tokens[:, p : p + 1], torch.arange(p, p + 1), cache)
    assert torch.allclose(logits[0, -1], want, atol=1e-5)
    assert len(cache.manager.free) == 8 - 3 - 1  # 3 blocks of the prompt, 1 copied on write


def test_the_learners_sink_rule_is_what_the_sink_cache_evicts_by():
    model = tiny_model()
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2)
    )
    learner = solution("sink_visible", SOLUTIONS)
    calls = []

    def counted(*args):
        calls.append(1)
        return learner(*args)

    def nll(rule):
        from minisparse.kvcache import SinkCache, token_nll

        caches = [SinkCache(2, 6, rule) for _ in range(model.config.n_layers)]
        return token_nll(model, tokens[0], caches, chunk=4)

    assert torch.allclose(nll(counted), nll(None), atol=1e-6) and calls
    # a rule that keeps one token too many changes what the model sees
    wider = lambda q, k, s, w: learner(q, k, s, w + 1)  # noqa: E731
    assert not torch.allclose(nll(wider), nll(None), atol=1e-6)


def test_the_learners_h2o_rule_is_what_the_h2o_cache_keeps():
    from minisparse.kvcache import H2OCache, token_nll

    model = tiny_model()
    tokens = torch.randint(
        0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)
    )
    learner = solution("h2o_keep", SOLUTIONS)

    def nll(rule):
        return token_nll(model, tokens, [H2OCache(8, 3, rule) for _ in model.layers], chunk=4)

    assert torch.allclose(nll(learner), nll(None), atol=1e-6)
    assert not torch.allclose(nll(no_recent_window), nll(None), atol=1e-6)
