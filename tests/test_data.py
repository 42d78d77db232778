"""Corpora, token batches and perplexity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.io.data import corpus, dedupe_paragraphs, pydoc_text, split_text, token_batches
from minisparse.io.eval import mean_nll, perplexity


def test_splits_are_disjoint_deterministic_and_complete():
    parts = {s: corpus(split=s) for s in ("train", "calib", "eval")}
    paragraphs = {s: set(t.split("\n\n")) for s, t in parts.items()}
    assert all(len(t) > 20_000 for t in parts.values())
    joined = "\n\n".join(parts[s] for s in ("train", "calib", "eval"))
    assert joined == dedupe_paragraphs(pydoc_text())
    assert not (paragraphs["eval"] - {""}) & paragraphs["train"]
    assert not (paragraphs["calib"] - {""}) & paragraphs["train"]
    assert corpus(split="eval") == parts["eval"]
    assert 0.75 < len(parts["train"]) / len(joined) < 0.85


def test_dedupe_keeps_first_occurrences():
    assert dedupe_paragraphs("a\n\nb\n\na\n\nc\n\nb") == "a\n\nb\n\nc"


def test_text_file_corpus(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 5 for i in range(100)))
    train, ev = corpus(str(path), "train"), corpus(str(path), "eval")
    assert "paragraph 0 " in train and "paragraph 99 " in ev and "paragraph 99 " not in train
    with pytest.raises(FileNotFoundError, match="path of a text file"):
        corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="Unknown split"):
        split_text("abc", "test")


def test_token_batches(embedded):
    _, tokenizer = embedded
    text = corpus(split="calib")
    batches = token_batches(tokenizer, text, seq_len=128, n=5)
    assert batches.shape == (5, 128) and batches.dtype == torch.long
    assert tokenizer.decode(batches[0, :20]) in text
    with pytest.raises(ValueError, match="ask for n <="):
        token_batches(tokenizer, "a short text", seq_len=128, n=2)


def test_perplexity_against_float64_reference():
    model = tiny_model(seed=21)
    ids = torch.randint(0, 97, (3 * 16 + 5,), generator=torch.Generator().manual_seed(22))
    got = perplexity(model, ids, seq_len=16, batch_size=2, progress=False)
    model64 = tiny_model(seed=21).double()
    windows = ids[:48].view(3, 16)
    with torch.no_grad():
        logits = model64(windows)[:, :-1]
    ref = F.cross_entropy(logits.reshape(-1, 97), windows[:, 1:].reshape(-1))
    assert math.isclose(got, math.exp(ref.item()), rel_tol=1e-5)
    assert math.isclose(math.log(got), mean_nll(model, ids, 16, progress=False), rel_tol=1e-6)
    with pytest.raises(ValueError, match="smaller seq_len"):
        perplexity(model, ids[:10], seq_len=16, progress=False)


def test_embedded_model_perplexity_is_sane(embedded):
    model, tokenizer = embedded
    ids = token_batches(tokenizer, corpus(split="eval"), 256, 2)
    ppl = perplexity(model, ids, seq_len=256, progress=False)
    assert 3.0 < ppl < 40.0  # a trained model on English prose; random weights give ~49152
