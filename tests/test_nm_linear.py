"""The compact N:M layer (minisparse.pruning.nm_linear) and its compiled 2:4 kernel.

References are independent: positions packed bit by bit in Python, the dense masked weight
multiplied in float64, the int8 codes rounded by hand, and the compiled decode step against the
torch forward of the same model and of the dense model it came from.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_decode import needs_compiler
from torch import nn

from conftest import tiny_model
from minisparse.core.model import make_cache
from minisparse.pruning import NMLinear, nm_mask, pack_positions, to_nm_, unpack_positions
from minisparse.pruning.lowering import nm_mat
from minisparse.runtime.decoder import Decoder

#: Odd sizes: rows of 72 and 100 inputs leave tails after the 16- and 32-input vector loops,
#: and 100 inputs leave a half-filled last byte of positions.
SHAPE = {"dim": 72, "head_dim": 18, "ffn_dim": 100}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nm_linear(out: int, inp: int, n: int, m: int, seed: int, bias: bool = True) -> nn.Linear:
    """A linear layer with random weights pruned to n:m by magnitude (no zero kept weight)."""
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    w = torch.randn(out, inp, generator=gen) + 0.05 * torch.randn(out, inp, generator=gen).sign()
    lin.weight.data = w * nm_mask(w.abs(), n, m)
    if bias:
        lin.bias.data = torch.randn(out, generator=gen)
    return lin


def pruned_model(seed: int) -> nn.Module:
    """A tiny model whose seven projections per block are 2:4 by magnitude."""
    model = tiny_model(seed=seed, std=0.1, **SHAPE)
    with torch.no_grad():
        for layer in model.layers:
            for owner in (layer.attn, layer.mlp):
                for name in PROJECTIONS:
                    lin = getattr(owner, name, None)
                    if lin is not None:
                        lin.weight.mul_(nm_mask(lin.weight.abs(), 2, 4))
    return model


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_positions_pack_bit_by_bit(bits):
    gen = torch.Generator().manual_seed(bits)
    pos = torch.randint(0, 1 << bits, (5, 13), generator=gen)
    packed = pack_positions(pos, bits)
    per = 8 // bits
    expect = torch.zeros(5, -(-13 // per), dtype=torch.int64)
    for r in range(5):
        for j in range(13):
            expect[r, j // per] += int(pos[r, j]) << (bits * (j % per))
    assert packed.dtype == torch.uint8 and torch.equal(packed.long(), expect)
    assert torch.equal(unpack_positions(packed, bits, 13), pos)


@pytest.mark.parametrize(("n", "m", "inp"), [(2, 4, 72), (2, 4, 100), (1, 4, 36), (4, 8, 48)])
@pytest.mark.parametrize("batch", [(7,), (3, 5), (1, 1)])
def test_forward_equals_the_masked_dense_layer(n, m, inp, batch):
    lin = nm_linear(11, inp, n, m, seed=inp + n)
    layer = NMLinear(lin, n, m)
    gen = torch.Generator().manual_seed(len(batch))
    x = torch.randn(*batch, inp, generator=gen)
    ref = (x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()).float()
    got = layer(x)
    assert got.shape == (*batch, 11)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dense_weight(), lin.weight.detach())
    assert layer.values.shape == (11, inp * n // m)


def test_int8_values_equal_their_own_dequantized_weight():
    lin = nm_linear(9, 40, 2, 4, seed=5, bias=False)
    layer = NMLinear(lin, int8=True)
    w = lin.weight.detach().double()
    kept = w[nm_mask(w.abs(), 2, 4)].view(9, 20)
    scale = kept.abs().amax(1) / 127  # symmetric, one scale per row
    q = torch.round(kept / scale[:, None]).clamp(-127, 127)
    assert torch.equal(layer.values.double(), q) and layer.values.dtype == torch.int8
    dense = torch.zeros(9, 40, dtype=torch.float64)
    dense[nm_mask(w.abs(), 2, 4)] = (q * scale[:, None]).flatten()
    torch.testing.assert_close(layer.dense_weight().double(), dense, rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)


def test_bytes_are_the_stated_share_of_the_dense_layer():
    out, inp = 16, 96
    lin = nm_linear(out, inp, 2, 4, seed=7)
    assert NMLinear(lin).nbytes() == 0.53125 * out * inp * 4  # 4 B + 2 bits per kept weight
    int8 = NMLinear(lin, int8=True)
    assert int8.nbytes() == 0.625 * out * inp + 4 * out  # 1 B + 2 bits, plus a scale a row


def test_a_weight_that_is_not_2_4_is_refused_with_the_fix():
    lin = nm_linear(4, 16, 2, 4, seed=8)
    zero = 4 + int((lin.weight.data[2, 4:8] == 0).nonzero()[0])
    lin.weight.data[2, zero] = 0.5  # a third non-zero in the group
    with pytest.raises(ValueError, match=r'prune\(model, pattern="2:4"\)'):
        NMLinear(lin)
    with pytest.raises(ValueError, match="multiple of 4"):
        NMLinear(nn.Linear(10, 3))


def test_to_nm_swaps_the_eligible_projections_in_place():
    model = pruned_model(seed=9)
    model.layers[0].mlp.up_proj.weight.data[0, :4] = 1.0  # no longer 2:4: stays as it is
    dense = copy.deepcopy(model)
    assert to_nm_(model, "mlp") is model
    kinds = [type(getattr(layer.mlp, p)) for layer in model.layers for p in PROJECTIONS[4:]]
    assert kinds.count(NMLinear) == 3 * len(model.layers) - 1
    assert not isinstance(model.layers[0].attn.q_proj, NMLinear)
    to_nm_(model, "all")
    assert sum(isinstance(m, NMLinear) for m in model.modules()) == 7 * len(model.layers) - 1
    tokens = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), dense(tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        to_nm_(model, "attn")
    with pytest.raises(ValueError, match="prune"):
        to_nm_(tiny_model(seed=1), "mlp")


def test_only_2_4_lowers_to_the_compiled_step():
    mat = nm_mat(NMLinear(nm_linear(8, 32, 2, 4, seed=10)), [])
    assert mat is not None and mat.nm_pos and not mat.scale
    assert nm_mat(NMLinear(nm_linear(8, 32, 2, 4, seed=10), int8=True), []).scale
    assert nm_mat(NMLinear(nm_linear(8, 32, 4, 8, seed=11), 4, 8), []) is None


def decode_against(model, reference, tokens, n: int) -> None:
    """Three single steps, then one call of n tokens: the compiled decoder of ``model`` against
    ``reference``'s cached torch forward."""
    with torch.inference_mode():
        ref_cache, dec_cache = make_cache(model.config, 1, 20), make_cache(model.config, 1, 20)
        reference(tokens[:, :6], torch.arange(6), ref_cache)
        reference(tokens[:, :6], torch.arange(6), dec_cache)
        decoder = Decoder(model, dec_cache)
        assert all(line.endswith(": C") for line in decoder.plan())
        for p in range(6, 9):
            ref = reference(tokens[:, p : p + 1], torch.tensor([p]), ref_cache)[0, 0]
            torch.testing.assert_close(
                decoder.step(int(tokens[0, p]), p), ref, rtol=1e-4, atol=1e-5
            )
        ref = reference(tokens[:, 9 : 9 + n], torch.arange(9, 9 + n), ref_cache)[0]
        got = decoder.forward(tokens[0, 9 : 9 + n].tolist(), 9)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize(("targets", "int8"), [("mlp", False), ("all", False), ("all", True)])
@pytest.mark.parametrize("n", [5, 8])
def test_compiled_steps_equal_torch_and_the_dense_model(targets, int8, n):
    """The C step reads the compact rows (one token, and n tokens in one call): the logits of
    the model's own torch forward, and of the dense model whose weights it holds (for int8
    values: the dense model with the dequantized weights)."""
    dense = pruned_model(seed=12)
    model = to_nm_(copy.deepcopy(dense), targets, int8=int8)
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 9 + n), generator=torch.Generator().manual_seed(n)
    )
    decode_against(model, model, tokens, n)
    with torch.no_grad():
        for layer, twin in zip(model.layers, dense.layers, strict=True):
            for owner, other in ((layer.attn, twin.attn), (layer.mlp, twin.mlp)):
                for name in PROJECTIONS:
                    if isinstance(getattr(owner, name, None), NMLinear):
                        getattr(other, name).weight.copy_(getattr(owner, name).dense_weight())
    decode_against(model, dense, tokens, n)
    x = torch.randn(2, SHAPE["dim"], generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(
        model.layers[0].mlp.gate_proj(x), F.linear(x, dense.layers[0].mlp.gate_proj.weight)
    )
