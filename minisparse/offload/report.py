"""``minisparse offload``: profile the model, place its neurons, report load and modelled speed.

    minisparse offload --budget 0.3 [--policy ilp|greedy|layerwise] [--gpu rtx4090] [--json]

The budget is a share of the model's FFN bytes (0.3 = the fast device holds 30 % of them).
Frequencies come from the calibration split of the default corpus, placements are made on
them, and every load and speed is read on the held-out split. The slow device is this CPU,
measured and checked against this model's own CPU decode (``offload.calibrate``: the error
is reported, and the fixed cost per call is solved from the dense step); the fast device is
the named GPU's specification: speeds are **modelled** (``minisparse.offload.time_model``).
The notebook of chapter 08 calls ``offload_report`` too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

from . import placement as O
from . import time_model as T
from .calibrate import calibrate, check_cpu_model

__all__ = [
    "Profiles",
    "add_arguments",
    "check_arguments",
    "format_report",
    "offload_report",
    "profiles",
    "run",
]


@dataclass
class Profiles:
    """What the chapter and the command measure once: the model and its neuron frequencies."""

    description: str
    calibration: list[Tensor]  # per layer, on the calibration text (placements use these)
    held_out: list[Tensor]  # per layer, on other text (loads and speeds use these)
    thresholds: list[float]


def profiles(
    model: Any, tokenizer: Any, windows: int = 8, seq_len: int = 256
) -> tuple[Any, Profiles]:
    """The ReLU model of chapter 04 (or chapter 03's thresholded one) and its frequencies."""
    from ..io.data import corpus, encode, token_batches
    from ..predictors import prediction_target

    calib = token_batches(tokenizer, corpus("pydoc", "calib"), seq_len, windows)
    held = encode(tokenizer, corpus("pydoc", "eval"))[: windows * seq_len].view(-1, seq_len)
    target = prediction_target(model, calib, 0.5, site="mlp_act")
    cal = O.profile(target.model, calib, target.thresholds, progress=False)
    out = O.profile(target.model, held, target.thresholds, progress=False)
    return target.model, Profiles(target.description, cal, out, target.thresholds)


def offload_report(
    p: Profiles,
    shape: T.ModelShape,
    budget_share: float,
    policy: str,
    cpu: T.Processor,
    gpu: T.GPU,
    min_per_layer: int = 0,
    group_size: int = 32,
    solver: O.Solver | None = None,
) -> dict[str, Any]:
    """The placement of ``policy`` at ``budget_share`` of the FFN bytes, and every policy's
    held-out load and modelled tokens/s at that budget (``solver``: the ILP's program, as in
    ``place``)."""
    if not 0 < budget_share <= 1:
        raise ValueError(f"--budget is a share of the FFN bytes in (0, 1], got {budget_share}.")
    budget = O.budget_for(p.calibration, shape.neuron_bytes, budget_share)
    chosen = O.place(
        p.calibration, shape.neuron_bytes, budget, policy, group_size, min_per_layer,
        solver=solver,
    )  # fmt: skip
    speeds = T.policy_speeds(
        shape,
        p.calibration,
        cpu,
        gpu,
        budget,
        min_per_layer=min_per_layer,
        group_size=group_size,
        held_out=p.held_out,
        solver=solver,
    )
    return {
        "model": p.description,
        "budget_share": budget_share,
        "budget_bytes": budget,
        "policy": policy,
        "hot_per_layer": chosen.hot_counts(),
        "bytes_used": chosen.bytes_used,
        "solve_seconds": round(chosen.solve_seconds, 3),
        "fast_load_calibration": chosen.load(p.calibration),
        "fast_load_held_out": chosen.load(p.held_out),
        "cpu_measured": asdict(cpu),
        "gpu_spec": {**asdict(gpu.device), "spec": gpu.spec, "link_gbs": gpu.link_gbs},
        "modelled_tok_s": {name: row["tok_s"] for name, row in speeds.items()},
        "modelled_fast_load": {name: row["fast_load"] for name, row in speeds.items()},
    }


def format_report(r: dict[str, Any]) -> str:
    gpu, cpu = r["gpu_spec"], r["cpu_measured"]
    lines = [
        f"model: {r['model']}",
        f"budget: {r['budget_share']:.0%} of the FFN bytes = {r['budget_bytes'] / 1e6:.1f} MB; "
        f"policy {r['policy']}: {sum(r['hot_per_layer']):,} hot neurons, "
        f"{r['bytes_used'] / 1e6:.1f} MB, solved in {r['solve_seconds']:.2f} s",
        f"hot neurons per layer: {r['hot_per_layer']}",
        f"fast-device load: {r['fast_load_held_out']:.1%} held out "
        f"({r['fast_load_calibration']:.1%} on the calibration text)",
        f"slow device (measured): {cpu['name']}, {cpu['bandwidth_gbs']:.1f} GB/s, "
        f"{cpu['call_us']:.0f} us per call",
        f"fast device (spec, modelled): {gpu['name']}, {gpu['spec']}",
    ]
    for c in r.get("cpu_checks", []):
        lines.append(
            f"  checked on this CPU's decode: {c['label']}: measured {c['measured_tok_s']:.1f} "
            f"tok/s, model error {c['error']:+.0%} (kernel fit), {c['calibrated_error']:+.0%} "
            "(calibrated)"
        )
    lines.append("modelled tokens/s at this budget (held-out frequencies):")
    for name, tok_s in r["modelled_tok_s"].items():
        load = r["modelled_fast_load"][name]
        dense = load is None or load != load  # NaN (None once through JSON): a dense policy
        load_text = "" if dense else f"   fast-device load {load:.1%}"
        lines.append(f"  {name:30s} {tok_s:9.1f}{load_text}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=float, default=0.3, help="share of the FFN bytes, (0, 1]")
    parser.add_argument("--policy", default="ilp", choices=O.POLICIES)
    parser.add_argument("--gpu", default="rtx4090", help=f"one of {', '.join(T.GPUS)}")
    parser.add_argument("--min-per-layer", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--windows", type=int, default=8, help="calibration windows of 256 tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def finite_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: JSON has no NaN or Infinity, and
    a strict reader refuses them (a policy that does not apply has NaN speed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def check_arguments(args: argparse.Namespace) -> None:
    if not 0 < args.budget <= 1:
        raise ValueError(f"--budget is a share of the FFN bytes in (0, 1], got {args.budget}.")
    T.check_gpu(args.gpu)
    if args.min_per_layer < 0:
        raise ValueError(f"--min-per-layer must be >= 0, got {args.min_per_layer}.")
    if args.group_size < 1:
        raise ValueError(f"--group-size must be at least 1, got {args.group_size}.")
    if args.windows < 1:
        raise ValueError(f"--windows must be at least 1, got {args.windows}.")


def run(args: argparse.Namespace) -> int:
    from ..io.loading import load
    from ..measure.machine import machine

    check_arguments(args)
    base, tokenizer = load(args.model, device="cpu")
    if args.min_per_layer > base.config.ffn_dim:
        raise ValueError(
            f"--min-per-layer {args.min_per_layer} is more than a layer's "
            f"{base.config.ffn_dim} neurons."
        )
    shape = T.shape_of(base)
    group_bytes = args.group_size * shape.neuron_bytes
    if args.budget * shape.layers * shape.ffn * shape.neuron_bytes < group_bytes:
        raise ValueError(
            f"--budget {args.budget} of the FFN bytes is less than one group of "
            f"{args.group_size} neurons ({group_bytes / 1e3:.0f} KB): nothing could be placed; "
            f"give at least {group_bytes / (shape.layers * shape.ffn * shape.neuron_bytes):.1e}."
        )
    model, p = profiles(base, tokenizer, args.windows)
    fitted = T.measure_cpu()
    checks = check_cpu_model(model, tokenizer, p.thresholds, fitted)
    cpu = calibrate(fitted, checks[0])
    report = offload_report(
        p,
        T.shape_of(model),
        args.budget,
        args.policy,
        cpu,
        T.check_gpu(args.gpu),
        args.min_per_layer,
        args.group_size,
    )
    report["cpu_checks"] = [
        {**asdict(c), "error": c.error, "calibrated_error": c.against(cpu).error} for c in checks
    ]
    report["machine"] = machine().as_dict()
    print(json.dumps(finite_json(report), allow_nan=False) if args.json else format_report(report))
    return 0
