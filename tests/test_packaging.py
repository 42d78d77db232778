"""Packaging: pyproject and environment.yml agree; the kernels are ``minisparse.kernels`` only,
never a top-level ``kernels`` that would hide Hugging Face's package of that name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


ROOT = Path(__file__).resolve().parents[1]


def requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


def environment_pip_section() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    reqs = []
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if not stripped.startswith("- "):
            break
        reqs.append(stripped[2:].strip().strip("\"'"))
    return reqs


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"] + project["optional-dependencies"]["dev"])
    env = requirement_names([r for r in environment_pip_section() if not r.startswith("-e")])
    assert declared == env, f"only in pyproject: {declared - env}; only in env: {env - declared}"


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_repo_root_does_not_shadow_hugging_face_kernels():
    """From the repository root (first on sys.path for ``python -c``, ``python -m pytest`` and
    notebooks opened there), transformers must still find its own ``kernels`` package when it
    builds a model, and ``minisparse.kernels`` must still import."""
    code = (
        "import importlib.util, pathlib\n"
        "import transformers.integrations.hub_kernels\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "import minisparse.kernels\n"
        "from minisparse.kernels import cpu, gather_gemv_ref\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "origin = spec.origin if spec else None\n"
        "here = pathlib.Path.cwd()\n"
        "shadows = (here / 'kernels' / '__init__.py', here / 'kernels.py')\n"
        "assert origin is None or pathlib.Path(origin) not in shadows, origin\n"
        "print('ok')\n"
    )
    result = run_python(code, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_no_top_level_kernels_package_in_the_checkout():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "kernels.py").exists()
    assert (ROOT / "minisparse" / "kernels" / "__init__.py").is_file()


def pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args, "-q"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_wheel_ships_minisparse_kernels_and_no_top_level_kernels(tmp_path):
    """Build the wheel, install it into a bare folder and import the kernels from there."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(ROOT))
    (wheel,) = wheel_dir.glob("minisparse-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "minisparse/kernels/__init__.py" in names and "minisparse/kernels/cpu.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    pip("install", "--no-deps", "--target", str(target), str(wheel))
    code = (
        "import minisparse.kernels, pathlib, sys\n"
        "from minisparse.kernels import cpu, gather_gemv_ref, sparse_ffn_ref\n"
        f"assert pathlib.Path(minisparse.kernels.__file__).is_relative_to({str(target)!r})\n"
        "print('ok')\n"
    )
    result = run_python(code, cwd=tmp_path, PYTHONPATH=str(target))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
