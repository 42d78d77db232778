"""Chapter 11's build: composing an engine from its config, in the order the bytes flow.

The learner writes ``build_engine(base, tokenizer, config, calibration) -> Engine`` for the
configurations without predictors or a hot/cold split, from the chapters' own pieces and the
registries (``config.method``, ``config.draft_kind``, ``engine.low_bit``, ``engine.sparse_model``,
``engine.make_draft``): refuse what does not combine (``config.check()``), make the method's
model, quantize *before* a method that chooses MLP neurons swaps in sparse MLPs (so they read int8
codes) and after otherwise, and make the draft from the finished target. The check builds both
engines on a small random model for a list of configurations and compares what each runs: the
target's logits on fixed tokens (to float32 rounding), the draft's kind, or the refusal. The
chapter's side-by-side table is then built by the learner's function.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.model import ModelConfig, Transformer, init_weights
from ...engine.compose import Engine, EngineConfig, build
from ..grading import Exercise, register

__all__ = ["learner_or_library"]

_CONFIGS = (
    EngineConfig(),
    EngineConfig(weights="int8"),
    EngineConfig(weights="int4"),
    EngineConfig(sparsity="cats", share=0.5),
    EngineConfig(sparsity="cats", share=0.3, weights="int8"),
    EngineConfig(sparsity="cats", share=0.5, sparse_kernels=False),
    EngineConfig(sparsity="teal", share=0.4),
    EngineConfig(sparsity="teal", share=0.4, weights="int8"),
    EngineConfig(draft="prompt-lookup", gamma=3),
    EngineConfig(weights="int8", draft="early-exit"),
    EngineConfig(sparsity="cats", weights="int4"),  # refused: no sparse int4 kernel
    EngineConfig(weights="int8", draft="int8"),  # refused: the draft is the target
)


def _tiny(seed: int) -> Transformer:
    config = ModelConfig(
        vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
        rope_theta=10000.0, max_seq_len=64, tie_embeddings=True, eos_token_ids=[],
    )  # fmt: skip
    return init_weights(Transformer(config), seed=seed, std=0.05).eval()


def _cases(gen: torch.Generator) -> list[tuple[Any, ...]]:
    seed = int(torch.randint(0, 2**16, (1,), generator=gen))
    return [(seed, config) for config in _CONFIGS]


def _what_runs(builder: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Build with ``builder`` on the seed's small model; return what the engine runs."""
    seed, config = args
    base = _tiny(seed)
    gen = torch.Generator().manual_seed(seed)
    calibration = torch.randint(0, 61, (2, 24), generator=gen)
    tokens = torch.randint(0, 61, (1, 12), generator=gen)
    try:
        engine = builder(base, None, config, calibration)
    except ValueError:
        return ("refused", config)
    except Exception as err:  # a wrong order crashes deep inside a chapter: show it as a mismatch
        return (f"crashed ({type(err).__name__}: {err})", config)
    with torch.inference_mode():
        logits = engine.model(tokens)
        draft_model = getattr(engine.draft, "model", None)  # a model-based draft: what it runs
        draft_logits = None if draft_model is None else draft_model(tokens)
    draft = None if engine.draft is None else type(engine.draft).__name__
    return ("built", config, logits, draft, draft_logits)


def _same(got: Any, expected: Any) -> bool:
    if got[0] != expected[0] or got[1] != expected[1]:
        return False
    if got[0] != "built":
        return got[0] == "refused"
    if got[3] != expected[3] or (got[4] is None) != (expected[4] is None):
        return False
    drafts_same = got[4] is None or bool(torch.allclose(got[4], expected[4], atol=1e-4))
    return drafts_same and bool(torch.allclose(got[2], expected[2], atol=1e-4))


def learner_or_library(build_engine: Any) -> Any:
    """The learner's builder for what it covers; the library's ``build`` for predictors and the
    hot/cold split, which the build leaves out."""

    def builder(base: Any, tokenizer: Any, config: EngineConfig, calibration: Any) -> Engine:
        if config.predictors is not None or config.offload_budget is not None:
            return build(base, tokenizer, config, calibration)
        return build_engine(base, tokenizer, config, calibration)

    return builder


register(
    "build_engine",
    Exercise(
        "11",
        "build_engine(base, tokenizer, config, calibration) -> Engine(config, model, tokenizer, "
        "draft, description=...): the model the config describes (sparsity method, weight "
        "format, draft; no predictors or offload), built from the chapters' pieces",
        build,
        _cases,
        _same,
        "config.check() first; model = config.method.model(base, calibration, config.share); "
        "when the method chooses neurons (method.neurons): low_bit(model, weights) BEFORE "
        "sparse_model(model, method.thresholds(model, calibration, share), None, "
        "config.sparse_kernels), else low_bit after; the draft is make_draft(kind.name, model, "
        "calibration) of the finished target",
        run=_what_runs,
        core=True,
    ),
)
