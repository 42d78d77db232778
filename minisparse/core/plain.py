"""Plain float layers: what pruning and export need to read, and the check that refuses the rest.

Chapters 09-12 replace a block's projections with layers that hold their weights in another
form (int8/int4 codes, NF4 blocks, LoRA adapters over a frozen base, compact N:M values).
Pruning chooses among float weights and an export writes float weights, so both first check
that every projection is a float ``nn.Linear`` with finite values (``check_plain_linears``),
and name the way back to one when it is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .model import Transformer

__all__ = [
    "BLOCK_PROJECTIONS",
    "REPAIR_WEIGHTS",
    "UNPLAIN_FIX",
    "check_finite",
    "check_plain_linears",
]

#: The projections of a block, by their path inside it: attention's four, then the MLP's three.
BLOCK_PROJECTIONS = (
    "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip

REPAIR_WEIGHTS = (
    "one of them would make its whole row or group NaN after quantization. Repair the weights "
    "first (reload the model, or torch.nan_to_num_ to zero them)."
)


def check_finite(x: Tensor, what: str, fix: str = REPAIR_WEIGHTS) -> None:
    """Refuse NaN or inf values in ``x`` with one ValueError that says where they are and
    ``fix``."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{what} holds {int(bad.sum())} NaN or inf value(s) (the first at index {where}); {fix}"
        )


#: How to get a float layer back from the layers ``check_plain_linears`` refuses, by type.
UNPLAIN_FIX = {
    "NMLinear": "a compact N:M layer (pruning.to_nm_); work on the model before to_nm_ (its "
    "pruned weights are zeros already), or rebuild it with minisparse.load",
    "NF4Linear": "an NF4 layer (peft.nf4_base_, qlora_); merge_qlora(model) gives float layers",
    "LoRALinear": "a LoRA layer; merge_lora(model) folds the adapters into float layers",
}


def check_plain_linears(model: Transformer, names: Sequence[str], action: str) -> None:
    """Refuse, naming the first, a block projection among ``names`` that is not a float
    ``nn.Linear`` (an N:M, NF4, LoRA or packed layer) or whose weight holds NaN or inf:
    ``action`` ("prune", "export") would read a weight it does not have, or NaN."""
    for i, layer in enumerate(model.layers):
        for name in names:
            linear = layer.get_submodule(name)
            kind = type(linear).__name__
            if not isinstance(linear, nn.Linear):
                fix = UNPLAIN_FIX.get(
                    kind, f"a {kind}; {action} the float model before quantizing it"
                )
                raise ValueError(f"cannot {action} layers.{i}.{name}: it is {fix}.")
            check_finite(
                linear.weight.detach(),
                f"layers.{i}.{name}.weight",
                f"{action} would choose from NaN scores and give NaN logits. Reload the model, "
                "or repair the weights first (torch.nan_to_num_).",
            )
