"""Chapter 12's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's masks and quantizer are the ones the chapter's pruned and NF4 models run with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from minisparse.course.builds.ch12 import pruning_with
from minisparse.course.plug import solution
from minisparse.pruning import prune
from minisparse.quant.nf4 import NF4_LEVELS, NF4Linear

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
wanda = solution("wanda_mask", SOLUTIONS)
nm = solution("nm_mask", SOLUTIONS)
nf4 = solution("nf4_quantize", SOLUTIONS)


def _prune_lowest(scores, k):
    keep = torch.ones_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.argsort(dim=-1, stable=True)[..., :k], False)


def magnitude_only(w, x_norm, sparsity):
    """Ranks by |W| alone: the activations' norms are ignored."""
    return _prune_lowest(w.abs(), round(sparsity * w.shape[-1]))


def whole_matrix(w, x_norm, sparsity):
    """Compares every weight with every other (one global threshold), not within a row."""
    flat = (w.abs() * x_norm).flatten()
    return _prune_lowest(flat, round(sparsity * flat.numel())).reshape(w.shape)


def per_column(w, x_norm, sparsity):
    """Compares within each input column instead of each output row."""
    scores = (w.abs() * x_norm).T
    return _prune_lowest(scores, round(sparsity * scores.shape[-1])).T.contiguous()


def truncated_count(w, x_norm, sparsity):
    """int(s * in) instead of round(s * in): one weight too few pruned on some rows."""
    return _prune_lowest(w.abs() * x_norm, int(sparsity * w.shape[-1]))


def strided_groups(scores, n, m):
    """Groups of every (in / m)-th column instead of m consecutive columns."""
    rows, cols = scores.shape
    groups = scores.reshape(rows, m, cols // m).transpose(1, 2)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.transpose(1, 2).reshape(rows, cols)


def row_top(scores, n, m):
    """Keeps the top n/m of each row, ignoring the groups."""
    cols = scores.shape[-1]
    return _prune_lowest(scores, cols - cols * n // m)


def lowest_kept(scores, n, m):
    """Keeps the n lowest of each group."""
    rows, cols = scores.shape
    groups = scores.reshape(rows, cols // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, (-groups).topk(n, dim=-1).indices, True)
    return keep.reshape(rows, cols)


def _nearest(normed, levels):
    return (normed[..., None] - levels).abs().argmin(-1).to(torch.uint8)


def row_absmax(w, block_size):
    """One absmax per row instead of per block (the codes use the row's scale)."""
    rows, cols = w.shape
    a = w.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    codes = _nearest(w / a, NF4_LEVELS)
    return codes, a.expand(rows, cols // block_size).contiguous()


def uniform_grid(w, block_size):
    """A uniform 16-level grid on [-1, 1] instead of the NormalFloat levels."""
    rows, cols = w.shape
    blocks = w.reshape(rows, -1, block_size)
    a = blocks.abs().amax(-1)
    codes = torch.round((blocks / a.clamp_min(1e-12)[..., None] + 1) * 7.5).clamp(0, 15)
    return codes.to(torch.uint8).reshape(rows, cols), a


def signed_max(w, block_size):
    """max(w) instead of max |w|: a block whose largest magnitude is negative overflows."""
    rows, cols = w.shape
    blocks = w.reshape(rows, -1, block_size)
    a = blocks.amax(-1).clamp_min(1e-12)
    return _nearest(blocks / a[..., None], NF4_LEVELS).reshape(rows, cols), a


def floor_level(w, block_size):
    """The level at or below w / a (searchsorted) instead of the nearest one."""
    rows, cols = w.shape
    blocks = w.reshape(rows, -1, block_size)
    a = blocks.abs().amax(-1)
    normed = blocks / a.clamp_min(1e-12)[..., None]
    codes = (torch.searchsorted(NF4_LEVELS, normed.contiguous(), right=True) - 1).clamp(0, 15)
    return codes.to(torch.uint8).reshape(rows, cols), a


WRONG = {
    "wanda_mask": [magnitude_only, whole_matrix, per_column, truncated_count],
    "nm_mask": [strided_groups, row_top, lowest_kept],
    "nf4_quantize": [row_absmax, uniform_grid, signed_max, floor_level],
}


def calibration(model):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_the_learners_masks_prune_the_model_as_the_librarys_do(pattern):
    model = tiny_model(seed=3, std=0.2)
    ids = calibration(model)
    calls = []

    def counted(fn):
        def wrapper(*args):
            calls.append(fn.__name__)
            return fn(*args)

        wrapper.__name__ = fn.__name__
        return wrapper

    select = pruning_with(counted(wanda), counted(nm))
    mine = prune(model, "wanda", 0.5, pattern, ids, select_fn=select)
    library = prune(model, "wanda", 0.5, pattern, ids)
    for a, b in zip(mine.parameters(), library.parameters(), strict=True):
        assert torch.equal(a, b)
    expected = "wanda_mask" if pattern == "unstructured" else "nm_mask"
    assert calls and set(calls) == {expected}


def test_a_wrong_mask_changes_the_pruned_model():
    model = tiny_model(seed=3, std=0.2)
    ids = calibration(model)
    mine = prune(model, "wanda", 0.5, "unstructured", ids, select_fn=pruning_with(magnitude_only))
    library = prune(model, "wanda", 0.5, "unstructured", ids)
    pairs = zip(mine.parameters(), library.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_the_learners_quantizer_makes_the_nf4_layers():
    linear = torch.nn.Linear(128, 6, bias=False)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(1))
    for double in (False, True):
        mine = NF4Linear.from_linear(linear, 64, double, quantize_fn=nf4)
        library = NF4Linear.from_linear(linear, 64, double)
        assert torch.equal(mine.weight, library.weight)
        wrong = NF4Linear.from_linear(linear, 64, double, quantize_fn=uniform_grid)
        assert not torch.equal(wrong.weight, library.weight)
