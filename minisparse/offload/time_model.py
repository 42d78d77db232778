"""How fast a hot/cold placement decodes: a bandwidth model, measured where it can be.

At batch 1 every part of a decode step is memory-bound, so a device's time is the bytes it
reads over its bandwidth, plus a fixed cost per call. For layer l of a hybrid step

    t_l = t_attn(fast) + t_pred(fast) + max(t_hot, t_cold + 2 t_link)
    t_hot  = E[active hot bytes]  / BW_fast + c_fast
    t_cold = E[active cold bytes] / BW_slow + c_slow,    t_link = latency + dim * bytes / BW_pcie

The CPU computes the cold neurons while the GPU computes the hot ones, and the layer waits for
the slower side plus the two small transfers (the input down, the partial output back).
E[active bytes] = sum_j P(neuron j active) x bytes per neuron; for a batch of b tokens a neuron
is read when any token needs it, 1 - (1 - f_j)^b if tokens were independent.

The slow device's parameters are **measured on this machine** (``measure_cpu``: the chapter 07
sparse FFN kernel on a working set far beyond the last-level cache, fitted as
time = c + bytes / BW); the fast device's come from a named GPU's specification
(``GPUS``), at an assumed share ``GPU_EFFICIENCY`` of its peak bandwidth. The result is a
*model*: every number this module produces is labelled "modelled" where it is shown.

Baselines: everything on the CPU (sparse), everything on the GPU (when it fits), and
llama.cpp's layer-wise offload (whole layers, dense, the first k on the GPU).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from .placement import Solver, place

__all__ = [
    "GPU",
    "GPUS",
    "GPU_EFFICIENCY",
    "RESERVE_GB",
    "SHAPES",
    "ModelShape",
    "Processor",
    "active",
    "check_gpu",
    "cpu_step",
    "fits_on_gpu",
    "hybrid_step",
    "layerwise_dense_step",
    "measure_cpu",
    "neuron_budget",
    "policy_speeds",
    "resample",
    "shape_of",
]

GPU_EFFICIENCY = 0.8  # assumed share of a GPU's peak bandwidth its sparse kernels reach
RESERVE_GB = 1.5  # GPU memory kept for the KV cache, activations and the CUDA context


@dataclass(frozen=True)
class Processor:
    """A device as the model sees it: achieved bandwidth, fixed cost per call, memory."""

    name: str
    bandwidth_gbs: float
    call_us: float
    memory_gb: float = math.inf
    measured: bool = False

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        return nbytes / (self.bandwidth_gbs * 1e9) + calls * self.call_us * 1e-6


@dataclass(frozen=True)
class GPU:
    """A named GPU (from its specification) and its link to the host."""

    device: Processor
    link_gbs: float  # host <-> GPU bandwidth
    link_us: float  # per transfer, including the synchronisation
    spec: str


def _gpu(name: str, peak_gbs: float, memory_gb: float, link_gbs: float, spec: str) -> GPU:
    device = Processor(name, GPU_EFFICIENCY * peak_gbs, call_us=5.0, memory_gb=memory_gb)
    return GPU(device, link_gbs, link_us=10.0, spec=spec)


GPUS: dict[str, GPU] = {
    "rtx4090": _gpu("RTX 4090", 1008, 24, 25, "1008 GB/s GDDR6X, 24 GB, PCIe 4.0 x16"),
    "rtx2080ti": _gpu("RTX 2080 Ti", 616, 11, 12, "616 GB/s GDDR6, 11 GB, PCIe 3.0 x16"),
    "a100": _gpu("A100 80GB PCIe", 1935, 80, 25, "1935 GB/s HBM2e, 80 GB, PCIe 4.0 x16"),
}


def check_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"Unknown GPU {name!r}; choose one of {', '.join(GPUS)}.")
    return GPUS[name]


@dataclass(frozen=True)
class ModelShape:
    """What the model reads per token: FFN neurons, attention and the LM head, in bytes."""

    name: str
    dim: int
    ffn: int
    layers: int
    attn_params: int  # per layer: q, k, v, o
    head_params: int  # the LM head (read once per token)
    mats: int = 3  # matrices per neuron: 3 for a gated MLP, 2 for a plain one (Falcon)
    bytes_per_weight: int = 2

    @property
    def neuron_bytes(self) -> int:
        return self.mats * self.dim * self.bytes_per_weight

    @property
    def ffn_bytes(self) -> int:
        return self.layers * self.ffn * self.neuron_bytes

    @property
    def other_bytes(self) -> int:
        """Everything but the FFNs: attention of every layer and the LM head."""
        return (self.layers * self.attn_params + self.head_params) * self.bytes_per_weight


def _llama(name: str, dim: int, ffn: int, layers: int, kv_dim: int, vocab: int) -> ModelShape:
    return ModelShape(name, dim, ffn, layers, 2 * dim * dim + 2 * dim * kv_dim, vocab * dim)


#: ReLU models PowerInfer ran (ReluLLaMA-7B/13B, ReluFalcon-40B), fp16 weights.
SHAPES: dict[str, ModelShape] = {
    "llama-7b": _llama("ReluLLaMA-7B", 4096, 11008, 32, 4096, 32000),
    "llama-13b": _llama("ReluLLaMA-13B", 5120, 13824, 40, 5120, 32000),
    "falcon-40b": replace(_llama("ReluFalcon-40B", 8192, 32768, 60, 1024, 65024), mats=2),
}


def shape_of(model: torch.nn.Module, bytes_per_weight: int = 4) -> ModelShape:
    c = model.config
    kv_dim = c.n_kv_heads * c.head_dim
    attn = c.dim * c.n_heads * c.head_dim * 2 + 2 * c.dim * kv_dim
    return ModelShape(
        "this model", c.dim, c.ffn_dim, c.n_layers, attn, c.vocab_size * c.dim, 3, bytes_per_weight
    )


def resample(frequencies: Sequence[Tensor], layers: int, width: int) -> list[Tensor]:
    """Our per-layer frequency curves stretched to ``layers`` x ``width`` neurons.

    Assumption: a larger model's layer at relative depth d has the same *sorted* frequency
    curve, as a function of rank / width, as our layer at depth d. Layer l takes our layer
    round(l (L - 1) / (layers - 1)); the neuron at rank r takes our curve's value at rank share
    (r + 0.5) / width, linearly interpolated. The result is sorted (rank 0 first).
    """
    ours = len(frequencies)
    out = []
    for layer in range(layers):
        src = round(layer * (ours - 1) / max(layers - 1, 1))
        curve = frequencies[src].double().sort(descending=True).values.numpy()
        at = (np.arange(width) + 0.5) / width * len(curve) - 0.5
        out.append(torch.from_numpy(np.interp(at, np.arange(len(curve)), curve)))
    return out


def active(f: Tensor, batch: int) -> Tensor:
    """P(a neuron is read in a step of ``batch`` tokens) = 1 - (1 - f)^batch (independence)."""
    return 1.0 - (1.0 - f.double()) ** batch


def hybrid_step(
    shape: ModelShape,
    frequencies: Sequence[Tensor],
    hot: Sequence[Tensor],
    cpu: Processor,
    gpu: GPU,
    batch: int = 1,
    predictor_share: float = 0.0,
) -> float:
    """Modelled seconds of one decode step with attention on the GPU and FFNs split by ``hot``.

    ``predictor_share``: predictor bytes per layer as a share of that layer's FFN bytes (read
    in full on the GPU every step).
    """
    fast, nb = gpu.device, shape.neuron_bytes
    link = 2 * (
        gpu.link_us * 1e-6 + shape.dim * shape.bytes_per_weight * batch / (gpu.link_gbs * 1e9)
    )
    total = fast.seconds(shape.head_params * shape.bytes_per_weight)
    layer_ffn = shape.ffn * nb
    for f, h in zip(frequencies, hot, strict=True):
        p = active(f, batch)
        total += fast.seconds(
            shape.attn_params * shape.bytes_per_weight + predictor_share * layer_ffn
        )
        t_hot = fast.seconds(float(p[h].sum()) * nb) if bool(h.any()) else 0.0
        t_cold = cpu.seconds(float(p[~h].sum()) * nb) + link if not bool(h.all()) else 0.0
        total += max(t_hot, t_cold)
    return total


def cpu_step(
    shape: ModelShape,
    frequencies: Sequence[Tensor],
    cpu: Processor,
    batch: int = 1,
    predictor_share: float = 0.0,
) -> float:
    """Modelled seconds of one step entirely on the CPU, with sparse FFNs."""
    ffn = sum(float(active(f, batch).sum()) for f in frequencies) * shape.neuron_bytes
    attn = shape.layers * (
        shape.attn_params * shape.bytes_per_weight
        + predictor_share * shape.ffn * shape.neuron_bytes
    )
    return cpu.seconds(
        ffn + attn + shape.head_params * shape.bytes_per_weight, calls=2 * shape.layers
    )


def layerwise_dense_step(
    shape: ModelShape, cpu: Processor, gpu: GPU, memory_bytes: float | None = None
) -> float:
    """Modelled seconds of llama.cpp's ``-ngl k``: the first k whole layers on the GPU, dense.

    k is as large as ``memory_bytes`` allows after the LM head (default: the GPU's memory less
    ``RESERVE_GB``).
    """
    per_layer = shape.attn_params * shape.bytes_per_weight + shape.ffn * shape.neuron_bytes
    if memory_bytes is None:
        memory_bytes = gpu.device.memory_gb * 1e9 - RESERVE_GB * 1e9
    room = memory_bytes - shape.head_params * shape.bytes_per_weight
    k = max(0, min(shape.layers, int(room // per_layer)))
    t = gpu.device.seconds(shape.head_params * shape.bytes_per_weight)
    t += gpu.device.seconds(k * per_layer, calls=2 * k)
    t += cpu.seconds((shape.layers - k) * per_layer, calls=2 * (shape.layers - k))
    return t + (gpu.link_us * 1e-6 if 0 < k < shape.layers else 0.0)


def fits_on_gpu(shape: ModelShape, gpu: GPU) -> bool:
    return shape.ffn_bytes + shape.other_bytes + RESERVE_GB * 1e9 <= gpu.device.memory_gb * 1e9


def neuron_budget(shape: ModelShape, gpu: GPU, predictor_share: float = 0.0) -> int:
    """GPU bytes left for FFN neurons after attention, LM head, predictors and the reserve."""
    predictors = predictor_share * shape.ffn_bytes
    room = gpu.device.memory_gb * 1e9 - RESERVE_GB * 1e9 - shape.other_bytes - predictors
    return int(max(0.0, min(room, shape.ffn_bytes)))


def policy_speeds(
    shape: ModelShape,
    frequencies: Sequence[Tensor],
    cpu: Processor,
    gpu: GPU,
    budget_bytes: int | None = None,
    batch: int = 1,
    predictor_share: float = 0.0,
    min_per_layer: int = 0,
    group_size: int = 256,
    held_out: Sequence[Tensor] | None = None,
    solver: Solver | None = None,
) -> dict[str, dict[str, float]]:
    """Modelled tokens/s and fast-device load of every policy.

    Placements are made on ``frequencies``; times and loads are read on ``held_out`` (default:
    the same). ``budget_bytes`` defaults to what the GPU holds after the rest of the model
    (``neuron_budget``). Every policy gets the same GPU memory: the budget plus the attention,
    LM head and predictors, which the hot/cold policies keep on the GPU. Rows: all-CPU,
    llama.cpp layer-wise (dense), layer-wise FFNs (sparse), hot/cold greedy, hot/cold ILP, and
    all-GPU when the budget holds every neuron. ``solver``: the ILP's program, as in ``place``.
    """
    budget = neuron_budget(shape, gpu, predictor_share) if budget_bytes is None else budget_bytes
    memory = budget + shape.other_bytes + predictor_share * shape.ffn_bytes
    made_on, frequencies = frequencies, frequencies if held_out is None else held_out
    rows: dict[str, dict[str, float]] = {}

    def add(name: str, step: float, load: float) -> None:
        rows[name] = {"tok_s": batch / step, "fast_load": load}

    add("all CPU (sparse)", cpu_step(shape, frequencies, cpu, batch, predictor_share), 0.0)
    add("llama.cpp layer-wise (dense)", layerwise_dense_step(shape, cpu, gpu, memory), math.nan)
    if budget > 0:
        for policy, label in (
            ("layerwise", "layer-wise FFNs (sparse)"),
            ("greedy", "hot/cold greedy"),
            ("ilp", "hot/cold ILP"),
        ):
            p = place(
                made_on, shape.neuron_bytes, budget, policy, group_size, min_per_layer,
                solver=solver,
            )  # fmt: skip
            step = hybrid_step(shape, frequencies, p.hot, cpu, gpu, batch, predictor_share)
            add(label, step, p.load([active(f, batch) for f in frequencies]))
    if budget >= shape.ffn_bytes and fits_on_gpu(shape, gpu):
        everything = [torch.ones(f.numel(), dtype=torch.bool) for f in frequencies]
        add(
            "all GPU",
            hybrid_step(shape, frequencies, everything, cpu, gpu, batch, predictor_share),
            1.0,
        )
    return rows


def measure_cpu(
    dim: int = 2048,
    ffn: int = 8192,
    densities: Sequence[float] = (0.05, 0.1, 0.2, 0.4),
    repeats: int = 7,
    seed: int = 0,
) -> Processor:
    """This CPU's sparse-FFN bandwidth and per-call cost, fitted from chapter 07's kernel.

    A random fp32 FFN of 3 x dim x ffn weights (192 MiB by default, beyond any last-level
    cache) runs the fused sparse FFN over rotating random active sets at each density; a least
    squares line time = c + bytes / BW through the medians gives BW and c.
    """
    from ..kernels import cpu
    from ..kernels.workloads import random_active_sets, random_ffn
    from ..measure.machine import cpu_name
    from ..measure.timing import interleaved_medians

    w = random_ffn(dim, ffn, seed=seed)
    x = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    fns, nbytes = {}, []
    for d in densities:
        sets = itertools.cycle(random_active_sets(ffn, 1.0 - d, 16, seed + 1))
        fns[f"{d}"] = lambda sets=sets: cpu.sparse_ffn(x, w.W_gate, w.W_up, w.W_down_t, next(sets))
        nbytes.append(round(d * ffn) * 3 * dim * 4)
    medians = interleaved_medians(fns, repeats=repeats, warmup=2)
    slope, intercept = np.polyfit(
        np.array(nbytes, dtype=float), np.array(list(medians.values())), 1
    )
    return Processor(
        f"this CPU ({cpu_name()}, {torch.get_num_threads()} threads)",
        bandwidth_gbs=1.0 / slope / 1e9,
        call_us=max(0.0, intercept * 1e6),
        measured=True,
    )
