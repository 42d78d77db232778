"""SparseMLP: the sparse model equals the dense model with the same activations masked."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from minisparse import sparse as S
from minisparse.core.model import MLP, ModelConfig, Transformer
from minisparse.kernels import cpu_int8
from minisparse.quant import quantize_model
from minisparse.sparse.weights import dequantized_mlp, int8_mlp
from minisparse.sparsity import cats_thresholds


def tiny(act: str = "silu", seed: int = 0) -> Transformer:
    """Three layers with larger weights, so that activations spread across thresholds."""
    return tiny_model(
        seed=seed,
        std=0.2,
        hidden_act=act,
        vocab_size=89,
        dim=40,
        n_layers=3,
        head_dim=10,
        ffn_dim=70,
        max_seq_len=64,
    )


def tokens(seed: int, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(0, 89, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
def test_threshold_model_equals_masked_dense_model(backend, act):
    model, toks = tiny(act), tokens(1)
    limits = cats_thresholds(model, tokens(2), sparsity=0.5)
    with torch.no_grad():
        sparse = S.sparse_mlps(model, limits, backend=backend)
        with S.using_mlps(model, sparse):
            out = model(toks)
        kept = [m.last_keep.float().mean().item() for m in sparse]
        assert all(0.2 < k < 0.8 for k in kept)  # each token skips about half its neurons
        with S.using_mlps(model, S.same_masks(model, sparse)):
            ref = model(toks)
        dense = model(toks)
    assert (out - ref).abs().max().item() <= 1e-4
    assert (out - dense).abs().max().item() > 1e-3  # the masks really change the model


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_select_model_equals_masked_dense_model(backend):
    model, toks = tiny(), tokens(3, (1, 7))
    hot = {i: torch.randperm(70, generator=torch.Generator().manual_seed(i))[:25] for i in range(3)}

    def select(layer: int, x: torch.Tensor) -> torch.Tensor:
        return hot[layer]

    with torch.no_grad():
        with S.using_mlps(model, S.sparse_mlps(model, select=select, backend=backend)):
            out = model(toks)
        with S.using_mlps(model, S.masked_mlps(model, select=select)):
            ref = model(toks)
        dense = model(toks)
    assert (out - ref).abs().max().item() <= 1e-4
    assert (out - dense).abs().max().item() > 1e-3


def test_threshold_zero_keeps_every_nonzero_neuron():
    model, toks = tiny(), tokens(4)
    with torch.no_grad():
        dense = model(toks)
        with S.using_mlps(model, S.sparse_mlps(model, 0.0)):
            out = model(toks)
    assert (out - dense).abs().max().item() <= 1e-4


def test_single_mlp_batch_union_and_own_masks():
    torch.manual_seed(0)
    mlp = MLP(ModelConfig(dim=33, ffn_dim=51, n_heads=3, n_kv_heads=1))
    x = torch.randn(4, 5, 33)
    sp, ref = S.SparseMLP(mlp, threshold=0.05), S.MaskedMLP(mlp, threshold=0.05)
    with torch.no_grad():
        out = sp(x)
        assert out.shape == x.shape
        assert (out - ref(x)).abs().max().item() <= 1e-5
    keep = sp.last_keep
    assert sp.last_density == keep.any(0).float().mean().item()  # the union is read
    assert keep.float().mean().item() < sp.last_density  # each token keeps fewer


@pytest.mark.parametrize("mode", ["threshold", "select"])
def test_a_prefill_of_many_tokens_reads_dense_matrices_with_the_same_values(mode):
    """More than PREFILL_TOKENS tokens run as dense matmuls masked per token: the same outputs
    as the gathered kernels on chunks of at most PREFILL_TOKENS tokens (each token's output
    depends only on itself), and as the masked dense MLP; the union is still reported."""
    torch.manual_seed(1)
    mlp = MLP(ModelConfig(dim=33, ffn_dim=51, n_heads=3, n_kv_heads=1))
    hot = torch.randperm(51, generator=torch.Generator().manual_seed(2))[:20]
    kw = {"threshold": 0.05} if mode == "threshold" else {"select": lambda x: hot}
    sp, ref = S.SparseMLP(mlp, backend="cpu", **kw), S.MaskedMLP(mlp, **kw)
    x = torch.randn(3 * S.PREFILL_TOKENS, 33)
    assert sp._many(x) and not sp._many(x[: S.PREFILL_TOKENS])
    with torch.no_grad():
        many = sp(x)
        keep, density = sp.last_keep, sp.last_density
        chunks = torch.cat([sp(c) for c in x.split(S.PREFILL_TOKENS)])
        assert (many - chunks).abs().max().item() <= 1e-5
        assert (many - ref(x)).abs().max().item() <= 1e-5
    assert density == pytest.approx(keep.any(0).float().mean().item())
    if mode == "threshold":
        assert keep.float().mean().item() < density  # each token keeps fewer than the union
    else:
        assert density == 20 / 51


def test_sparsify_and_swap_back():
    model = tiny()
    dense = S.sparsify(model, 0.1)
    assert all(isinstance(layer.mlp, S.SparseMLP) for layer in model.layers)
    with pytest.raises(ValueError, match="put the dense MLPs back"):
        S.sparsify(model, 0.1)
    S.swap_mlps(model, dense)
    assert all(isinstance(layer.mlp, MLP) for layer in model.layers)


def test_bad_arguments_raise_clear_errors():
    model = tiny()
    mlp = model.layers[0].mlp
    with pytest.raises(ValueError, match="exactly one of threshold"):
        S.SparseMLP(mlp)
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        S.SparseMLP(mlp, threshold=-0.5)
    with pytest.raises(ValueError, match="Unknown backend"):
        S.SparseMLP(mlp, threshold=0.1, backend="tpu")
    with pytest.raises(ValueError, match="3 layers"):
        S.sparse_mlps(model, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        cats_thresholds(model, tokens(0), 1.0)
    biased = MLP(ModelConfig(dim=8, ffn_dim=16, n_heads=2, n_kv_heads=1, mlp_bias=True))
    with pytest.raises(ValueError, match="bias-free"):
        S.SparseMLP(biased, threshold=0.1)


def test_triton_backend_without_cuda_or_interpreter_names_the_fix(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA"):
        S.SparseMLP(tiny().layers[0].mlp, threshold=0.1, backend="triton")


def test_sparse_mlp_keeps_a_backend_name_and_picks_kernels_per_call():
    from minisparse import kernels
    from minisparse.kernels import cpu

    mlp = tiny().layers[0].mlp
    sp = S.SparseMLP(mlp, threshold=0.1)
    assert sp.backend == "auto" and sp.ops is cpu
    assert S.SparseMLP(mlp, threshold=0.1, backend="triton").ops is kernels
    assert S.resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="backend='cpu' needs"):
        S.resolve_backend("cpu", torch.device("cuda"))


def sparsified(seed: int, **kw) -> Transformer:
    model = tiny(seed=seed)
    S.sparsify(model, **kw)
    return model


@pytest.mark.parametrize(
    "kw", [{"thresholds": 0.1}, {"select": lambda layer, x: torch.arange(layer, 70, 3)}]
)
def test_sparsified_model_deepcopies(kw):
    import copy

    model, toks = sparsified(0, **kw), tokens(6)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(toks), model(toks))
    mlp, twin_mlp = model.layers[0].mlp, twin.layers[0].mlp
    assert isinstance(twin_mlp, S.SparseMLP) and twin_mlp.W_gate.data_ptr() != mlp.W_gate.data_ptr()


def test_sparsified_state_dict_round_trip_gives_identical_outputs(tmp_path):
    model, toks = sparsified(0, thresholds=0.1), tokens(7)
    dense_keys = set(tiny(seed=0).state_dict())
    state = model.state_dict()
    assert set(state) == dense_keys  # the dense model's names and shapes
    torch.save(state, tmp_path / "sparse.pt")
    loaded = torch.load(tmp_path / "sparse.pt", weights_only=True)
    other = sparsified(1, thresholds=0.1)  # other weights, same structure
    other.load_state_dict(loaded)
    dense = tiny(seed=1)
    dense.load_state_dict(loaded)  # a sparse checkpoint is a dense checkpoint
    with torch.no_grad():
        assert torch.equal(other(toks), model(toks))
        S.sparsify(dense, thresholds=0.1)
        assert torch.equal(dense(toks), model(toks))


def test_sparse_state_dict_refuses_wrong_shapes_and_names():
    model = sparsified(0, thresholds=0.1)
    state = model.state_dict()
    bad = dict(state)
    bad["layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.mlp\.down_proj\.weight"):
        model.load_state_dict(bad)
    extra = {**state, "layers.0.mlp.bogus": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="bogus"):
        model.load_state_dict(extra)
    missing = {k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        model.load_state_dict(missing)


def test_calibrated_thresholds_hit_the_target_sparsity():
    model = tiny()
    calib = tokens(5, (4, 16))
    limits = cats_thresholds(model, calib, 0.7)
    acts = S.gate_activations(model, calib)
    for t, a in zip(limits, acts, strict=True):
        assert abs((a <= t).float().mean().item() - 0.7) < 0.02


def test_embedded_model_sparse_logits_match(embedded):
    """On the real model, fp32 rounding over 30 layers is ~5e-5 on logits of ~30, so the sparse
    model is compared with the float64 masked model, and held to dense fp32's own accuracy."""
    import copy

    from minisparse.io.data import corpus, token_batches

    model, tokenizer = embedded

    calib = token_batches(tokenizer, corpus("pydoc", "calib"), 32, 2)
    toks = token_batches(tokenizer, corpus("pydoc", "eval"), 16, 1)
    limits = cats_thresholds(model, calib, 0.5)
    with torch.no_grad():
        sparse = S.sparse_mlps(model, limits)
        with S.using_mlps(model, sparse):
            out = model(toks)
        m64 = copy.deepcopy(model).double()
        with S.using_mlps(m64, S.same_masks(m64, sparse)):
            ref64 = m64(toks)
        dense_err = (model(toks).double() - m64(toks)).abs().max().item()
    sparse_err = (out.double() - ref64).abs().max().item()
    assert sparse_err <= 2e-4 and sparse_err <= 3 * dense_err


# ---- int8 weights: sparsity times chapter 09's weight-only quantization ------------------------


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def int8_model(act: str = "silu", seed: int = 0) -> Transformer:
    return quantize_model(tiny(act, seed), bits=8, packed=True, progress=False)


def masked_dequantized(model: Transformer, sparse) -> list[S.MaskedMLP]:
    """The float32 MLPs of the dequantized int8 weights, masked exactly as ``sparse`` was."""
    return [
        S.MaskedMLP(dequantized_mlp(layer.mlp), keep=sp.last_keep)
        for layer, sp in zip(model.layers, sparse, strict=True)
    ]


@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 9), (5, 14)])  # the C loops, and 70: torch
def test_int8_threshold_model_equals_the_masked_dequantized_model(act, shape):
    model, toks = int8_model(act), tokens(1, shape)
    limits = cats_thresholds(model, tokens(2, (2, 9)), sparsity=0.5)
    with torch.no_grad():
        sparse = S.sparse_mlps(model, limits)
        assert all(m.int8 and m.Q_gate.dtype == torch.int8 for m in sparse)
        with S.using_mlps(model, sparse):
            out = model(toks)
        with S.using_mlps(model, masked_dequantized(model, sparse)):
            ref = model(toks)
        with S.using_mlps(model, [dequantized_mlp(layer.mlp) for layer in model.layers]):
            dense = model(toks)
    assert 0 < sparse[0].last_keep.float().mean().item() < 0.9
    assert rel(out, ref) <= 1e-4
    assert rel(out, dense) > 1e-3  # the masks really change the model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_int8_select_mlp_equals_the_masked_dequantized_mlp(fused, n_tokens):
    torch.manual_seed(0)
    mlp = int8_mlp(tiny().layers[1].mlp)
    hot = torch.randperm(70, generator=torch.Generator().manual_seed(3))[:25]
    sp = S.SparseMLP(mlp, select=lambda x: hot)
    if not fused:
        sp.act_name = None  # as for an activation the kernels do not know: gate, act, up, down
    x = torch.randn(n_tokens, 40, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = sp(x)
        ref = S.MaskedMLP(dequantized_mlp(mlp), select=lambda x: hot)(x)
        dense = dequantized_mlp(mlp)(x)
    assert rel(out, ref) <= 1e-4 and rel(out, dense) > 1e-3


def test_int8_sparse_mlp_is_correct_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu_int8, "int8_library", lambda: None)
    mlp = int8_mlp(tiny().layers[0].mlp)
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for kw in ({"threshold": 0.05}, {"select": lambda x: torch.arange(3, 70, 4)}):
            sp = S.SparseMLP(mlp, **kw)
            out = sp(x)
            ref = S.MaskedMLP(dequantized_mlp(mlp), keep=sp.last_keep)(x)
            assert rel(out, ref) <= 1e-4 and sp.last_density < 1


def test_int8_sparse_mlp_keeps_the_int8_models_codes_and_checkpoints(tmp_path):
    model, toks = int8_model(), tokens(7, (1, 5))
    quantized = int8_mlp(tiny().layers[0].mlp)  # the helper quantizes as quantize_model does
    assert torch.equal(quantized.gate_proj.q, model.layers[0].mlp.gate_proj.q)
    int8_state = model.state_dict()
    S.sparsify(model, 0.1)
    state = model.state_dict()
    assert set(state) == set(int8_state)  # Int8Linear's names: q and scale of each projection
    assert all(torch.equal(state[k], v) for k, v in int8_state.items())
    torch.save(state, tmp_path / "sparse_int8.pt")
    other = int8_model(seed=1)
    S.sparsify(other, 0.1)
    other.load_state_dict(torch.load(tmp_path / "sparse_int8.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(other(toks), model(toks))
    bad = {**state, "layers.0.mlp.down_proj.q": torch.zeros(3, 3, dtype=torch.int8)}
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.mlp\.down_proj\.q"):
        other.load_state_dict(bad)


def test_int8_sparse_mlp_refuses_a_mix_and_the_triton_backend():
    mlp = tiny().layers[0].mlp
    mixed = int8_mlp(mlp)
    mixed.up_proj = mlp.up_proj
    with pytest.raises(ValueError, match="all float or all int8"):
        S.SparseMLP(mixed, threshold=0.1)
    from minisparse.kernels.interpreter import triton_available

    if triton_available():  # without triton, backend='triton' fails earlier (ImportError)
        with pytest.raises(ValueError, match="no Triton kernels for int8"):
            S.SparseMLP(int8_mlp(mlp), threshold=0.1, backend="triton")


@pytest.mark.parametrize("problem", ["bias", "down_in_act"])
def test_an_mlp_a_subset_cannot_compute_is_refused_by_sparse_and_moe_mlps(problem):
    """SparseMLP and MoEMLP (chapter 12) compute a subset of the neurons and mask
    act(gate x) * (up x) themselves: an MLP with biases, or with a module at the down
    projection's input, gets one error naming the module and the fix."""
    from minisparse.moe.mlp import MoEMLP

    mlp = tiny_model(seed=2).layers[0].mlp
    if problem == "bias":
        mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(mlp.up_proj.out_features))
        match = "supports bias-free MLPs"
    else:
        mlp.down_in_act = torch.nn.ReLU()
        match = "remove_thresholds_"
    with pytest.raises(ValueError, match=f"SparseMLP {match}|{match}"):
        S.SparseMLP(mlp, threshold=0.1)
    experts = torch.arange(mlp.up_proj.out_features).view(4, -1)
    with pytest.raises(ValueError, match=f"MoEMLP {match}|{match}"):
        MoEMLP(mlp, experts, router=None, top_k=1)
