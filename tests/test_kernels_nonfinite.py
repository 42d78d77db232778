"""NaN and inf in activations or weights: every backend gives torch's dense math on the selected
rows and columns (``minisparse.kernels.validate`` states the rule).

A NaN or inf the selection reads propagates exactly as in a float64 torch matmul; one it does
not read (an unselected row, an unselected channel) has no effect; with a threshold the
selection is |x| > t, which is false for NaN, so a NaN input is inactive. Checked for the torch
references, the C fast path, its torch fallback and the Triton kernels in the interpreter, on
tiny shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from minisparse import kernels
from minisparse.kernels import cpu, reference

NAN, INF = float("nan"), float("inf")
# the Triton interpreter computes with NumPy, which warns about the NaN these tests make
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

GATHER = {
    "reference": reference.gather_gemv_ref,
    "cpu": cpu.gather_gemv,
    "cpu_rows_dot": cpu.gather_rows_dot,
    "triton": kernels.gather_gemv,
    "triton_naive": kernels.gather_gemv_naive,
}
INPUT = {
    "reference": reference.scatter_gemv_ref,
    "cpu": cpu.scatter_gemv,
    "triton": kernels.scatter_gemv,
}
FFN = {
    "reference": reference.sparse_ffn_ref,
    "cpu": cpu.sparse_ffn,
    "triton": kernels.sparse_ffn,
    "triton_unfused": kernels.sparse_ffn_unfused,
}


def modes(table: dict[str, Callable]) -> list[tuple[str, str]]:
    """(backend, mode) pairs: CPU functions through the compiled loops and through the torch
    fallback, the other backends once."""
    return [
        (name, mode)
        for name in table
        for mode in (("fast", "torch_fallback") if name.startswith("cpu") else ("native",))
    ]


def use_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "torch_fallback":
        monkeypatch.setattr(cpu, "load_library", lambda: None)
    elif mode == "fast" and not cpu.fast_path_available():
        pytest.skip("no C compiler builds the CPU fast path here")


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(11, 13, generator=gen)
    x = torch.randn(2, 13, generator=gen)
    return W, x


def same(out: torch.Tensor, want: torch.Tensor) -> None:
    """NaN where want has NaN, the same infinities, finite values to float32 rounding."""
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)


SELECTED = torch.tensor([9, 2, 5, 5, 0])  # unsorted, one repeat
UNSELECTED_ROW = 7


def gather_cases() -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    def nan_in_x():
        W, x = inputs(1)
        x[0, 3] = NAN  # every output of token 0 is NaN, token 1 untouched
        return W, x

    def inf_in_x():
        W, x = inputs(2)
        x[1, 4] = INF
        return W, x

    def nan_in_selected_row():
        W, x = inputs(3)
        W[2, 6] = NAN
        return W, x

    def nonfinite_in_unselected_row():
        W, x = inputs(4)
        W[UNSELECTED_ROW] = torch.tensor([NAN, INF, -INF] * 4 + [NAN])
        return W, x

    return {
        f.__name__: f
        for f in (nan_in_x, inf_in_x, nan_in_selected_row, nonfinite_in_unselected_row)
    }


@pytest.mark.parametrize("case", list(gather_cases()))
@pytest.mark.parametrize(("backend", "mode"), modes(GATHER))
def test_gather_gemv_nonfinite(case, backend, mode, monkeypatch):
    use_mode(mode, monkeypatch)
    W, x = gather_cases()[case]()
    want = x.double() @ W.double()[SELECTED].T
    same(GATHER[backend](W, x, SELECTED), want)
    assert not want.isfinite().all() or case == "nonfinite_in_unselected_row"


def test_gather_nan_rows_are_where_dense_math_puts_them():
    W, x = gather_cases()["nan_in_x"]()
    out = cpu.gather_gemv(W, x, SELECTED)
    assert out[0].isnan().all() and out[1].isfinite().all()


@pytest.mark.parametrize(("backend", "mode"), modes(INPUT))
@pytest.mark.parametrize("where", ["selected", "unselected"])
def test_scatter_gemv_index_nonfinite(backend, mode, where, monkeypatch):
    use_mode(mode, monkeypatch)
    W_t, _ = inputs(5)  # [11, 13]: 11 input channels
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 11, generator=gen)
    channel = 5 if where == "selected" else UNSELECTED_ROW
    x[0, channel] = NAN
    x[1, channel] = INF
    W_t[channel, 3] = -INF
    want = x.double()[:, SELECTED] @ W_t.double()[SELECTED]
    out = INPUT[backend](W_t, x, idx=SELECTED)
    same(out, want)
    assert out.isfinite().all() == (where == "unselected")


@pytest.mark.parametrize(("backend", "mode"), modes(INPUT))
@pytest.mark.parametrize("threshold", [0.5, INF])
def test_scatter_gemv_threshold_nonfinite(backend, mode, threshold, monkeypatch):
    use_mode(mode, monkeypatch)
    W_t, _ = inputs(7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 11, generator=gen)
    x[0, 2] = NAN  # |NaN| > t is false: inactive, no effect
    x[1, 4] = INF  # active (unless t = inf): inf times the row
    x[2, 4] = -INF
    x64 = x.double()
    want = torch.where(x64.abs() > threshold, x64, torch.zeros_like(x64)) @ W_t.double()
    out = INPUT[backend](W_t, x, threshold=threshold)
    same(out, want)
    assert out[0].isfinite().all()
    if threshold == INF:
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(("backend", "mode"), modes(FFN))
@pytest.mark.parametrize("where", ["x", "selected_gate", "selected_down", "unselected"])
def test_sparse_ffn_nonfinite(backend, mode, where, monkeypatch):
    use_mode(mode, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    Wg, Wu, Wd_t = (torch.randn(11, 13, generator=gen) for _ in range(3))
    x = torch.randn(2, 13, generator=gen)
    if where == "x":
        x[1, 0] = NAN
    elif where == "selected_gate":
        Wg[5, 1] = INF
    elif where == "selected_down":
        Wd_t[9, 4] = INF
    else:
        Wg[UNSELECTED_ROW], Wu[UNSELECTED_ROW, 2], Wd_t[UNSELECTED_ROW, 0] = NAN, INF, -INF
    x64, rows = x.double(), SELECTED
    h = F.silu(x64 @ Wg.double()[rows].T) * (x64 @ Wu.double()[rows].T)
    want = h @ Wd_t.double()[rows]
    out = FFN[backend](x, Wg, Wu, Wd_t, SELECTED, "silu")
    same(out, want)
    assert out.isfinite().all() == (where == "unselected")
