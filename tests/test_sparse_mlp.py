"""SparseMLP: the sparse model equals the dense model with the same activations masked."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from minisparse import sparse_mlp as S
from minisparse.model import MLP, ModelConfig, Transformer


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
    limits = S.calibrate_thresholds(model, tokens(2), sparsity=0.5)
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
        S.calibrate_thresholds(model, tokens(0), 1.0)
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
    limits = S.calibrate_thresholds(model, calib, 0.7)
    acts = S.gate_activations(model, calib)
    for t, a in zip(limits, acts, strict=True):
        assert abs((a <= t).float().mean().item() - 0.7) < 0.02


def test_embedded_model_sparse_logits_match(embedded):
    """On the real model, fp32 rounding over 30 layers is ~5e-5 on logits of ~30, so the sparse
    model is compared with the float64 masked model, and held to dense fp32's own accuracy."""
    import copy

    from minisparse.data import corpus, token_batches

    model, tokenizer = embedded

    calib = token_batches(tokenizer, corpus("pydoc", "calib"), 32, 2)
    toks = token_batches(tokenizer, corpus("pydoc", "eval"), 16, 1)
    limits = S.calibrate_thresholds(model, calib, 0.5)
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
