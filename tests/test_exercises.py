"""Every worked solution passes its check, and every check fails on a wrong answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisparse.exercises import EXERCISES, check

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
#: exercise -> the function its solution file defines
FUNCTIONS = {
    "rope": "apply_rope",
    "kv_bytes": "kv_bytes",
    "teal_threshold": "threshold",
    "quantize_groups": "quantize_groups",
    "verify_greedy": "verify",
    "fast_load": "fast_load",
}


def solution(name: str):
    spec = importlib.util.spec_from_file_location(name, SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, FUNCTIONS[name])


def test_every_exercise_has_a_solution():
    assert set(FUNCTIONS) == set(EXERCISES)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_worked_solution_passes(name, seed, capsys):
    assert check(name, solution(name), seed=seed)
    assert "correct" in capsys.readouterr().out


#: a plausible mistake for each exercise
WRONG = {
    "rope": lambda x, cos, sin: x * cos + torch.roll(x, 1, -1) * sin,  # neighbours, not halves
    "kv_bytes": lambda layers, h, d, s, b: layers * h * d * s * b * 2,  # forgot the values
    "teal_threshold": lambda x, s: float(torch.quantile(x.double(), s)),  # signed, not |x|
    "quantize_groups": lambda x, bits, g: solution("quantize_groups")(x, bits, x.shape[1]),
    "verify_greedy": lambda logits, drafts: (len(drafts), int(logits[-1].argmax())),
    "fast_load": lambda hot, f: sum(float(h.float().mean()) for h in hot) / len(hot),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_answer_fails_with_a_hint(name, capsys):
    assert not check(name, WRONG[name], seed=0)
    out = capsys.readouterr().out
    assert "mismatch" in out and "hint:" in out


def test_an_unknown_exercise_is_refused():
    with pytest.raises(ValueError, match="choose one of rope"):
        check("softmax", lambda x: x)
