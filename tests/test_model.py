"""The from-scratch decoder against transformers' Llama and against its own uncached forward."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from minisparse.core.model import (
    KVCache,
    Linear,
    RMSNorm,
    Transformer,
    apply_rope,
    make_cache,
    rope_cos_sin,
    rope_inv_freq,
    use_input_major_weights,
    use_output_major_weights,
    use_streaming_gemv,
)
from minisparse.io.hf import compare_logits, from_hf, to_hf
from minisparse.kernels.cpu import fast_path_available
from minisparse.runtime.generate import generate

# (n_heads, n_kv_heads, head_dim, hidden, tied): MHA, GQA ratio 3, GQA ratio 4, MQA, odd head_dim
HF_SHAPES = {
    "mha": (4, 4, 16, 64, True),
    "gqa3": (6, 2, 8, 48, True),
    "gqa4": (8, 2, 8, 64, False),
    "mqa": (4, 1, 16, 64, True),
    "odd_head_dim_untied": (4, 2, 10, 40, False),
}


def random_hf_llama(n_heads, n_kv_heads, head_dim, hidden, tied, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=113,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 6,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_theta=5000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("shape", list(HF_SHAPES), ids=list(HF_SHAPES))
def test_tiny_configs_match_transformers(shape):
    hf = random_hf_llama(*HF_SHAPES[shape])
    model = from_hf(hf)
    tokens = torch.randint(0, 113, (2, 23), generator=torch.Generator().manual_seed(1))
    parity = compare_logits(model, hf, tokens)
    assert parity.max_abs_diff <= 1e-4
    assert parity.same_argmax
    assert model.config.tie_embeddings == HF_SHAPES[shape][4]


def test_embedded_model_matches_transformers(embedded, hf_reference):
    """minisparse's model (converted from transformers' dequantized GGUF) against transformers'
    model as the cache kept it: a fault in either conversion or in the cached reference fails."""
    model, tokenizer = embedded
    from minisparse.io.data import corpus, token_batches

    tokens = token_batches(tokenizer, corpus(split="eval"), seq_len=64, n=1)
    parity = compare_logits(model, hf_reference, tokens)
    assert parity.max_abs_diff <= 1e-3
    assert parity.same_argmax


def test_cached_chunks_equal_full_forward():
    model = tiny_model(seed=3)
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens)
        cache = make_cache(model.config, batch=2, max_seq_len=40)
        pieces, start = [], 0
        for length in (11, 1, 7, 1, 10):  # prefill, single tokens and chunks after a prefix
            pos = torch.arange(start, start + length)
            pieces.append(model(tokens[:, start : start + length], pos, cache))
            start += length
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_input_major_layout_changes_nothing_but_strides():
    model = tiny_model(seed=5)
    tokens = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(tokens)
        use_input_major_weights(model)
        assert model.layers[0].mlp.up_proj.weight.t().is_contiguous()
        assert model.lm_head.weight is model.embed.weight
        after = model(tokens)
        use_output_major_weights(model)
        assert model.layers[0].mlp.up_proj.weight.is_contiguous()
    assert torch.allclose(before, after, atol=1e-5, rtol=0)


def test_to_hf_round_trip_matches():
    model = tiny_model(seed=7, tie_embeddings=False)
    hf = to_hf(model)
    tokens = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(8))
    assert compare_logits(model, hf, tokens).max_abs_diff <= 1e-5
    back = from_hf(hf)
    assert compare_logits(back, hf, tokens).max_abs_diff <= 1e-5


def test_rmsnorm_against_float64():
    torch.manual_seed(9)
    norm = RMSNorm(33, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(4, 5, 33) * 3
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert torch.allclose(norm(x).double(), ref, atol=1e-5, rtol=1e-5)


def test_rope_matches_transformers_and_is_relative():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(10)
    q, k = torch.randn(1, 3, 9, 16), torch.randn(1, 3, 9, 16)
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(rope_inv_freq(16, 10000.0), pos, torch.float32)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert torch.allclose(apply_rope(q, cos, sin), ref_q, atol=1e-6)
    assert torch.allclose(apply_rope(k, cos, sin), ref_k, atol=1e-6)
    # q_m . k_n depends on m - n only: shift both positions by 5
    shifted_cos, shifted_sin = rope_cos_sin(rope_inv_freq(16, 10000.0), pos + 5, torch.float32)
    a = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)
    b = apply_rope(q, shifted_cos, shifted_sin) @ apply_rope(k, shifted_cos, shifted_sin).transpose(
        -1, -2
    )
    assert torch.allclose(a, b, atol=1e-4)


def test_kv_cache_overflow_is_a_clear_error():
    cache = KVCache(1, 2, 8, 4)
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="larger max_seq_len"):
        cache.update(torch.arange(6, 9), k, k)


def test_kv_cache_scattered_positions():
    cache = KVCache(1, 1, 8, 2)
    k = torch.randn(1, 1, 2, 2)
    keys, _ = cache.update(torch.tensor([1, 4]), k, k + 1)
    assert keys.shape[2] == 5
    assert torch.equal(keys[:, :, 1], k[:, :, 0]) and torch.equal(keys[:, :, 4], k[:, :, 1])


def test_bad_config_and_token_shape():
    from minisparse.core.model import ModelConfig

    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=9, n_kv_heads=2)
    with pytest.raises(ValueError, match="Unknown activation"):
        ModelConfig(hidden_act="swish-ish")
    with pytest.raises(ValueError, match=r"tokens\[None\]"):
        tiny_model()(torch.tensor([1, 2, 3]))


def test_embedded_model_shape(embedded):
    model, _ = embedded
    c = model.config
    assert (c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim) == (
        30,
        576,
        1536,
        9,
        3,
        64,
    )
    assert c.tie_embeddings and c.vocab_size == 49152 and c.rope_theta == 100000.0
    assert isinstance(model, Transformer)
    assert 134e6 < model.num_parameters() < 135e6


@pytest.mark.parametrize(("n_in", "n_out", "bias"), [(37, 101, False), (576, 1536, True)])
def test_streaming_linear_matches_float64(n_in, n_out, bias):
    gen = torch.Generator().manual_seed(n_in)
    lin = Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=gen))
    use_streaming_gemv(lin)
    # without a C compiler the switch stays off (one warning) and F.linear computes the same
    assert lin.streaming == fast_path_available() and lin.weight.t().is_contiguous()
    x = torch.randn(1, 1, n_in, generator=gen)
    with torch.no_grad():
        assert lin.can_stream(x)
        got = lin(x)
    ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    assert got.shape == (1, 1, n_out)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    # several rows, or a gradient to compute, go to F.linear
    assert not lin.can_stream(torch.randn(2, n_in))
    lin.weight.requires_grad_(True)
    assert not lin.can_stream(x)


def test_streaming_gemv_decode_equals_torch_decode(embedded, monkeypatch):
    """Chapter 07's streaming GEMV switched on for torch-module decoding: the same 16 tokens as
    F.linear, and it really runs (7 projections per layer + the LM head per single-token step,
    plus the LM head on the prefill's last position)."""
    from minisparse.kernels import cpu

    model, tokenizer = embedded
    prompt = "Exceptions are raised when"
    plain = generate(model, tokenizer, prompt, max_new_tokens=16, compiled=False)
    calls = []
    real = cpu.dense_gemv
    monkeypatch.setattr(cpu, "dense_gemv", lambda W_t, x: calls.append(1) or real(W_t, x))
    use_streaming_gemv(model, True)
    try:
        on = fast_path_available()
        assert all(m.streaming == on for m in model.modules() if isinstance(m, Linear))
        fast = generate(model, tokenizer, prompt, max_new_tokens=16, compiled=False)
    finally:
        use_output_major_weights(use_streaming_gemv(model, False))  # as load() made it
    assert fast == plain and len(fast) == 16
    assert len(calls) == (15 * (7 * model.config.n_layers + 1) + 1 if on else 0)
    assert model.layers[0].mlp.up_proj.weight.is_contiguous()


def test_offset_positions_without_cache_stay_causal():
    model = tiny_model(seed=51)
    a = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(52))
    b = a.clone()
    b[0, -1] = (b[0, -1] + 1) % 97  # change only the last token
    with torch.no_grad():
        la, lb = model(a, torch.arange(5, 13)), model(b, torch.arange(5, 13))
    assert torch.equal(la[:, :-1], lb[:, :-1])  # earlier positions cannot see it
    assert not torch.equal(la[:, -1], lb[:, -1])


def test_cache_needs_positions_and_accepts_int32():
    model = tiny_model(seed=53)
    cache = make_cache(model.config, 1, 16)
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="pass input_pos"):
        model(tokens, cache=cache)
    with torch.no_grad():
        got = model(tokens, torch.tensor([0, 1, 2], dtype=torch.int32), cache)
    assert torch.allclose(got, model(tokens), atol=1e-6)


def test_low_precision_load_keeps_rope_in_float32_and_skips_streaming():
    import minisparse

    model, _ = minisparse.load(dtype=torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32
    lin = model.layers[0].mlp.up_proj
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.is_contiguous()
    assert not lin.streaming
    assert tiny_model().to(torch.float16).inv_freq.dtype == torch.float32


def test_scaled_rope_survives_export(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cfg = LlamaConfig(
        vocab_size=90,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=rope,
    )
    torch.manual_seed(54)
    hf = LlamaForCausalLM(cfg).eval()
    model = from_hf(hf)
    assert model.config.rope_scaling["rope_type"] == "llama3"
    to_hf(model).save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 90, (1, 120), generator=torch.Generator().manual_seed(55))
    assert compare_logits(model, reloaded, tokens).max_abs_diff <= 1e-5
