"""No input crashes a kernel: hypothesis drives the public kernel API with hostile arguments.

Out-of-range, negative, huge, repeated and unsorted indices, empty index sets, index tensors of
every dtype and rank, weights and activations of the wrong shape, dtype or layout, non-contiguous
and stride-0 tensors, NaN and inf values, bad thresholds and activation names, for every
backend: the torch references, the C fast path, the Triton kernels (interpreter). Each call must
either raise ``ValueError``/``TypeError`` or return what an independent float64 oracle computes,
and an oracle that sees invalid input must see the call refuse it.

The property runs in a subprocess (this file run as a script): a segmentation fault then fails
the test, with the last case printed, instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
OTHER_DTYPES = (torch.int64, torch.bool, torch.complex64)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


class Invalid(Exception):
    """The oracle's verdict: these arguments are not valid input."""


@dataclass
class Case:
    op: str
    backend: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __repr__(self) -> str:
        def show(a: Any) -> str:
            if isinstance(a, torch.Tensor):
                vals = a.flatten()[:8].tolist() if a.numel() else []
                return f"T({a.dtype}, {tuple(a.shape)}, stride={a.stride()}, {vals})"
            return repr(a)

        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return f"{self.op}/{self.backend}({', '.join(parts)})"


# ---- inputs --------------------------------------------------------------------------------


@st.composite
def float_tensor(draw: st.DrawFn, shape: tuple[int, ...], gen: torch.Generator) -> Any:
    """Usually a float32 tensor of ``shape``; sometimes a wrong shape, dtype, layout or type,
    non-contiguous, stride-0, or holding NaN / inf."""
    kind = draw(st.sampled_from(["ok"] * 12 + ["dtype", "other_dtype", "shape", "list", "odd"]))
    if kind == "shape":
        shape = draw(st.sampled_from([shape[:-1], (*shape, 1), (*shape[:-1], shape[-1] + 1)]))
        shape = shape if shape else ()
    dtype = torch.float32
    if kind == "dtype":
        dtype = draw(st.sampled_from(FLOATS))
    if kind == "other_dtype":
        dtype = draw(st.sampled_from(OTHER_DTYPES))
    t = torch.randn(*shape, generator=gen).to(dtype) if shape else torch.randn(()).to(dtype)
    if kind == "list":
        return t.tolist()
    if kind == "odd" and t.dim() == 2 and t.numel():
        layout = draw(st.sampled_from(["transposed", "stride0", "sliced"]))
        if layout == "transposed":
            t = t.T.contiguous().T
        elif layout == "stride0":
            t = t[:1].expand_as(t)
        else:
            t = torch.cat([t, t], dim=1)[:, ::2]
    if t.is_floating_point() and t.numel() and draw(st.booleans()):
        flat = t.reshape(-1).clone()
        for _ in range(draw(st.integers(1, 2))):
            pos = draw(st.integers(0, flat.numel() - 1))
            flat[pos] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        t = flat.reshape(t.shape)
    return t


@st.composite
def index_tensor(draw: st.DrawFn, size: int) -> Any:
    """Indices for a dimension of ``size``: in range or not, repeated, unsorted, empty, of any
    integer dtype (or a wrong one), any rank, sometimes a list or non-contiguous."""
    in_range = st.integers(0, max(size - 1, 0))
    if draw(st.integers(0, 2)):  # mostly valid sets, so that results get compared too
        values = draw(st.lists(in_range, max_size=8))
    else:
        near = st.integers(-3, size + 3)
        huge = st.sampled_from([10**9, -(10**9), 2**40, 2**62])
        values = draw(st.lists(st.one_of(in_range, near, huge), max_size=8))
    t = torch.tensor(values, dtype=torch.int64)
    odd = ["dtype", "float", "bool", "2d", "0d", "list", "step"]
    kind = draw(st.sampled_from(["ok"] * 10 + odd))
    if kind == "dtype":
        t = t.to(draw(st.sampled_from(INDEX_DTYPES)))
    elif kind == "float":
        t = t.float()
    elif kind == "bool":
        t = t.bool()
    elif kind == "2d":
        t = t.reshape(-1, 1)
    elif kind == "0d" and t.numel():
        t = t[0]
    elif kind == "list":
        return values
    elif kind == "step":
        t = torch.stack([t, t], 1).reshape(-1)[::2]
    return t


@st.composite
def cases(draw: st.DrawFn) -> Case:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    op, backend = draw(st.sampled_from(sorted(KERNELS)))
    rows, cols = draw(st.integers(0, 7)), draw(st.integers(0, 9))
    batch = draw(st.sampled_from([None, 0, 1, 3]))
    x_shape = lambda width: (width,) if batch is None else (batch, width)  # noqa: E731
    idx = draw(index_tensor(rows))
    kwargs: dict[str, Any] = {}
    if op in ("gather", "rows_dot"):
        args = (draw(float_tensor((rows, cols), gen)), draw(float_tensor(x_shape(cols), gen)), idx)
    elif op == "input_idx":
        args = (draw(float_tensor((rows, cols), gen)), draw(float_tensor(x_shape(rows), gen)))
        kwargs = {"idx": idx}
    elif op == "input_threshold":
        args = (draw(float_tensor((rows, cols), gen)), draw(float_tensor(x_shape(rows), gen)))
        threshold = st.sampled_from([0.0, 0.5, float("inf"), -1.0, float("nan"), "0.5", True])
        kwargs = {"threshold": draw(st.one_of(threshold, st.just(torch.tensor(0.5))))}
        W_t = args[0]
        if isinstance(W_t, torch.Tensor) and W_t.is_floating_point() and (batch or 0) > 1:
            # the one documented exception (validate.py): weights are assumed finite there
            args = (W_t.nan_to_num(0.0, 1.0, -1.0), args[1])
        if draw(st.integers(0, 9)) == 0:
            kwargs["idx"] = idx  # both: refused
    elif op == "scatter":
        n = len(idx) if isinstance(idx, list) else (idx.shape[0] if idx.dim() else 1)
        v_shape = (n,) if batch is None else (batch, n)
        args = (draw(float_tensor((rows, cols), gen)), draw(float_tensor(v_shape, gen)), idx)
    elif op == "dense":
        args = (draw(float_tensor((rows, cols), gen)), draw(float_tensor(x_shape(rows), gen)))
    else:
        mats = tuple(draw(float_tensor((rows, cols), gen)) for _ in range(3))
        act = draw(st.sampled_from(["silu", "relu", "gelu", "silu", "tanh", 3]))
        args = (draw(float_tensor(x_shape(cols), gen)), *mats, idx, act)
    return Case(op, backend, args, kwargs)


# ---- the oracle: validity and the float64 result, written from the docstrings ---------------


def need(ok: bool) -> None:
    if not ok:
        raise Invalid


def matrix(W: Any) -> torch.Tensor:
    need(isinstance(W, torch.Tensor) and W.dim() == 2 and W.is_floating_point())
    return W.double()


def vector(x: Any, width: int) -> torch.Tensor:
    need(isinstance(x, torch.Tensor) and x.dim() in (1, 2) and x.is_floating_point())
    need(x.shape[-1] == width)
    return x.double()


def indices(idx: Any, size: int) -> torch.Tensor:
    need(isinstance(idx, torch.Tensor) and idx.dim() == 1)
    need(not (idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool))
    idx = idx.long()
    need(bool(((idx >= 0) & (idx < size)).all()))
    return idx


def float32(*tensors: torch.Tensor) -> None:
    need(all(t.dtype == torch.float32 for t in tensors))


ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def expected(case: Case) -> torch.Tensor:
    """The float64 result, or Invalid."""
    a, kw = case.args, case.kwargs
    if case.op in ("gather", "rows_dot"):
        W = matrix(a[0])
        x, idx = vector(a[1], W.shape[1]), indices(a[2], W.shape[0])
        if case.op == "rows_dot":
            float32(a[0], a[1])
            x = x if x.dim() == 2 else x[None]
        return x @ W[idx].T
    if case.op in ("input_idx", "input_threshold"):
        W_t = matrix(a[0])
        x = vector(a[1], W_t.shape[0])
        need(("idx" in kw) != ("threshold" in kw))
        if "idx" in kw:
            idx = indices(kw["idx"], W_t.shape[0])
            return x[..., idx] @ W_t[idx]
        t = kw["threshold"]
        need(not isinstance(t, (bool, str)))
        need(float(t) >= 0)
        xb = x if x.dim() == 2 else x[None]
        keep = xb.abs() > float(t)  # each row sums over its own active channels only
        rows = [row[m] @ W_t[m] for row, m in zip(xb, keep, strict=True)]
        y = torch.stack(rows) if rows else torch.zeros(0, W_t.shape[1], dtype=x.dtype)
        return y.reshape(*x.shape[:-1], W_t.shape[1])
    if case.op == "scatter":
        W_t = matrix(a[0])
        need(isinstance(a[2], torch.Tensor))
        idx = indices(a[2], W_t.shape[0])
        v = vector(a[1], idx.numel())
        float32(a[0], a[1])
        return (v if v.dim() == 2 else v[None]) @ W_t[idx]
    if case.op == "dense":
        W_t = matrix(a[0])
        x = vector(a[1], W_t.shape[0])
        float32(a[0], a[1])
        return x @ W_t
    x_in, *mats, idx_in, act = a
    Wg, Wu, Wd = (matrix(m) for m in mats)
    need(Wg.shape == Wu.shape == Wd.shape)
    x, idx = vector(x_in, Wg.shape[1]), indices(idx_in, Wg.shape[0])
    need(act in ACTS)
    return (ACTS[act](x @ Wg[idx].T) * (x @ Wu[idx].T)) @ Wd[idx]


def scale(case: Case) -> torch.Tensor:
    """The forward-error yardstick: the same sums over absolute values (finite parts only)."""
    absolute = [
        a.abs().nan_to_num(0.0, 0.0, 0.0)
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for a in case.args
    ]
    if case.op == "ffn":
        x, Wg, Wu, Wd, idx, _ = absolute
        probe = Case(case.op, case.backend, (x, Wg, Wu, Wd, idx, "relu"), case.kwargs)
        return expected(probe)
    return expected(Case(case.op, case.backend, tuple(absolute), case.kwargs))


# ---- the kernels under test --------------------------------------------------------------


KERNELS = {
    ("gather", "reference"): "reference.gather_gemv_ref",
    ("gather", "cpu"): "cpu.gather_gemv",
    ("gather", "triton"): "kernels.gather_gemv",
    ("gather", "triton_naive"): "kernels.gather_gemv_naive",
    ("rows_dot", "cpu"): "cpu.gather_rows_dot",
    ("scatter", "cpu"): "cpu.scatter_rows_sum",
    ("dense", "cpu"): "cpu.dense_gemv",
    ("input_idx", "reference"): "reference.scatter_gemv_ref",
    ("input_idx", "cpu"): "cpu.scatter_gemv",
    ("input_idx", "triton"): "kernels.scatter_gemv",
    ("input_threshold", "reference"): "reference.scatter_gemv_ref",
    ("input_threshold", "cpu"): "cpu.scatter_gemv",
    ("input_threshold", "triton"): "kernels.scatter_gemv",
    ("ffn", "reference"): "reference.sparse_ffn_ref",
    ("ffn", "cpu"): "cpu.sparse_ffn",
    ("ffn", "triton"): "kernels.sparse_ffn",
    ("ffn", "triton_naive"): "kernels.sparse_ffn_unfused",
}
"""(op, backend) -> the public function under test, as module.name."""


def kernel(case: Case) -> Any:
    from minisparse import kernels
    from minisparse.kernels import cpu, reference

    modules = {"kernels": kernels, "cpu": cpu, "reference": reference}
    module, name = KERNELS[(case.op, case.backend)].split(".")
    return getattr(modules[module], name)


def agrees(out: torch.Tensor, want: torch.Tensor, yardstick: torch.Tensor) -> bool:
    """Same shape; NaN where want is NaN; the same infinities; finite parts within rounding."""
    if tuple(out.shape) != tuple(want.shape):
        return False
    got = out.double()
    if not torch.equal(got.isnan(), want.isnan()):
        return False
    inf = want.isinf()
    if not torch.equal(got.isinf(), inf) or not torch.equal(got[inf], want[inf]):
        return False
    finite = want.isfinite()
    eps = max(torch.finfo(out.dtype).eps, torch.finfo(torch.float32).eps)
    bound = 32 * eps * (yardstick[finite] + want[finite].abs()) + 1e-6
    return bool(((got[finite] - want[finite]).abs() <= bound).all())


OUTCOMES: Counter[str] = Counter()


def check(case: Case) -> None:
    print(repr(case), flush=True)  # the last line names the culprit if the process dies
    try:
        want: torch.Tensor | None = expected(case)
    except Invalid:
        want = None
    try:
        out = kernel(case)(*case.args, **case.kwargs)
    except (ValueError, TypeError) as err:
        assert want is None, f"valid input refused: {err!r}"
        OUTCOMES["refused"] += 1
        return
    assert want is not None, "invalid input accepted"
    assert isinstance(out, torch.Tensor), type(out)
    assert agrees(out, want, scale(case)), f"got {out}, want {want}"
    OUTCOMES["computed"] += 1
    OUTCOMES[f"computed {case.op}/{case.backend}"] += 1


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases())
def fuzz(case: Case) -> None:
    check(case)


def test_public_kernels_survive_any_input():
    env = {**os.environ, "FUZZ_EXAMPLES": "600"}
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=1200
    )
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else "(no case printed)"
    died = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else "failed"
    assert proc.returncode == 0, f"{died}; last case: {last}\n{proc.stderr[-4000:]}"
    outcomes = json.loads(last.removeprefix("OUTCOMES "))
    # not vacuous: many hostile inputs refused, many valid ones computed and compared
    assert outcomes["refused"] >= 100 and outcomes["computed"] >= 100, outcomes
    untested = [f"{op}/{be}" for op, be in KERNELS if not outcomes.get(f"computed {op}/{be}")]
    assert not untested, f"never given valid input: {untested}"


def test_issue_example_raises_instead_of_crashing():
    """The call that used to kill the process (issue 21) now names the fix."""
    code = (
        "import torch\n"
        "from minisparse.kernels import cpu\n"
        "W, x = torch.randn(20, 8), torch.randn(8)\n"
        "try:\n"
        "    cpu.gather_rows_dot(W, x, torch.tensor([1, 5, 10**9]))\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outside [0, 20)" in proc.stdout and "drop or clamp" in proc.stdout


def test_allocation_failure_in_c_is_a_memory_error():
    from minisparse.kernels import cpu

    with pytest.raises(MemoryError, match=r"torch\.set_num_threads"):
        cpu._raise_for(cpu.NO_MEMORY, "the row scatter", 10**12)
    with pytest.raises(ValueError, match="outside the rows"):
        cpu._raise_for(cpu.BAD_INDEX, "the row gather", 0)
    cpu._raise_for(0, "the row gather", 0)


if __name__ == "__main__":
    fuzz()
    print("OUTCOMES", json.dumps(OUTCOMES), flush=True)
