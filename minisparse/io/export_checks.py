"""What an export refuses before any work: layers no file format holds, and folders it must
not write into or replace (``minisparse.io.export``'s checks, one place for each)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..core.model import MLP, Transformer
from ..core.plain import BLOCK_PROJECTIONS, check_plain_linears

__all__ = ["EXPORT_MARK", "check_export_folder", "check_plain_mlps", "check_writable_folder"]


def check_plain_mlps(model: Transformer) -> None:
    """Exports hold dense weights: sparse or split MLPs are an execution choice, not a format;
    every projection must be a float linear layer with finite weights (not N:M, NF4, LoRA or
    packed: ``core.plain.check_plain_linears`` names the first and the way back)."""

    for i, layer in enumerate(model.layers):
        if type(layer.mlp) is not MLP:
            raise ValueError(
                f"Layer {i}'s MLP is a {type(layer.mlp).__name__}; export the dense model (before "
                "sparsify_ / apply) and ship the predictors or placement beside it."
            )
    check_plain_linears(model, BLOCK_PROJECTIONS, "export")


def check_writable_folder(out: Path) -> None:
    """Refuse an export to ``out`` whose folder does not take a new file (a missing folder, a
    read-only or virtual file system such as /proc), naming ``out``, before any work: the
    export writes a temporary file beside ``out`` first, whose name would mean nothing."""
    folder = out.expanduser().absolute().parent
    while not folder.exists() and folder != folder.parent:  # made on the way: its parent counts
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(
            f"cannot write {out}: {folder} does not take new files ({err.strerror}); choose "
            "another place for the export."
        ) from err


#: The file every HF export writes into its folder: only a folder that holds it may be replaced.
EXPORT_MARK = "minisparse_export.json"


def check_export_folder(directory: Path) -> None:
    """An HF export replaces its folder whole: refuse a folder that is not empty and was not
    made by an export (no ``EXPORT_MARK``) — a project, a downloaded checkpoint, a model the
    export reads from."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; give a folder name for --format hf.")
    if directory.is_dir() and any(directory.iterdir()):
        if not (directory / EXPORT_MARK).is_file():
            raise ValueError(
                f"{directory} is not empty and was not made by minisparse export (no "
                f"{EXPORT_MARK}); an HF export replaces its folder whole, so choose a new or "
                "empty folder."
            )
