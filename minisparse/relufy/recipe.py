"""ReLUfication: turning a SiLU model into a sparse ReLU model (Mirzadeh et al. 2023).

A SiLU MLP activation a = x sigmoid(x) is almost never exactly zero, so no weight can be skipped
for free. ReLU(x) = max(x, 0) is exactly zero for every negative pre-activation, about half of
them in a trained model, and more after training adapts to it. ReLUfication swaps the
activations and fine-tunes briefly to recover the quality:

* **stage 1** replaces the MLP activation by ReLU. a = ReLU(W_gate x) is sparse, so the rows of
  W_up and the columns of W_down of the zero neurons need not be read:
      y = W_down (ReLU(W_gate x) * W_up x) = sum_{j : W_gate[j] x > 0} ...
* **stage 2** also puts a ReLU after the RMSNorms that feed the attention and the MLP, so the
  inputs of q/k/v and of gate/up become sparse too and their columns can be skipped.

``relufy`` returns a new model (the input is untouched; weights are copied unchanged, only the
activation modules differ): like every function without a trailing underscore, it never
changes its argument. ``minisparse.relufy.finetune`` recovers quality by distillation from the
dense model; ``relufy_and_finetune`` runs it and keeps the result in the cache, and
``load_relufied`` reads it back (what ``minisparse relufy --stage 1 --steps N`` produces).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ..core.model import Transformer, check_count
from ..files.cache import cache_dir, save_tensors_atomic
from ..io.data import corpus, encode
from ..io.eval import windows
from ..sparsity import measure
from .finetune import FinetuneConfig, Step, cpu_name, distillation_step, finetune_, uses_bf16

STAGES = (1, 2)
EVAL_WINDOW = 256  # tokens per held-out window that ``sparsity.measure`` scores


def check_stage(stage: object) -> int:
    """1 or 2, else a ValueError saying what the stages are."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"stage must be 1 (MLP activation) or 2 (also after the norms), got {stage!r}."
        )
    return int(stage)  # type: ignore[call-overload]


def check_relufy_arguments(
    stage: object, seq_len: object, eval_tokens: object, min_eval_tokens: int = 2
) -> None:
    """What ``relufy_and_finetune`` needs besides the model, checked before any work.

    ``sparsity.measure`` scores windows of ``EVAL_WINDOW`` tokens, so a real run needs
    ``min_eval_tokens=EVAL_WINDOW`` (the command line asks for it).
    """
    check_stage(stage)
    check_count(seq_len, "seq_len", minimum=2, fix="training windows need 2 tokens or more")
    check_count(
        eval_tokens,
        "eval_tokens",
        minimum=min_eval_tokens,
        fix=f"perplexity is measured on windows of {EVAL_WINDOW} tokens",
    )


def relufy(model: Transformer, stage: int = 1) -> Transformer:
    """A copy of ``model`` with ReLU activations: stage 1 in the MLPs, stage 2 also after norms.

    ``model`` itself is left unchanged.
    """
    check_stage(stage)
    new = copy.deepcopy(model)
    new.config = dataclasses.replace(model.config, hidden_act="relu")
    for layer in new.layers:
        layer.mlp.act = nn.ReLU()
        if stage == 2:
            layer.attn_in_act = nn.ReLU()
            layer.mlp_in_act = nn.ReLU()
    return new


def relufied_stage(model: Transformer) -> int:
    """0 for a model with its own activations, 1 or 2 for a ReLUfied one."""
    layer = model.layers[0]
    if isinstance(layer.attn_in_act, nn.ReLU) and isinstance(layer.mlp_in_act, nn.ReLU):
        return 2
    return 1 if isinstance(layer.mlp.act, nn.ReLU) else 0


def result_dir(stage: int, trainable: str, root: Path | None = None) -> Path:
    """Where a fine-tuned ReLU model of this stage and trainable set lives in the cache."""
    return (root or cache_dir()) / "relufied" / f"stage{stage}-{trainable}"


def save_relufied(model: Transformer, path: Path, stage: int, info: dict[str, Any]) -> None:
    """Keep the weights that differ from the base model's (``info['trained']`` names them)."""
    names = info["trained"]
    state = model.state_dict()
    tensors = {name: state[name].detach().contiguous() for name in names}
    save_tensors_atomic(tensors, path, {"stage": str(stage), "info": json.dumps(info)})


def read_relufied(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The run description and the weights of a saved fine-tuned ReLU model, or one ValueError
    that says the file is damaged and how to make it again."""
    from safetensors import SafetensorError, safe_open

    fix = "delete it and make it again with `minisparse relufy` (or `minisparse prepare`)"
    try:
        with safe_open(str(path), "pt") as f:
            info = json.loads((f.metadata() or {})["info"])
        tensors = load_file(str(path))
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path} is not a readable fine-tuned model ({err!r}); {fix}.") from err
    if not isinstance(info, dict) or not tensors:
        raise ValueError(f"{path} holds no fine-tuned model; {fix}.")
    return info, tensors


def load_relufied(
    base: Transformer, stage: int = 1, trainable: str = "mlp", root: Path | None = None
) -> tuple[Transformer, dict[str, Any]]:
    """The fine-tuned ReLU model saved by ``relufy_and_finetune`` (base weights from ``base``)."""
    path = result_dir(stage, trainable, root) / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(
            f"No fine-tuned stage-{stage} model ({trainable}) in {path.parent}; make one with "
            f"`minisparse relufy --stage {stage} --trainable {trainable} --steps 300`."
        )
    info, tensors = read_relufied(path)
    model = relufy(base, stage)
    missing = model.load_state_dict(tensors, strict=False).unexpected_keys
    if missing:
        raise ValueError(f"{path} holds weights this model does not have: {missing[:3]}...")
    return model, info


def relufy_and_finetune(
    base: Transformer,
    tokenizer: Any,
    stage: int,
    config: FinetuneConfig,
    seq_len: int = 128,
    eval_tokens: int = 8 * 256,
    root: Path | None = None,
    resume: bool = True,
    progress: bool = True,
    measured: dict[str, dict[str, float]] | None = None,
    swap: Callable[[Transformer, int], Transformer] = relufy,
    step: Step = distillation_step,
) -> tuple[Transformer, dict[str, Any]]:
    """ReLUfy ``base``, fine-tune it by distillation on the train text, save it; (model, report).

    The report holds the dense model's and the swapped model's held-out perplexity and
    sparsity, the fine-tuning history (every ``config.eval_every`` steps), the result and the
    wall time. The fine-tuned weights go to ``result_dir(stage, config.trainable, root)``
    (``load_relufied`` reads them); its checkpoint makes an interrupted run resumable.
    ``measured`` may hold the ``"dense"`` and ``"swapped"`` results of ``sparsity.measure`` on
    the same ``eval_tokens`` when the caller already has them; they are not measured again.
    ``base`` is left unchanged. ``swap(base, stage)`` makes the student (``relufy``) and
    ``step`` trains it one step at a time (``finetune_``'s; chapter 04 passes the learner's).
    """
    check_relufy_arguments(stage, seq_len, eval_tokens)
    if not isinstance(config, FinetuneConfig):
        raise ValueError(f"config must be a FinetuneConfig, got {type(config).__name__}.")
    if seq_len > base.config.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's context of {base.config.max_seq_len} tokens; "
            "use a shorter seq_len."
        )
    train = windows(encode(tokenizer, corpus(split="train")), seq_len)
    eval_ids = encode(tokenizer, corpus(split="eval"))[:eval_tokens]
    student = swap(base, stage)
    report: dict[str, Any] = {
        "stage": stage,
        "config": dataclasses.asdict(config),
        "train_tokens_per_step": config.batch_size * seq_len,
        "train_windows": train.shape[0],
        "eval_tokens": eval_ids.numel(),
    }
    for name, model in (("dense", base), ("swapped", student)):
        report[name] = (measured or {}).get(name) or measure(model, eval_ids)
    out = result_dir(stage, config.trainable, root)
    result = finetune_(
        student,
        base,
        train,
        config,
        checkpoint_dir=out,
        resume=resume,
        evaluate=lambda m: measure(m, eval_ids),
        progress=progress,
        step=step,
    )
    report["history"] = result.history
    report["finetuned"] = {k: v for k, v in result.history[-1].items() if k != "step"}
    report["seconds"] = result.seconds
    report["threads"] = torch.get_num_threads()
    report["bf16"] = uses_bf16(config, base.device)
    report["cpu"] = cpu_name()
    report["trained"] = result.trained
    save_relufied(result.model, out / "model.safetensors", stage, report)
    return result.model, report


@torch.no_grad()
def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models hold identical parameters and buffers (same names, same values)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


__all__ = [
    "STAGES",
    "load_relufied",
    "relufied_stage",
    "relufy",
    "relufy_and_finetune",
    "result_dir",
    "save_relufied",
    "weights_equal",
]
