"""Autoregressive generation: greedy, sampling (temperature, top-k, top-p) and streaming.

Decoding has two phases:

* **prefill** runs the whole prompt through the model in one call and fills the KV cache;
* **decode** feeds one token at a time; each step reads every weight once but does only
  2 * params FLOPs, so at batch 1 it is memory-bound.

With a KV cache a step attends to the stored keys/values of all earlier tokens (O(t) work);
without one (``use_cache=False``) every step recomputes the whole sequence (O(t^2)) and serves as
the reference the cache is checked against.

Sampling turns the last logits z into probabilities p = softmax(z / T); top-k keeps the k
largest, top-p (nucleus) keeps the smallest set whose mass reaches p; T = 0 means greedy argmax,
and top-k / top-p are refused with it (they would change nothing).

Randomness: with ``seed=`` a run draws from its own generator and repeats exactly; without it,
sampling draws from torch's global generator, so ``torch.manual_seed`` makes it repeatable too.

Every argument is checked before any work: a bad prompt, count or sampling setting raises one
``ValueError`` that names it and says what to pass instead.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kvcache.contiguous import make_kv_cache
from ..runtime.decoder import Decoder
from .model import Transformer, check_cache, check_count

__all__ = [
    "Prompt",
    "TextStreamer",
    "check_length",
    "check_messages",
    "check_prompt_ids",
    "check_sampling",
    "check_seed",
    "encode_prompt",
    "generate",
    "logits_to_probs",
    "make_generator",
    "next_token",
    "stop_ids",
]

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a string, chat messages (template applied), or token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("The prompt is empty; pass some text, chat messages or token ids.")
        return list(tokenizer(prompt)["input_ids"])  # with BOS where the model expects one
    prompt = list(prompt)
    if not prompt:
        raise ValueError("The prompt is empty; pass some text, chat messages or token ids.")
    if all(isinstance(m, dict) for m in prompt):
        check_messages(prompt)
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise TypeError(
        "prompt must be a string, a list of chat messages ({'role': ..., 'content': ...}) "
        "or a list of token ids."
    )


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Chat messages need a string ``role`` and a non-empty string ``content`` each."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"Chat message {i} must have a string 'role' and 'content', got {m!r}; e.g. "
                "{'role': 'user', 'content': 'Hello'}."
            )
        if not m["content"].strip():
            raise ValueError(
                f"Chat message {i} ({m['role']}) is empty; write something for the model to answer."
            )


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Every prompt token id must be in the model's vocabulary, 0 .. vocab_size - 1."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"Prompt token id {bad[0]} is outside the model's vocabulary (0 .. {vocab_size - 1}); "
            "encode the text with this model's tokenizer."
        )


def check_sampling(
    temperature: float, top_k: int | None = None, top_p: float | None = None
) -> None:
    """Refuse sampling settings that cannot work or would be silently ignored.

    ``temperature``: a finite number >= 0 (0 = greedy). ``top_k``: None or a whole number >= 1.
    ``top_p``: None or a number in (0, 1]. top-k / top-p filter what is *sampled*, so with
    greedy decoding they would do nothing: asking for both is an error.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}.")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"temperature must be >= 0 and finite, got {temperature}; use 0 for greedy "
            "decoding or e.g. 0.7 for sampling."
        )
    if top_k is not None:
        check_count(top_k, "top_k", fix="use None for no limit")
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float))
        or not 0 < top_p <= 1  # False for NaN too
    ):
        raise ValueError(f"top_p must be in (0, 1] (or None for no limit), got {top_p!r}.")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(
            "top_k and top_p choose among sampled tokens, but temperature 0 means greedy "
            "decoding, which ignores them; pass a temperature > 0 (e.g. 0.7) or drop top_k/top_p."
        )


def logits_to_probs(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Sampling distribution over the vocabulary from logits [..., vocab] (temperature > 0)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature must be > 0 for sampling; use 0 only for greedy decoding.")
    z = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token from the last logits [vocab]: argmax when temperature == 0.

    Without a ``generator`` sampling draws from torch's global generator (``torch.manual_seed``).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int) -> int:
    """prompt + new tokens, after checking that they fit the model's context."""
    check_count(max_new_tokens, "max_new_tokens", fix="ask for at least 1 new token")
    total = prompt_len + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"Prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {model.config.max_seq_len} tokens; shorten the prompt or ask "
            "for fewer tokens."
        )
    return total


def check_seed(seed: object) -> None:
    """A seed is None (torch's global generator) or a whole number >= 0."""
    if seed is not None:
        check_count(seed, "seed", minimum=0, fix="or None to use torch's global generator")


def make_generator(
    device: torch.device, seed: int | None, sampling: bool = True
) -> torch.Generator | None:
    """A generator seeded with ``seed``; None without a seed (or when not sampling).

    None makes torch's sampling functions draw from the global generator of ``device``, so
    ``torch.manual_seed(s)`` before a call makes an unseeded run repeatable.
    """
    check_seed(seed)
    if seed is None or not sampling:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def stop_ids(model: Transformer, tokenizer: Any) -> set[int]:
    """Token ids that end generation: the config's EOS ids plus the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class TextStreamer:
    """Print decoded text as tokens arrive (decodes the whole tail so multi-byte pieces join)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.ids: list[int] = []
        self.printed = 0

    def put(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.write(text[self.printed :])
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(text[self.printed :] + "\n")  # whatever was held back for a missing byte


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Any,
    prompt: Prompt,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    stream: bool | Callable[[str], Any] = False,
    cache: str | Sequence[Any] = "static",
    compiled: bool = True,
    stop_at_eos: bool = True,
    **cache_options: int,
) -> list[int]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt``; returns the new token ids.

    Stops after an end-of-sequence token (which is included); ``stop_at_eos=False`` goes on to
    exactly ``max_new_tokens`` (benchmarks compare runs of equal length). ``stream=True`` prints
    the text as it is produced; a callable receives the text pieces instead. ``cache`` picks the
    KV cache: ``"static"`` (default), ``"paged"`` (``block_size=``), ``"sink"`` (``n_sink=``,
    ``window=``), ``"h2o"`` (``budget=``, ``recent=``), or a fresh per-layer cache object
    (``minisparse.kvcache``). Sampling without ``seed`` draws from torch's global generator
    (``torch.manual_seed`` makes it repeatable). With ``compiled`` (default) a float32 model on
    the CPU decodes through ``minisparse.runtime.decoder.Decoder`` (one compiled call per block
    half, same results); ``compiled=False`` runs every step as torch modules. Every argument is
    checked before any work.
    """
    check_sampling(temperature, top_k, top_p)
    check_count(max_new_tokens, "max_new_tokens", fix="ask for at least 1 new token")
    check_seed(seed)
    if not isinstance(cache, str):
        check_cache(cache, model.config.n_layers)
    ids = encode_prompt(tokenizer, prompt)
    check_prompt_ids(ids, model.config.vocab_size)
    total = check_length(model, len(ids), max_new_tokens)
    device = model.device
    generator = make_generator(device, seed, sampling=temperature > 0)
    streamer = None
    if stream:
        streamer = TextStreamer(tokenizer, stream if callable(stream) else None)
    stops = stop_ids(model, tokenizer) if stop_at_eos else set()

    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    if not use_cache:
        if cache != "static" or cache_options:
            raise ValueError("use_cache=False recomputes everything; drop the cache arguments.")
        kv = None
    elif isinstance(cache, str):
        kv = make_kv_cache(cache, model.config, total, 1, model.dtype, device, **cache_options)
    elif cache_options:
        raise ValueError("Cache options apply to a cache name; configure a cache object itself.")
    else:
        kv = cache
    input_pos = torch.arange(len(ids), device=device)
    decoder = (
        Decoder(model, kv) if compiled and kv is not None and Decoder.supports(model) else None
    )
    out: list[int] = []
    for _ in range(max_new_tokens):
        if decoder is not None and out:  # a single new token: the compiled step
            logits = decoder.step(out[-1], len(ids) + len(out) - 1)
        else:
            hidden = (
                model.hidden_states(tokens, input_pos, kv)
                if use_cache
                else model.hidden_states(tokens)
            )
            logits = model.lm_head(hidden[0, -1])
        tok = next_token(logits, temperature, top_k, top_p, generator)
        out.append(tok)
        if streamer is not None:
            streamer.put(tok)
        if tok in stops:
            break
        new = torch.tensor([[tok]], dtype=torch.long, device=device)
        if use_cache:
            tokens, input_pos = new, input_pos[-1:] + 1
        else:
            tokens = torch.cat([tokens, new], dim=1)
    if streamer is not None:
        streamer.end()
    return out
