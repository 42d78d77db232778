"""DejaVu's oracle: masks, masked passes and similarities against direct computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.core.hooks import capture_inputs
from minisparse.relufy import relufy
from minisparse.sparse import MaskedMLP, using_mlps
from minisparse.sparsity import contextual as C


def model_and_tokens(seed: int = 0, relu: bool = False):
    model = tiny_model(seed=seed, std=0.2, n_layers=3, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    if relu:
        model = relufy(model, 1)
    gen = torch.Generator().manual_seed(100 + seed)
    tokens = torch.randint(0, model.config.vocab_size, (3, 24), generator=gen)
    return model, tokens


@pytest.mark.parametrize("relu", [False, True])
def test_oracle_at_zero_sparsity_equals_dense_exactly(relu):
    model, tokens = model_and_tokens(1, relu)
    with torch.no_grad():
        dense = model(tokens)
        _, scores = C.record_scores(model, tokens)
        masks = C.Masks(
            [C.top_mask(s, 0.0) for s in scores.neurons], [C.top_mask(s, 0.0) for s in scores.heads]
        )
        assert all(m.all() for m in masks.neurons + masks.heads)
        with C.masks_applied(model, masks):  # hooks installed, every unit kept
            masked = model(tokens)
    assert torch.equal(masked, dense)
    (q,) = C.oracle_quality(model, tokens, [C.Setting(0.0, 0.0)], progress=False)
    assert q.ppl == q.dense_ppl and q.agreement == 1.0 and q.overall == 0.0


def test_pass_one_scores_are_the_down_inputs_and_head_norms():
    model, tokens = model_and_tokens(2)
    logits, scores = C.record_scores(model, tokens)
    assert torch.equal(logits, model(tokens))
    layer = model.layers[1]
    # recompute layer 1's MLP input and attention output by hand from the residual stream
    with torch.no_grad(), capture_inputs({"x": layer, "o": layer.attn.o_proj}) as seen:
        model(tokens)
    x = seen["x"][0]
    normed = layer.attn_norm(x)
    o = seen["o"][0].view(3, 24, 4, 10)
    assert torch.allclose(scores.heads[1], o.norm(dim=-1))
    with torch.no_grad():
        a = x + layer.attn(normed, *rope(model, 24), torch.arange(24), None)
        m_in = layer.mlp_norm(a)
        h = layer.mlp.act(layer.mlp.gate_proj(m_in)) * layer.mlp.up_proj(m_in)
    assert torch.allclose(scores.neurons[1], h.abs(), atol=1e-6)


def rope(model, seq: int):
    from minisparse.core.rope import rope_cos_sin

    return rope_cos_sin(model.inv_freq, torch.arange(seq), torch.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.93])
def test_top_mask_keeps_exactly_the_largest(seed, sparsity):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(5, 7, 37, generator=gen)
    keep = C.top_mask(scores, sparsity)
    k = C.keep_count(37, sparsity)
    assert k == 37 - round(sparsity * 37)
    assert (keep.sum(-1) == k).all()
    kth = scores.sort(-1, descending=True).values[..., k - 1 : k]
    assert torch.equal(keep, scores >= kth)  # continuous random scores: no ties


def test_contextual_neuron_masks_equal_masked_dense_mlps():
    """Pass 2's hooks against an independent reference: MaskedMLP with the same masks."""
    model, tokens = model_and_tokens(3, relu=True)
    setting = C.Setting(mlp=0.6)
    with torch.no_grad():
        _, scores = C.record_scores(model, tokens)
        masks = C.oracle_masks(scores, setting)
        with C.masks_applied(model, masks):
            got = model(tokens)
        reference = [
            MaskedMLP(layer.mlp, keep=keep.reshape(-1, keep.shape[-1]))
            for layer, keep in zip(model.layers, masks.neurons, strict=True)
        ]
        with using_mlps(model, reference):
            want = model(tokens)
    assert masks.heads is None
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, model(tokens), atol=1e-3)  # the masks do something


def test_static_head_masks_equal_zeroed_output_columns():
    """A fixed head set is the same as deleting the dropped heads' columns of W_o."""
    model, tokens = model_and_tokens(4)
    calib = torch.randint(
        0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(9)
    )
    static = C.static_scores(model, calib, batch_size=2)
    masks = C.oracle_masks(static, C.Setting(heads=0.5, static=True))
    assert masks.neurons is None and all(m.shape == (4,) and m.sum() == 2 for m in masks.heads)
    with torch.no_grad(), C.masks_applied(model, masks):
        got = model(tokens)
    pruned = tiny_model(seed=4, std=0.2, n_layers=3, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    with torch.no_grad():
        for layer, keep in zip(pruned.layers, masks.heads, strict=True):
            w = layer.attn.o_proj.weight.view(40, 4, 10)
            w[:, ~keep] = 0.0
        want = pruned(tokens)
    assert torch.allclose(got, want, atol=1e-5)


def test_static_scores_are_calibration_means():
    model, tokens = model_and_tokens(5)
    static = C.static_scores(model, tokens, batch_size=2)
    _, scores = C.record_scores(model, tokens)
    for got, per_token in zip(static.neurons, scores.neurons, strict=True):
        assert torch.allclose(got.float(), per_token.reshape(-1, 70).mean(0), atol=1e-5)
    for got, per_token in zip(static.heads, scores.heads, strict=True):
        assert torch.allclose(got.float(), per_token.reshape(-1, 4).mean(0), atol=1e-5)


def test_quality_counts_perplexity_and_agreement_like_a_direct_computation():
    model, tokens = model_and_tokens(6, relu=True)
    setting = C.Setting(mlp=0.5, heads=0.25)
    (q,) = C.oracle_quality(model, tokens, [setting], batch_size=2, progress=False)
    # the same numbers, computed window by window without the tally
    nll, agree, count = 0.0, 0, 0
    dense_nll = 0.0
    with torch.no_grad():
        for chunk in tokens.split(2):
            dense, scores = C.record_scores(model, chunk)
            with C.masks_applied(model, C.oracle_masks(scores, setting)):
                logits = model(chunk)
            targets = chunk[:, 1:]
            nll += float(
                F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
            )
            dense_nll += float(
                F.cross_entropy(dense[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
            )
            agree += int((logits[:, :-1].argmax(-1) == dense[:, :-1].argmax(-1)).sum())
            count += targets.numel()
    assert q.ppl == pytest.approx(math.exp(nll / count), rel=1e-6)
    assert q.dense_ppl == pytest.approx(math.exp(dense_nll / count), rel=1e-6)
    assert q.agreement == agree / count
    assert q.neuron_density == 35 / 70 and q.head_density == 3 / 4


def test_quality_keeps_each_windows_nll_and_its_ratio_to_dense():
    model, tokens = model_and_tokens(6, relu=True)
    setting = C.Setting(mlp=0.5)
    (q,) = C.oracle_quality(model, tokens, [setting], batch_size=4, progress=False)
    assert len(q.window_nll) == len(q.dense_window_nll) == tokens.shape[0]
    # windows are equally long, so the mean of their NLLs is the perplexity's
    assert math.exp(sum(q.window_nll) / len(q.window_nll)) == pytest.approx(q.ppl, rel=1e-6)
    dense_mean = sum(q.dense_window_nll) / len(q.dense_window_nll)
    assert math.exp(dense_mean) == pytest.approx(q.dense_ppl, rel=1e-6)
    ratio = q.ratio()
    assert ratio.mid == pytest.approx(q.ppl / q.dense_ppl, rel=1e-6)
    assert ratio.low <= ratio.mid <= ratio.high
    (same,) = C.oracle_quality(model, tokens, [C.Setting(mlp=0.0)], progress=False)
    assert same.ratio().mid == pytest.approx(1.0) and same.ratio().low == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no per-window NLLs"):
        C.Quality(**{**vars(same), "window_nll": ()}).ratio()


def test_overall_sparsity_by_hand():
    model, _ = model_and_tokens()
    c = model.config  # dim 40, 4 heads of 10, 2 KV heads, ffn 70
    q_o, k_v, mlp = 2 * 40 * 40, 2 * 40 * 20, 3 * 40 * 70
    got = C.overall_sparsity(model, neuron_density=0.25, head_density=0.5)
    assert got == pytest.approx(1 - (q_o * 0.5 + k_v + mlp * 0.25) / (q_o + k_v + mlp))
    assert C.overall_sparsity(model, 1.0, 1.0) == 0.0
    assert c.n_kv_heads == 2


def test_layer_similarity_equals_direct_cosines():
    model, tokens = model_and_tokens(7)
    stream = []
    hooks = [
        layer.register_forward_pre_hook(lambda _m, a: stream.append(a[0])) for layer in model.layers
    ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    sim = C.layer_similarity(model, tokens)
    want = [float(F.cosine_similarity(a, b, dim=-1).mean()) for a, b in itertools.pairwise(stream)]
    assert sim["residual"] == pytest.approx(want, abs=1e-6)
    assert len(sim["mlp_in"]) == len(model.layers) - 1


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        C.Setting(mlp=1.0)
    model, tokens = model_and_tokens()
    with pytest.raises(ValueError, match="static_scores"):
        C.oracle_quality(model, tokens, [C.Setting(mlp=0.5, static=True)], progress=False)
    assert C.Setting(0.5, 0.25, static=True).label == "static MLP 50% + heads 25%"
