"""Chapter 11's core build: its plausible mistakes in composing an engine (``WRONG``, rejected in
test_exercises.py), and the chapter's table can be built by the learner's function."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisparse.course.builds.ch11 import learner_or_library
from minisparse.course.plug import solution
from minisparse.engine import Engine, EngineConfig, low_bit, make_draft, sparse_model

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
build_engine = solution("build_engine", SOLUTIONS)


def sparse_then_quantized(base, tokenizer, config, calibration):
    """Quantizes after the sparse MLPs are in: they keep reading float32 weights."""
    config.check()
    method, kind = config.method, config.draft_kind
    model = base if method is None else method.model(base, calibration, config.share)
    if method is not None and method.neurons:
        model = sparse_model(model, method.thresholds(model, calibration, config.share), None,
                             config.sparse_kernels)  # fmt: skip
    if config.weights != "fp32":
        model = low_bit(model, config.weights)
    draft = None if kind is None else make_draft(kind.name, model, calibration)
    return Engine(config, model, tokenizer, draft)


def unchecked(base, tokenizer, config, calibration):
    """Builds what the config says without asking whether it combines."""
    method, kind = config.method, config.draft_kind
    model = base if method is None else method.model(base, calibration, config.share)
    if config.weights != "fp32":
        model = low_bit(model, config.weights)
    if method is not None and method.neurons:
        model = sparse_model(model, method.thresholds(model, calibration, config.share), None,
                             config.sparse_kernels)  # fmt: skip
    draft = None if kind is None else make_draft(kind.name, model, calibration)
    return Engine(config, model, tokenizer, draft)


def draft_of_the_base(base, tokenizer, config, calibration):
    """The draft is made from the model before quantization and sparsity."""
    engine = build_engine(base, tokenizer, config, calibration)
    kind = config.draft_kind
    engine.draft = None if kind is None else make_draft(kind.name, base, calibration)
    return engine


def default_share(base, tokenizer, config, calibration):
    """Calibrates every method at 50 %, whatever share the config asks for."""
    return build_engine(
        base, tokenizer, EngineConfig(**{**config.__dict__, "share": 0.5}), calibration
    )


WRONG = {"build_engine": [sparse_then_quantized, unchecked, draft_of_the_base, default_share]}


def test_the_learners_builder_builds_what_it_covers_and_leaves_the_rest_to_the_library():
    calls = []

    def counted(*args):
        calls.append(args[2])
        return build_engine(*args)

    builder = learner_or_library(counted)
    from minisparse.course.builds.ch11 import _tiny

    base = _tiny(0)
    calibration = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(0))
    engine = builder(base, None, EngineConfig(weights="int8"), calibration)
    assert calls == [EngineConfig(weights="int8")] and engine.config.weights == "int8"
    with pytest.raises(ValueError, match="predictors"):  # the library's build, not the learner's
        builder(base, None, EngineConfig(predictors="file.safetensors"), calibration)
    assert len(calls) == 1
