"""What every benchmark writes with ``--json FILE``: one shape, one writer.

A result file is a JSON object with the machine it ran on (``measure.machine``: CPU, vector
ISA, read bandwidth measured in the run), the date, the command that made it, the command's
options, and then the benchmark's own fields (its rows, costs, ...). It is written atomically
(``files.cache``): an interrupted run leaves the earlier file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..files.cache import atomic_write_text
from ..measure.machine import Machine

__all__ = ["result", "settings_of", "write_result"]


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as JSON values (paths as text; the output options left out)."""
    skip = ("func", "json", "record", "argv")
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}


def result(args: argparse.Namespace, about: Machine, **fields: Any) -> dict[str, Any]:
    """A benchmark's result: machine, date, command and settings, then ``fields``."""
    return {
        "machine": about.as_dict(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "minisparse " + " ".join(getattr(args, "argv", [])),
        "settings": settings_of(args),
        **fields,
    }


def write_result(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``--json`` when it was given, and say where."""
    if args.json is None:
        return
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {path}")
