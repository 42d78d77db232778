"""Chapter 05's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's masks are the ones the oracle's masked passes run with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.course.plug import solution
from minisparse.relufy import relufy
from minisparse.sparsity import contextual as C
from minisparse.sparsity.oracle import ActivationOracle

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
neuron_mask = solution("oracle_neuron_mask", SOLUTIONS)
head_mask = solution("oracle_head_mask", SOLUTIONS)
ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def _top(scores, k):
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.topk(k, dim=-1).indices, True) if k else keep


def _k(n, sparsity):
    return max(1, n - round(sparsity * n))


def gate_only(gate, up, act, sparsity):
    """Scores by the activation alone (CATS' score), not by what the down projection reads."""
    return _top(ACTS[act](gate).abs(), _k(gate.shape[-1], sparsity))


def signed_h(gate, up, act, sparsity):
    """Keeps the largest h, not the largest |h|: strongly negative neurons are dropped."""
    return _top(ACTS[act](gate) * up, _k(gate.shape[-1], sparsity))


def no_floor(gate, up, act, sparsity):
    """n - round(s n) without max(1, ...): a row keeps nothing at a high sparsity."""
    n = gate.shape[-1]
    return _top((ACTS[act](gate) * up).abs(), n - round(sparsity * n))


def interleaved_heads(o, n_heads, sparsity):
    """Head i taken as channels i, i + H, i + 2H, ... instead of a consecutive block."""
    norms = o.reshape(*o.shape[:-1], -1, n_heads).norm(dim=-2)
    return _top(norms, _k(n_heads, sparsity))


def l1_heads(o, n_heads, sparsity):
    """Sum of |o| per head instead of the L2 norm: ranks some heads differently."""
    norms = o.reshape(*o.shape[:-1], n_heads, -1).abs().sum(-1)
    return _top(norms, _k(n_heads, sparsity))


def kept_the_dropped_share(o, n_heads, sparsity):
    """Keeps round(s H) heads: sparsity read as the share kept."""
    norms = o.reshape(*o.shape[:-1], n_heads, -1).norm(dim=-1)
    return _top(norms, max(1, round(sparsity * n_heads)))


WRONG = {
    "oracle_neuron_mask": [gate_only, signed_h, no_floor],
    "oracle_head_mask": [interleaved_heads, l1_heads, kept_the_dropped_share],
}


def model_and_tokens(relu: bool):
    model = tiny_model(seed=1, std=0.2, n_layers=3, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    if relu:
        model = relufy(model, 1)
    tokens = torch.randint(
        0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0)
    )
    return model, tokens


SETTINGS = [C.Setting(mlp=0.5), C.Setting(heads=0.5), C.Setting(mlp=0.8, heads=0.25)]


@pytest.mark.parametrize("relu", [False, True])
def test_the_learners_masks_run_the_oracle_as_the_librarys_do(relu):
    model, tokens = model_and_tokens(relu)
    calls = {"neurons": 0, "heads": 0}

    def counted(kind, fn):
        def wrapper(*args):
            calls[kind] += 1
            return fn(*args)

        return wrapper

    oracle = ActivationOracle(counted("neurons", neuron_mask), counted("heads", head_mask))
    mine = C.oracle_quality(model, tokens, SETTINGS, progress=False, oracle=oracle)
    library = C.oracle_quality(model, tokens, SETTINGS, progress=False)
    assert [(q.ppl, q.agreement) for q in mine] == [(q.ppl, q.agreement) for q in library]
    assert calls == {"neurons": 2 * 3, "heads": 2 * 3}  # two settings of each kind, 3 layers


def test_a_different_rule_changes_what_the_oracle_measures():
    model, tokens = model_and_tokens(False)
    oracle = ActivationOracle(gate_only, interleaved_heads)
    mine = C.oracle_quality(model, tokens, SETTINGS, progress=False, oracle=oracle)
    library = C.oracle_quality(model, tokens, SETTINGS, progress=False)
    assert all(a.ppl != b.ppl for a, b in zip(mine, library, strict=True))


def test_activations_are_refused_where_h_is_changed_before_the_down_projection():
    model, tokens = model_and_tokens(False)
    model.layers[1].mlp.down_in_act = torch.nn.ReLU()
    with pytest.raises(ValueError, match=r"Layers \[1\] change h"):
        C.oracle_quality(model, tokens, SETTINGS, progress=False, oracle=ActivationOracle())
