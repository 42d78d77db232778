"""Where a learner's answer differs from the reference: the message a failed check prints.

A check that only says "mismatch" and prints the first values of both answers leaves the
learner to find the difference; when the answer is slightly wrong (a missing 1/√d, a block
shared that should have been copied) those first values are often equal. ``difference`` goes
to the place instead:

* two tensors of one shape: the first element that differs beyond the check's tolerance, the
  values expected and got there, the largest |difference| and where it is, and how many differ;
* sequences, dicts and dataclasses: the first item (index, key or field) that differs, then
  inside it, down to a number or a tensor, written as a path such as ``result[7][1][0]``;
* values of the wrong kind (``kind_mismatch``: a float64 tensor for a float32 one, a list for a
  tensor) fail before any value is compared;
* a script the check drove the learner's class or loop through (a list of operations, one
  result recorded after each): the step where the traces part, its operation, and the state
  both agreed on before it.

The tolerance is the comparison's own (``close``: 1e-5, ``loose``: 1e-4, ``equal``: exact; see
``TOLERANCES``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "difference",
    "element_index",
    "kind_mismatch",
    "script_step",
    "tensor_difference",
]

#: How many characters of a value a message shows.
SHOWN = 100


def element_index(flat: int, shape: Sequence[int]) -> list[int]:
    """The index into ``shape`` of the ``flat``-th element in row-major order."""
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return out[::-1]


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def tensor_difference(got: Tensor, expected: Tensor, tol: float) -> str | None:
    """Where two tensors of one shape differ beyond ``tol`` (absolute plus relative to the
    expected value; NaN only matches NaN, inf only the same inf), or None where they do not."""
    if not (expected.is_floating_point() or expected.is_complex()):
        tol = 0.0  # indices, counts, masks: equal or not
    g, e = got.detach().cpu().double().flatten(), expected.detach().cpu().double().flatten()
    diff = (g - e).abs()
    both_nan = torch.isnan(g) & torch.isnan(e)
    same_inf = torch.isinf(g) & torch.isinf(e) & (g == e)
    bad = ~(diff <= tol + tol * e.abs()) & ~both_nan & ~same_inf
    count = int(bad.sum())
    if count == 0:
        return None
    first = int(bad.nonzero()[0])
    scored = torch.where(bad, diff.nan_to_num(nan=math.inf), torch.zeros_like(diff))
    worst = int(scored.argmax())

    def at(i: int) -> str:
        return (
            f"{element_index(i, expected.shape)}: expected {e[i].item():.6g}, got {g[i].item():.6g}"
        )

    text = f"first difference at {at(first)}"
    if worst != first:
        text += f"; largest |difference| {diff[worst].item():.3g} at {at(worst)}"
    elif math.isnan(g[first].item()):
        text += " (NaN where the reference has a number)"
    else:
        text += f" (|difference| {diff[first].item():.3g}, the largest)"
    allowed = f"beyond {tol:g} absolute + {tol:g} relative" if tol else "not equal"
    return f"{text}; {count} of {g.numel()} values {allowed}"


def _number_difference(got: Any, expected: Any, tol: float) -> str | None:
    if isinstance(got, bool) or isinstance(expected, bool):
        return None if got == expected else f"expected {expected}, got {got}"
    g, e = float(got), float(expected)
    if (math.isnan(g) and math.isnan(e)) or g == e or abs(g - e) <= tol + tol * abs(e):
        return None
    return f"expected {_shown(expected)}, got {_shown(got)} (difference {g - e:+.3g})"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) or (isinstance(v, Tensor) and v.dim() == 0)


def difference(got: Any, expected: Any, tol: float = 0.0, where: str = "result") -> str | None:
    """The first place where ``got`` differs from ``expected`` (see the module docstring), as
    one line that starts with that place, or None where nothing differs beyond ``tol``."""
    if isinstance(expected, Tensor) and isinstance(got, Tensor):
        if got.shape != expected.shape:
            return f"{where} has shape {list(got.shape)}, expected {list(expected.shape)}"
        found = tensor_difference(got, expected, tol)
        return None if found is None else f"{where}: {found}"
    if _is_number(expected) and _is_number(got):
        found = _number_difference(
            got.item() if isinstance(got, Tensor) else got,
            expected.item() if isinstance(expected, Tensor) else expected,
            tol,
        )
        return None if found is None else f"{where}: {found}"
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in expected:
            if key not in got:
                return f"{where} has no key {key!r}"
            found = difference(got[key], expected[key], tol, f"{where}[{key!r}]")
            if found:
                return found
        extra = [k for k in got if k not in expected]
        return f"{where} has the extra key {extra[0]!r}" if extra else None
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        for i, (g, e) in enumerate(zip(got, expected, strict=False)):
            found = difference(g, e, tol, f"{where}[{i}]")
            if found:
                return found
        if len(got) != len(expected):
            return f"{where} has {len(got)} items, expected {len(expected)}"
        return None
    if dataclasses.is_dataclass(expected) and type(got) is type(expected):
        for field in dataclasses.fields(expected):
            found = difference(
                getattr(got, field.name),
                getattr(expected, field.name),
                tol,
                f"{where}.{field.name}",
            )
            if found:
                return found
        return None
    try:
        if bool(got == expected):
            return None
    except (RuntimeError, TypeError, ValueError):  # no truth value (arrays and the like)
        pass
    return f"{where}: expected {_shown(expected)}, got {_shown(got)}"


def script_step(path_line: str, args: tuple[Any, ...], expected: Any) -> str | None:
    """For a build driven through a script (one of ``args`` is a list of operations and the
    result a list with one entry after each): the step where the traces part, its operation
    and the state before it; None when the difference is not in such a trace."""
    if not (isinstance(expected, list) and path_line.startswith("result[")):
        return None
    step = int(path_line[len("result[") : path_line.index("]")])
    scripts = [a for a in args if isinstance(a, list) and len(a) == len(expected)]
    if not scripts:
        return None
    op = scripts[0][step]
    before = (
        f"after step {step - 1} both were {_shown(expected[step - 1])}"
        if step
        else "it is the first step"
    )
    return f"the traces part at step {step} of {len(expected)}, the operation {op!r} ({before})"


def kind_mismatch(got: Any, expected: Any, where: str = "the result") -> str | None:
    """What differs between the kinds of ``got`` and ``expected``: a tensor's type, dtype or
    shape, a sequence's or a dict's type, recursively through items that both hold; None when
    nothing does.

    A right value of the wrong kind (a float64 or int mask, a list or numpy array for a
    tensor) breaks the code the chapter runs it in, so it fails before values are compared.
    Lengths and keys are values (the comparison judges them), and Python numbers match each
    other (``exact`` and ``near`` judge ints and floats)."""
    if isinstance(expected, Tensor):
        if not isinstance(got, Tensor):
            return f"{where} is a {type(got).__name__}, the reference's a torch.Tensor"
        if got.dtype != expected.dtype:
            return f"{where} has dtype {got.dtype}, the reference's {expected.dtype}"
        if got.shape != expected.shape:
            return f"{where} has shape {list(got.shape)}, the reference's {list(expected.shape)}"
        return None
    if isinstance(expected, (tuple, list, dict)) and type(got) is not type(expected):
        return f"{where} is a {type(got).__name__}, the reference's a {type(expected).__name__}"
    if isinstance(expected, dict):
        pairs = [(f"{where}[{k!r}]", got[k], expected[k]) for k in expected if k in got]
    elif isinstance(expected, (tuple, list)):
        pairs = [
            (f"{where}[{i}]", g, e) for i, (g, e) in enumerate(zip(got, expected, strict=False))
        ]
    else:
        return None
    return next((m for w, g, e in pairs if (m := kind_mismatch(g, e, w))), None)
