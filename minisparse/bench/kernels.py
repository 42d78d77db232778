"""Benchmark: sparse FFN kernels against dense, and against the ideal (1 - s).

``minisparse bench sparse-ffn`` (or ``python -m minisparse.bench.kernels``) times, for each FFN
shape and sparsity s, three products side by side with the dense product they replace:

* ``gate/up``: row-sparse GEMV over the active neurons (dense: ``F.linear(x, W_gate)``);
* ``down``: column-sparse GEMV over the active neurons (dense: ``F.linear(h, W_down)``);
* ``ffn``: the whole sparse gated FFN (dense: the three linears and the activation).

At batch 1 each is memory-bound: reading (1 - s) of the weights takes at best (1 - s) of the
dense time, so we report ``time / dense``, ``(time / dense) / (1 - s)`` (1.0: the ideal) and
GB/s against a measured copy bandwidth. CPU: the C fast path; CUDA: the Triton kernels.

Measurement rules (``minisparse.measure.timing``): variants are interleaved within every repeat so
machine drift hits all of them alike, warm-up first, median of repeats. The active neurons are
drawn at random and rotated between calls (several sets per sparsity), and so are the weights:
each call reads the next of several copies of the FFN, as many as it takes to exceed
``WORKING_SET_MB`` (``--working-set-mb``), so every matrix arrives cold from memory, as in a
decode step, which streams all the other layers' weights between two calls of a layer. A small
FFN (576 x 1536 x 3 fp32 = 10.6 MB) would otherwise stay in the last-level cache, and its
ratios would measure call overheads at cache bandwidth, not what decoding meets;
``--working-set-mb 0`` (one copy) keeps that cache-resident case as a labelled contrast.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..core.model import check_count
from ..kernels.workloads import FFNWeights, check_sparsity, random_active_sets, random_ffn
from ..measure.machine import machine
from ..measure.timing import copy_bandwidth, interleaved_medians
from .kernel_studies import gather_progression, union_density, weight_copies
from .results import result, write_result

__all__ = [
    "KERNELS",
    "SHAPES",
    "SPARSITIES",
    "BenchRow",
    "add_arguments",
    "bench_shape",
    "bench_sparse_ffn",
    "dense_ffn",
    "format_table",
    "gather_progression",
    "graphed",
    "kernel_backend",
    "main",
    "parse_shape",
    "parse_sparsity",
    "run",
    "sparse_ffn_of",
    "union_density",
    "weight_copies",
]

SHAPES = ((4096, 11008), (576, 1536))
SPARSITIES = (0.0, 0.5, 0.7, 0.9, 0.95)
KERNELS = ("gate/up", "down", "ffn")
GRAPH_CALLS = 8  # calls per captured CUDA graph (one per rotating active set)
WORKING_SET_MB = 256.0  # weights rotated through per shape: more than any last-level cache


@dataclass
class BenchRow:
    """One line of the table: a kernel at one shape and sparsity."""

    shape: str
    kernel: str
    sparsity: float
    dense_ms: float
    sparse_ms: float
    ratio_to_dense: float
    ratio_to_ideal: float
    sparse_gbs: float
    dense_gbs: float
    copy_fraction: float


def kernel_backend(device: torch.device) -> dict[str, Callable]:
    """The sparse kernels for a device: Triton on CUDA, the C fast path on the CPU."""
    if device.type == "cuda":
        from .. import kernels as backend
    else:
        from ..kernels import cpu as backend
    return {
        "gather_gemv": backend.gather_gemv,
        "scatter_gemv": backend.scatter_gemv,
        "sparse_ffn": backend.sparse_ffn,
    }


def graphed(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``calls`` consecutive calls of ``fn`` captured once as a CUDA graph; returns its replay.

    Replaying a graph launches the recorded kernels without running any Python: its time is
    the GPU's own time, without the per-call host overhead (argument checks, allocation,
    Triton's launcher) that eager calls pay. Serving engines decode through graphs for that
    reason. Each call may use a different active set (``fn`` draws the next one), so the
    graph still rotates through ``calls`` sets.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(calls):  # warm-up on a side stream: compiles kernels, fills caches
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def dense_ffn(x: Tensor, w: FFNWeights) -> Tensor:
    """The dense gated SiLU FFN the sparse one replaces."""
    return F.linear(F.silu(F.linear(x, w.W_gate)) * F.linear(x, w.W_up), w.W_down)


def bench_shape(
    dim: int,
    ffn: int,
    sparsities: tuple[float, ...] = SPARSITIES,
    kernels: tuple[str, ...] = KERNELS,
    repeats: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    bandwidth_gbs: float | None = None,
    progress: tqdm | None = None,
    cuda_graphs: bool = False,
    working_set_mb: float = WORKING_SET_MB,
) -> list[BenchRow]:
    """Dense vs sparse for one FFN shape at each sparsity; one ``BenchRow`` per kernel and s.

    ``cuda_graphs``: time CUDA graph replays of ``GRAPH_CALLS`` calls (per call), the GPU's
    own time, instead of eager calls from Python. ``working_set_mb``: every call reads the next
    of ``weight_copies`` copies of the weights (cold, as in decoding); 0 gives one copy.
    """
    device = torch.device(device)
    if cuda_graphs and device.type != "cuda":
        raise ValueError("cuda_graphs needs a CUDA device; drop it on the CPU.")
    for s in sparsities:
        check_sparsity(s)
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"Unknown kernels {sorted(unknown)}; choose from {KERNELS}.")
    if bandwidth_gbs is None:
        bandwidth_gbs = copy_bandwidth(device=device)
    ops = kernel_backend(device)
    ffn_bytes = 3 * dim * ffn * torch.empty(0, dtype=dtype).element_size()
    copies = [
        random_ffn(dim, ffn, dtype, device, seed + 7 * c)
        for c in range(weight_copies(ffn_bytes, working_set_mb))
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(dim, generator=gen).to(device=device, dtype=dtype)
    h = torch.randn(ffn, generator=gen).to(device=device, dtype=dtype)
    matrix_bytes = ffn_bytes // 3
    rows = []
    for s in sparsities:
        sets = itertools.cycle(random_active_sets(ffn, s, 8, seed + 2, device))
        fraction = round((1.0 - s) * ffn) / ffn
        ws = {name: itertools.cycle(copies) for name in (*KERNELS, *(f"{k}+" for k in KERNELS))}
        cases = {  # each call takes the next copy of the weights (its own rotation per variant)
            "gate/up": (
                lambda w=ws["gate/up"]: F.linear(x, next(w).W_gate),
                lambda w=ws["gate/up+"], sets=sets: ops["gather_gemv"](
                    next(w).W_gate, x, next(sets)
                ),
                1,
            ),
            "down": (
                lambda w=ws["down"]: F.linear(h, next(w).W_down),
                lambda w=ws["down+"], sets=sets: ops["scatter_gemv"](
                    next(w).W_down_t, h, idx=next(sets)
                ),
                1,
            ),
            "ffn": (
                lambda w=ws["ffn"]: dense_ffn(x, next(w)),
                lambda w=ws["ffn+"], sets=sets: sparse_ffn_of(ops, x, next(w), next(sets)),
                3,
            ),
        }
        fns = {}
        for name in kernels:
            dense_fn, sparse_fn, _ = cases[name]
            fns[f"{name} dense"], fns[f"{name} sparse"] = dense_fn, sparse_fn
        calls = GRAPH_CALLS if cuda_graphs else 1
        if cuda_graphs:
            fns = {key: graphed(fn, calls) for key, fn in fns.items()}
        t = {k: v / calls for k, v in interleaved_medians(fns, repeats, warmup, device).items()}
        for name in kernels:
            n_mats = cases[name][2]
            dense_s, sparse_s = t[f"{name} dense"], t[f"{name} sparse"]
            ratio = sparse_s / dense_s
            sparse_bytes = n_mats * matrix_bytes * fraction
            rows.append(
                BenchRow(
                    shape=f"{dim}x{ffn}",
                    kernel=name,
                    sparsity=s,
                    dense_ms=dense_s * 1e3,
                    sparse_ms=sparse_s * 1e3,
                    ratio_to_dense=ratio,
                    ratio_to_ideal=ratio / (1.0 - s),
                    sparse_gbs=sparse_bytes / sparse_s / 1e9,
                    dense_gbs=n_mats * matrix_bytes / dense_s / 1e9,
                    copy_fraction=sparse_bytes / sparse_s / 1e9 / bandwidth_gbs,
                )
            )
        if progress is not None:
            progress.update(1)
    return rows


def sparse_ffn_of(ops: dict[str, Callable], x: Tensor, w: FFNWeights, idx: Tensor) -> Tensor:
    return ops["sparse_ffn"](x, w.W_gate, w.W_up, w.W_down_t, idx, "silu")


def bench_sparse_ffn(
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    sparsities: tuple[float, ...] = SPARSITIES,
    kernels: tuple[str, ...] = KERNELS,
    repeats: int = 20,
    warmup: int = 3,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    show_progress: bool = True,
    cuda_graphs: bool = False,
    working_set_mb: float = WORKING_SET_MB,
) -> tuple[list[BenchRow], float]:
    """Run ``bench_shape`` for every shape; return the rows and the copy bandwidth (GB/s)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bandwidth = copy_bandwidth(device=device)
    rows: list[BenchRow] = []
    # tqdm's delay: the bar appears only when the run lasts more than 2 seconds
    with tqdm(
        total=len(shapes) * len(sparsities),
        desc="sparse-ffn",
        delay=2.0,
        disable=not show_progress,
        file=sys.stderr,
    ) as bar:
        for dim, ffn in shapes:
            rows += bench_shape(
                dim, ffn, sparsities, kernels, repeats, warmup, device, dtype, seed, bandwidth, bar,
                cuda_graphs, working_set_mb,
            )  # fmt: skip
    return rows, bandwidth


def format_table(rows: list[BenchRow], bandwidth_gbs: float) -> str:
    """The rows as a fixed-width text table."""
    lines = [
        f"measured copy bandwidth: {bandwidth_gbs:.1f} GB/s",
        (
            f"{'shape':>11} {'kernel':>8} {'s':>5} {'dense ms':>9} {'sparse ms':>10} "
            f"{'/dense':>7} {'/ideal':>7} {'GB/s':>7} {'of copy':>8}"
        ),
    ]
    for r in rows:
        lines.append(
            f"{r.shape:>11} {r.kernel:>8} {r.sparsity:>5.2f} {r.dense_ms:>9.3f} "
            f"{r.sparse_ms:>10.3f} {r.ratio_to_dense:>7.3f} {r.ratio_to_ideal:>7.3f} "
            f"{r.sparse_gbs:>7.1f} {r.copy_fraction:>8.0%}"
        )
    return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x11008' -> (4096, 11008): model dim x FFN dim."""
    try:
        dim, ffn = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not DIMxFFN, e.g. 4096x11008"
        ) from None
    if dim < 1 or ffn < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} needs positive sizes")
    return dim, ffn


def parse_sparsity(text: str) -> float:
    try:
        return check_sparsity(float(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minisparse bench sparse-ffn``."""
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=list(SHAPES),
        help="FFN shapes as DIMxFFN (default: 4096x11008 576x1536)",
    )
    parser.add_argument(
        "--sparsity",
        type=parse_sparsity,
        nargs="+",
        default=list(SPARSITIES),
        help="fractions of neurons skipped, each in [0, 1) (default: 0 0.5 0.7 0.9 0.95)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=KERNELS,
        default=list(KERNELS),
        help="which products to time (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up runs")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="weight dtype (the CPU fast path is float32; others use the torch path)",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch + OpenMP)")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="CUDA only: time graph replays (GPU time, no per-call host overhead)",
    )
    parser.add_argument(
        "--working-set-mb",
        type=float,
        default=WORKING_SET_MB,
        help="MB of weight copies each shape rotates through, so every call reads cold weights "
        f"as decoding does (default {WORKING_SET_MB:.0f}; 0: one copy, cache-resident if small)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed arguments; print the table; return the exit status."""
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    check_count(args.warmup, "--warmup", minimum=0)
    weight_copies(1, args.working_set_mb)  # a negative size is refused before any work
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda was asked for but no CUDA device is visible; drop --device to "
            "benchmark the CPU fast path, or run on a machine with a GPU."
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.cuda_graphs and device != "cuda":
        raise RuntimeError("--cuda-graphs needs a CUDA device; drop it to benchmark the CPU.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    about = machine()
    print(about.line(), flush=True)
    rows, bandwidth = bench_sparse_ffn(
        tuple(args.shapes), tuple(args.sparsity), tuple(args.kernels), args.repeats, args.warmup,
        args.device, getattr(torch, args.dtype), args.seed, cuda_graphs=args.cuda_graphs,
        working_set_mb=args.working_set_mb,
    )  # fmt: skip
    timing = "CUDA graph replays" if args.cuda_graphs else "eager calls"
    print(
        f"device: {device}, threads: {torch.get_num_threads()}, dtype: {args.dtype}, {timing}, "
        f"weights rotated through {args.working_set_mb:.0f} MB"
    )
    print(format_table(rows, bandwidth))
    rows_json = [asdict(r) for r in rows]
    payload = result(args, about, copy_bandwidth_gbs=bandwidth, timing=timing, rows=rows_json)
    write_result(args, payload)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.kernels", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
