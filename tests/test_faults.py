"""Nothing lost: cache writes under a full disk and after a kill (tests/faults.py)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from faults import kill_when, run_with_disk_limit

from minisparse.files.cache import save_tensors_atomic, sweep_temporaries, write_dir_atomic
from minisparse.io.weight_cache import build_lock, write_or_warn

BIG_WRITE = (
    "import torch, warnings\n"
    "from pathlib import Path\n"
    "from minisparse.files.cache import save_tensors_atomic\n"
    "from minisparse.io.weight_cache import write_or_warn\n"
    "out = Path({out!r})\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    ok = write_or_warn('the weights', lambda: save_tensors_atomic(\n"
    "        {{'w': torch.ones(4_000_000)}}, out, {{}}))\n"
    "print(ok, [str(w.message) for w in caught])\n"
)


def test_a_full_disk_costs_a_warning_and_leaves_no_file(tmp_path):
    out = tmp_path / "cache" / "model.safetensors"
    proc = run_with_disk_limit(BIG_WRITE.format(out=str(out)), limit_bytes=1_000_000)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("False [") and "Could not write the weights" in proc.stdout
    assert not out.exists() and not list(out.parent.iterdir())  # no temporary left either


def test_a_killed_write_leaves_only_a_temporary_that_the_next_builder_sweeps(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"the good file")
    ready = tmp_path / "writing"
    code = (
        "import torch\n"
        "from pathlib import Path\n"
        "import minisparse.files.cache as c\n"
        "real = c.save_file\n"
        "def slow(tensors, tmp, metadata):\n"
        f"    Path({str(ready)!r}).touch()\n"
        "    import time; time.sleep(60)\n"
        "c.save_file = slow\n"
        f"out = Path({str(folder)!r}) / 'model.safetensors'\n"
        "c.save_tensors_atomic({'w': torch.ones(10)}, out, {})\n"
    )
    assert kill_when(code, ready) < 0
    assert (folder / "model.safetensors").read_bytes() == b"the good file"  # untouched
    orphans = list(folder.glob("*.tmp"))
    assert orphans  # the orphan the kill left
    (folder / ".tmpXYZ123").write_bytes(b"another library's orphan")
    (folder / "fresh.tmp").write_bytes(b"a writer at work right now")
    for old in [*orphans, folder / ".tmpXYZ123"]:
        os.utime(old, (0, 0))  # left long ago
    with build_lock(folder) as locked:
        assert locked
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "fresh.tmp", "model.safetensors"]


def test_sweep_removes_files_and_folders_and_keeps_the_rest(tmp_path):
    (tmp_path / "a.tmp").write_text("x")
    (tmp_path / "b.tmp").mkdir()
    (tmp_path / "b.tmp" / "inner").write_text("y")
    (tmp_path / "model.safetensors").write_text("keep")
    (tmp_path / "tokenizer").mkdir()
    assert sweep_temporaries(tmp_path) == []  # fresh: they may belong to a writer at work
    for name in ("a.tmp", "b.tmp"):
        os.utime(tmp_path / name, (0, 0))
    removed = sweep_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == ["a.tmp", "b.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "tokenizer"]


def test_a_failing_folder_write_keeps_the_old_folder(tmp_path):
    target = tmp_path / "tokenizer"
    target.mkdir()
    (target / "tokenizer.json").write_text("old")

    def fail(folder: Path) -> None:
        (folder / "tokenizer.json").write_text("half")
        raise OSError(28, "No space left on device")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not write_or_warn("the tokenizer", lambda: write_dir_atomic(target, fail))
    assert "No space left" in str(caught[0].message)
    assert (target / "tokenizer.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]


def test_safetensors_errors_become_os_errors(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import minisparse.files.cache as C

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(C, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        save_tensors_atomic({"w": torch.ones(2)}, tmp_path / "m.safetensors", {})
    assert not list(tmp_path.iterdir())


def test_a_failed_final_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    import minisparse.files.cache as C

    target = tmp_path / "export"
    target.mkdir()
    (target / "config.json").write_text("old")
    real = os.replace
    calls = []

    def failing(src, dst):
        calls.append(dst)
        if Path(dst) == target and Path(src).suffix == ".tmp":  # the new folder into place
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(C.os, "replace", failing)
    with pytest.raises(OSError, match="cross-device"):
        write_dir_atomic(target, lambda folder: (folder / "config.json").write_text("new"))
    assert (target / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
