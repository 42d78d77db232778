"""``use``: the learner's passing code is what runs; a stub or a wrong answer leaves the library's
in place (with one line saying so); the test suite's worked-solution mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisparse.core.rope import apply_rope
from minisparse.course import Impl, use
from minisparse.course.plug import SOLUTIONS_ENV, solution

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"


@pytest.fixture(autouse=True)
def learner_mode(monkeypatch):
    monkeypatch.delenv(SOLUTIONS_ENV, raising=False)  # the suite sets it for the notebooks


def my_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def test_a_passing_function_is_what_runs(capsys):
    impl = use("rope", my_rope, seed=0)
    assert isinstance(impl, Impl) and impl.fn is my_rope and impl.who == "yours" and impl.learners
    assert "from here on the chapter runs apply_rope (yours)" in capsys.readouterr().out
    x, cos, sin = torch.randn(1, 2, 3, 4), torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(impl(x, cos, sin), my_rope(x, cos, sin))


def test_a_stub_leaves_the_librarys_version_running(capsys):
    def stub(x, cos, sin):
        raise NotImplementedError("write my_apply_rope")

    impl = use("rope", stub, seed=0)
    out = capsys.readouterr().out
    assert "not written yet (write my_apply_rope)" in out
    assert "until yours passes, the chapter runs apply_rope (the library's)" in out
    assert impl.who == "the library's" and not impl.learners and str(impl) == "rope: the library's"
    x, cos, sin = torch.randn(1, 2, 3, 4), torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(impl(x, cos, sin), apply_rope(x, cos, sin))


def test_a_wrong_answer_leaves_the_librarys_version_running(capsys):
    impl = use("rope", lambda x, cos, sin: x * cos, seed=0)
    out = capsys.readouterr().out
    assert "mismatch" in out and "hint:" in out and impl.who == "the library's"


def test_the_worked_solution_stands_in_when_the_suite_asks(monkeypatch, capsys):
    monkeypatch.setenv(SOLUTIONS_ENV, str(SOLUTIONS))
    impl = use("rope", lambda *a: None, seed=0)
    assert impl.who == "the worked solution" and impl.fn.__name__ == "apply_rope"
    assert "worked solution stands in" in capsys.readouterr().out


def test_a_missing_solution_or_exercise_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"No worked solution .*rope\.py; set MINISPARSE"):
        solution("rope", tmp_path)
    (tmp_path / "rope.py").write_text("def rotate(x, cos, sin):\n    return x\n")
    with pytest.raises(AttributeError, match="must define apply_rope"):
        solution("rope", tmp_path)
    with pytest.raises(ValueError, match="Unknown exercise 'softmax'"):
        use("softmax", lambda x: x)
