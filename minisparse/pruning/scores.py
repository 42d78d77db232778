"""How much each weight matters: the score a pruning method ranks weights by.

* **Magnitude** (the classic baseline): S_ij = |W_ij|.
* **Wanda** (Sun et al. 2024, "A Simple and Effective Pruning Approach for Large Language
  Models"): S_ij = |W_ij| · ‖X_j‖₂, where ‖X_j‖₂ is the L2 norm of input feature j over the
  calibration tokens (X [tokens, in]). A small weight on an input that is often large can
  matter more than a large weight on an input that is nearly always zero; like AWQ (chapter
  09), Wanda looks at the weights *and* the activations that multiply them.

Both take W [out, in] and return scores of the same shape; the masks (``masks``) then compare
scores within each output row (Wanda's choice) or within groups of m inputs (N:M patterns).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["input_norms", "magnitude_score", "wanda_score"]


def magnitude_score(weight: Tensor) -> Tensor:
    """S = |W| [out, in]."""
    return weight.abs()


def input_norms(x: Tensor) -> Tensor:
    """‖X_j‖₂ [in] over every token of ``x`` [..., in]: sqrt(Σ_t x_tj²)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat.double().pow(2).sum(0).sqrt().to(x.dtype)


def wanda_score(weight: Tensor, x_norm: Tensor) -> Tensor:
    """S_ij = |W_ij| · ‖X_j‖₂ for W [out, in] and the input norms ``x_norm`` [in]."""
    if x_norm.shape != weight.shape[-1:]:
        raise ValueError(
            f"x_norm must hold one norm per input column, shape [{weight.shape[-1]}]; got "
            f"{list(x_norm.shape)} (input_norms(x) computes it from calibration inputs x)"
        )
    return weight.abs() * x_norm.to(weight.dtype).abs()
