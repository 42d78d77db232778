"""Weights in 2 MB pages: the same values, shapes, strides and sharing, only other memory."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from conftest import tiny_model
from minisparse.core import memory
from minisparse.core.memory import empty_huge, huge_pages_available, to_huge_pages_

needs_thp = pytest.mark.skipif(
    not huge_pages_available(), reason="no transparent huge pages on this system"
)


def huge_kb() -> int:
    """AnonHugePages of this process, in kB (Linux)."""
    text = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


@needs_thp
def test_moving_keeps_values_strides_and_tied_weights(monkeypatch):
    monkeypatch.setattr(memory, "MIN_BYTES", 0)
    model = tiny_model(seed=3, dim=64, ffn_dim=96, vocab_size=200)
    model.layers[0].mlp.up_proj.weight.data = (
        model.layers[0].mlp.up_proj.weight.t().contiguous().t()
    )
    before = {n: (t.clone(), t.stride()) for n, t in model.state_dict().items()}
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    ids = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    to_huge_pages_(model, min_bytes=0)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name][0]) and t.stride() == before[name][1], name
    assert all(model.state_dict()[n].data_ptr() != p for n, p in ptrs.items())
    assert model.lm_head.weight is model.embed.weight  # still one tensor
    assert torch.equal(model(ids), want)


@needs_thp
def test_a_large_tensor_is_backed_by_huge_pages_and_a_deepcopy_stays_there():
    before = huge_kb()
    t = empty_huge((8 << 20,))  # 32 MB
    t.fill_(1.0)
    assert huge_kb() - before >= 16 << 10  # at least half of it in 2 MB pages
    model = tiny_model(seed=1, dim=512, ffn_dim=2048, vocab_size=4096, n_layers=2)
    start = huge_kb()
    twin = copy.deepcopy(model)  # Transformer.__deepcopy__ moves the copy's weights
    assert huge_kb() > start
    ids = torch.randint(0, 4096, (1, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(twin(ids), model(ids))


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    model = tiny_model(seed=2)
    ptr = model.embed.weight.data_ptr()
    assert to_huge_pages_(model, min_bytes=0) is model and model.embed.weight.data_ptr() == ptr
    assert empty_huge((3, 4)).shape == (3, 4)
