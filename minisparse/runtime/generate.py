"""Autoregressive generation: greedy, sampling (temperature, top-k, top-p) and streaming.

Decoding has two phases:

* **prefill** runs the whole prompt through the model in one call and fills the KV cache;
* **decode** feeds one token at a time; each step reads every weight once but does only
  2 * params FLOPs, so at batch 1 it is memory-bound.

With a KV cache a step attends to the stored keys/values of all earlier tokens (O(t) work);
without one (``use_cache=False``) every step recomputes the whole sequence (O(t^2)) and serves as
the reference the cache is checked against. A float32 model on the CPU decodes its single-token
steps through the compiled step (``Decoder``), which is why generation sits above the model, the
KV caches and the runtime; prompts, sampling and their checks are the model's own
(``minisparse.core.sampling``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.model import Transformer, check_cache, check_count
from ..core.sampling import (
    Prompt,
    TextStreamer,
    check_length,
    check_prompt_ids,
    check_sampling,
    check_seed,
    encode_prompt,
    make_generator,
    next_token,
    stop_ids,
)
from ..kvcache.contiguous import make_kv_cache
from .decoder import Decoder

__all__ = ["generate"]


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
