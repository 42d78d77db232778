"""Generation: cached vs uncached decoding, transformers' greedy decoding, sampling, prompts."""

from __future__ import annotations

import pytest
import torch

from conftest import IdTokenizer, tiny_model
from minisparse.bench import hf_greedy
from minisparse.core.sampling import encode_prompt, logits_to_probs, next_token
from minisparse.io.hf import to_hf
from minisparse.runtime.generate import generate


def test_cache_equals_no_cache_on_embedded_model(embedded):
    model, tokenizer = embedded
    prompt = "The for statement is used to iterate over the elements of a sequence"
    cached = generate(model, tokenizer, prompt, max_new_tokens=32)
    uncached = generate(model, tokenizer, prompt, max_new_tokens=32, use_cache=False)
    assert len(cached) == 32
    assert cached == uncached


def test_greedy_matches_transformers_generate():
    model = tiny_model(seed=11)
    hf = to_hf(model)
    prompt = [5, 17, 3, 88, 41, 2]
    ours = generate(model, IdTokenizer(), prompt, max_new_tokens=40)
    with torch.inference_mode():
        theirs = hf_greedy(hf, prompt, 40, [])
    assert ours == theirs and len(ours) == 40


def test_cache_equals_no_cache_when_sampling():
    model = tiny_model(seed=12)
    kw = {"max_new_tokens": 30, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 123}
    a = generate(model, IdTokenizer(), "1 2 3", **kw)
    b = generate(model, IdTokenizer(), "1 2 3", use_cache=False, **kw)
    c = generate(model, IdTokenizer(), "1 2 3", **{**kw, "seed": 124})
    assert a == b
    assert a != c  # another seed gives another sample (30 draws from a near-flat distribution)


def test_stops_at_eos():
    model = tiny_model(seed=13)
    free = generate(model, IdTokenizer(), "4 5 6", max_new_tokens=20)
    stop = free[7]
    model.config.eos_token_ids = [stop]
    try:
        stopped = generate(model, IdTokenizer(), "4 5 6", max_new_tokens=20)
    finally:
        model.config.eos_token_ids = []
    first = free.index(stop)
    assert stopped == free[: first + 1]
    model.config.eos_token_ids = [stop]
    try:
        on = generate(model, IdTokenizer(), "4 5 6", max_new_tokens=20, stop_at_eos=False)
    finally:
        model.config.eos_token_ids = []
    assert on == free  # every token, the end-of-sequence one included


def test_top_k_and_top_p():
    torch.manual_seed(14)
    logits = torch.randn(50) * 2
    probs = logits_to_probs(logits, temperature=1.0, top_k=5)
    assert int((probs > 0).sum()) == 5
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    assert set(probs.nonzero().flatten().tolist()) == set(torch.topk(logits, 5).indices.tolist())
    full = torch.softmax(logits, -1)
    nucleus = logits_to_probs(logits, temperature=1.0, top_p=0.8)
    kept = nucleus > 0
    order = torch.argsort(full, descending=True)
    n = int(kept.sum())
    assert full[order[: n - 1]].sum() < 0.8 <= full[order[:n]].sum()  # the smallest such set
    assert torch.allclose(nucleus[kept], full[kept] / full[kept].sum())
    # temperature -> 0 with top_k = 1 is greedy
    assert next_token(logits, temperature=0.5, top_k=1) == int(logits.argmax())


def test_sampling_follows_the_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    gen = torch.Generator().manual_seed(15)
    draws = torch.tensor([next_token(logits, 1.0, generator=gen) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.03)


def test_prompt_forms(embedded):
    model, tokenizer = embedded
    messages = [{"role": "user", "content": "Say hi."}]
    ids = encode_prompt(tokenizer, messages)
    text = tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert generate(model, tokenizer, messages, max_new_tokens=5) == generate(
        model, tokenizer, ids, max_new_tokens=5
    )


def test_stream_prints_the_decoded_text(embedded):
    model, tokenizer = embedded
    pieces: list[str] = []
    ids = generate(model, tokenizer, "Python is", max_new_tokens=12, stream=pieces.append)
    assert "".join(pieces).rstrip("\n") == tokenizer.decode(ids, skip_special_tokens=True)


def test_bad_prompts_are_clear_errors(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tokenizer, "")
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tokenizer, [])
    with pytest.raises(ValueError, match="shorten the prompt"):
        generate(model, tokenizer, [1] * 8190, max_new_tokens=10)
    with pytest.raises(ValueError, match="at least 1"):
        generate(model, tokenizer, "hi", max_new_tokens=0)
    with pytest.raises(TypeError, match="chat messages"):
        generate(model, tokenizer, [1.5, 2.5])
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(3), temperature=0.0)


def test_bad_sampling_arguments():
    logits = torch.randn(10)
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        logits_to_probs(logits, 1.0, top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        logits_to_probs(logits, 1.0, top_p=0.0)


def test_streamer_flushes_held_back_text_at_the_end():
    from minisparse.core.sampling import TextStreamer

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "ab" + "\ufffd" * (len(ids) - 1)

    pieces: list[str] = []
    streamer = TextStreamer(Tok(), pieces.append)
    streamer.put(1)
    streamer.put(2)  # ends with U+FFFD: held back, it may be half a character
    streamer.end()
    assert "".join(pieces) == "ab\ufffd\n"


def test_sampling_without_a_seed_follows_torch_manual_seed():
    model = tiny_model(seed=16)
    kw = {"max_new_tokens": 20, "temperature": 1.0}
    torch.manual_seed(5)
    a = generate(model, IdTokenizer(), "1 2 3", **kw)
    torch.manual_seed(5)
    b = generate(model, IdTokenizer(), "1 2 3", **kw)
    torch.manual_seed(6)
    c = generate(model, IdTokenizer(), "1 2 3", **kw)
    assert a == b
    assert a != c  # 20 draws from a near-flat distribution over 97 tokens
    torch.manual_seed(5)
    assert generate(model, IdTokenizer(), "1 2 3", seed=5, **kw) == generate(
        model, IdTokenizer(), "1 2 3", seed=5, **kw
    )  # a seed gives its own generator, whatever the global state


def test_greedy_refuses_sampling_filters():
    model = tiny_model(seed=17)
    with pytest.raises(ValueError, match="greedy decoding, which ignores them"):
        generate(model, IdTokenizer(), "1 2", max_new_tokens=2, top_k=5)
    with pytest.raises(ValueError, match="greedy decoding, which ignores them"):
        generate(model, IdTokenizer(), "1 2", max_new_tokens=2, top_p=0.5)
