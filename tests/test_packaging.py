"""Packaging: pyproject and environment.yml agree; kernels install as minisparse.kernels."""

from __future__ import annotations

import importlib.util
import re
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


def test_kernels_are_a_subpackage_not_a_top_level_module():
    import minisparse.kernels

    assert Path(minisparse.kernels.__file__).parent.name == "kernels"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or "minisparse" not in str(spec.origin or "")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["package-dir"] == {"minisparse.kernels": "kernels"}
