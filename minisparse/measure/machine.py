"""Which machine made a number: CPU, cores, threads, torch, GPU and measured memory bandwidth.

A speed measured on one machine says little about another: decoding at batch 1 streams the
weights, so its time follows the memory bandwidth, which differs between machines (and drifts
on a shared one). Every chapter prints ``machine().line()`` beside its timings, and every
benchmark's JSON carries ``machine().as_dict()``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Machine", "cpu_info", "cpu_name", "machine", "vector_isa"]


def cpu_info() -> str:
    """The text of /proc/cpuinfo (Linux), or "" where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows; reports name their machine."""
    for line in cpu_info().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def vector_isa() -> str:
    """The widest x86 vector extension the CPU reports (what the C kernels compile for)."""
    flags = cpu_info()
    for name, flag in (("AVX-512", "avx512f"), ("AVX2", "avx2")):
        if f" {flag}" in flags:
            return name
    return platform.machine()


@dataclass(frozen=True)
class Machine:
    cpu: str
    vector_isa: str
    cores: int
    threads: int
    torch: str
    gpu: str | None
    read_gbs: float | None  # measured read bandwidth of the main memory (None: not measured)
    kernels: str = ""  # the compiled kernels' compiler and -march target, or why torch runs

    def line(self) -> str:
        """One line for a notebook or a report."""
        bandwidth = "" if self.read_gbs is None else f", read bandwidth {self.read_gbs:.1f} GB/s"
        gpu = f", GPU {self.gpu}" if self.gpu else ", no GPU"
        return (
            f"machine: {self.cpu} ({self.vector_isa}), {self.cores} cores, {self.threads} torch "
            f"threads, torch {self.torch}{gpu}{bandwidth}"
            + (f"; {self.kernels}" if self.kernels else "")
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def machine(measure_bandwidth: bool = True) -> Machine:
    """This machine; ``measure_bandwidth`` times a 256 MiB read (about a second)."""
    from ..kernels.cpu_build import describe_build
    from .timing import read_bandwidth

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return Machine(
        cpu=cpu_name(),
        vector_isa=vector_isa(),
        cores=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        gpu=gpu,
        read_gbs=round(read_bandwidth(), 1) if measure_bandwidth else None,
        kernels=describe_build(),
    )
