"""The compiled decode step against the model's own cached forward, on fresh random models.

Every case prefills a prompt into two caches, then decodes the same tokens with
``model(token, pos, cache)`` and with ``Decoder.step``, and compares the logits of every step
(float32 rounding apart, the same numbers) and the plan (which halves ran as C).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_model
from minisparse.core.model import make_cache
from minisparse.kernels.cpu import fast_path_available
from minisparse.kvcache import make_kv_cache
from minisparse.predictors import Predictor, Predictors, init_random
from minisparse.runtime import decoder as decode
from minisparse.runtime.decoder import Decoder
from minisparse.runtime.generate import generate
from minisparse.sparse import sparsify
from minisparse.sparsity import MagnitudeThreshold

needs_compiler = pytest.mark.skipif(
    not fast_path_available(), reason="no C compiler here: every half runs as torch"
)


def decode_both(model, steps=8, prompt=6, seed=0, cache="static"):
    """(reference logits, decoder logits, decoder) for ``steps`` tokens after a prompt."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt + steps), generator=gen)
    length = prompt + steps + 2
    with torch.inference_mode():
        ref_cache = make_kv_cache(cache, model.config, length)
        dec_cache = make_kv_cache(cache, model.config, length)
        model(tokens[:, :prompt], torch.arange(prompt), ref_cache)
        model(tokens[:, :prompt], torch.arange(prompt), dec_cache)
        decoder = Decoder(model, dec_cache)
        ref, got = [], []
        for p in range(prompt, prompt + steps):
            ref.append(model(tokens[:, p : p + 1], torch.tensor([p]), ref_cache)[0, 0].clone())
            got.append(decoder.step(int(tokens[0, p]), p).clone())
    return torch.stack(ref), torch.stack(got), decoder


def assert_close(ref, got):
    err = (ref.double() - got.double()).abs().max() / ref.double().abs().max()
    assert err < 2e-5, float(err)


def all_c(decoder) -> bool:
    return all(line.endswith(": C") for line in decoder.plan()) and decoder.c_head


@needs_compiler
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # grouped-query attention, tied embeddings, SiLU
        {"n_kv_heads": 4},  # multi-head
        {"n_kv_heads": 1, "hidden_act": "gelu", "tie_embeddings": False},  # multi-query
        {"attention_bias": True, "mlp_bias": True, "hidden_act": "relu"},
        {"dim": 40, "head_dim": 10, "ffn_dim": 37, "vocab_size": 61},  # no multiple of 4 or 16
    ],
)
def test_step_equals_cached_forward(overrides):
    model = tiny_model(seed=3, std=0.1, **overrides)
    ref, got, decoder = decode_both(model)
    assert all_c(decoder)
    assert_close(ref, got)


@needs_compiler
def test_scaled_rope_and_activation_slots():
    """RoPE attention scaling, ReLU slots and magnitude thresholds run in C, as torch does."""
    model = tiny_model(seed=4, std=0.1)
    model.rope_scale = 1.3
    for layer in model.layers:
        layer.attn_in_act = nn.ReLU()
        layer.mlp_in_act = MagnitudeThreshold(nn.Identity(), 0.3)
        layer.mlp.act = MagnitudeThreshold(nn.SiLU(), 0.01)
        layer.mlp.down_in_act = nn.ReLU()
    ref, got, decoder = decode_both(model)
    assert all_c(decoder)
    assert_close(ref, got)


class DoubledThreshold(MagnitudeThreshold):
    """A subclass that computes something else: it must not run as the parent's C lowering."""

    def forward(self, x):
        return 2 * super().forward(x)


@needs_compiler
def test_a_subclass_of_a_lowered_type_runs_as_torch():
    """Lowerings are registered by exact type: a subclass of MagnitudeThreshold that changes
    the output is not lowered as TEAL (which would silently drop its factor 2)."""
    model = tiny_model(seed=4, std=0.1, n_layers=2)
    model.layers[0].mlp_in_act = DoubledThreshold(nn.Identity(), 0.3)
    model.layers[1].mlp_in_act = MagnitudeThreshold(nn.Identity(), 0.3)
    ref, got, decoder = decode_both(model, steps=4)
    assert decoder.plan() == ["0.attn: C", "0.mlp: torch", "1.attn: C", "1.mlp: C"]
    assert_close(ref, got)


def test_what_c_does_not_know_runs_as_torch():
    """A hook, an unknown activation, a non-static cache: those halves run as torch, and the
    logits still equal the model's (and the hook still sees every step)."""
    model = tiny_model(seed=5, std=0.1, n_layers=3)
    seen = []
    model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(1))
    model.layers[1].mlp.act = nn.Tanh()
    ref, got, decoder = decode_both(model, steps=5, cache="paged")
    assert_close(ref, got)
    plan = decoder.plan()
    assert "0.mlp: torch" in plan and "1.mlp: torch" in plan
    assert all(line.endswith("torch") for line in plan if ".attn" in line)  # paged cache
    assert len(seen) == 2 * (1 + 5)  # the reference and the decoder each ran it per step
    if fast_path_available():
        assert "2.mlp: C" in plan


def test_without_the_compiled_library_everything_is_torch(monkeypatch):
    monkeypatch.setattr(decode, "decode_library", lambda: None)
    model = tiny_model(seed=6, std=0.1)
    ref, got, decoder = decode_both(model, steps=4)
    assert all(line.endswith("torch") for line in decoder.plan()) and not decoder.c_head
    assert_close(ref, got)


@needs_compiler
def test_sparse_mlp_threshold_mode():
    model = tiny_model(seed=7, std=0.1)
    sparsify(model, thresholds=0.1)
    ref, got, decoder = decode_both(model)
    assert all_c(decoder)
    assert_close(ref, got)
    densities = [layer.mlp.last_density for layer in model.layers]
    assert all(0.05 < d < 0.95 for d in densities), densities  # really sparse, not empty


def predicted_model(kind: str):
    """A tiny model whose MLPs run the neurons random chapter 06 predictors of ``kind`` pick
    (biased so that about half of them are on)."""
    model = tiny_model(seed=8, std=0.1)
    c = model.config
    neurons = nn.ModuleList(
        init_random(Predictor(c.dim, 6, c.ffn_dim, kind=kind), seed=i) for i in range(c.n_layers)
    )
    with torch.no_grad():
        for p in neurons:
            p.up.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(9))
            p.cutoff.fill_(0.1)
    predictors = Predictors(neurons=neurons, thresholds=[0.0] * c.n_layers, kind=kind)
    sparsify(model, select=predictors.select)
    return model


@needs_compiler
@pytest.mark.parametrize("kind", ["lowrank", "mlp"])
def test_sparse_mlp_predictor_mode(kind):
    model = predicted_model(kind)
    ref, got, decoder = decode_both(model)
    assert all_c(decoder)
    assert_close(ref, got)
    assert all(0.05 < layer.mlp.last_density < 0.95 for layer in model.layers)


@needs_compiler
def test_an_unknown_selector_runs_as_torch():
    model = tiny_model(seed=10, std=0.1)
    sparsify(model, select=lambda layer, x: torch.arange(0, model.config.ffn_dim, 3))
    ref, got, decoder = decode_both(model, steps=4)
    assert_close(ref, got)
    assert all(line.endswith("torch") for line in decoder.plan() if ".mlp" in line)
    assert all(line.endswith("C") for line in decoder.plan() if ".attn" in line)


def test_position_outside_the_cache_is_an_error():
    model = tiny_model(seed=11)
    cache = make_cache(model.config, 1, 4)
    with torch.inference_mode():
        decoder = Decoder(model, cache)
        with pytest.raises(ValueError, match="do not fit"):
            decoder.step(1, 4)


def test_other_dtypes_are_refused_with_the_fix():
    model = tiny_model(seed=12).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 models on the CPU"):
        Decoder(model, make_cache(model.config, 1, 8, dtype=torch.bfloat16))


def test_generate_compiled_equals_torch_steps(embedded):
    """On the real model, 32 greedy tokens: the compiled steps give the torch steps' tokens."""
    model, tokenizer = embedded
    prompt = "Exceptions are raised when"
    fast = generate(model, tokenizer, prompt, max_new_tokens=32)
    plain = generate(model, tokenizer, prompt, max_new_tokens=32, compiled=False)
    assert fast == plain and len(fast) == 32


@needs_compiler
def test_embedded_model_runs_entirely_in_c(embedded):
    model, _ = embedded
    with torch.inference_mode():
        decoder = Decoder(model, make_cache(model.config, 1, 16))
    assert all_c(decoder)


#: A tiny shape every int4 kernel takes: rows in multiples of 16, rows of 32-weight groups.
INT4_SHAPE = {"dim": 64, "head_dim": 16, "ffn_dim": 96, "vocab_size": 112}


def low_bit(model, weights):
    """The model with packed int8 or int4 layers, and its float32 reference: int8 layers that
    compute with float32 activations (``fast = False``), int4 layers replaced by float32
    linears holding their dequantized weights (what the C step computes, in float32)."""
    from minisparse.quant import Int4Linear, Int8Linear, quantize_model

    if weights == "fp32":
        return model, model
    bits, group = (8, None) if weights == "int8" else (4, 32)
    model = quantize_model(model, bits=bits, group_size=group, packed=True, progress=False)
    reference = copy.deepcopy(model)
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                child.fast = False
            elif isinstance(child, Int4Linear):
                assert child.fast  # the shape takes the int4 kernel, so C reads its blocks
                linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight.data = child.dequantized()
                linear.bias = None if child.bias is None else nn.Parameter(child.bias.clone())
                setattr(parent, name, linear)
    return model, reference


# widths that are no multiple of 16, row counts that are no multiple of a register tile (4 or 2
# rows, ``mdot_tile``) and an odd number of neurons (gate and up of two at once) take the tails
ODD_SHAPE = {"dim": 40, "head_dim": 10, "ffn_dim": 37, "vocab_size": 61}


@needs_compiler
@pytest.mark.parametrize(
    ("weights", "shape"),
    [
        ("fp32", {}),
        ("int8", INT4_SHAPE),
        ("int4", INT4_SHAPE),
        ("fp32", ODD_SHAPE),
        ("int8", ODD_SHAPE),
    ],
)
@pytest.mark.parametrize("n", [2, 5, 7, 8])
def test_several_tokens_in_one_call_equal_the_cached_forward(n, weights, shape):
    """forward(tokens, pos) for n consecutive tokens (a verification pass) gives the logits of
    model(tokens, positions, cache), each token seeing the ones before it, and leaves the cache
    as the model leaves it (the next single step agrees too); float32, int8 or int4 weights,
    on a shape that fills the register tiles and one that leaves partial ones."""
    model, reference = low_bit(tiny_model(seed=13, std=0.1, **shape), weights)
    gen = torch.Generator().manual_seed(14)
    tokens = torch.randint(0, model.config.vocab_size, (1, 6 + n + 1), generator=gen)
    with torch.inference_mode():
        ref_cache, dec_cache = make_cache(model.config, 1, 20), make_cache(model.config, 1, 20)
        for cache in (ref_cache, dec_cache):
            reference(tokens[:, :6], torch.arange(6), cache)
        decoder = Decoder(model, dec_cache)
        assert all_c(decoder)
        ref = reference(tokens[:, 6 : 6 + n], torch.arange(6, 6 + n), ref_cache)[0]
        got = decoder.forward(tokens[0, 6 : 6 + n].tolist(), 6).clone()
        assert_close(ref, got)
        last = 6 + n
        ref_next = reference(tokens[:, last : last + 1], torch.tensor([last]), ref_cache)[0, 0]
        assert_close(ref_next, decoder.step(int(tokens[0, last]), last))


@needs_compiler
@pytest.mark.parametrize("mode", ["threshold", "lowrank", "mlp"])
@pytest.mark.parametrize("n", [2, 5])
def test_several_tokens_through_a_sparse_mlp_run_in_c_like_torch(mode, n):
    """A verification pass through sparse MLPs runs in C: the rows of the neurons active for any
    of the n tokens are read once, each token keeping its own neurons (thresholds) or all of
    them (predictors: the union, as ``SparseMLP`` computes for several tokens)."""
    if mode == "threshold":
        model = tiny_model(seed=15, std=0.1)
        sparsify(model, thresholds=0.3)  # about a quarter of the neurons per token
    else:
        model = predicted_model(mode)
    gen = torch.Generator().manual_seed(16)
    tokens = torch.randint(0, model.config.vocab_size, (1, 5 + n), generator=gen)
    with torch.inference_mode():
        ref_cache, dec_cache = make_cache(model.config, 1, 12), make_cache(model.config, 1, 12)
        for cache in (ref_cache, dec_cache):
            model(tokens[:, :5], torch.arange(5), cache)
        times: dict[str, float] = {}
        decoder = Decoder(model, dec_cache)
        got = decoder.forward(tokens[0, 5:].tolist(), 5, times).clone()
        read = [layer.mlp.last_density for layer in model.layers]
        ref = model(tokens[:, 5:], torch.arange(5, 5 + n), ref_cache)[0]
    assert_close(ref, got)
    assert "sparse mlp" in times and "torch" not in times
    assert read == [layer.mlp.last_density for layer in model.layers]  # the same union
    assert all(0.05 < d < 1 for d in read), read


def test_token_ids_outside_the_vocabulary_and_negative_positions_are_errors():
    model = tiny_model(seed=19)
    with torch.inference_mode():
        decoder = Decoder(model, make_cache(model.config, 1, 8))
        for bad in ([97], [-1], [3, 1000]):
            with pytest.raises(ValueError, match="vocabulary"):
                decoder.forward(bad, 0)
        with pytest.raises(ValueError, match="pos must be at least 0"):
            decoder.step(1, -1)


def test_more_tokens_than_one_call_takes_is_an_error():
    model = tiny_model(seed=17)
    with torch.inference_mode():
        decoder = Decoder(model, make_cache(model.config, 1, 32))
        with pytest.raises(ValueError, match="1 to 8 tokens"):
            decoder.forward(list(range(9)), 0)


def make_prefilled(model, tokens):
    """A cache holding ``model``'s keys and values of the first 6 tokens."""
    cache = make_cache(model.config, 1, 16)
    model(tokens[:, :6], torch.arange(6), cache)
    return cache


def test_q8_activations_round_each_run_of_32_to_int8_against_a_loop():
    """x̂ = d round(x / d), d = max|x| / 127 per 32 values, checked element by element in
    float64 (the reference rounds x * (1 / d) in float32, as C does)."""
    from minisparse.quant.layers import q8_activations

    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3)) * 4
    x[1, 32:64] = 0.0  # an all-zero run: d = 0, x̂ = 0
    got = q8_activations(x)
    for r in range(3):
        for b in range(3):
            run = x[r, 32 * b : 32 * b + 32]
            d = float(run.abs().max()) / 127.0
            for i, v in enumerate(run.tolist()):
                q = 0 if d == 0 else round(float(torch.tensor(v) * (1 / torch.tensor(d))))
                assert abs(q) <= 127
                assert float(got[r, 32 * b + i]) == pytest.approx(q * d, abs=1e-6)
    assert (got - x).abs().max() <= x.abs().max() / 254 * 1.0001  # half a step at most
    with pytest.raises(ValueError, match="runs of 32"):
        q8_activations(torch.ones(2, 40))


@needs_compiler
@pytest.mark.parametrize("n", [1, 3, 8])
def test_int4_with_int8_activations_runs_in_c_like_its_torch_reference(n):
    """``int8_activations_``: every int4 projection (LM head included) multiplies its blocks
    with activations rounded to int8 per 32 (integer dot products in C), equal to the float
    product of the dequantized weights with q8_activations(x), for single steps and for passes
    of several tokens, and different from the float-activation model by the rounding."""
    from minisparse.quant.layers import Int4Linear, int8_activations_, q8_activations

    class Rounded(nn.Linear):  # the reference: float math on the rounded inputs
        def forward(self, x):
            return F.linear(q8_activations(x), self.weight, self.bias)

    model, reference = low_bit(tiny_model(seed=19, std=0.1, **INT4_SHAPE), "int4")
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                rounded = Rounded(child.in_features, child.out_features, child.bias is not None)
                rounded.load_state_dict(child.state_dict())
                setattr(parent, name, rounded)
    exact = copy.deepcopy(model)
    int8_activations_(model)
    assert all(m.act_int8 for m in model.modules() if isinstance(m, Int4Linear))
    tokens = torch.randint(0, 112, (1, 6 + n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        caches = [make_cache(model.config, 1, 16) for _ in range(3)]
        for m, cache in zip((reference, reference, exact), caches, strict=True):
            m(tokens[:, :6], torch.arange(6), cache)
        decoder = Decoder(model, caches[1])
        assert all_c(decoder)
        ref = reference(tokens[:, 6:], torch.arange(6, 6 + n), caches[0])[0]
        got = decoder.forward(tokens[0, 6:].tolist(), 6).clone()
        assert_close(ref, got)
        torch_path = model(tokens[:, 6:], torch.arange(6, 6 + n), make_prefilled(model, tokens))
        assert (torch_path[0] - ref).abs().max() < 0.05 * ref.abs().max()  # bfloat16's kernel
        other = Decoder(exact, caches[2]).forward(tokens[0, 6:].tolist(), 6)
        assert (other - got).abs().max() > 1e-4  # the rounding is visible, not a no-op
    with pytest.raises(ValueError, match="no Int4Linear"):
        int8_activations_(tiny_model())


@needs_compiler
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_low_bit_weights_run_in_c_and_equal_their_dequantized_math(weights):
    """Weight-only int8 and int4 projections (chapter 09's packed layers, LM head included) run
    in C: s_i * sum_k q_ik x_k (int8), sum over 32-weight blocks of ((u - 8) s + z) x (int4),
    in float32, equal F.linear with the dequantized weight (no bfloat16 activations)."""
    from minisparse.quant import Int4Linear, Int8Linear

    model, reference = low_bit(tiny_model(seed=18, std=0.1, **INT4_SHAPE), weights)
    kind = Int8Linear if weights == "int8" else Int4Linear
    assert sum(isinstance(m, kind) for m in model.modules()) == 7 * model.config.n_layers + 1
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, 14), generator=gen)
    with torch.inference_mode():
        ref_cache, dec_cache = make_cache(model.config, 1, 16), make_cache(model.config, 1, 16)
        reference(tokens[:, :6], torch.arange(6), ref_cache)
        reference(tokens[:, :6], torch.arange(6), dec_cache)
        decoder = Decoder(model, dec_cache)
        assert all_c(decoder)
        for p in range(6, 14):
            ref = reference(tokens[:, p : p + 1], torch.tensor([p]), ref_cache)[0, 0]
            assert_close(ref, decoder.step(int(tokens[0, p]), p))


@needs_compiler
@pytest.mark.parametrize("threshold", [0.0, 0.6, 1e9])  # nothing, about half, every input cut
@pytest.mark.parametrize("overrides", [{}, {"dim": 40, "head_dim": 10, "ffn_dim": 37,
                                            "attention_bias": True, "mlp_bias": True}])  # fmt: skip
def test_teal_thresholds_read_only_the_rows_of_non_zero_inputs(threshold, overrides):
    """TEAL at the inputs of q/k/v, gate/up and down: those projections are read input-major
    (rows of zero inputs skipped), and steps and several-token calls equal the model's forward."""
    model = tiny_model(seed=9, std=0.1, **overrides)
    for layer in model.layers:
        layer.attn_in_act = MagnitudeThreshold(nn.Identity(), threshold)
        layer.mlp_in_act = MagnitudeThreshold(nn.Identity(), threshold)
        layer.mlp.down_in_act = MagnitudeThreshold(nn.Identity(), threshold / 20)
    ref, got, decoder = decode_both(model, steps=6)
    assert all_c(decoder)
    attn, mlp, c = decoder.halves[0].c, decoder.halves[1].c, model.config
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # one bundled row per input
    assert [m.in_stride for m in (attn.wq, attn.wk, attn.wv, attn.wo)] == [qkv] * 3 + [0]
    assert [m.in_stride for m in (mlp.wg, mlp.wu, mlp.wd)] == [2 * c.ffn_dim] * 2 + [c.dim]
    assert attn.wk.data - attn.wq.data == 4 * c.n_heads * c.head_dim
    assert_close(ref, got)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=gen)
    with torch.inference_mode():
        for n in (3, 8):  # a verification pass: each input row read once for all n tokens
            ref_cache, dec_cache = (make_kv_cache("static", model.config, 24) for _ in range(2))
            model(tokens[:, :4], torch.arange(4), ref_cache)
            model(tokens[:, :4], torch.arange(4), dec_cache)
            ref = model(tokens[:, 4 : 4 + n], torch.arange(4, 4 + n), ref_cache)[0]
            got = Decoder(model, dec_cache).forward(tokens[0, 4 : 4 + n].tolist(), 4)
            assert_close(ref, got)


@needs_compiler
def test_teal_skips_the_bytes_of_zero_inputs():
    """Input-major reading skips rows: with every input of down_proj cut, its weights are never
    read, so NaN weights give what zero weights give (a row-major read would multiply 0 by NaN
    and return NaN)."""
    model = tiny_model(seed=10, std=0.1, mlp_bias=True)
    for layer in model.layers:
        layer.mlp.down_in_act = MagnitudeThreshold(nn.Identity(), 1e9)
        with torch.no_grad():
            layer.mlp.down_proj.weight.zero_()
    poisoned = copy.deepcopy(model)
    for layer in poisoned.layers:
        with torch.no_grad():
            layer.mlp.down_proj.weight.fill_(float("nan"))
    tokens = [5, 9, 2, 7, 11, 3]
    with torch.inference_mode():
        ref = model(torch.tensor([tokens]), torch.arange(6), make_cache(model.config, 1, 8))[0]
        decoder = Decoder(poisoned, make_cache(poisoned.config, 1, 8))
        got = decoder.forward(tokens[:4], 0).clone()
        got = torch.cat([got, decoder.forward(tokens[4:], 4)])
    assert decoder.halves[1].c.wd.in_stride == model.config.dim
    assert_close(ref, got)
