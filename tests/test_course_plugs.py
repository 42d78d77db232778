"""Chapters 00 and 01 plug the learner's functions into the real model's modules: the model then
computes with them (and only inside the ``with`` block), and a wrong function shows."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import IdTokenizer, tiny_model
from minisparse.course.builds.ch00 import norms_with
from minisparse.course.builds.ch01 import attention_with
from minisparse.course.plug import solution
from minisparse.runtime.generate import generate

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def test_the_learners_rms_norm_runs_in_every_norm_of_the_model():
    model, ids = tiny_model(), tokens(9)
    calls = []

    def counted(x, w, eps):
        calls.append(1)
        return solution("rms_norm", SOLUTIONS)(x, w, eps)

    with torch.no_grad():
        want = model(ids)
        with norms_with(model, counted):
            got = model(ids)
        with norms_with(model, lambda x, w, eps: x * w):  # no normalisation at all
            wrong = model(ids)
    assert len(calls) == 2 * model.config.n_layers + 1
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(wrong, want, atol=1e-2)
    assert type(model.norm).__name__ == "RMSNorm"


def test_the_learners_rope_and_attention_decode_like_the_model():
    model, ids = tiny_model(n_kv_heads=2), tokens(12, 1)
    rope, attend = solution("rope", SOLUTIONS), solution("gqa_attention", SOLUTIONS)
    prompt = " ".join(str(int(t)) for t in ids[0])
    with torch.no_grad():
        want = generate(model, IdTokenizer(), prompt, max_new_tokens=6, stop_at_eos=False)
        with attention_with(model, rope=rope, attend=attend):
            got = generate(model, IdTokenizer(), prompt, max_new_tokens=6, stop_at_eos=False)
        with attention_with(model, rope=lambda x, cos, sin: x):  # no rotation: positions lost
            lost = model(ids)
        assert not torch.allclose(lost, model(ids), atol=1e-3)
    assert got == want
