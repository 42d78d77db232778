"""Which machine made a number: CPU, cores, threads, torch, GPU and measured memory bandwidth.

A speed measured on one machine says little about another: decoding at batch 1 streams the
weights, so its time follows the memory bandwidth, which differs between machines (and drifts
on a shared one). Every chapter prints ``machine().line()`` beside its timings, and every
benchmark's JSON carries ``machine().as_dict()``.

The read bandwidth is measured once per machine (``machine_bandwidth``: the median of five
256 MiB reads) and kept in the cache under a key of the CPU, its flags, the torch thread count
and the torch version, so every chapter run on one machine prints the same figure and draws
the same roofline; ``machine_bandwidth(fresh=True)`` measures again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Machine", "cpu_info", "cpu_name", "machine", "machine_bandwidth", "vector_isa"]


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


def _facts_path() -> Path:
    from ..files.cache import cache_dir
    from ..kernels.cpu_build import cpu_identity

    key = "\0".join([cpu_identity(), str(torch.get_num_threads()), torch.__version__])
    return cache_dir() / f"machine_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def machine_bandwidth(fresh: bool = False) -> float:
    """This machine's read bandwidth in GB/s, measured once and then read from the cache.

    The median of five ``read_bandwidth`` runs (a 256 MiB read each), rounded to 0.1 GB/s. A
    missing or unreadable cache file is measured again; one that cannot be written leaves a
    warning and the figure.
    """
    from ..files.cache import atomic_write_text
    from .timing import read_bandwidth

    path = _facts_path()
    if not fresh:
        try:
            value = json.loads(path.read_text())["read_gbs"]
            if type(value) in (int, float) and 0 < value < math.inf:
                return float(value)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    value = round(statistics.median(read_bandwidth() for _ in range(5)), 1)
    try:
        atomic_write_text(path, json.dumps({"cpu": cpu_name(), "read_gbs": value}) + "\n")
    except OSError as err:
        warnings.warn(f"Could not keep the measured bandwidth in {path} ({err}).", stacklevel=2)
    return value


def machine(measure_bandwidth: bool = True) -> Machine:
    """This machine; ``measure_bandwidth``: its read bandwidth (``machine_bandwidth``: measured
    once per machine, about five seconds, then read from the cache)."""
    from ..kernels.cpu_build import describe_build

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
        read_gbs=machine_bandwidth() if measure_bandwidth else None,
        kernels=describe_build(),
    )
