"""How the kernels package sets itself up: without Triton, and with a damaged compiled library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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


def test_damaged_compiled_library_is_rebuilt(tmp_path):
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from minisparse.kernels import cpu\n"
        "print(cpu.fast_path_available())\n"
    )
    first = run_python(code, MINISPARSE_CACHE=str(tmp_path))
    assert first.stdout.strip() == "True", first.stderr
    (lib,) = (tmp_path / "cpu_kernels").glob("*.so")
    lib.write_bytes(b"not a shared library")
    second = run_python(code, MINISPARSE_CACHE=str(tmp_path))
    assert second.stdout.strip() == "True", second.stderr
    assert Path(lib).stat().st_size > 1000
