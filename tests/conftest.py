"""Shared fixtures: the embedded model (loaded once), transformers' reference, tiny models.

The whole session (unit tests and the notebooks nbval runs) uses a new, empty weight cache in a
temporary folder: every run takes the first-load path a new user takes (GGUF through transformers,
then the cache), and no test ever reads or writes the user's own cache. Set
``MINISPARSE_TEST_CACHE`` to a folder to keep that cache between runs instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

import minisparse
from minisparse.core.model import ModelConfig, Transformer, init_weights
from minisparse.io.loading import load_hf_reference

# Property tests draw the same examples on every run: a failure is reproducible, never luck.
settings.register_profile("deterministic", derandomize=True, print_blob=True, deadline=None)
settings.load_profile("deterministic")

_SESSION_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    keep = os.environ.get("MINISPARSE_TEST_CACHE")
    path = keep or tempfile.mkdtemp(prefix="minisparse-test-cache-")
    if not keep:
        _SESSION_CACHE.append(path)
    os.environ["MINISPARSE_CACHE"] = path  # inherited by subprocesses and notebook kernels
    # every notebook runs with the worked solutions plugged into its core builds: the learner's
    # path, end to end (the saved notebooks show the unsolved path: the library's code runs)
    os.environ["MINISPARSE_SOLUTIONS"] = str(
        Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M, shared by every test; do not modify."""
    return minisparse.load()


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own LlamaForCausalLM read from the embedded GGUF."""
    model, _ = load_hf_reference()
    return model.eval()


class IdTokenizer:
    """Stands in for a tokenizer on tiny random models: ids are written as numbers."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight config (2 layers) for fast exactness tests."""
    base = {
        "vocab_size": 97,
        "dim": 48,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 12,
        "ffn_dim": 80,
        "rope_theta": 10000.0,
        "max_seq_len": 96,
        "tie_embeddings": True,
        "eos_token_ids": [],
    }
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, std: float = 0.02, **overrides) -> Transformer:
    return init_weights(Transformer(tiny_config(**overrides)), seed=seed, std=std).eval()


def save_tiny_hf(directory: Path, seed: int = 0, **config) -> Path:
    """Save a tiny random transformers LlamaForCausalLM with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = {
        "vocab_size": 101,
        "hidden_size": 48,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    defaults.update(config)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**defaults)).save_pretrained(directory)
    return directory
