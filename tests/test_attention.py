"""MHA/MQA/GQA against per-head attention and SDPA, K/V head regrouping against the original
model, and tiled (online-softmax) attention against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.core.attention import (
    attention,
    expand_kv_heads,
    mha_to_gqa,
    position_mask,
    regroup_kv_heads,
    tiled_attention,
)
from minisparse.measure.tolerance import attention_bound


def qkv(b, h, g, t, n, d, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, t, d, generator=gen, dtype=dtype),
        torch.randn(b, g, n, d, generator=gen, dtype=dtype),
        torch.randn(b, g, n, d, generator=gen, dtype=dtype),
    )


def per_head_reference(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v head by head in float64, each query head on its own K/V head."""
    group = q.shape[1] // k.shape[1]
    out = []
    for h in range(q.shape[1]):
        s = q[:, h].double() @ k[:, h // group].double().transpose(-1, -2) / q.shape[-1] ** 0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        out.append(torch.softmax(s, -1) @ v[:, h // group].double())
    return torch.stack(out, 1)


@pytest.mark.parametrize("heads,kv_heads", [(6, 6), (6, 3), (6, 2), (6, 1)])
def test_mha_gqa_mqa_equal_per_head_attention_and_sdpa(heads, kv_heads):
    q, k, v = qkv(2, heads, kv_heads, 9, 13, 16, seed=heads + kv_heads)
    mask = position_mask(torch.arange(4, 13), torch.arange(13))
    ours = attention(q, k, v, mask)
    bound = attention_bound(q, k, v)  # float32 rounding of two correct attentions (tolerance)
    torch.testing.assert_close(ours.double(), per_head_reference(q, k, v, mask), atol=bound, rtol=0)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads < heads)
    torch.testing.assert_close(ours, sdpa, atol=bound, rtol=0)


def test_gqa_with_as_many_kv_heads_as_query_heads_is_mha_exactly():
    q, k, v = qkv(1, 4, 4, 7, 7, 8, seed=5)
    mask = position_mask(torch.arange(7), torch.arange(7))
    w = torch.softmax((q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~mask, float("-inf")), -1)
    assert torch.equal(attention(q, k, v, mask), w @ v)


def test_expanding_kv_heads_leaves_the_model_unchanged():
    model = tiny_model(seed=3, n_heads=6, n_kv_heads=2, head_dim=8)
    mha = expand_kv_heads(model)
    assert mha.config.n_kv_heads == 6 and mha.layers[0].attn.k_proj.out_features == 48
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        torch.testing.assert_close(mha(tokens), model(tokens), atol=1e-5, rtol=0)
        # pooling copies of a head gives back that head (to rounding)
        back = mha_to_gqa(mha, 2)
        torch.testing.assert_close(
            back.layers[1].attn.v_proj.weight, model.layers[1].attn.v_proj.weight, atol=1e-8, rtol=0
        )
        torch.testing.assert_close(back(tokens), model(tokens), atol=1e-6, rtol=0)
    assert model.config.n_kv_heads == 2  # the original is not modified


def test_mha_to_gqa_mean_pools_each_group():
    model = tiny_model(seed=4, n_heads=4, n_kv_heads=4, head_dim=6, attention_bias=True)
    gqa = mha_to_gqa(model, 2)
    first = regroup_kv_heads(model, 2, how="first")
    w = model.layers[0].attn.k_proj.weight.view(4, 6, -1)
    b = model.layers[0].attn.k_proj.bias.view(4, 6)
    pooled = gqa.layers[0].attn.k_proj
    torch.testing.assert_close(pooled.weight.view(2, 6, -1)[1], (w[2] + w[3]) / 2)
    torch.testing.assert_close(pooled.bias.view(2, 6)[0], (b[0] + b[1]) / 2)
    assert torch.equal(first.layers[0].attn.k_proj.weight.view(2, 6, -1)[1], w[2])
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        assert gqa(tokens).shape == model(tokens).shape
        assert (gqa(tokens) - model(tokens)).abs().max() > 1e-4  # pooling distinct heads changes it


def test_regrouping_rejects_impossible_head_counts():
    model = tiny_model(seed=5, n_heads=6, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="must divide n_heads"):
        regroup_kv_heads(model, 4)
    with pytest.raises(ValueError, match="one count must divide the other"):
        regroup_kv_heads(model, 3)
    with pytest.raises(ValueError, match="expand_kv_heads"):
        mha_to_gqa(model, 6)
    with pytest.raises(ValueError, match="mha_to_gqa"):
        expand_kv_heads(model, 1)
    with pytest.raises(ValueError, match="'mean' or 'first'"):
        regroup_kv_heads(model, 1, how="max")
    q, k, v = qkv(1, 6, 4, 3, 3, 8, seed=8)
    with pytest.raises(ValueError, match="cannot share"):
        attention(q, k, v)


@pytest.mark.parametrize(
    "t,n,block_q,block_k,kv_heads",
    [
        (64, 64, 16, 16, 4),
        (37, 37, 16, 8, 2),
        (1, 53, 16, 16, 1),
        (19, 71, 8, 32, 4),
        (5, 5, 64, 64, 2),
    ],
)
def test_tiled_attention_equals_sdpa(t, n, block_q, block_k, kv_heads):
    q, k, v = qkv(2, 4, kv_heads, t, n, 32, seed=t * n)
    gqa = kv_heads < 4
    plain = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    tiled = tiled_attention(q, k, v, block_q=block_q, block_k=block_k)
    bound = attention_bound(q, k, v)  # float32 rounding of two correct attentions (tolerance)
    torch.testing.assert_close(tiled, plain, atol=bound, rtol=0)
    mask = position_mask(torch.arange(n - t, n), torch.arange(n))  # queries are the last t
    causal = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    tiled_causal = tiled_attention(q, k, v, causal=True, block_q=block_q, block_k=block_k)
    torch.testing.assert_close(tiled_causal, causal, atol=bound, rtol=0)
    if t == n:
        square = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.testing.assert_close(tiled_causal, square, atol=bound, rtol=0)


def test_tiled_attention_in_float64_matches_to_rounding():
    q, k, v = qkv(1, 2, 2, 45, 45, 16, seed=9, dtype=torch.float64)
    ref = per_head_reference(q, k, v, position_mask(torch.arange(45), torch.arange(45)))
    torch.testing.assert_close(
        tiled_attention(q, k, v, causal=True, block_q=7, block_k=10), ref, atol=1e-12, rtol=0
    )


def test_tiled_attention_rejects_bad_shapes():
    q, k, v = qkv(1, 2, 2, 8, 4, 16, seed=10)
    with pytest.raises(ValueError, match="q_len <= k_len"):
        tiled_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="positive"):
        tiled_attention(q, k, v, block_q=0)
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        tiled_attention(q[0], k[0], v[0])
