"""Chapter 04's core builds: the ReLU swap, and one step of distillation that repairs it.

``relufy(model, stage)`` returns a *copy* of the model (its own weights, equal to the input's)
with ReLU activations: stage 1 replaces every MLP's activation, a = ReLU(W_gate x); stage 2 also
puts a ReLU after both norms of every layer (``attn_in_act``, ``mlp_in_act``), so q/k/v and
gate/up read sparse inputs too; the copy's ``config.hidden_act`` says "relu" (export and saved
predictors read it). The input model is left exactly as it was. Checked against the library's
``relufy.relufy`` on tiny random models (weights of std 0.2, so SiLU and ReLU differ clearly),
both stages: the copy's logits on random tokens, its ``hidden_act``, that the input model's
logits did not change and that the copy shares no weight tensor with it (training the student
would otherwise train the teacher too).

``distillation_step(student, teacher, tokens, optimizer, config)`` is one step of the repair,

    teacher logits (no gradients) -> student logits -> L = w T^2 KL(p_T || p_S) + (1 - w) CE
    -> backward -> clip the gradient norm to config.grad_clip -> optimizer.step(),

with the gradients zeroed so that each step uses its own (before the backward or after the
step), returning (loss, KL, CE). The check takes two steps with the learner's function and two
with the library's ``distillation_step`` (what ``finetune_`` calls each step) on the same tiny
random teacher and its ReLU student, and compares the trained parameters after them, the (loss,
KL, CE) of each step, and whether the teacher got gradients. The optimizer is plain SGD: its
update is linear in the gradient, so two right steps agree to rounding, while AdamW's first steps
move each weight by about +-lr whatever its gradient (hiding a missing clip, and turning the
rounding of a near-zero gradient into a difference of order lr). Cases mix pure KL (w = 1), pure
CE (w = 0), temperatures other than 1, a clip that binds and one that does not, MLP-only and full
training. The chapter then runs the learner's step inside ``finetune_`` (AdamW) through its
``step`` argument.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...relufy.finetune import (
    FinetuneConfig,
    distillation_step,
    select_trainable_,
    trainable_parameters,
)
from ...relufy.recipe import relufy
from ..grading import Exercise, draw_int, register
from .ch03 import TinyModel

__all__: list[str] = []

Cases = list[tuple[Any, ...]]


def _numbers(values: Any) -> str:
    return "[" + ", ".join(f"{float(v):.6g}" for v in values) + "]"


# --- relufy ------------------------------------------------------------------------------------


class Swap(NamedTuple):
    """What a swap produced: the input model untouched?, weights shared with it?, the copy's
    hidden_act, and the copy's logits."""

    input_unchanged: bool
    shares_weights: bool
    hidden_act: str
    logits: Tensor

    def __repr__(self) -> str:
        return (
            f"input unchanged {self.input_unchanged}, shares weights {self.shares_weights}, "
            f"hidden_act {self.hidden_act!r}, logits {_numbers(self.logits.flatten()[:3])}..."
        )


def _swap_cases(gen: torch.Generator) -> Cases:
    """(tiny model, stage, tokens) per case."""
    out: Cases = []
    for stage in (1, 2):
        for layers, seq in ((1, 1), (2, 7), (3, 12)):
            spec = TinyModel(draw_int(gen, 0, 1000), layers)
            out.append((spec, stage, spec.tokens(gen, 2, seq)))
    return out


def _run_swap(swap: Any, args: tuple[Any, ...]) -> Swap:
    spec, stage, tokens = args
    model = spec.build()
    with torch.no_grad():
        before = model(tokens)
        new = swap(model, stage)
        unchanged = torch.equal(model(tokens), before)
        logits = new(tokens)
    theirs = {p.data_ptr() for p in model.parameters()}
    shared = any(p.data_ptr() in theirs for p in new.parameters())
    return Swap(unchanged, shared, str(getattr(new.config, "hidden_act", None)), logits)


def _same_swap(got: Any, expected: Swap) -> bool:
    return (
        isinstance(got, Swap)
        and got[:3] == expected[:3]
        and got.logits.shape == expected.logits.shape
        and bool(torch.allclose(got.logits, expected.logits, rtol=1e-4, atol=1e-5))
    )


register(
    "relufy",
    Exercise(
        "04",
        "relufy(model, stage) -> a new model: a deep copy of `model` whose MLP activations "
        "(layer.mlp.act) are ReLU, and at stage 2 also the modules after both norms "
        "(layer.attn_in_act, layer.mlp_in_act), with config.hidden_act = 'relu'; `model` "
        "itself stays as it was",
        relufy,
        _swap_cases,
        _same_swap,
        "copy.deepcopy(model) first and change only the copy (setting modules on `model` "
        "changes the teacher; a copy that shares weight tensors trains the teacher with the "
        "student); every layer's mlp.act = nn.ReLU(); stage 2 only: layer.attn_in_act and "
        "layer.mlp_in_act = nn.ReLU() too; new.config = dataclasses.replace(model.config, "
        "hidden_act='relu')",
        run=_run_swap,
        core=True,
    ),
)


# --- distillation_step -------------------------------------------------------------------------


class Training(NamedTuple):
    """What two steps of distillation produced."""

    teacher_has_gradients: bool
    moved: float  # sum of |w_after - w_before| over the trained parameters (what the repr shows)
    losses: list[tuple[float, float, float]]  # (loss, KL, CE) per step
    weights: Tensor  # the trained parameters after the steps, flattened

    def __repr__(self) -> str:
        steps = ", ".join(_numbers(step) for step in self.losses)
        return (
            f"teacher grads {self.teacher_has_gradients}; weights moved {self.moved:.6g}; "
            f"(loss, KL, CE) {steps}"
        )


def _step_cases(gen: torch.Generator) -> Cases:
    """(tiny teacher, tokens of step 1, tokens of step 2, config) per case."""
    settings = (  # layers, batch, seq, trainable, kd_weight, temperature, grad_clip
        (2, 2, 8, "mlp", 0.9, 1.0, 1.0),
        (1, 1, 2, "mlp", 1.0, 2.0, 0.05),
        (2, 3, 9, "all", 0.0, 1.0, 0.05),
        (3, 2, 6, "mlp", 0.5, 0.5, 100.0),
    )
    out: Cases = []
    for layers, batch, seq, trainable, w, temperature, clip in settings:
        spec = TinyModel(draw_int(gen, 0, 1000), layers)
        config = FinetuneConfig(
            lr=0.5, trainable=trainable, kd_weight=w, temperature=temperature, grad_clip=clip,
            bf16=False,
        )  # fmt: skip
        out.append((spec, spec.tokens(gen, batch, seq), spec.tokens(gen, batch, seq), config))
    return out


def _run_steps(step: Any, args: tuple[Any, ...]) -> Training:
    """Two steps of ``step`` on a tiny teacher's ReLU student, with plain SGD (see the module
    docstring)."""
    spec, first, second, config = args
    teacher = spec.build()
    student = select_trainable_(relufy(teacher, 1), config)
    params = trainable_parameters(student)
    optimizer = torch.optim.SGD(params.values(), lr=config.lr)
    student.train()
    losses = []
    for tokens in (first, second):
        loss, kl, ce = step(student, teacher, tokens, optimizer, config)
        losses.append(tuple(torch.as_tensor(v).item() for v in (loss, kl, ce)))
    before = teacher.state_dict()
    weights = torch.cat([p.detach().flatten() for p in params.values()])
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in params.items())
    touched = any(p.grad is not None for p in teacher.parameters())
    return Training(touched, moved, losses, weights)


def _same_training(got: Any, expected: Training) -> bool:
    return (
        isinstance(got, Training)
        and got.teacher_has_gradients == expected.teacher_has_gradients
        and len(got.losses) == len(expected.losses)
        and all(
            math.isclose(g, e, rel_tol=1e-4, abs_tol=1e-5)
            for gs, es in zip(got.losses, expected.losses, strict=True)
            for g, e in zip(gs, es, strict=True)
        )
        and got.weights.shape == expected.weights.shape
        and bool(torch.allclose(got.weights, expected.weights, rtol=1e-4, atol=1e-5))
    )


register(
    "distillation_step",
    Exercise(
        "04",
        "distillation_step(student, teacher, tokens [b, t], optimizer, config) -> (loss, KL, "
        "CE): one step of distillation: the teacher's logits without gradients, the student's "
        "logits, L = w T^2 KL(softmax(teacher / T) || softmax(student / T)) + (1 - w) "
        "CE(student, next tokens) (w = config.kd_weight, T = config.temperature), backward, "
        "the gradient norm of the optimizer's parameters clipped to config.grad_clip, "
        "optimizer.step(); each step's gradients are its own",
        distillation_step,
        _step_cases,
        _same_training,
        "teacher under torch.no_grad(); KL(p_T || p_S) summed over the vocabulary, averaged "
        "over all b * t positions, times T^2; the CE predicts tokens[:, 1:] from the logits "
        "of positions 0 .. t-2; optimizer.zero_grad() before backward (or after the step), "
        "else gradients add up across steps; clip_grad_norm_([p for g in "
        "optimizer.param_groups for p in g['params']], config.grad_clip) between backward "
        "and optimizer.step()",
        run=_run_steps,
        core=True,
    ),
)
