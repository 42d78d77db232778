"""Fault injection for the tests: run Python code in a child process under a full disk (a
file-size limit: writes past it fail with EFBIG, as on a full disk) or kill it mid-way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELUDE = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"


def run_with_disk_limit(code: str, limit_bytes: int, **env: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter that cannot write a file larger than the limit."""
    return subprocess.run(
        [sys.executable, "-c", PRELUDE.format(limit=limit_bytes) + code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def kill_when(code: str, ready: Path, **env: str) -> int:
    """Start ``code``, wait until it creates the file ``ready``, then SIGKILL it (an
    interrupted write: power loss, OOM killer). Returns the child's exit status."""
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env})
    deadline = time.monotonic() + 300
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    return proc.wait(timeout=60)
