"""Text corpora and token batches for calibration and evaluation.

The default corpus is the Python reference manual that ships with every CPython
(``pydoc_data.topics``): about 65k words of human-written English with code, available offline.
Paragraphs that occur more than once (the manual repeats some passages across topics) are kept
once, so no evaluation paragraph is also a training paragraph. The text is then split
deterministically into three disjoint parts by paragraph:

    train  the first 80 % of the characters   (fine-tuning, predictor training)
    calib  the next 10 %                       (thresholds, quantization calibration)
    eval   the last 10 %                       (perplexity)

Any local text file is split the same way; ``wikitext-2`` is read through ``datasets`` when the
network and that package are available (never needed by the tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SPLITS",
    "SPLIT_BOUNDS",
    "corpus",
    "dedupe_paragraphs",
    "encode",
    "pydoc_text",
    "split_text",
    "token_batches",
    "wikitext_text",
]

SPLITS = ("train", "calib", "eval", "all")
SPLIT_BOUNDS = {"train": (0.0, 0.8), "calib": (0.8, 0.9), "eval": (0.9, 1.0), "all": (0.0, 1.0)}


def pydoc_text() -> str:
    """The Python reference manual topics, sorted by name and joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def dedupe_paragraphs(text: str) -> str:
    """``text`` with every repeated paragraph after its first occurrence removed."""
    seen: set[str] = set()
    kept = []
    for par in text.split("\n\n"):
        key = par.strip()
        if key and key in seen:
            continue
        seen.add(key)
        kept.append(par)
    return "\n\n".join(kept)


def split_text(text: str, split: str) -> str:
    """The ``split`` part of ``text``, cut at paragraph boundaries by character share.

    A paragraph belongs to the split in which its first character falls, so the three parts are
    disjoint and together give back every paragraph.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {SPLITS}.")
    lo, hi = SPLIT_BOUNDS[split]
    paragraphs = text.split("\n\n")
    total = len(text)
    chosen, start = [], 0
    for par in paragraphs:
        share = start / total if total else 0.0
        if lo <= share < hi or (hi == 1.0 and share >= lo):
            chosen.append(par)
        start += len(par) + 2
    return "\n\n".join(chosen)


def wikitext_text(split: str) -> str:
    """WikiText-2 (raw) through ``datasets``; needs the network the first time."""
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError(
            "The 'wikitext-2' corpus needs the datasets package: pip install datasets"
        ) from err
    hf_split = {"train": "train", "calib": "validation", "eval": "test"}[split]
    rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=hf_split)
    return "".join(rows["text"])


def corpus(name: str = "pydoc", split: str = "eval") -> str:
    """Text of a corpus split: ``"pydoc"`` (default, offline), ``"wikitext-2"``, or a file path."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {SPLITS}.")
    if name == "pydoc":
        return split_text(dedupe_paragraphs(pydoc_text()), split)
    if name == "wikitext-2":
        return wikitext_text(split) if split != "all" else wikitext_text("train")
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"Unknown corpus {name!r}: use 'pydoc', 'wikitext-2', or the path of a text file."
        )
    return split_text(dedupe_paragraphs(path.read_text(encoding="utf-8")), split)


def encode(tokenizer: Any, text: str) -> Tensor:
    """All token ids of ``text`` (no special tokens) as a 1-D LongTensor."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def token_batches(tokenizer: Any, text: str, seq_len: int, n: int) -> Tensor:
    """The first ``n`` non-overlapping windows of ``seq_len`` tokens of ``text``: [n, seq_len]."""
    if seq_len < 2 or n < 1:
        raise ValueError(f"Need seq_len >= 2 and n >= 1, got seq_len={seq_len}, n={n}.")
    ids = encode(tokenizer, text)
    available = ids.numel() // seq_len
    if available < n:
        raise ValueError(
            f"The text has {ids.numel()} tokens: only {available} windows of {seq_len}; "
            f"ask for n <= {available}, a shorter seq_len, or a longer text."
        )
    return ids[: n * seq_len].view(n, seq_len)
