"""Fine-tuning on a CPU by distillation: a student model learns to match a teacher's logits.

After a change that hurts quality (ReLU instead of SiLU, chapter 04) the changed model, the
*student*, is trained to predict what the unchanged model, the *teacher*, predicts. Per token
the loss mixes the distillation term and the ordinary language-modelling loss:

    L = w KL(p_teacher || p_student) + (1 - w) CE(next token, p_student)

with p = softmax(logits / T) in the KL (scaled by T^2, Hinton et al. 2015). The teacher's full
distribution carries far more signal per token than the one-hot next token, which is what makes a
few hundred thousand tokens on a CPU worth something.

What trains (``trainable``): ``"mlp"`` (gate/up/down weights only), ``"all"``, or ``"lora"``:
every projection W of the blocks gets a low-rank update, W x + (alpha / r) B A x with
A [r, in], B [out, r], B = 0 at the start (Hu et al. 2021); only A and B train, and
``merge_lora_`` folds B A into W afterwards (``minisparse.relufy.lora``). Functions whose
name ends in ``_`` change the model they are given (``finetune_`` trains the student in place).

One step (``distillation_step``): the teacher's logits without gradients, the student's with,
the loss, backward, the gradient norm clipped to ``grad_clip``, an optimiser step.
Optimiser: AdamW, learning rate warmed up linearly for ``warmup`` steps, then cosine decay to
``min_lr_ratio`` of the peak. ``torch.autocast`` to bf16 (weights and optimiser state stay
fp32) roughly doubles throughput on CPUs with bf16 instructions (AVX512-BF16, AMX) but is several
times *slower* than fp32 on CPUs without them, where torch falls back to a scalar bf16 GEMM; by
default (``bf16=None``) it is used only where the hardware has it (``native_bf16``).

A checkpoint (trainable tensors, optimiser state, history) is written every
``checkpoint_every`` steps (``minisparse.relufy.checkpoint``); a run started again with the same
settings and directory resumes from it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.checks import check_count, check_fraction, check_positive
from ..core.model import Transformer
from ..measure.machine import cpu_info, cpu_name
from ..sparsity import recording
from .checkpoint import load_checkpoint, save_checkpoint
from .lora import (
    LORA_TARGETS,
    LoRALinear,
    add_lora,
    add_lora_,
    lora_weight_names,
    merge_lora,
    merge_lora_,
)

TRAINABLE = ("mlp", "all", "lora")


@dataclass
class FinetuneConfig:
    """Settings of a fine-tuning run (the checkpoint records them; resuming needs the same)."""

    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-4
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    trainable: str = "mlp"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    kd_weight: float = 0.9
    temperature: float = 1.0
    grad_clip: float = 1.0
    bf16: bool | None = None  # None: bf16 autocast where the hardware has bf16 (native_bf16)
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 0

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {self.trainable!r}.")
        for name in ("steps", "batch_size", "lora_rank", "checkpoint_every"):
            check_count(getattr(self, name), name)
        for name in ("warmup", "eval_every", "seed"):
            check_count(getattr(self, name), name, minimum=0)
        for name, example in (("lr", "3e-4"), ("lora_alpha", "32"), ("temperature", "1.0")):
            check_positive(getattr(self, name), name, example)
        check_positive(self.grad_clip, "grad_clip", "1.0")
        check_fraction(self.kd_weight, "kd_weight")
        check_fraction(self.min_lr_ratio, "min_lr_ratio")
        if not self.weight_decay >= 0 or not math.isfinite(self.weight_decay):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}.")
        if self.bf16 not in (None, True, False):
            raise ValueError(f"bf16 must be None (automatic), True or False, got {self.bf16!r}.")


def lr_at(step: int, config: FinetuneConfig) -> float:
    """Learning rate of ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio * lr."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(config.steps - config.warmup, 1)
    progress = min((step - config.warmup) / span, 1.0)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def select_trainable_(model: Transformer, config: FinetuneConfig) -> Transformer:
    """Freeze everything, then unfreeze (or add, for LoRA) the trainable set; in place."""
    for p in model.parameters():
        p.requires_grad_(False)
    if config.trainable == "lora":
        add_lora_(model, config.lora_rank, config.lora_alpha, seed=config.seed)
    for name, p in model.named_parameters():
        wanted = {
            "mlp": ".mlp." in name,
            "all": True,
            "lora": name.endswith((".A", ".B")),
        }[config.trainable]
        p.requires_grad_(wanted)
    return model


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter for every parameter that requires a gradient."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def batch_order(n: int, batch_size: int, step: int, seed: int) -> Tensor:
    """Row indices of ``step``'s batch: epochs of seeded permutations of range(n), read in order."""
    start = step * batch_size
    rows = []
    while len(rows) < batch_size:
        epoch, offset = divmod(start + len(rows), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        rows.extend(perm[offset : offset + batch_size - len(rows)].tolist())
    return torch.tensor(rows)


def distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, tokens: Tensor, config: FinetuneConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, KL, CE) per token, as in the module docstring."""
    vocab = student_logits.shape[-1]
    s = student_logits.float().reshape(-1, vocab)
    t = teacher_logits.float().reshape(-1, vocab)
    temp = config.temperature
    kl = (
        F.kl_div(
            F.log_softmax(s / temp, -1),
            F.log_softmax(t / temp, -1),
            log_target=True,
            reduction="batchmean",
        )
        * temp**2
    )
    ce = F.cross_entropy(
        student_logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)
    )
    return config.kd_weight * kl + (1 - config.kd_weight) * ce, kl, ce


def distillation_step(
    student: Transformer,
    teacher: nn.Module,
    tokens: Tensor,
    optimizer: torch.optim.Optimizer,
    config: FinetuneConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """One optimiser step of distillation on ``tokens`` [batch, seq]; (loss, KL, CE).

    The teacher's logits without gradients, the student's with, ``distillation_loss``, then
    zero the old gradients, backpropagate, clip the gradient norm of the optimiser's parameters
    to ``config.grad_clip`` and step. Both forward passes run under bf16 autocast when
    ``config.bf16`` says so. ``finetune_`` sets the learning rate before each call.
    """
    device = tokens.device
    with torch.inference_mode(), autocast(config, device):
        teacher_logits = teacher(tokens)
    with autocast(config, device):
        logits = student(tokens)
    loss, kl, ce = distillation_loss(logits, teacher_logits.clone(), tokens, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    return loss, kl, ce


#: (student, teacher, tokens, optimizer, config) -> (loss, KL, CE): one step of ``finetune_``
Step = Callable[
    [Transformer, nn.Module, Tensor, torch.optim.Optimizer, FinetuneConfig],
    tuple[Tensor | float, Tensor | float, Tensor | float],
]


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 matrices natively (faster than fp32).

    CUDA: what torch reports. CPU: the AVX512-BF16 or AMX-BF16 instruction flags (Linux); other
    x86 and ARM CPUs run torch's bf16 GEMM in a slow reference loop (about 8x slower than fp32
    on an AVX2 machine), so fp32 is the fast choice there.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_info()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def uses_bf16(config: FinetuneConfig, device: torch.device) -> bool:
    """Whether a run with ``config`` on ``device`` autocasts to bf16 (None: where native)."""
    return native_bf16(device) if config.bf16 is None else config.bf16


def autocast(config: FinetuneConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(config, device))


@dataclass
class FinetuneResult:
    """The trained model (LoRA merged), the names of the weights that changed, the history."""

    model: Transformer
    trained: list[str]
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def finetune_(
    student: Transformer,
    teacher: nn.Module,
    train_batches: Tensor,
    config: FinetuneConfig,
    checkpoint_dir: Path | None = None,
    resume: bool = True,
    evaluate: Callable[[Transformer], dict[str, float]] | None = None,
    progress: bool = True,
    until: int | None = None,
    step: Step = distillation_step,
) -> FinetuneResult:
    """Train ``student`` in place to match ``teacher`` on ``train_batches`` [n, seq].

    Returns a ``FinetuneResult`` whose ``model`` is ``student`` itself (LoRA merged into it).

    Each step sets the learning rate of the schedule, then calls ``step(student, teacher,
    tokens, optimizer, config)`` (``distillation_step``; chapter 04 passes the learner's), with
    ``config.bf16`` resolved to True or False for this device.

    ``until`` stops after that many steps (a time budget); the schedule still spans
    ``config.steps``, and a later call with the same checkpoint directory resumes from there.

    ``evaluate(student)`` (e.g. held-out perplexity and sparsity) runs every ``eval_every``
    steps and at the end; its numbers join the history. The progress bar shows loss and the
    share of exact zeros in the MLP activations of the current batch.
    """
    device = next(student.parameters()).device
    teacher.eval()
    check_train_batches(train_batches, student.config.vocab_size)
    if until is not None:
        check_count(until, "until")
    params = trainable_parameters(select_trainable_(student, config))
    optimizer = torch.optim.AdamW(
        params.values(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
    )
    ckpt = checkpoint_dir / "checkpoint.safetensors" if checkpoint_dir else None
    start, history = 0, []
    if ckpt is not None and resume and ckpt.exists():
        start, history = load_checkpoint(ckpt, params, optimizer, config)
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, config.steps),
        desc="fine-tune",
        disable=not progress,
        initial=start,
        total=config.steps,
    )
    resolved = dataclasses.replace(config, bf16=uses_bf16(config, device))
    for index in bar:
        if until is not None and index >= until:
            break
        row = batch_order(train_batches.shape[0], config.batch_size, index, config.seed)
        tokens = train_batches[row].to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(index, config)
        student.train()
        with recording(student, ("mlp_act",)) as stats:
            loss, kl, ce = step(student, teacher, tokens, optimizer, resolved)
        sparsity = stats.mean(stats.zero_fraction("mlp_act"))
        entry = {
            "step": index + 1,
            "loss": torch.as_tensor(loss).item(),  # a tensor or a number, from any step
            "kl": torch.as_tensor(kl).item(),
            "ce": torch.as_tensor(ce).item(),
            "lr": lr_at(index, config),
            "sparsity": sparsity,
        }
        last = entry["step"] in (config.steps, until)
        if evaluate is not None and (
            last or (config.eval_every and entry["step"] % config.eval_every == 0)
        ):
            student.eval()
            entry.update(evaluate(student))
        history.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", sparsity=f"{sparsity:.1%}")
        if ckpt is not None and (last or entry["step"] % config.checkpoint_every == 0):
            save_checkpoint(ckpt, entry["step"], params, optimizer, config, history)
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    trained = merge_lora(student) if config.trainable == "lora" else list(params)
    return FinetuneResult(student, trained, history, time.perf_counter() - t0)


def check_train_batches(batches: Tensor, vocab_size: int) -> None:
    """Training windows: token ids [n, seq] with n >= 1 and seq >= 2, inside the vocabulary."""
    if not isinstance(batches, Tensor) or batches.dim() != 2 or batches.shape[1] < 2:
        shape = tuple(batches.shape) if isinstance(batches, Tensor) else type(batches).__name__
        raise ValueError(
            f"train_batches must be token ids [n, seq] with seq >= 2, got {shape}; build them "
            "with minisparse.io.eval.windows(ids, seq_len)."
        )
    if batches.shape[0] < 1:
        raise ValueError("train_batches holds no window; give more text or a shorter seq_len.")
    ids_ok = not batches.dtype.is_floating_point and batches.dtype != torch.bool
    if not ids_ok or int(batches.min()) < 0 or int(batches.max()) >= vocab_size:
        raise ValueError(
            f"train_batches must hold token ids in 0 .. {vocab_size - 1} (torch.long); encode "
            "the text with this model's tokenizer."
        )


# The names before the in-place convention (a trailing underscore), kept for existing code.
select_trainable = select_trainable_
finetune = finetune_


def iter_history(history: list[dict[str, float]], key: str) -> Iterator[tuple[float, float]]:
    """(step, value) pairs of the history entries that have ``key``."""
    return ((h["step"], h[key]) for h in history if key in h)


__all__ = [
    "LORA_TARGETS",
    "FinetuneConfig",
    "FinetuneResult",
    "LoRALinear",
    "add_lora",
    "add_lora_",
    "cpu_info",
    "cpu_name",
    "distillation_loss",
    "distillation_step",
    "finetune",
    "finetune_",
    "iter_history",
    "lora_weight_names",
    "lr_at",
    "merge_lora",
    "merge_lora_",
    "native_bf16",
    "select_trainable_",
    "trainable_parameters",
    "uses_bf16",
]
