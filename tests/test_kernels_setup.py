"""How the kernels package sets itself up: without Triton, without a compiler or OpenMP, with a
damaged compiled library, and without touching the process (environment, triton)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisparse.kernels import cpu, cpu_build


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_load_and_cpu_kernels_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, minisparse\n"
        "from minisparse.kernels import HAVE_TRITON, gather_gemv, cpu\n"
        "assert not HAVE_TRITON\n"
        "W, x = torch.randn(9, 5), torch.randn(5)\n"
        "idx = torch.tensor([1, 4, 7])\n"
        "assert torch.allclose(cpu.gather_gemv(W, x, idx), W[idx] @ x, atol=1e-5)\n"
        "try:\n"
        "    gather_gemv(W, x, idx)\n"
        "except ImportError as err:\n"
        "    print('clear error:', 'pip install triton' in str(err))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert "clear error: True" in proc.stdout


LOAD_LOOPS = (
    "import warnings; warnings.simplefilter('error')\n"
    "from minisparse.kernels import cpu\n"
    "print(cpu.fast_path_available())\n"
)


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "foreign", "no symbols", "stamp missing"],
)
def test_a_damaged_or_foreign_compiled_library_is_rebuilt_never_loaded(tmp_path, damage):
    """Whatever sits at a library's path, the next run neither crashes nor runs it: a file that
    does not match the stamp its build wrote (or that lacks a symbol) is compiled again."""
    if not cpu.fast_path_available():
        pytest.skip("no C compiler here: there is no compiled library to damage")
    env = {"MINISPARSE_CACHE": str(tmp_path), "MINISPARSE_MARCH": "native"}
    first = run_python(LOAD_LOOPS, **env)
    assert first.stdout.strip() == "True", first.stderr
    (lib,) = (tmp_path / "cpu_kernels").glob("cpu_[0-9a-f]*.so")
    good = lib.read_bytes()
    if damage == "garbage":
        lib.write_bytes(b"not a shared library")
    elif damage == "truncated":  # a bus error in the dynamic loader if it were loaded
        lib.write_bytes(good[:10_000])
    elif damage in ("foreign", "no symbols"):
        planted = tmp_path / "planted.c"
        planted.write_text(
            "#include <stdio.h>\n"
            '__attribute__((constructor)) static void hello(void) { puts("PLANTED RAN"); }\n'
            "int unrelated(void) { return 1; }\n"
        )
        compiler = cpu.resolve_compiler(cpu.find_compiler())
        out = tmp_path / "planted.so"
        subprocess.run(
            [*compiler.command, "-shared", "-fPIC", str(planted), "-o", str(out)], check=True
        )
        lib.write_bytes(out.read_bytes())
        if damage == "no symbols":  # stamped as if our build had made it: loaded, then refused
            lib.with_suffix(".sha256").write_text(cpu_build._digest(lib))
    else:
        lib.with_suffix(".sha256").unlink()
    second = run_python(LOAD_LOOPS, **env)
    assert second.returncode == 0 and second.stdout.strip().endswith("True"), second.stderr
    if damage != "no symbols":
        assert "PLANTED RAN" not in second.stdout  # never handed to the dynamic loader
    assert cpu_build._verified(lib) and lib.stat().st_size > 10_000


def test_cache_folders_and_libraries_are_private_whatever_the_umask(tmp_path):
    if not cpu.fast_path_available():
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    stale = cache / "cpu_kernels" / "tmpdead.tmp"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))  # a compile killed long ago
    code = "import os; os.umask(0)\n" + LOAD_LOOPS
    proc = run_python(code, MINISPARSE_CACHE=str(cache), MINISPARSE_MARCH="native")
    assert proc.stdout.strip() == "True", proc.stderr
    folder = cache / "cpu_kernels"
    assert folder.stat().st_mode & 0o077 == 0
    (lib,) = folder.glob("cpu_[0-9a-f]*.so")
    assert (
        lib.stat().st_mode & 0o077 == 0 and lib.with_suffix(".sha256").stat().st_mode & 0o077 == 0
    )
    assert not stale.exists()  # swept


def test_library_leaves_environment_and_triton_alone(embedded):
    """Importing minisparse, the CPU fast path, load() and generation change no environment
    variable and never import triton; a Triton kernel called on CPU tensors still runs (in the
    interpreter), and afterwards the environment is still untouched. Each step reports itself,
    so a failure names the step that changed the process. ``embedded`` fills the session's
    weight cache first, so the subprocess loads from it in seconds."""
    code = (
        "import os, sys\n"
        "before = dict(os.environ)\n"
        "def state(step):\n"
        "    changed = sorted(k for k in set(before) | set(os.environ)\n"
        "                     if before.get(k) != os.environ.get(k))\n"
        "    print(step, 'triton' in sys.modules, changed, flush=True)\n"
        "import torch, minisparse\n"
        "state('import')\n"
        "from minisparse.kernels import cpu\n"
        "W, x, idx = torch.randn(50, 40), torch.randn(40), torch.tensor([1, 7, 49])\n"
        "assert torch.allclose(cpu.gather_gemv(W, x, idx), W[idx] @ x, atol=1e-5)\n"
        "cpu.dense_gemv(W.T.contiguous(), torch.randn(40))\n"
        "state('cpu_fast_path')\n"
        "model, tokenizer = minisparse.load()\n"
        "state('load')\n"
        "minisparse.generate(model, tokenizer, 'Hello', max_new_tokens=2)\n"
        "state('generate')\n"
        "from minisparse import kernels\n"
        "assert torch.allclose(kernels.gather_gemv(W, x, idx), W[idx] @ x, atol=1e-5)\n"
        "print('triton_on_cpu', 'TRITON_INTERPRET' in os.environ, flush=True)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for step in ("import", "cpu_fast_path", "load", "generate"):
        assert f"{step} False []" in lines, (step, lines)
    assert "triton_on_cpu False" in lines


def test_no_compiler_means_torch_everywhere(tmp_path):
    """CC names a missing program: one warning, no library, every CPU function still right."""
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from minisparse.kernels import cpu\n"
        "    assert not cpu.fast_path_available()\n"
        "assert any('Install gcc or clang' in str(w.message) for w in caught), caught\n"
        "g = torch.Generator().manual_seed(0)\n"
        "W, x = torch.randn(30, 20, generator=g), torch.randn(2, 20, generator=g)\n"
        "idx = torch.tensor([29, 0, 5, 5])\n"
        "close = lambda a, b: torch.allclose(a, b, atol=1e-5)\n"
        "assert close(cpu.gather_gemv(W, x, idx), x @ W[idx].T)\n"
        "assert close(cpu.gather_rows_dot(W, x, idx), x @ W[idx].T)\n"
        "Wt = W.T.contiguous()\n"
        "xi = torch.randn(30, generator=g)\n"
        "masked = torch.where(xi.abs() > 0.5, xi, torch.zeros_like(xi))\n"
        "assert close(cpu.scatter_gemv(W, xi, threshold=0.5), masked @ W)\n"
        "assert close(cpu.dense_gemv(Wt, x), x @ Wt)\n"
        "Wd = torch.randn(30, 20, generator=g)\n"
        "h = torch.nn.functional.silu(x @ W[idx].T) * (x @ W[idx].T)\n"
        "assert close(cpu.sparse_ffn(x, W, W, Wd, idx), h @ Wd[idx])\n"
        "from minisparse.kernels.cpu_build import describe_build\n"
        "said = describe_build()\n"
        "assert said == \"torch path (the C compiler '/nonexistent/cc' is not usable)\", said\n"
        "print('ok')\n"
    )
    proc = run_python(code, CC="/nonexistent/cc", MINISPARSE_CACHE=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert not list(tmp_path.rglob("*.so"))


def test_fast_path_tests_skip_with_a_reason_without_a_compiler(tmp_path):
    """The kernel tests that need the compiled loops report a skip, not a failure."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(Path(__file__).parent / "test_kernels.py"),
            "-k",
            "prefetch_switch or follow_torch_threads or builds_wherever or refuse_out_of_range",
        ],
        env={**os.environ, "CC": "/nonexistent/cc", "MINISPARSE_TEST_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "4 skipped" in proc.stdout and "SKIPPED" in proc.stdout, proc.stdout[-3000:]


def test_compiler_without_openmp_builds_a_single_threaded_library(tmp_path):
    """A compiler that refuses -fopenmp (stock macOS clang) still gives the fast path, on one
    thread, with a warning naming the fix."""
    real = cpu.find_compiler()
    if real is None or cpu.resolve_compiler(real) is None:
        pytest.skip("no C compiler here")
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do [ "$arg" = "-fopenmp" ] && exit 1; done\n'
        f'exec {cpu.resolve_compiler(real).path} "$@"\n'
    )
    wrapper.chmod(0o755)
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from minisparse.kernels import cpu\n"
        "    lib = cpu.load_library()\n"
        "assert lib is not None and not lib.built_with_openmp()\n"
        "assert any('no OpenMP' in str(w.message) for w in caught), caught\n"
        "torch.set_num_threads(2)\n"
        "assert cpu.fast_path_threads() == 1\n"
        "g = torch.Generator().manual_seed(1)\n"
        "Wt, v = torch.randn(1100, 1000, generator=g), torch.randn(2, 1100, generator=g)\n"
        "assert torch.allclose(cpu.dense_gemv(Wt, v), (v.double() @ Wt.double()).float(),\n"
        "                      rtol=1e-4, atol=1e-3)\n"
        "print('ok')\n"
    )
    proc = run_python(code, CC=str(wrapper), MINISPARSE_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_library_key_follows_compiler_flags_and_cpu(monkeypatch):
    base = cpu.Compiler(("cc",), "/usr/bin/gcc-12", "gcc 12.2")
    key = cpu.library_key(base)
    assert key == cpu.library_key(cpu.Compiler(("cc",), "/usr/bin/gcc-12", "gcc 12.2"))
    assert key != cpu.library_key(dataclasses.replace(base, path="/opt/gcc-13/bin/gcc"))
    assert key != cpu.library_key(dataclasses.replace(base, version="gcc 12.3"))
    assert key != cpu.library_key(dataclasses.replace(base, command=("cc", "-m32")))
    assert key != cpu.library_key(base, target="x86-64-v3")  # the -march flag is in the key
    monkeypatch.setattr(cpu_build, "cpu_identity", lambda: "another CPU")
    assert key != cpu.library_key(base)


def test_compiler_is_resolved_to_its_real_path():
    spec = cpu.find_compiler()
    found = None if spec is None else cpu.resolve_compiler(spec)
    if found is None:
        pytest.skip("no C compiler here")
    assert os.path.isabs(found.path) and os.path.realpath(found.path) == found.path
    assert found.version
    assert cpu.resolve_compiler("/nonexistent/cc") is None
    assert cpu.resolve_compiler("") is None


def test_local_headers_are_pasted_into_the_source(tmp_path):
    from minisparse.kernels.cpu_build import with_local_headers

    (tmp_path / "shared.h").write_text("static int twice(int x) { return 2 * x; }\n")
    source = '#include <math.h>\n#include "shared.h"\nint f(void) { return twice(3); }\n'
    text = with_local_headers(source, tmp_path)
    assert text.startswith("#include <math.h>\nstatic int twice")
    assert '"shared.h"' not in text
    # the package's own C files compile from one text with the shared vector helpers in it
    step = with_local_headers(cpu_build_source("step.c"))
    assert "load16_i8" in step and '#include "simd.h"' not in step


def cpu_build_source(name):
    from pathlib import Path

    import minisparse.kernels

    return (Path(minisparse.kernels.__file__).parents[1] / "runtime" / name).read_text()


def test_the_c_layout_of_every_struct_and_constant_matches_ctypes():
    """abi.h and abi.py declare the same structs and constants: each compiled library reports
    sizeof/offsetof as its compiler lays them out, and they equal ctypes' numbers."""
    from minisparse.kernels import abi, cpu_int8
    from minisparse.runtime.step import decode_library

    libraries = [cpu_build.load_library(), cpu_int8.int8_library(), decode_library()]
    if any(lib is None for lib in libraries):
        pytest.skip("no C compiler here: nothing compiled to compare")
    expected = abi.layout()
    assert expected[:6] == [40, 0, 8, 16, 24, 32]  # Mat: five 8-byte fields
    for lib in libraries:
        assert abi.c_layout(lib) == expected


def test_the_layout_check_catches_a_field_ctypes_lacks(monkeypatch):
    """Drop one field of a ctypes struct: the numbers no longer match the C side's."""
    import ctypes

    from minisparse.kernels import abi

    class Short(ctypes.Structure):
        _fields_ = abi.Slot._fields_[:1]

    before = abi.layout()
    monkeypatch.setattr(abi, "STRUCTS", (abi.Mat, Short, *abi.STRUCTS[2:]))
    assert abi.layout() != before
