"""Chapter 09's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and quantize_model runs the learner's GPTQ and AWQ on a tiny model exactly as it runs the
library's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from minisparse.course.builds.ch09 import awq_search_with, gptq_with
from minisparse.course.plug import solution
from minisparse.quant import quantize_model

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
gptq = solution("gptq_quantize", SOLUTIONS)
awq = solution("awq_search", SOLUTIONS)


def grid(w, bits):
    lo, hi = w.amin(1), w.amax(1)
    return ((hi - lo) / (2**bits - 1)).clamp_min(1e-30), lo


def gptq_with_mistake(mistake):
    """The worked solution's loop with one of the mistakes a first attempt makes."""

    def wrong(w, x, bits, group_size, damp):
        w = w.clone()
        original = w.clone()
        _rows, cols = w.shape
        g = cols if group_size is None else group_size
        h = x.T @ x
        dead = h.diagonal() == 0
        h[dead, dead] = 1.0
        w[:, dead] = 0.0
        if mistake != "no damping":
            h += damp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
        if mistake == "factor of H":
            u = torch.linalg.cholesky(h, upper=True)
        else:
            u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
        q, scales, offsets = torch.zeros_like(w), [], []
        for i in range(cols):
            if i % g == 0:
                source = original if mistake == "ranges before corrections" else w
                scale, offset = grid(source[:, i : i + g], bits)
                scales.append(scale)
                offsets.append(offset)
            q[:, i] = torch.round((w[:, i] - offset) / scale).clamp(0, 2**bits - 1)
            err = (w[:, i] - (q[:, i] * scale + offset)) / u[i, i]
            end = (i // g + 1) * g if mistake == "feedback within the group" else cols
            if mistake != "round to nearest":
                w[:, i + 1 : end] -= err[:, None] * u[i, i + 1 : end][None, :]
        return q, torch.stack(scales, 1), torch.stack(offsets, 1)

    wrong.__name__ = mistake.replace(" ", "_")
    return wrong


def fake_quantize(w, bits, group_size):
    out = torch.empty_like(w)
    g = w.shape[1] if group_size is None else group_size
    for start in range(0, w.shape[1], g):
        scale, lo = grid(w[:, start : start + g], bits)
        q = torch.round((w[:, start : start + g] - lo[:, None]) / scale[:, None])
        out[:, start : start + g] = q.clamp(0, 2**bits - 1) * scale[:, None] + lo[:, None]
    return out


def awq_with_mistake(mistake):
    def wrong(x, w, bits, group_size, n_grid):
        stat = x.abs().amax(0) if mistake == "max not mean" else x.abs().mean(0)
        best, best_loss, losses = None, float("inf"), []
        for i in range(n_grid):
            s = stat.pow(i / n_grid).clamp_min(1e-4)
            if mistake != "not normalised":
                s = s / (s.max() * s.min()).sqrt()
            w_hat = fake_quantize(w * s, bits, group_size)
            diff = w - (w_hat if mistake == "not scaled back" else w_hat / s)
            out = diff if mistake == "weight error" else x @ diff.T
            loss = float(out.pow(2).sum() / out.numel())
            losses.append(loss)
            if loss <= best_loss:
                best, best_loss = s, loss
        return best, torch.tensor(losses)

    wrong.__name__ = mistake.replace(" ", "_")
    return wrong


WRONG = {
    "gptq_quantize": [
        gptq_with_mistake(m)
        for m in (
            "round to nearest",
            "feedback within the group",
            "factor of H",
            "no damping",
            "ranges before corrections",
        )
    ],
    "awq_search": [
        awq_with_mistake(m)
        for m in ("not scaled back", "weight error", "max not mean", "not normalised")
    ],
}


def counted(fn):
    def wrapper(*args):
        wrapper.calls += 1
        return fn(*args)

    wrapper.calls = 0
    return wrapper


@pytest.fixture(scope="module")
def tiny():
    """A tiny model in float64 and its calibration tokens: the learner's code and the library's
    then agree on every rounding decision."""
    model = tiny_model(seed=0, tie_embeddings=False).double()
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, tokens


@pytest.mark.parametrize("group_size", [16, None])
def test_quantize_model_runs_the_learners_gptq(tiny, group_size):
    model, tokens = tiny
    options = {"bits": 4, "group_size": group_size, "calib_batches": tokens, "progress": False}
    learners = counted(gptq)
    ours = quantize_model(model, "gptq", gptq_fn=gptq_with(learners), **options)
    library = quantize_model(model, "gptq", **options)
    assert learners.calls == 4 * model.config.n_layers  # q/k/v, o, gate/up and down per layer
    for (name, a), b in zip(ours.named_parameters(), library.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-9), name


def test_quantize_model_runs_the_learners_awq(tiny):
    """Every group but o_proj under GQA (which shares scales by head) uses the learner's search."""
    model, tokens = tiny
    options = {
        "bits": 4,
        "group_size": 16,
        "calib_batches": tokens,
        "progress": False,
        "awq_grid": 5,
    }
    learners = counted(awq)
    ours = quantize_model(model, "awq", awq_search_fn=awq_search_with(learners), **options)
    library = quantize_model(model, "awq", **options)
    assert learners.calls == 3 * model.config.n_layers
    for (name, a), b in zip(ours.named_parameters(), library.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-9), name


def test_the_course_plugs_refuse_the_symmetric_grid(tiny):
    model, tokens = tiny
    with pytest.raises(ValueError, match="asymmetric grid"):
        quantize_model(
            model, "gptq", bits=8, calib_batches=tokens, progress=False, gptq_fn=gptq_with(gptq)
        )
