"""RoPE against transformers' rotary embedding, its relative-position property, context
extension, and ALiBi slopes against the paper's values and BLOOM's implementation."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from minisparse.core.model import ModelConfig
from minisparse.core.rope import (
    alibi_bias,
    alibi_slopes,
    interpolated_inv_freq,
    ntk_inv_freq,
    rope_frequencies,
    rope_inv_freq,
    rotate,
)
from minisparse.measure.tolerance import rope_bound


def test_rope_equals_transformers_rotary_for_the_embedded_config():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    c = ModelConfig()  # the embedded SmolLM2-135M shape: head_dim 64, theta 1e5
    hf_config = LlamaConfig(
        hidden_size=c.dim,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_seq_len,
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, c.n_heads, 37, c.head_dim, generator=gen)
    k = torch.randn(2, c.n_kv_heads, 37, c.head_dim, generator=gen)
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)
    # float32 angles p * theta_i carry an error of up to 2 p theta_i u: the bound grows with p
    for high in (128, 8192):
        positions = torch.randint(0, high, (37,), generator=gen)
        cos, sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])
        hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
        for x, theirs in ((q, hf_q), (k, hf_k)):
            atol = rope_bound(x, positions, inv_freq)
            torch.testing.assert_close(rotate(x, positions, inv_freq), theirs, rtol=0, atol=atol)


def test_scores_depend_only_on_the_offset():
    gen = torch.Generator().manual_seed(1)
    d = 32
    inv_freq = rope_inv_freq(d, 10000.0)
    q, k = torch.randn(d, dtype=torch.float64, generator=gen), torch.randn(d, generator=gen)
    k = k.double()

    def score(m: int, n: int) -> float:
        qm = rotate(q[None], torch.tensor([m]), inv_freq.double())
        kn = rotate(k[None], torch.tensor([n]), inv_freq.double())
        return float(qm @ kn.T)

    for offset in (0, 3, 17):
        scores = [score(m, m + offset) for m in (0, 5, 100, 1234)]
        assert max(scores) - min(scores) < 1e-4 * max(1.0, abs(scores[0]))
    assert abs(score(0, 3) - score(0, 17)) > 1e-3  # different offsets do differ


def test_rotation_keeps_norms():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 9, 16, generator=gen)
    y = rotate(x, torch.arange(50, 59), rope_inv_freq(16, 500.0))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(x, y)


def test_position_interpolation_reads_position_p_as_p_over_s():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 8, 16, generator=gen)
    inv_freq = rope_inv_freq(16, 10000.0)
    positions = torch.arange(0, 32, 4)
    stretched = rotate(x, positions, interpolated_inv_freq(inv_freq, 4.0))
    torch.testing.assert_close(stretched, rotate(x, positions // 4, inv_freq))


def test_ntk_keeps_the_fastest_and_stretches_the_slowest_frequency_by_s():
    d, base, s = 64, 100000.0, 8.0
    plain, ntk = rope_inv_freq(d, base), ntk_inv_freq(d, base, s)
    assert math.isclose(float(ntk[0]), float(plain[0]))
    assert math.isclose(float(plain[-1] / ntk[-1]), s, rel_tol=1e-9)
    ratios = plain / ntk
    assert bool((ratios[1:] > ratios[:-1]).all())  # stretch grows from fast to slow pairs


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=">= 1"):
        interpolated_inv_freq(rope_inv_freq(8, 10.0), 0.5)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_inv_freq(7, 10000.0)
    with pytest.raises(ValueError, match="at least 1"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="cannot exceed"):
        alibi_bias(4, 5, 3)
    model = tiny_model(seed=1)
    with (
        pytest.raises(ValueError, match="inv_freq must have shape"),
        rope_frequencies(model, torch.ones(3)),
    ):
        pass


def test_rope_frequencies_changes_the_model_and_restores_it():
    model = tiny_model(seed=2)
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = model(tokens)
        with rope_frequencies(model, interpolated_inv_freq(model.inv_freq, 2.0)):
            scaled = model(tokens)
        after = model(tokens)
    assert torch.equal(before, after)
    assert (before - scaled).abs().max() > 1e-3


def test_alibi_slopes_match_the_paper():
    eight = [2.0**-i for i in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    assert alibi_slopes(8).tolist() == eight
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    twelve = eight + [2.0 ** -(0.5 + i) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(twelve, dtype=torch.float64))


@pytest.mark.parametrize("n_heads", [8, 6, 12, 20])
def test_alibi_bias_matches_bloom(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    n = 11
    bloom = build_alibi_tensor(torch.ones(1, n), n_heads, torch.float64)  # m_h * j per key j
    ours = alibi_bias(n_heads, n)  # -m_h * (i - j): the same up to a constant per row
    i = torch.arange(n, dtype=torch.float64)
    shifted = ours + alibi_slopes(n_heads)[:, None, None] * i[None, :, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    expected = bloom.view(n_heads, 1, n).expand(n_heads, n, n)
    torch.testing.assert_close(shifted[:, causal], expected[:, causal].double(), rtol=0, atol=1e-6)
    decode_row = alibi_bias(n_heads, 1, n)
    torch.testing.assert_close(decode_row[:, 0], ours[:, -1])
