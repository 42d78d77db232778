"""Recovering a 2:4-pruned model cheaply: QLoRA adapters on its frozen NF4 base, distilled.

Pruning half of every projection's weights in a 2:4 pattern (Wanda's scores, chapter 12)
costs SmolLM2-135M a lot of quality. Recovery trains only LoRA adapters (``qlora_``) on top of
the pruned weights stored in NF4, by distillation from the dense model with chapter 04's loop
(``minisparse.relufy.finetune.finetune_`` with ``trainable="lora"``):

    student = LoRA(NF4(prune_2:4(W)))        teacher = the dense model

The adapters' B A is dense, so the merged model (``merge_qlora``) is no longer 2:4 sparse:
recovery with adapters keeps the pattern only while the adapters stay separate (a sparse
kernel for the base plus the small dense products). ``recover`` measures the held-out
perplexity (``minisparse.io.eval``, with bootstrap intervals) of the dense model, the pruned
model, the pruned model on its NF4 base before training, the QLoRA model after training and the
merged model, and keeps the adapters in the cache; ``load_recovered`` rebuilds the QLoRA model
from them. ``minisparse recover`` runs it; the checkpoint makes an interrupted run resumable.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from ..core.checks import check_count
from ..core.model import Transformer
from ..files.cache import atomic_write_text, cache_dir, save_tensors_atomic
from ..io.data import corpus, encode
from ..io.eval import bootstrap_perplexity, window_nlls, windows
from ..pruning.prune import prune
from ..quant.nf4 import NF4Linear, check_block
from ..relufy.finetune import FinetuneConfig, cpu_name, finetune_, uses_bf16
from ..relufy.lora import LORA_TARGETS, add_lora_
from .qlora import nf4_base_, projections, trainable_state_bytes
from .recovery_file import (
    FIX,
    check_adapters,
    check_masks,
    masked_weights,
    read_adapters,
)

__all__ = [
    "EVAL_SEQ",
    "adapters_path",
    "add_arguments",
    "add_command",
    "apply_masks",
    "base_fingerprint",
    "load_recovered",
    "perplexity_entry",
    "prune_24",
    "pruning_masks",
    "recover",
    "run",
    "save_recovered",
]

EVAL_SEQ = 256  # tokens per held-out window


def adapters_path(root: Path | None = None) -> Path:
    """Where ``recover`` keeps the adapters (and its checkpoint's folder)."""
    return (root or cache_dir()) / "recovered" / "adapters.safetensors"


def base_fingerprint(model: Transformer) -> str:
    """A short hash of every NF4 code and scale: the base the adapters were trained on."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        if isinstance(module, NF4Linear):
            for buffer in module.buffers():
                data = buffer.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                digest.update(name.encode() + data.numpy().tobytes())
    return digest.hexdigest()[:16]


def prune_24(model: Transformer, calibration: Tensor) -> Transformer:
    """A copy of ``model`` with every block projection pruned 2:4 by Wanda's scores on
    ``calibration`` [n, seq] (``minisparse.pruning.prune``, block by block); ``model`` is left
    unchanged."""
    return prune(model, "wanda", sparsity=0.5, pattern="2:4", calibration=calibration)


def perplexity_entry(
    model: Transformer, eval_ids: Tensor, progress: bool = False
) -> dict[str, Any]:
    """Held-out perplexity with its 95 % bootstrap interval over windows of ``EVAL_SEQ``."""
    nll = window_nlls(model, eval_ids, EVAL_SEQ, progress=progress)
    ppl = bootstrap_perplexity(nll)
    return {"ppl": ppl.mid, "low": ppl.low, "high": ppl.high, "windows": nll.numel()}


def pruning_masks(pruned: Transformer) -> dict[str, Tensor]:
    """The kept weights of every block projection, one bit each: "mask/<weight name>" -> uint8."""
    return {
        key: torch.from_numpy(np.packbits((p != 0).cpu().numpy().reshape(-1)))
        for key, p in masked_weights(pruned).items()
    }


@torch.no_grad()
def apply_masks(base: Transformer, masks: dict[str, Tensor]) -> Transformer:
    """A copy of ``base`` with the weights ``pruning_masks`` dropped set to zero; a ValueError
    (``check_masks``) when a mask does not fit ``base``."""
    check_masks(base, masks)
    pruned = copy.deepcopy(base)
    for key, bits in masks.items():
        p = pruned.get_parameter(key.removeprefix("mask/"))
        keep = np.unpackbits(bits.numpy())[: p.numel()].reshape(tuple(p.shape))
        p.mul_(torch.from_numpy(keep).to(device=p.device, dtype=p.dtype))
    return pruned


def recover(
    base: Transformer,
    tokenizer: Any,
    config: FinetuneConfig,
    block_size: int = 64,
    seq_len: int = 128,
    eval_tokens: int = 8 * EVAL_SEQ,
    calib_windows: int = 16,
    root: Path | None = None,
    resume: bool = True,
    progress: bool = True,
) -> tuple[Transformer, dict[str, Any]]:
    """Prune ``base`` 2:4, put it on NF4, train LoRA adapters by distillation; (merged, report).

    ``config.trainable`` must be ``"lora"`` (its rank and alpha are the adapters'). The
    report holds the perplexities of the five models of the module docstring, the trained
    state against full fine-tuning, the loss history, the steps, batch and seconds. ``base``
    is left unchanged; the adapters go to ``adapters_path(root)``.
    """
    if not isinstance(config, FinetuneConfig) or config.trainable != "lora":
        raise ValueError(
            "config must be a FinetuneConfig with trainable='lora' (QLoRA trains adapters)."
        )
    check_count(seq_len, "seq_len", minimum=2, fix="training windows need 2 tokens or more")
    check_count(eval_tokens, "eval_tokens", minimum=EVAL_SEQ, fix=f"windows are {EVAL_SEQ} tokens")
    check_count(calib_windows, "calib_windows", fix="Wanda needs a few windows, e.g. 16")
    for owner, name in projections(base, LORA_TARGETS):  # NF4 blocks must divide every row
        check_block(getattr(owner, name).in_features, block_size)
    train = windows(encode(tokenizer, corpus(split="train")), seq_len)
    calibration = windows(encode(tokenizer, corpus(split="calib")), seq_len)[:calib_windows]
    eval_ids = encode(tokenizer, corpus(split="eval"))[:eval_tokens]
    ppl = {"dense": perplexity_entry(base, eval_ids, progress)}
    pruned = prune_24(base, calibration)
    masks = pruning_masks(pruned)
    ppl["pruned 2:4"] = perplexity_entry(pruned, eval_ids, progress)
    student = nf4_base_(pruned, block_size)
    ppl["2:4 + NF4, before training"] = perplexity_entry(student, eval_ids, progress)
    nf4_model = copy.deepcopy(student)
    path = adapters_path(root)
    result = finetune_(
        student, base, train, config, checkpoint_dir=path.parent, resume=resume, progress=progress
    )
    adapters = {
        name.removeprefix("param/"): t
        for name, t in load_file(str(path.parent / "checkpoint.safetensors")).items()
        if name.startswith("param/")
    }
    qlora = attach_adapters_(nf4_model, adapters, config)
    ppl["2:4 + QLoRA, after training"] = perplexity_entry(qlora, eval_ids, progress)
    ppl["merged"] = perplexity_entry(result.model, eval_ids, progress)
    with torch.inference_mode():
        sample = eval_ids[:EVAL_SEQ][None]
        gap = (qlora(sample) - result.model(sample)).abs().max().item()
    settings = {"block_size": block_size, "seq_len": seq_len, "calib_windows": calib_windows}
    report: dict[str, Any] = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "bf16": uses_bf16(config, base.device),
        "steps": config.steps,
        "batch_size": config.batch_size,
        "train_tokens_per_step": config.batch_size * seq_len,
        "seconds": result.seconds,
        "config": dataclasses.asdict(config),
        **settings,
        "eval_tokens": eval_ids.numel(),
        "perplexity": ppl,
        "merged_vs_qlora_max_logit_gap": gap,
        "trainable_state": trainable_state_bytes(qlora),
        "history": [{k: h[k] for k in ("step", "loss", "kl", "ce", "lr")} for h in result.history],
    }
    save_recovered(path, adapters, masks, config, settings, nf4_model)
    return result.model, report


def save_recovered(
    path: Path,
    adapters: dict[str, Tensor],
    masks: dict[str, Tensor],
    config: FinetuneConfig,
    settings: dict[str, Any],
    model: Transformer,
) -> None:
    """Write the file ``load_recovered`` reads: adapters, masks, and as metadata ``config``,
    ``settings`` and the fingerprint of ``model`` (the QLoRA model the adapters sit on)."""
    meta = {
        "config": json.dumps(dataclasses.asdict(config)),
        "settings": json.dumps(settings),
        "fingerprint": base_fingerprint(model),
    }
    tensors = {**{k: v.contiguous() for k, v in adapters.items()}, **masks}
    save_tensors_atomic(tensors, path, meta)


def attach_adapters_(
    model: Transformer, adapters: dict[str, Tensor], config: FinetuneConfig
) -> Transformer:
    """LoRA adapters of ``config``'s rank and alpha on ``model``'s NF4 base, set to
    ``adapters`` (name -> tensor, as ``finetune_`` names them); in place. As after ``qlora_``,
    only the adapters' A and B require a gradient."""
    add_lora_(model, config.lora_rank, config.lora_alpha, seed=config.seed)
    check_adapters(model, adapters, config.lora_rank)
    model.load_state_dict(adapters, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".A", ".B")))
    return model.eval()


def load_recovered(
    base: Transformer, root: Path | None = None
) -> tuple[Transformer, dict[str, Any]]:
    """The QLoRA model ``recover`` trained: ``base`` pruned and on NF4 again, adapters loaded.

    Returns (model, settings). ``merge_qlora(model)`` gives the plain float model. Raises
    FileNotFoundError when there are no adapters, one ValueError when they are damaged or were
    trained on another base: a mask or adapter tensor missing, extra or of the wrong shape
    (``check_masks``, ``check_adapters``: another architecture, another rank), or another
    pruned base (the fingerprint).
    """
    path = adapters_path(root)
    if not path.exists():
        raise FileNotFoundError(
            f"No recovered adapters in {path.parent}; {FIX} (about 15 min on 2 cores)."
        )
    meta, tensors = read_adapters(path)
    masks = {k: v for k, v in tensors.items() if k.startswith("mask/")}
    adapters = {k: v for k, v in tensors.items() if not k.startswith("mask/")}
    config = FinetuneConfig(**json.loads(meta["config"]))
    settings = json.loads(meta["settings"])
    if not masks:
        raise ValueError(f"{path} holds no pruning masks (an older file); {FIX} --fresh.")
    base_nf4 = nf4_base_(apply_masks(base, masks), settings["block_size"])
    model = attach_adapters_(base_nf4, adapters, config)  # fingerprinted as saved: with adapters
    if base_fingerprint(model) != meta["fingerprint"]:
        raise ValueError(
            f"The adapters in {path} were trained on another pruned base than this model gives; "
            f"{FIX} --fresh for this model."
        )
    return model, {
        **settings,
        "config": dataclasses.asdict(config),
    }


def add_command(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``recover`` subcommand of ``minisparse`` (``sub``: the command line's subparsers)."""
    parser = sub.add_parser(
        "recover",
        help="recover a 2:4-pruned model with QLoRA adapters on an NF4 base (chapter 12)",
        parents=[common],
    )
    parser.add_argument("--model", default="smollm2-135m", help="as for the other commands")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--block-size", type=int, default=64, help="NF4 block of weights")
    parser.add_argument("--eval-tokens", type=int, default=8 * EVAL_SEQ)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--fresh", action="store_true", help="ignore a checkpoint; start over")
    parser.add_argument("--save-dir", default=None, help="where adapters go (default: the cache)")
    parser.add_argument("--record", default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    """The ``minisparse recover`` command: recover, print the perplexities, record the JSON."""
    from ..io.loading import load

    check_count(args.threads, "--threads", minimum=0, fix="0 keeps torch's default")
    check_count(args.block_size, "--block-size", fix="QLoRA uses 64")
    check_count(args.seq_len, "--seq-len", minimum=2, fix="training windows need 2 tokens or more")
    check_count(args.eval_tokens, "--eval-tokens", minimum=EVAL_SEQ, fix=f"windows are {EVAL_SEQ}")
    config = FinetuneConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        trainable="lora",
        lora_rank=args.rank,
        lora_alpha=args.alpha,
        checkpoint_every=args.checkpoint_every,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, device=args.device)
    root = Path(args.save_dir) if args.save_dir else None
    _, report = recover(
        model,
        tokenizer,
        config,
        block_size=args.block_size,
        seq_len=args.seq_len,
        eval_tokens=args.eval_tokens,
        root=root,
        resume=not args.fresh,
    )
    report["command"] = "minisparse " + shlex.join(args.argv)
    for name, r in report["perplexity"].items():
        print(f"{name:28s} perplexity {r['ppl']:8.2f}  ({r['low']:.2f} to {r['high']:.2f})")
    state = report["trainable_state"]
    print(
        f"trained state {state['trainable_bytes'] / 2**20:.1f} MiB vs full fine-tuning "
        f"{state['full_bytes'] / 2**20:.0f} MiB; adapters in {adapters_path(root)}"
    )
    if args.record:
        atomic_write_text(Path(args.record), json.dumps(report, indent=1) + "\n")
        print(f"report: {args.record}")
    return 0
