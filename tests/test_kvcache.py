"""KV cache sizing, the paged cache (block tables, prefix sharing, copy-on-write), the sink and
H2O caches against static-cache decoding, and the waste simulation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from minisparse.core.attention import attention
from minisparse.core.model import make_cache
from minisparse.kvcache import (
    BlockManager,
    H2OCache,
    OutOfBlocks,
    PagedKVCache,
    SinkCache,
    Trace,
    kv_cache_bytes,
    make_kv_cache,
    random_trace,
    simulate_waste,
    token_nll,
)
from minisparse.runtime.generate import generate


class IdTokenizer:
    """Ids written as numbers, for tiny random models."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_kv_cache_bytes_reproduces_the_published_numbers():
    assert kv_cache_bytes(32, 32, 128, 1) == 524_288  # Llama-2-7B, fp16: 512 KiB per token
    mha_70b = kv_cache_bytes(80, 64, 128, 4096, batch=16)
    assert mha_70b == 160 * 2**30  # a 70B model with full multi-head K/V: 160 GiB
    assert kv_cache_bytes(80, 8, 128, 4096, batch=16) * 8 == mha_70b  # GQA, 8 K/V heads
    assert kv_cache_bytes(30, 3, 64, 10, bytes_per_elem=4) == 2 * 30 * 3 * 64 * 10 * 4


def test_kv_cache_bytes_matches_the_cache_tensors():
    model = tiny_model(seed=0)
    cache = make_cache(model.config, batch=3, max_seq_len=40)
    stored = sum(c.k.numel() * c.k.element_size() * 2 for c in cache)
    c = model.config
    assert kv_cache_bytes(c.n_layers, c.n_kv_heads, c.head_dim, 40, 3, 4) == stored


def test_kv_cache_bytes_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_kv_heads must be at least 1"):
        kv_cache_bytes(32, 0, 128, 10)
    with pytest.raises(ValueError, match="seq_len >= 0"):
        kv_cache_bytes(32, 8, 128, -1)


@pytest.mark.parametrize(
    "kind,options",
    [
        ("paged", {"block_size": 5}),
        ("sink", {"n_sink": 4, "window": 60}),  # window >= sequence length: nothing evicted
        ("h2o", {"budget": 60}),
    ],
)
def test_greedy_decoding_equals_static_cache(kind, options):
    model = tiny_model(seed=21)
    prompt = " ".join(str(int(t)) for t in random_ids(13, seed=22))
    static = generate(model, IdTokenizer(), prompt, max_new_tokens=40)
    other = generate(model, IdTokenizer(), prompt, max_new_tokens=40, cache=kind, **options)
    assert len(static) == 40 and other == static


@pytest.mark.parametrize(
    "cache",
    [
        lambda c: PagedKVCache(c, n_blocks=9, block_size=7),
        lambda c: [SinkCache(n_sink=2, window=100) for _ in range(c.n_layers)],
        lambda c: [H2OCache(budget=100) for _ in range(c.n_layers)],
    ],
)
def test_chunked_logits_equal_the_static_cache_when_nothing_is_evicted(cache):
    model = tiny_model(seed=23)
    ids = random_ids(60, seed=24)
    full = token_nll(model, ids, chunk=60)
    chunked = token_nll(model, ids, cache(model.config), chunk=11)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)


class BandedAttention:
    """Reference for one layer: the whole sequence at once, each query masked to its sinks and
    window by explicit loops (no cache, no eviction)."""

    def __init__(self, n_sink: int, window: int) -> None:
        self.n_sink, self.window = n_sink, window

    def attend(self, q, k, v, input_pos):
        n = k.shape[2]
        mask = torch.zeros(n, n, dtype=torch.bool)
        for p in range(n):
            for j in range(p + 1):
                mask[p, j] = j < self.n_sink or j > p - self.window
        return attention(q, k, v, mask)


@pytest.mark.parametrize("chunk", [1, 6])
def test_sink_cache_equals_banded_attention_over_the_whole_sequence(chunk):
    model = tiny_model(seed=25)
    ids = random_ids(40, seed=26)
    n_sink, window = 3, 8
    streamed = token_nll(model, ids, [SinkCache(n_sink, window) for _ in range(2)], chunk=chunk)
    banded = token_nll(model, ids, [BandedAttention(n_sink, window) for _ in range(2)], chunk=39)
    torch.testing.assert_close(streamed, banded, atol=1e-5, rtol=0)
    plain = token_nll(model, ids, chunk=6)
    assert (streamed[window:] - plain[window:]).abs().max() > 1e-3  # eviction changes the result


def test_sink_cache_keeps_sinks_and_window_only():
    model = tiny_model(seed=27)
    caches = [SinkCache(n_sink=4, window=10) for _ in range(2)]
    token_nll(model, random_ids(50, seed=28), caches, chunk=1)
    assert caches[0].pos.tolist() == [0, 1, 2, 3, *range(39, 49)]


def test_h2o_keeps_recent_and_heaviest_tokens_within_budget():
    model = tiny_model(seed=29)
    caches = [H2OCache(budget=12, recent=4) for _ in range(2)]
    token_nll(model, random_ids(50, seed=30), caches, chunk=1)
    for cache in caches:
        assert cache.pos.shape[-1] == 12
        assert (cache.pos[..., -4:] == torch.arange(45, 49)).all()  # the four newest tokens
        assert bool((cache.pos[..., 1:] > cache.pos[..., :-1]).all())  # kept in position order


def test_h2o_evicts_the_lowest_scores():
    cache = H2OCache(budget=3, recent=1)
    cache.k = torch.zeros(1, 1, 5, 2)
    cache.v = torch.zeros(1, 1, 5, 2)
    cache.pos = torch.arange(5).view(1, 1, 5)
    cache.score = torch.tensor([[[5.0, 0.1, 3.0, 0.2, 0.0]]])
    cache.evict()
    assert cache.pos.flatten().tolist() == [0, 2, 4]


def test_bounded_caches_reject_bad_sizes():
    with pytest.raises(ValueError, match="window >= 1"):
        SinkCache(4, 0)
    with pytest.raises(ValueError, match="recent <= budget"):
        H2OCache(budget=4, recent=5)
    config = tiny_model().config
    with pytest.raises(ValueError, match="Unknown cache 'ring'"):
        make_kv_cache("ring", config, 10)
    with pytest.raises(ValueError, match=r"do not apply to the 'sink' cache; it takes \['n_sink'"):
        make_kv_cache("sink", config, 10, budget=3)
    with pytest.raises(ValueError, match="drop the cache arguments"):
        generate(tiny_model(), IdTokenizer(), "1 2", 3, use_cache=False, cache="sink")
    with pytest.raises(ValueError, match="at least 2 token ids"):
        token_nll(tiny_model(), torch.tensor([3]))


def test_block_manager_shares_prefixes_and_copies_on_write():
    m = BlockManager(n_blocks=6, block_size=4)
    a = m.add_sequence()
    assert m.prepare_write(a, 0, 10) == []  # 10 tokens: 3 blocks
    assert m.table(a) == [0, 1, 2] and m.blocks_in_use == 3
    b = m.fork(a)
    assert m.table(b) == [0, 1, 2] and m.refs[:3] == [2, 2, 2] and m.blocks_in_use == 3
    copies = m.prepare_write(b, 10, 11)  # b writes into the shared, partly filled block 2
    assert copies == [(2, 3)] and m.table(b) == [0, 1, 3] and m.refs[2] == 1
    assert m.prepare_write(a, 10, 12) == [] and m.table(a) == [0, 1, 2]  # a owns block 2 now
    m.free_sequence(a)
    assert m.refs[:3] == [1, 1, 0] and m.blocks_in_use == 3
    m.free_sequence(b)
    assert m.blocks_in_use == 0
    s = m.add_sequence()
    torch.testing.assert_close(m.slots(s, torch.arange(0)), torch.zeros(0, dtype=torch.long))
    with pytest.raises(OutOfBlocks, match="more blocks"):
        m.prepare_write(s, 0, 25)
    with pytest.raises(KeyError, match="Unknown sequence 99"):
        m.table(99)


def test_paged_cache_forked_sequences_decode_like_separate_static_caches():
    model = tiny_model(seed=31)
    prefix, tail_a, tail_b = random_ids(11, 32), random_ids(6, 33), random_ids(6, 34)
    cache = PagedKVCache(model.config, n_blocks=12, block_size=4)
    with torch.inference_mode():
        model(prefix[None], torch.arange(11), cache)
        a = cache.active
        b = cache.fork()
        shared = cache.manager.blocks_in_use
        pos = torch.arange(11, 17)
        out_a = model(tail_a[None], pos, cache)
        cache.use(b)
        out_b = model(tail_b[None], pos, cache)
        cache.use(a)
        again_a = model(tail_a[None], pos, cache)  # a's blocks were not touched by b
        for tail, out in ((tail_a, out_a), (tail_b, out_b)):
            ref = model(torch.cat([prefix, tail])[None])[:, 11:]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(again_a, out_a, atol=1e-6, rtol=0)
    assert shared == 3  # 11 tokens in blocks of 4, held once by both sequences
    assert cache.manager.table(a)[:2] == cache.manager.table(b)[:2]  # full prefix blocks shared
    assert cache.manager.table(a)[2] != cache.manager.table(b)[2]  # the partial one was copied
    with pytest.raises(ValueError, match="batch 1"):
        cache[0].update(torch.arange(2), torch.zeros(2, 2, 2, 12), torch.zeros(2, 2, 2, 12))


def test_paging_wastes_at_most_a_block_per_request():
    trace = random_trace(32, max_prompt=300, max_output=400, seed=0, shared_prefix=64)
    reports = {r.scheme: r for r in simulate_waste(trace, max_seq_len=2048, block_size=16)}
    worst_paged = 32 * 15 / reports["paged"].reserved_slots
    assert reports["paged"].waste <= worst_paged
    assert reports["contiguous, max length"].waste > 0.6
    assert reports["paged"].waste < reports["contiguous, prompt + max output"].waste
    shared = reports["paged + shared prefix"]
    assert shared.reserved_slots < reports["paged"].reserved_slots
    assert math.isclose(reports["paged"].used_slots, reports["contiguous, max length"].used_slots)


def test_waste_on_a_hand_computed_trace():
    # one request: prompt 3, output 2 -> holds 4 then 5 tokens; blocks of 4 -> 4 then 8 slots
    reports = simulate_waste(Trace([3], [2]), max_seq_len=10, block_size=4)
    by = {r.scheme: r for r in reports}
    assert by["contiguous, max length"].reserved_slots == 10
    assert by["contiguous, prompt + max output"].reserved_slots == 5
    assert by["paged"].reserved_slots == 6 and by["paged"].used_slots == 4.5
    with pytest.raises(ValueError, match="max_seq_len"):
        simulate_waste(Trace([3], [2]), max_seq_len=4)
