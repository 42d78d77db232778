"""Chapter 04's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's swap and distillation step are what ``relufy_and_finetune`` runs."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_model
from minisparse.core.model import Transformer
from minisparse.course.plug import solution
from minisparse.relufy import finetune as FT
from minisparse.relufy import recipe as R
from minisparse.relufy import relufy as library_relufy

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
relufy = solution("relufy", SOLUTIONS)
step = solution("distillation_step", SOLUTIONS)


def in_place(model, stage):
    """Swaps the activations of the model it was given and returns it: the teacher is gone."""
    model.config = dataclasses.replace(model.config, hidden_act="relu")
    for layer in model.layers:
        layer.mlp.act = nn.ReLU()
        if stage == 2:
            layer.attn_in_act, layer.mlp_in_act = nn.ReLU(), nn.ReLU()
    return model


def shared_weights(model, stage):
    """A new model built around the input's weight tensors (load_state_dict(assign=True))."""
    new = Transformer(dataclasses.replace(model.config, hidden_act="relu"))
    new.load_state_dict(model.state_dict(), assign=True)
    new.eval()
    for layer in new.layers:
        if stage == 2:
            layer.attn_in_act, layer.mlp_in_act = nn.ReLU(), nn.ReLU()
    return new


def one_norm_only(model, stage):
    """Stage 2 puts the ReLU after the attention norm only."""
    new = relufy(model, 1)
    if stage == 2:
        for layer in new.layers:
            layer.attn_in_act = nn.ReLU()
    return new


def config_unchanged(model, stage):
    """The right modules, but the copy's config still says SiLU."""
    new = relufy(model, stage)
    new.config = copy.deepcopy(model.config)
    return new


def _loss(logits, teacher_logits, tokens, config, reverse=False, shifted=True):
    vocab, T = logits.shape[-1], config.temperature
    log_s = F.log_softmax(logits.reshape(-1, vocab) / T, -1)
    log_t = F.log_softmax(teacher_logits.reshape(-1, vocab) / T, -1)
    if reverse:
        log_s, log_t = log_t, log_s
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * T**2
    if shifted:
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    else:
        ce = F.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
    return config.kd_weight * kl + (1 - config.kd_weight) * ce, kl, ce


def _step(student, teacher, tokens, optimizer, config, *, grad_teacher=False, zero=True,
          clip=True, **loss_options):  # fmt: skip
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.enable_grad() if grad_teacher else torch.no_grad():
        teacher_logits = teacher(tokens)
    loss, kl, ce = _loss(student(tokens), teacher_logits, tokens, config, **loss_options)
    if zero:
        optimizer.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    return loss.detach(), kl.detach(), ce.detach()


def no_zero_grad(*args):
    """Never zeroes the gradients: the second step adds its gradients to the first's."""
    return _step(*args, zero=False)


def no_clipping(*args):
    """Skips clip_grad_norm_."""
    return _step(*args, clip=False)


def kl_reversed(*args):
    """KL(student || teacher) instead of KL(teacher || student)."""
    return _step(*args, reverse=True)


def teacher_with_gradients(*args):
    """The teacher's forward pass records a graph: backward fills the teacher's .grad."""
    return _step(*args, grad_teacher=True)


def unshifted_targets(*args):
    """The CE of position i against token i instead of token i + 1."""
    return _step(*args, shifted=False)


WRONG = {
    "relufy": [in_place, shared_weights, one_norm_only, config_unchanged],
    "distillation_step": [
        no_zero_grad,
        no_clipping,
        kl_reversed,
        teacher_with_gradients,
        unshifted_targets,
    ],
}


def tiny():
    return tiny_model(seed=0, std=0.2, n_layers=2, dim=32, head_dim=8, ffn_dim=64)


def windows(seed: int, n: int = 40, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 97, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("stage", [1, 2])
def test_the_learners_swap_equals_the_librarys(stage):
    model = tiny()
    tokens = windows(1, 2, 9)
    mine, library = relufy(model, stage), library_relufy(model, stage)
    assert R.weights_equal(mine, library) and R.relufied_stage(mine) == stage
    assert mine.config.hidden_act == "relu" and model.config.hidden_act == "silu"
    assert torch.allclose(mine(tokens), library(tokens))


def test_relufy_and_finetune_runs_the_learners_swap_and_step(tmp_path, monkeypatch):
    """The same run with the learner's swap and step as with the library's: same model."""
    calls = []

    def counted_step(*args):
        calls.append(1)
        return step(*args)

    monkeypatch.setattr(R, "corpus", lambda split: split)
    monkeypatch.setattr(R, "encode", lambda tokenizer, text: windows(7).view(-1))
    monkeypatch.setattr(R, "measure", lambda model, ids: {"ppl": 1.0})
    config = FT.FinetuneConfig(steps=3, batch_size=2, lr=1e-3, warmup=1, bf16=False)
    runs = {}
    for who, swap, one_step in (("mine", relufy, counted_step), ("library", None, None)):
        extra = {"swap": swap, "step": one_step} if swap else {}
        runs[who], report = R.relufy_and_finetune(
            tiny(), None, 1, config, seq_len=16, eval_tokens=64, root=tmp_path / who,
            progress=False, **extra,
        )  # fmt: skip
        assert len(report["history"]) == 3
    assert len(calls) == 3
    mine, library = runs["mine"].state_dict(), runs["library"].state_dict()
    assert all(torch.allclose(mine[k], library[k], atol=1e-6) for k in library)
