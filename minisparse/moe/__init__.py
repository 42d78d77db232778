"""MoEfication (chapter 12): a dense FFN read as a mixture of experts, structured sparsity.

Chapters 05-06 predict, per token, which of a layer's n neurons are active. MoEfication
(Zhang et al. 2022) makes the choice coarser: the neurons are grouped offline into E experts of
m = n / E, and a small router picks, per token, the k experts to compute:

    y(x) = sum_{e in top-k(router(x))} act(W_gate[e] x) * (W_up[e] x) @ W_down[:, e]^T

equal to the dense MLP with every neuron outside the chosen experts zeroed (exact at k = E).
The grouping decides the quality: experts of neurons that fire together are worth computing as
a whole or skipping as a whole.

The package meets five pieces, one module each, all importable from here:

1. ``grouping``: balanced k-means on the neurons' co-activation profiles (each expert exactly
   m neurons, via an exact balanced assignment), and the random baseline;
2. ``routing``: the router (a chapter-06 ``Predictor`` with E units) fitted to each expert's
   share of active neurons; the top-k choice; the neuron mask of chosen experts;
3. ``mlp``: ``MoEMLP``, the MLP that computes only the chosen experts;
4. ``convert``: ``moefy``, a copy of a model with MoE MLPs (``fit_moe_layers``, ``moe_mlps``);
5. ``compare``: MoE experts against chapter 06's neuron predictors and the oracle at equal
   compute: recall of the active neurons, perplexity, MLP bytes per token.

Reference: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022).
"""

from . import compare, convert, grouping, mlp, routing
from .compare import *  # noqa: F403
from .convert import *  # noqa: F403
from .grouping import *  # noqa: F403
from .mlp import *  # noqa: F403
from .routing import *  # noqa: F403

__all__ = [*grouping.__all__, *routing.__all__, *mlp.__all__, *convert.__all__, *compare.__all__]
