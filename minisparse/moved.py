"""Old module paths, kept for one release: ``minisparse.sparse_mlp`` still imports, with a
``DeprecationWarning`` that names the module's new place (``minisparse.sparse``).

The library was one flat folder of modules grouped by name prefixes; it is now a package per
concept (``core``, ``io``, ``sparsity``, ``sparse``, ``quant``, ...). A finder on
``sys.meta_path`` answers the old names with the new modules themselves (the same objects, so
monkeypatching either name patches both). One old path is gone: ``minisparse.generate`` is the
function ``generate`` (its module is ``minisparse.core.generate``), and an alias would replace
the function with the module.

Names renamed with the move (no alias): ``sparse_input_gemv`` (and ``_ref``, ``_i8``) is
``scatter_gemv``; the sparse package's ``calibrate_thresholds`` is
``minisparse.sparsity.cats_thresholds``; ``EngineConfig.cats_sparsity`` is ``share``;
``engine.SPARSITY`` / ``WEIGHTS`` / ``DRAFTS`` are ``engine.choices()`` (read from the
registries); ``quant.METHODS`` is ``quant.QUANT_METHODS``, whose methods own their options (an
option of another method is refused, not ignored); the C structs and constants of
``decode_layers`` are in ``minisparse.kernels.abi``, its library in ``minisparse.runtime.step``;
``minisparse.kernels.cpu_loops`` is ``kernels/cpu.c`` (its declarations in ``cpu_build``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

# old module (under minisparse.) -> its new home (a package face where the old module was one)
MOVED = {
    "checks": "core.checks", "model_config": "core.config", "model_layers": "core.layers",
    "model": "core.model", "rope": "core.rope", "attention": "core.attention",
    "hooks": "core.hooks",
    "cache": "io.cache", "loading": "io.loading", "loading_cache": "io.weight_cache",
    "loading_sources": "io.sources", "hf": "io.hf", "export": "io.export", "data": "io.data",
    "eval": "io.eval",
    "machine": "measure.machine", "timing": "measure.timing", "tolerance": "measure.tolerance",
    "plots": "measure.plots",
    "kvcache_eviction": "kvcache.eviction", "kvcache_paged": "kvcache.paged",
    "sparsity_stats": "sparsity.stats", "sparsity_savings": "sparsity.savings",
    "sparsity_thresholds": "sparsity.thresholds", "contextual": "sparsity.contextual",
    "finetune": "relufy.finetune", "finetune_lora": "relufy.lora",
    "predictor": "predictors.lowrank", "predictors_pipeline": "predictors.pipeline",
    "predictors_records": "predictors.records", "predictors_set": "predictors.collection",
    "predictors_sizing": "predictors.sizing",
    "sparse_mlp": "sparse", "sparse_mlp_masks": "sparse.masks",
    "sparse_mlp_weights": "sparse.weights",
    "offload_report": "offload.report", "offload_time": "offload.time_model",
    "hybrid": "offload.hybrid",
    "quant_tensor": "quant.tensor", "quant_layers": "quant.layers",
    "quant_calibration": "quant.calibration", "gptq": "quant.gptq", "smoothing": "quant.smoothing",
    "speculative_drafts": "speculative.drafts", "speculative_sampling": "speculative.sampling",
    "speculative_theory": "speculative.theory",
    "decode": "runtime.decoder", "decode_layers": "runtime.lowering",
    "exercises": "course.exercises", "exercise_run": "course.grading",
    "exercise_sets_early": "course.sets_early", "exercise_sets_late": "course.sets_late",
    "tour": "course.tour", "prepare": "course.prepare",
}  # fmt: skip


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module has run already


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None):
        package, _, old = fullname.partition(".")
        if package != "minisparse" or old not in MOVED:
            return None
        new = f"minisparse.{MOVED[old]}"
        warnings.warn(
            f"{fullname} moved to {new}: import it from there (the old path goes next release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import minisparse`` does)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
