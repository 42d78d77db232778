"""The timing harness, and the sparse-ffn benchmark end to end on small shapes.

Times are never asserted; only the order of the calls, the table's structure and the
bookkeeping (bytes, ratios, per-token division).
"""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
import torch

from minisparse.bench import kernels as KB
from minisparse.measure import timing


def test_bench_shape_rows_and_ratios():
    rows = KB.bench_shape(
        64, 96, sparsities=(0.0, 0.5), repeats=2, warmup=1, bandwidth_gbs=10.0, working_set_mb=0.2
    )
    assert [(r.kernel, r.sparsity) for r in rows] == [
        (k, s) for s in (0.0, 0.5) for k in KB.KERNELS
    ]
    for r in rows:
        assert r.shape == "64x96" and r.dense_ms > 0 and r.sparse_ms > 0
        assert r.ratio_to_dense == pytest.approx(r.sparse_ms / r.dense_ms)
        assert r.ratio_to_ideal == pytest.approx(r.ratio_to_dense / (1 - r.sparsity))
        n_mats = 3 if r.kernel == "ffn" else 1
        moved = n_mats * 64 * round((1 - r.sparsity) * 96) * 4
        assert r.sparse_gbs == pytest.approx(moved / (r.sparse_ms / 1e3) / 1e9)
        assert r.copy_fraction == pytest.approx(r.sparse_gbs / 10.0)


def test_weight_copies_exceed_the_working_set():
    assert KB.weight_copies(10 * 2**20, 256) == 26  # 26 x 10 MiB is the first past 256 MiB
    assert KB.weight_copies(10 * 2**20, 0) == 1
    assert KB.weight_copies(300 * 2**20, 256) == 1
    with pytest.raises(ValueError, match="at least 0"):
        KB.weight_copies(10, -1)


def test_every_call_reads_the_next_copy_of_the_weights(monkeypatch):
    """Dense and sparse variants each cycle through all copies, so no call finds its weights
    left in the cache by the call before (the benchmark's cold-weights rule)."""
    seen: dict[str, list[int]] = {"dense": [], "sparse": []}
    real, real_linear = KB.kernel_backend(torch.device("cpu")), KB.F.linear

    def gather(W, x, idx):
        seen["sparse"].append(W.data_ptr())
        return real["gather_gemv"](W, x, idx)

    def linear(x, W, *args):
        seen["dense"].append(W.data_ptr())
        return real_linear(x, W, *args)

    monkeypatch.setattr(KB, "kernel_backend", lambda device: {**real, "gather_gemv": gather})
    monkeypatch.setattr(KB.F, "linear", linear)
    ffn_bytes = 3 * 32 * 48 * 4
    KB.bench_shape(
        32, 48, (0.5,), ("gate/up",), repeats=5, warmup=1, bandwidth_gbs=1.0,
        working_set_mb=2.5 * ffn_bytes / 2**20,
    )  # fmt: skip
    for name, ptrs in seen.items():
        assert len(ptrs) == 6, name
        assert len(set(ptrs)) == 3, name  # three copies, in turn
        assert all(a != b for a, b in itertools.pairwise(ptrs)), name


def test_random_active_sets_are_sorted_seeded_and_sized():
    sets = KB.random_active_sets(100, 0.7, count=3, seed=1)
    again = KB.random_active_sets(100, 0.7, count=3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(sets, again, strict=True))
    for s in sets:
        assert s.numel() == 30 and torch.equal(s, s.sort().values) and s.unique().numel() == 30
    assert not torch.equal(sets[0], sets[1])


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_sparsity_outside_range_is_rejected(bad):
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        KB.random_active_sets(10, bad, 1)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        KB.bench_shape(8, 8, sparsities=(bad,), repeats=1, bandwidth_gbs=1.0)


def test_cli_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    status = KB.main(
        [
            "--shapes",
            "48x80",
            "--sparsity",
            "0",
            "0.9",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--working-set-mb",
            "0.1",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    text = capsys.readouterr().out
    assert text.startswith("machine: ") and text.count("machine: ") == 1
    assert "copy bandwidth" in text and "48x80" in text and "/ideal" in text
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 6 and data["copy_bandwidth_gbs"] > 0
    assert data["settings"]["working_set_mb"] == 0.1 and data["command"].startswith("minisparse")
    assert data["machine"]["cores"] >= 1 and data["machine"]["read_gbs"] > 0


def test_cli_argument_errors():
    parser = argparse.ArgumentParser()
    KB.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--sparsity", "1.2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--shapes", "4096by11008"])
    args = parser.parse_args(["--device", "cuda"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            KB.run(args)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        KB.run(parser.parse_args(["--device", "cpu", "--cuda-graphs"]))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        KB.bench_shape(8, 16, (0.5,), repeats=1, device="cpu", cuda_graphs=True)


def test_interleaved_medians_counts_calls():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    t = KB.interleaved_medians({"a": lambda: bump("a"), "b": lambda: bump("b")}, 5, 2)
    assert set(t) == {"a", "b"} and calls == {"a": 7, "b": 7}
    with pytest.raises(ValueError, match="repeats"):
        KB.interleaved_medians({"a": lambda: None}, 0)


def test_harness_interleaves_variants_after_the_warm_up(monkeypatch):
    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = timing.interleaved_times(fns, repeats=3, warmup=2)
    # rounds: every variant once, the order rotating from round to round
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c", "b", "c", "a"]
    assert times == {name: [1.0, 1.0, 1.0] for name in fns}  # warm-up rounds dropped
    calls.clear()
    timing.interleaved_times(fns, repeats=1, warmup=1, rotate=False)
    assert calls == ["a", "b", "c"] * 2
    with pytest.raises(ValueError, match="warmup"):
        timing.interleaved_times(fns, repeats=1, warmup=-1)


def test_per_token_is_the_median_of_each_repeat_over_its_tokens(monkeypatch):
    clock = iter([0.0, 10.0, 14.0, 20.0, 26.0, 30.0, 38.0])  # warm-up (one read), 4, 6, 8 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    counts = iter([9, 1, 3, 2])  # the warm-up makes 9 tokens; then 4 / 1, 6 / 3, 8 / 2
    seconds = timing.interleaved_per_token({"run": lambda: next(counts)}, repeats=3, warmup=1)
    assert seconds == {"run": 4.0}  # median of 4, 2, 4
    tokens = iter([[1, 2], [1, 2, 3, 4]])
    monkeypatch.setattr(timing.time, "perf_counter", iter([0.0, 2.0, 4.0]).__next__)
    speed = timing.interleaved_decode({"m": lambda: next(tokens)}, 1, 1, progress=False)["m"]
    assert speed.tok_s == 2.0 and speed.tokens == [1, 2, 3, 4]  # 4 tokens in 2 seconds


def test_decode_steps_subtract_the_one_token_run_of_the_same_round(monkeypatch):
    """Round 1: 1 token in 1 s, 5 tokens in 5 s -> (5 - 1) / 4 = 1 s per step; round 2: 2 s and
    3 s -> 0.25 s. Speed 1 / median = 1 / 0.625; prefill (+ first token) median 1.5 s."""
    clock = iter([0.0, 1.0, 1.0, 6.0, 10.0, 12.0, 12.0, 15.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    asked = []
    run = lambda n: asked.append(n) or list(range(n))  # noqa: E731
    speeds, prefill = timing.interleaved_decode_steps({"m": run}, 5, 2, 0, progress=False)
    assert asked == [1, 5, 1, 5]  # the short run first in each round
    assert speeds["m"].rounds == [1.0, 0.25] and speeds["m"].tok_s == 1 / 0.625
    assert speeds["m"].tokens == [0, 1, 2, 3, 4] and prefill == {"m": 1.5}
    with pytest.raises(ValueError, match="at least 2"):
        timing.interleaved_decode_steps({"m": run}, 1)


def test_paired_speedup_is_the_median_of_the_ratios_within_rounds():
    """A machine twice as slow during round 3 slows both runs of that round: the pairs keep the
    speedup at 2, while the ratio of the two medians (4 / 3) would not."""
    reference = timing.ModelSpeed(0.25, [], [2.0, 4.0, 10.0])
    faster = timing.ModelSpeed(1 / 3, [], [1.0, 4.0, 3.0])
    assert faster.round_speedups(reference) == pytest.approx([2.0, 1.0, 10 / 3])
    assert faster.paired_speedup(reference) == pytest.approx(2.0)
    with pytest.raises(ValueError):  # the rounds must pair up
        faster.paired_speedup(timing.ModelSpeed(1.0, [], [1.0]))


def test_per_token_rounds_divide_each_round_by_its_tokens(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.0, 7.0])  # a warm-up round (start only), then 2 s and 4 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    counts = iter([4, 2, 8])
    rounds = timing.per_token_rounds({"a": lambda: next(counts)}, repeats=2, warmup=1)
    assert rounds == {"a": [1.0, 0.5]}  # 2 s / 2 tokens, 4 s / 8; the warm-up's 4 dropped


def test_sparse_decode_speed_keeps_the_rounds_of_both_runs(monkeypatch):
    """bench_decode_sparse hands back each run's seconds per token per round, and the speedup of
    each round is dense / sparse seconds of that round."""
    from types import SimpleNamespace

    from minisparse.bench import decode
    from minisparse.runtime import generate as gen_module
    from minisparse.sparse import swap

    monkeypatch.setattr(gen_module, "generate", lambda *a, **k: [1, 2])
    monkeypatch.setattr(swap, "swap_mlps", lambda model, mlps: None)
    monkeypatch.setattr(swap, "mean_density", lambda mlps: 0.5)

    def fake_interleaved(runs, repeats, warmup, progress):
        tokens = {name: run() for name, run in runs.items()}
        rounds = {"dense": [2.0, 4.0, 3.0], "sparse": [1.0, 4.0, 2.0]}
        return {n: timing.ModelSpeed(1 / rounds[n][2], tokens[n], rounds[n]) for n in runs}

    monkeypatch.setattr(decode, "interleaved_decode", fake_interleaved)
    model = SimpleNamespace(layers=[SimpleNamespace(mlp=None)])
    speed = decode.bench_decode_sparse(model, None, "p", [None], max_new_tokens=2, repeats=3)
    assert speed.dense_rounds == [2.0, 4.0, 3.0] and speed.sparse_rounds == [1.0, 4.0, 2.0]
    assert speed.round_speedups() == pytest.approx([2.0, 1.0, 1.5])
    assert speed.mean_density == 0.5 and speed.same_tokens
