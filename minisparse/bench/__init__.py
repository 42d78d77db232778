"""Benchmarks: the course's benchmarks, all timed by one harness, ``minisparse.measure.timing``.

* ``decode``: ``minisparse bench decode``, greedy decode speed side by side (minisparse,
  transformers, llama.cpp, dense vs sparse MLPs, any set of models).
* ``kernels``: ``minisparse bench sparse-ffn``, sparse FFN kernels vs dense and the ideal
  (chapter 07).
* ``quant``: ``minisparse bench quant``, float32 / bfloat16 / int8 / int4 decode (chapter 09).
* ``speculative``: ``minisparse bench speculative``, plain vs speculative decoding (chapter 10).
* ``sparse_decode``: ``minisparse bench sparse-decode``, decode speed of a dense model and its
  sparse version (ReLU + predictors, or TEAL thresholds) against the ceiling their bytes set.

The harness (warm-up, variants interleaved within every repeat, medians, seconds per token,
memory bandwidth, roofline) sits beside this package rather than in it (``minisparse.measure``):
the library measures with it too (``measure.machine``'s read bandwidth, ``offload.time_model``'s
CPU fit), and the library never imports this package, which imports the library. Its names are
exported here as well, with the decode benchmarks', as ``from minisparse.bench import median_time``.

Each benchmark's ``run`` prints ``minisparse.measure.machine.machine().line()`` first and writes
``machine().as_dict()`` into its ``--json`` file: a speed means little without the machine.
"""

from ..measure.timing import (
    ModelSpeed,
    copy_bandwidth,
    interleaved_decode,
    interleaved_medians,
    interleaved_per_token,
    interleaved_times,
    median_time,
    read_bandwidth,
    roofline_seconds,
    synchronize,
)
from .decode import (
    DecodeResult,
    bench_decode,
    bench_decode_models,
    hf_greedy,
    llama_cpp_decode,
)

__all__ = [
    "DecodeResult",
    "ModelSpeed",
    "bench_decode",
    "bench_decode_models",
    "copy_bandwidth",
    "hf_greedy",
    "interleaved_decode",
    "interleaved_medians",
    "interleaved_per_token",
    "interleaved_times",
    "llama_cpp_decode",
    "median_time",
    "read_bandwidth",
    "roofline_seconds",
    "synchronize",
]
