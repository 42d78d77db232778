"""Choosing the instruction set the kernels are compiled for (minisparse.kernels.cpu_isa)."""

from __future__ import annotations

import ctypes
import json

import pytest

from minisparse.kernels import cpu, cpu_build, cpu_isa

X86_V2 = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"
X86_V3 = f"{X86_V2} avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
AVX512_INFO = f"processor\t: 0\nflags\t\t: fpu sse2 {X86_V3} avx512f\n"
SSE4_INFO = f"flags\t\t: fpu sse2 {X86_V2}\n"


def test_targets_follow_the_cpu_flags_and_the_architecture():
    assert cpu_isa.available_targets(AVX512_INFO, "x86_64") == cpu_isa.TARGETS
    assert cpu_isa.available_targets(SSE4_INFO, "x86_64") == ("native", "x86-64-v2")
    assert cpu_isa.available_targets("flags\t: fpu sse2\n", "x86_64") == ("native",)
    no_movbe = AVX512_INFO.replace(" movbe", "")  # a VM that hides one v3 flag: no v3 build
    assert cpu_isa.available_targets(no_movbe, "x86_64") == ("native", "x86-64-v2")
    assert cpu_isa.available_targets(AVX512_INFO, "aarch64") == ("native",)


def test_the_override_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_VAR, "x86-64-v3")
    assert cpu_isa.requested_target() == "x86-64-v3"
    monkeypatch.setenv(cpu_isa.ENV_VAR, "")
    assert cpu_isa.requested_target() == "auto"
    monkeypatch.setenv(cpu_isa.ENV_VAR, "avx9")
    with pytest.raises(ValueError, match="auto, native, x86-64-v3, x86-64-v2"):
        cpu_isa.requested_target()


class FakeLibrary:
    """A build whose probe reports a set time (seconds per call), counting its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0
        self.isa_probe = self

    def __call__(self, rows: int, reps: int, threads: int, seconds) -> float:
        self.calls += 1
        seconds._obj.value = self.seconds
        return 1.0


def choose(tmp_path, speeds: dict[str, float], candidates=("native", "x86-64-v3", "x86-64-v2")):
    libs = {t: FakeLibrary(s) for t, s in speeds.items()}
    built = []

    def build(target):
        built.append(target)
        return libs[target]

    choice = cpu_isa.chosen_target(candidates, build, tmp_path / "choice.json", threads=2)
    return choice, built, libs


def test_a_faster_portable_build_replaces_native_and_the_choice_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_isa, "ROUNDS", 3)
    choice, built, libs = choose(tmp_path, {"native": 0.012, "x86-64-v3": 0.004})
    assert choice.target == "x86-64-v3" and built == ["native", "x86-64-v3"]  # never v2
    assert libs["native"].calls == libs["x86-64-v3"].calls == 4  # warm-up + 3, alternating
    assert choice.seconds["native"] > 2 * choice.seconds["x86-64-v3"]
    assert "-march=x86-64-v3 (measured faster" in choice.describe()
    # measured once: the next process reads the saved choice and builds nothing
    again, built_again, _ = choose(tmp_path, {"native": 0.001, "x86-64-v3": 0.02})
    assert again == choice and built_again == []
    # a damaged saved choice is measured again (and replaced)
    (tmp_path / "choice.json").write_text("{not json")
    third, built_third, _ = choose(tmp_path, {"native": 0.001, "x86-64-v3": 0.006})
    assert third.target == "native" and built_third == ["native", "x86-64-v3"]
    assert json.loads((tmp_path / "choice.json").read_text())["target"] == "native"


def test_native_keeps_its_place_within_the_noise_margin(tmp_path, monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV_VAR, raising=False)
    picked = cpu_isa._pick({"native": 1.02, "x86-64-v3": 1.0})
    assert picked.target == "native"
    assert cpu_isa._pick({"native": 1.10, "x86-64-v3": 1.0}).target == "x86-64-v3"


def test_override_and_single_target_measure_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV_VAR, "x86-64-v2")
    choice, built, _ = choose(tmp_path, {"native": 0.001, "x86-64-v3": 0.001})
    assert choice.target == "x86-64-v2" and built == [] and "MINISPARSE_MARCH" in choice.reason
    with pytest.raises(ValueError, match="lacks"):
        choose(tmp_path, {}, candidates=("native",))
    monkeypatch.delenv(cpu_isa.ENV_VAR)
    choice, built, _ = choose(tmp_path, {}, candidates=("native",))  # ARM, or no AVX2
    assert choice.target == "native" and built == []


def test_a_build_that_fails_leaves_native(tmp_path, monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV_VAR, raising=False)

    def build(target):
        raise RuntimeError("cc1: error: bad value 'x86-64-v3' for '-march='")

    choice = cpu_isa.chosen_target(("native", "x86-64-v3"), build, tmp_path / "c.json", 2)
    assert choice.target == "native" and "bad value" in choice.reason


def test_the_real_probe_runs_the_same_work_in_every_build(tmp_path, monkeypatch):
    """isa_probe of runtime/step.c compiled for each target gives the same checksum (the same
    arithmetic, up to float32 rounding in a different order)."""
    if not cpu.fast_path_available():
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    compiler = cpu.resolve_compiler(cpu.find_compiler())
    sums = {}
    for target in cpu_isa.available_targets():
        lib = cpu_build.build_for(compiler, cpu_build.PROBE_SOURCE, target, cpu_isa.declare_probe)
        elapsed = ctypes.c_double(0.0)
        sums[target] = lib.isa_probe(64, 3, 2, ctypes.byref(elapsed))
        assert 0 < elapsed.value < 10  # the work alone was timed
    assert all(s == s for s in sums.values()), sums  # no NaN: the matrices were allocated
    first = sums["native"]
    assert all(abs(s - first) <= 1e-4 * max(1.0, abs(first)) for s in sums.values()), sums


def test_the_machine_line_names_the_build():
    from minisparse.measure.machine import machine

    line = machine(measure_bandwidth=False).line()
    if cpu.fast_path_available():
        assert "C kernels:" in line and "-march=" in line
    else:
        assert "torch path" in line


def test_bench_isa_decodes_the_same_tokens_with_every_build():
    from conftest import tiny_model
    from minisparse.bench.isa import bench_isa

    if not cpu.fast_path_available():
        pytest.skip("no C compiler here")
    model = tiny_model(seed=4, std=0.2)
    rows = bench_isa(model, [3, 1, 4, 1, 5], ("fp32",), max_new_tokens=6, repeats=1, progress=False)
    assert [r.target for r in rows] == list(cpu_isa.available_targets())
    assert all(r.same_tokens_as_native for r in rows)  # fails if a build computes differently
    assert sum(r.chosen for r in rows) == 1 and rows[0].vs_native == 1.0
    assert all(r.tok_s > 0 and r.mb_per_token > 0 for r in rows)


def test_bench_isa_runs_the_2_4_layers_alike_with_every_build():
    """Chapter 12's compact 2:4 layers (float32 and int8 values) through every build of the
    step decode the native build's tokens (tests/test_nm_linear.py checks the native build's
    logits against the masked dense model)."""
    import copy

    import torch

    from conftest import tiny_model
    from minisparse.bench.isa import bench_isa
    from minisparse.pruning import nm_mask, to_nm_

    if not cpu.fast_path_available():
        pytest.skip("no C compiler here")
    dense = tiny_model(seed=5, std=0.2)
    with torch.no_grad():
        for layer in dense.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.mul_(nm_mask(lin.weight.abs(), 2, 4))
    variants = {
        "dense": dense,
        "2:4": to_nm_(copy.deepcopy(dense), "mlp"),
        "2:4 int8": to_nm_(copy.deepcopy(dense), "mlp", int8=True),
    }
    rows = bench_isa(dense, [3, 1, 4, 1, 5], max_new_tokens=6, repeats=1, progress=False,
                     variants=variants)  # fmt: skip
    assert {r.weights for r in rows} == set(variants)
    assert all(r.same_tokens_as_native for r in rows)
