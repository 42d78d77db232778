"""Checking the offload time model against this machine's own decode, before extrapolating.

The time model (``time_model``) says a CPU decode step of a model with L layers takes

    t = bytes / BW + 2 L c

with BW and c fitted from chapter 07's sparse FFN kernel (``measure_cpu``). Before that model
speaks for a 13B model on a GPU it can be asked about the one case this machine runs for real:
the whole step on the CPU, in the compiled decode step, once with dense MLPs and once with
sparse ones. For each, the bytes the step reads come from ``engine.step_bytes`` (a thresholded
sparse MLP reads its gate in full and the active share d of up and down, (1 + 2d) / 3 of its
bytes), and

    error = modelled tok/s / measured tok/s - 1

(negative: the model is slower than the machine). ``calibrate`` keeps BW and solves the dense
step's equation for c instead (one measured point, one unknown), so that the model reproduces
the measured dense decode; the sparse step is then an independent check of the calibrated model.
Where even c = 0 is slower than measured, BW is the one refit instead: bytes / t.

What c then holds is everything in the dense step that is not weight bytes at BW: attention's
arithmetic, the KV cache, the LM head's call, the loop around the calls. The time model charges
it to every call, the cold FFN calls of a hybrid step included, which is an assumption. And the
sparse step checked here is the one this machine runs, thresholds on the gate, which reads the
gate in full; the time model's rows assume predictors, which skip all three matrices of an
inactive neuron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..measure.timing import DECODE_PROMPT
from .time_model import Processor

__all__ = ["StepCheck", "calibrate", "check_cpu_model", "step_check"]


@dataclass(frozen=True)
class StepCheck:
    """One measured decode step beside what a CPU model says of the same bytes."""

    label: str
    step_bytes: float
    calls: int
    measured_tok_s: float
    modelled_tok_s: float

    @property
    def error(self) -> float:
        """modelled / measured - 1: the model's relative error in tokens/s."""
        return self.modelled_tok_s / self.measured_tok_s - 1.0

    def against(self, cpu: Processor) -> StepCheck:
        """The same measured step beside another CPU model."""
        return step_check(self.label, self.step_bytes, self.calls, self.measured_tok_s, cpu)

    def line(self) -> str:
        return (
            f"{self.label:28s} {self.step_bytes / 1e6:6.0f} MB   "
            f"measured {self.measured_tok_s:6.1f} tok/s   "
            f"modelled {self.modelled_tok_s:6.1f} tok/s   error {self.error:+.0%}"
        )


def step_check(
    label: str, step_bytes: float, calls: int, measured_tok_s: float, cpu: Processor
) -> StepCheck:
    """A measured step beside ``cpu``'s model of it: ``calls`` fixed costs plus the bytes."""
    if not (math.isfinite(measured_tok_s) and measured_tok_s > 0 and step_bytes > 0 and calls > 0):
        raise ValueError(
            f"A step check needs finite positive tok/s, positive bytes and at least one call, "
            f"got {measured_tok_s}, {step_bytes} and {calls}."
        )
    modelled = 1.0 / cpu.seconds(step_bytes, calls)
    return StepCheck(label, step_bytes, calls, measured_tok_s, modelled)


def calibrate(cpu: Processor, dense: StepCheck) -> Processor:
    """``cpu`` with its fixed cost per call solved from the measured ``dense`` step.

    t = bytes / BW + calls * c  gives  c = (t - bytes / BW) / calls. When the bytes alone take
    longer than t at BW (c would be negative), c = 0 and BW = bytes / t.
    """
    t = 1.0 / dense.measured_tok_s
    streaming = dense.step_bytes / (cpu.bandwidth_gbs * 1e9)
    name = f"{cpu.name}, calibrated on this model's dense decode"
    if t >= streaming:
        return replace(cpu, name=name, call_us=(t - streaming) / dense.calls * 1e6)
    return replace(cpu, name=name, call_us=0.0, bandwidth_gbs=dense.step_bytes / t / 1e9)


def check_cpu_model(
    model: Any,
    tokenizer: Any,
    thresholds: Any,
    cpu: Processor,
    new_tokens: int = 32,
    repeats: int = 3,
    prompt: str = DECODE_PROMPT,
) -> tuple[StepCheck, StepCheck]:
    """The dense and the sparse-MLP (``thresholds``) decode steps of ``model`` on this CPU,
    measured side by side in the compiled step without the prompt's prefill
    (``timing.interleaved_decode_steps``), each beside ``cpu``'s model of the bytes it reads."""
    from ..measure.timing import interleaved_decode_steps
    from ..runtime.generate import generate
    from ..sparse.swap import sparse_mlps, using_mlps
    from ..sparse.traffic import step_bytes

    mlps = {"dense": [layer.mlp for layer in model.layers]}
    mlps["sparse"] = list(sparse_mlps(model, thresholds))  # over the model's own weights

    def decode(name: str) -> Any:
        def run(n: int) -> list[int]:
            with using_mlps(model, mlps[name]), torch.inference_mode():
                return generate(model, tokenizer, prompt, max_new_tokens=n, stop_at_eos=False)

        return run

    runs = {name: decode(name) for name in mlps}
    speeds, _ = interleaved_decode_steps(runs, new_tokens, repeats, warmup=1, progress=False)
    calls = 2 * model.config.n_layers
    dense = step_check("all CPU, dense MLPs", step_bytes(model), calls, speeds["dense"].tok_s, cpu)
    with using_mlps(model, mlps["sparse"]):  # their decode steps' densities, recorded as they ran
        share = step_bytes(model)
    label = "all CPU, sparse MLPs"
    return dense, step_check(label, share, calls, speeds["sparse"].tok_s, cpu)
