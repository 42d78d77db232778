"""The KV cache: how big it is, how serving systems store it, and how to bound it.

**Size.** Every layer keeps a key and a value vector per K/V head for every token seen, so

    bytes = 2 (K and V) * n_layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_elem.

Llama-2-7B (32 layers, 32 heads of 128, fp16) needs 2 * 32 * 32 * 128 * 2 = 512 KiB per token.
With GQA the cache shrinks by n_heads / n_kv_heads; a decode step reads all of it, so it is also
memory traffic.

Four ways to hold it, all made by ``make_kv_cache`` and all run by ``model(tokens, pos, cache)``:

* **static** (``minisparse.core.model.KVCache``): one preallocated [max_len] buffer per layer; no
  allocation while decoding, but a server that reserves max_len per request wastes whatever the
  request does not use;
* **paged** (vLLM, Kwon et al., 2023; ``kvcache.paged``): a pool of fixed-size blocks, a block
  table per sequence, blocks allocated on demand and shared between sequences with a common
  prefix (copy-on-write). Waste is at most one partial block per sequence;
* **sink** (StreamingLLM, Xiao et al., 2024; ``kvcache.eviction``): the first ``n_sink``
  tokens plus the last ``window``, a fixed memory whatever the length;
* **h2o** (H2O, Zhang et al., 2023; ``kvcache.eviction``): per K/V head the ``recent`` newest
  tokens plus those with the most accumulated attention, up to ``budget``.

``token_nll`` measures what a bounded cache costs: the loss of every token of a long text fed
through the cache in chunks, against the full cache.

References: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023); Xiao et al., "Efficient Streaming Language Models with Attention
Sinks" (ICLR 2024); Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
of Large Language Models" (NeurIPS 2023).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.model import KVCache, ModelConfig, Transformer, check_count, make_cache
from .eviction import H2OCache, SinkCache
from .paged import (
    BlockManager,
    OutOfBlocks,
    PagedKVCache,
    PagedLayer,
    Trace,
    WasteReport,
    random_trace,
    simulate_waste,
)

CACHE_KINDS = ("static", "paged", "sink", "h2o")


def kv_cache_bytes(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    bytes_per_elem: float = 2,
) -> int:
    """Bytes of keys and values: 2 * layers * kv_heads * head_dim * seq_len * batch * bytes."""
    sizes = {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "batch": batch}
    for name, value in sizes.items():
        check_count(value, name)
    check_count(seq_len, "seq_len", minimum=0)
    if not bytes_per_elem > 0:
        raise ValueError(
            f"Need seq_len >= 0 and bytes_per_elem > 0, got {seq_len} and {bytes_per_elem}."
        )
    return round(2 * n_layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_elem)


def make_kv_cache(
    kind: str,
    config: ModelConfig,
    max_seq_len: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **options: int,
) -> Sequence:
    """Per-layer caches of one kind for a model: ``"static"``, ``"paged"`` (``block_size``),
    ``"sink"`` (``n_sink``, ``window``) or ``"h2o"`` (``budget``, ``recent``)."""
    allowed = {"static": (), "paged": ("block_size",), "sink": ("n_sink", "window")}
    allowed["h2o"] = ("budget", "recent")
    if kind not in allowed:
        raise ValueError(f"Unknown cache {kind!r}; use one of {CACHE_KINDS} or a cache object.")
    unknown = set(options) - set(allowed[kind])
    if unknown:
        raise ValueError(
            f"Options {sorted(unknown)} do not apply to the {kind!r} cache; "
            f"it takes {list(allowed[kind]) or 'no options'}."
        )
    check_count(max_seq_len, "max_seq_len")
    check_count(batch, "batch")
    if kind == "static":
        return make_cache(config, batch, max_seq_len, dtype, device)
    if batch != 1:
        raise ValueError(f"The {kind!r} cache runs batch 1; got batch {batch}.")
    if kind == "paged":
        block_size = check_count(options.get("block_size", 16), "block_size", fix="e.g. 16")
        n_blocks = math.ceil(max_seq_len / block_size)
        return PagedKVCache(config, n_blocks, block_size, dtype, device)
    if kind == "sink":
        return [SinkCache(**options) for _ in range(config.n_layers)]
    return [H2OCache(**options) for _ in range(config.n_layers)]


@torch.inference_mode()
def token_nll(
    model: Transformer, token_ids: Tensor, cache: Sequence | None = None, chunk: int = 64
) -> Tensor:
    """Negative log-likelihood of every token after the first, fed in chunks through ``cache``.

    ``token_ids`` is 1-D; the result [n - 1] holds -log p(t_{i+1} | what the cache kept of
    t_0..t_i). Feeding chunks costs O(n (kept + chunk)) instead of re-running a window per
    token. ``cache=None`` uses a static cache (the full-attention reference).
    """
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError("token_ids must be a 1-D tensor of at least 2 token ids.")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}.")
    n = token_ids.numel()
    device = model.device
    if cache is None:
        cache = make_cache(model.config, 1, n, model.dtype, device)
    ids = token_ids.to(device)
    out = []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        logits = model(ids[None, start:end], torch.arange(start, end, device=device), cache)
        out.append(F.cross_entropy(logits[0].float(), ids[start + 1 : end + 1], reduction="none"))
    return torch.cat(out).cpu()


__all__ = [
    "CACHE_KINDS",
    "BlockManager",
    "H2OCache",
    "KVCache",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedLayer",
    "SinkCache",
    "Trace",
    "WasteReport",
    "kv_cache_bytes",
    "make_cache",
    "make_kv_cache",
    "random_trace",
    "simulate_waste",
    "token_nll",
]
