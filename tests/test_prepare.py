"""``minisparse prepare``: the plan names what is missing; a failed step stops with its status."""

from __future__ import annotations

import argparse

from minisparse.course import prepare as P


def read_fake(path):
    if path.read_bytes() != b"x":
        raise ValueError("not an artifact")


def fake(tmp_path, name, done, argv=("info",)):
    path = tmp_path / f"{name}.bin"
    if done:
        path.write_bytes(b"x")
    return P.Artifact(name, lambda: path, argv, 2.0, "a test", read_fake)


def test_the_plan_says_what_is_done_what_is_missing_and_how_long(tmp_path):
    artifacts = (fake(tmp_path, "a", True), fake(tmp_path, "b", False), fake(tmp_path, "c", False))
    text = P.plan(artifacts)
    assert "- a: done" in text and "- b: missing: to make, ~2 min" in text
    assert "`minisparse info`" in text and text.endswith("2 to make, about 4 min")
    assert P.plan(artifacts[:1]).endswith("all done")


def test_nothing_runs_when_everything_is_done_or_only_a_list_is_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "ARTIFACTS", (fake(tmp_path, "a", True),))
    assert P.run(argparse.Namespace(list=False)) == 0
    monkeypatch.setattr(P, "ARTIFACTS", (fake(tmp_path, "b", False, ("no-such-command",)),))
    assert P.run(argparse.Namespace(list=True)) == 0  # --list never runs a step


def test_a_failing_step_stops_with_its_status_and_names_the_command(tmp_path, monkeypatch, capsys):
    bad = fake(tmp_path, "b", False, ("relufy", "--stage", "3"))  # argparse refuses: status 2
    after = fake(tmp_path, "c", False, ("no-such-command",))
    monkeypatch.setattr(P, "ARTIFACTS", (bad, after))
    assert P.run(argparse.Namespace(list=False)) == 2
    assert "`minisparse relufy --stage 3` did not finish (status 2)" in capsys.readouterr().out


def test_a_damaged_artifact_is_not_done_and_the_real_readers_say_why(tmp_path, monkeypatch):
    artifact = fake(tmp_path, "a", True)
    artifact.path().write_bytes(b"garbage")
    assert not artifact.done() and artifact.problem() == "damaged (not an artifact)"
    assert "- a: damaged (not an artifact): to make" in P.plan((artifact,))
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "cache"))
    for real in P.ARTIFACTS:  # garbage at the real paths reads as damaged, never as done
        real.path().parent.mkdir(parents=True, exist_ok=True)
        real.path().write_bytes(b"not a safetensors file")
        assert real.problem().startswith("damaged (") and not real.done()


def test_a_damaged_relu_model_is_one_clear_error(tmp_path):
    import pytest

    from conftest import tiny_model
    from minisparse.relufy import load_relufied, result_dir

    path = result_dir(1, "mlp", tmp_path) / "model.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"not a readable fine-tuned model.*minisparse relufy"):
        load_relufied(tiny_model(), 1, root=tmp_path)
