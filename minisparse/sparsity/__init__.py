"""Activation sparsity: measure it, create it without training, and count what it saves.

A projection y = W x reads every column of W, but column j only matters when x_j != 0: a
kernel that skips the zero inputs (chapter 07) reads a fraction (1 - s) of W, where s is the
share of zeros in x. The chapter meets three ideas, one module each, all importable from here:

1. **Measuring** (``stats``). ``record`` streams a model over text and keeps, at five
   sites of every layer (attn_in, mlp_in, mlp_act, down_in, heads), only summaries: zeros, a
   histogram of log10|x|, per-feature activation counts. From them: the share of |x| <= t per
   layer, magnitude quantiles, and per-neuron frequencies whose Lorenz curve shows how few
   "hot" neurons do most of the work (PowerInfer, Song et al. 2023).
2. **Creating** (``thresholds``). Pick per layer the magnitude t_l with
   P(|x| <= t_l) = s on calibration text and zero everything below it: x · 1[|x| > t_l]
   (TEAL, Liu et al. 2024, on the projections' inputs; CATS, Lee et al. 2024, on the SiLU
   output). ``calibrate_thresholds``, ``apply_thresholds_``, ``remove_thresholds_``,
   ``thresholds_applied``.
3. **Counting** (``savings``). Per projection, the FLOPs 2 · out · in · s and weight
   bytes a sparse kernel would skip per token, next to what stays dense (attention scores, LM
   head).

References: Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023); Liu et al., "Training-Free Activation Sparsity in Large Language Models" (TEAL,
2024); Lee et al., "CATS: Contextually-Aware Thresholding for Sparsity in Large Language Models"
(2024).
"""

from __future__ import annotations

from .methods import (
    SPARSITY_METHODS,
    TEAL_SITES,
    SparsityMethod,
    register_sparsity,
    sparsity_method,
    teal_model,
)
from .savings import ProjectionSavings, projection_skips, savings
from .stats import (
    BINS_PER_DECADE,
    LOG10_MAX,
    LOG10_MIN,
    N_BINS,
    SITES,
    SLOTS,
    SiteStats,
    SparsityStats,
    attach,
    check_sites,
    check_sparsity,
    head_norms,
    lorenz_curve,
    measure,
    measure_with_nlls,
    per_layer,
    record,
    recording,
    site_width,
    top_share,
)
from .thresholds import (
    MagnitudeThreshold,
    Thresholds,
    apply_thresholds,
    apply_thresholds_,
    calibrate_thresholds,
    cats_thresholds,
    check_threshold,
    remove_thresholds,
    remove_thresholds_,
    thresholds_applied,
    thresholds_at,
)

__all__ = [
    "BINS_PER_DECADE",
    "LOG10_MAX",
    "LOG10_MIN",
    "N_BINS",
    "SITES",
    "SLOTS",
    "SPARSITY_METHODS",
    "TEAL_SITES",
    "MagnitudeThreshold",
    "ProjectionSavings",
    "SiteStats",
    "SparsityMethod",
    "SparsityStats",
    "Thresholds",
    "apply_thresholds",
    "apply_thresholds_",
    "attach",
    "calibrate_thresholds",
    "cats_thresholds",
    "check_sites",
    "check_sparsity",
    "check_threshold",
    "head_norms",
    "lorenz_curve",
    "measure",
    "measure_with_nlls",
    "per_layer",
    "projection_skips",
    "record",
    "recording",
    "register_sparsity",
    "remove_thresholds",
    "remove_thresholds_",
    "savings",
    "site_width",
    "sparsity_method",
    "teal_model",
    "thresholds_applied",
    "thresholds_at",
    "top_share",
]
