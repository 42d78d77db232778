"""The KV cache: how big it is, how serving systems store it, and how to bound it.

**Size.** Every layer keeps a key and a value vector per K/V head for every token seen, so

    bytes = 2 (K and V) * n_layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_elem.

Llama-2-7B (32 layers, 32 heads of 128, fp16) needs 2 * 32 * 32 * 128 * 2 = 512 KiB per token.
With GQA the cache shrinks by n_heads / n_kv_heads; a decode step reads all of it, so it is also
memory traffic.

**Static cache** (``minisparse.model.KVCache``): one preallocated [max_len] buffer per layer;
no allocation while decoding, but a server that reserves max_len per request wastes whatever
the request does not use.

**Paged cache** (vLLM, Kwon et al., 2023). Memory is a pool of fixed-size blocks of
``block_size`` tokens; each sequence has a *block table* mapping its logical block i to a
physical block, allocated on demand from a free list. Waste is at most one partial block per
sequence. Sequences that share a prompt prefix share its blocks (reference counts); the first
write into a shared block copies it (copy-on-write).

**Attention sinks** (StreamingLLM, Xiao et al., 2024). Keeping only the last ``window`` tokens
fails as soon as the first tokens leave: softmax needs somewhere to put attention mass that has
no better target, and models learn to park it on the first tokens. Keeping ``n_sink`` (4) first
tokens plus the window restores quality at a fixed memory.

**Heavy hitters** (H2O, Zhang et al., 2023). A few tokens collect most of the attention. Keep,
per K/V head, the ``budget - recent`` tokens with the largest accumulated attention plus the
``recent`` newest tokens; evict the rest.

Positions. The sink and H2O caches keep every key rotated at its *original* position, so a
query sees exactly the relative offsets it would see with the full cache; only which keys remain
changes. StreamingLLM instead renumbers positions inside the cache, which is needed to run past
the model's trained context; within it (our experiments) original positions isolate the effect
of eviction from that of new offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attention_weights, kv_group, position_mask, repeat_kv
from .model import KVCache, ModelConfig, Transformer, check_count, make_cache

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


# --- paged cache ----------------------------------------------------------------------------


class OutOfBlocks(MemoryError):
    """The block pool is exhausted."""


class BlockManager:
    """Block tables, a free-block allocator and reference counts; no tensors.

    Sequence ``s`` stores token position p in physical block ``tables[s][p // block_size]`` at
    offset ``p % block_size``. ``prepare_write`` allocates blocks on demand and returns the
    (source, destination) block copies that copy-on-write requires.
    """

    def __init__(self, n_blocks: int, block_size: int = 16) -> None:
        check_count(n_blocks, "n_blocks")
        check_count(block_size, "block_size", fix="e.g. 16 tokens per block")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.refs = [0] * n_blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.next_id = 0

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocks(
                f"All {self.n_blocks} blocks of {self.block_size} tokens are in use; create the "
                "cache with more blocks or free finished sequences."
            )
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def add_sequence(self) -> int:
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def fork(self, parent: int) -> int:
        """A new sequence sharing all of ``parent``'s blocks (prefix sharing)."""
        child = self.add_sequence()
        self.tables[child] = list(self.table(parent))
        self.lengths[child] = self.lengths[parent]
        for block in self.tables[child]:
            self.refs[block] += 1
        return child

    def free_sequence(self, seq: int) -> None:
        for block in self.table(seq):
            self.release(block)
        del self.tables[seq], self.lengths[seq]

    def table(self, seq: int) -> list[int]:
        if seq not in self.tables:
            raise KeyError(f"Unknown sequence {seq}; live sequences: {sorted(self.tables)}.")
        return self.tables[seq]

    def prepare_write(self, seq: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions start..end-1 of ``seq`` writable; return the blocks to copy."""
        table = self.table(seq)
        while len(table) * self.block_size < end:
            table.append(self.allocate())
        copies = []
        for i in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if self.refs[table[i]] > 1:  # shared: copy before writing
                fresh = self.allocate()
                copies.append((table[i], fresh))
                self.release(table[i])
                table[i] = fresh
        self.lengths[seq] = max(self.lengths[seq], end)
        return copies

    def slots(self, seq: int, positions: Tensor) -> Tensor:
        """Physical slot (block * block_size + offset) of each position of ``seq``."""
        table = torch.tensor(self.table(seq), dtype=torch.long)
        return table[positions.cpu() // self.block_size] * self.block_size + (
            positions.cpu() % self.block_size
        )

    @property
    def blocks_in_use(self) -> int:
        return self.n_blocks - len(self.free)


class PagedKVCache:
    """A paged KV cache for a whole model: one block pool per layer, shared block tables.

    ``cache[i]`` is layer i's view with the static cache's ``update`` protocol, so
    ``model(tokens, input_pos, cache)`` works unchanged. It runs the *active* sequence
    (``use(seq)``); ``fork()`` starts a sequence that shares the active one's prefix.
    """

    def __init__(
        self,
        config: ModelConfig,
        n_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.manager = BlockManager(n_blocks, block_size)
        shape = (config.n_layers, config.n_kv_heads, n_blocks * block_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [PagedLayer(self, i) for i in range(config.n_layers)]
        self.active = self.manager.add_sequence()

    def __getitem__(self, layer: int) -> PagedLayer:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def use(self, seq: int) -> None:
        self.manager.table(seq)  # raises for an unknown sequence
        self.active = seq

    def fork(self, seq: int | None = None) -> int:
        """A new sequence sharing ``seq``'s (default: the active one's) blocks."""
        return self.manager.fork(self.active if seq is None else seq)

    def write(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [1, kv_heads, t, d] at ``input_pos``; return positions 0..end-1."""
        if k.shape[0] != 1:
            raise ValueError(
                f"PagedKVCache runs one sequence at a time (batch 1), got batch {k.shape[0]}; "
                "fork() a sequence per request instead."
            )
        end = int(input_pos[-1]) + 1
        bs = self.manager.block_size
        for src, dst in self.manager.prepare_write(self.active, int(input_pos[0]), end):
            self.k[:, :, dst * bs : (dst + 1) * bs] = self.k[:, :, src * bs : (src + 1) * bs]
            self.v[:, :, dst * bs : (dst + 1) * bs] = self.v[:, :, src * bs : (src + 1) * bs]
        slots = self.manager.slots(self.active, input_pos).to(self.k.device)
        self.k[layer].index_copy_(1, slots, k[0])
        self.v[layer].index_copy_(1, slots, v[0])
        every = self.manager.slots(self.active, torch.arange(end)).to(self.k.device)
        return self.k[layer].index_select(1, every)[None], self.v[layer].index_select(1, every)[
            None
        ]


class PagedLayer:
    """Layer ``index`` of a ``PagedKVCache``, with the static cache's ``update`` protocol."""

    def __init__(self, cache: PagedKVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.write(self.index, input_pos, k, v)


@dataclass
class WasteReport:
    """Time-averaged KV memory of one storage scheme over a simulated trace."""

    scheme: str
    reserved_slots: float  # token slots held, averaged over decode steps
    used_slots: float  # token slots holding a live token (shared ones counted once)

    @property
    def waste(self) -> float:
        return 1.0 - self.used_slots / self.reserved_slots


@dataclass
class Trace:
    """Requests decoded together: prompt and output lengths, an optional shared prefix."""

    prompt_lens: list[int]
    output_lens: list[int]
    shared_prefix: int = 0
    steps: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.prompt_lens) != len(self.output_lens) or not self.prompt_lens:
            raise ValueError("Give one output length per prompt length, for at least one request.")
        if min(self.prompt_lens) <= self.shared_prefix or min(self.output_lens) < 1:
            raise ValueError("Every prompt must be longer than the shared prefix; outputs >= 1.")
        self.steps = list(range(max(self.output_lens)))


def random_trace(
    n_requests: int,
    max_prompt: int,
    max_output: int,
    seed: int = 0,
    shared_prefix: int = 0,
) -> Trace:
    """Uniformly random prompt (shared_prefix + 1 .. max_prompt) and output (1 .. max_output)
    lengths, seeded."""
    check_count(n_requests, "n_requests")
    check_count(max_output, "max_output")
    check_count(shared_prefix, "shared_prefix", minimum=0)
    check_count(
        max_prompt,
        "max_prompt",
        minimum=shared_prefix + 1,
        fix="prompts must be longer than the shared prefix",
    )
    rng = np.random.default_rng(seed)
    prompts = rng.integers(shared_prefix + 1, max_prompt + 1, n_requests).tolist()
    outputs = rng.integers(1, max_output + 1, n_requests).tolist()
    return Trace(prompts, outputs, shared_prefix)


def simulate_waste(trace: Trace, max_seq_len: int, block_size: int = 16) -> list[WasteReport]:
    """KV memory of a batch decoded step by step under four storage schemes.

    At step s, request r holds prompt_r + s tokens until its output is done, then leaves.
    * ``contiguous, max length``: each live request reserves ``max_seq_len`` slots;
    * ``contiguous, prompt + max output``: each reserves its prompt plus the longest output;
    * ``paged``: blocks on demand from a ``BlockManager``;
    * ``paged + shared prefix``: the same, the prompt prefix stored once (``fork``).
    """
    check_count(block_size, "block_size", fix="e.g. 16 tokens per block")
    check_count(max_seq_len, "max_seq_len")
    longest = max(p + o for p, o in zip(trace.prompt_lens, trace.output_lens, strict=True))
    if longest > max_seq_len:
        raise ValueError(f"A request needs {longest} tokens > max_seq_len={max_seq_len}.")
    max_out = max(trace.output_lens)
    reserved = {"max": 0, "bound": 0, "paged": 0, "shared": 0}
    used = {"private": 0, "shared": 0}
    total_blocks = sum(math.ceil((p + max_out) / block_size) + 1 for p in trace.prompt_lens)
    paged, shared = BlockManager(total_blocks, block_size), BlockManager(total_blocks, block_size)
    root = shared.add_sequence()
    if trace.shared_prefix:
        shared.prepare_write(root, 0, trace.shared_prefix)
    seqs = []
    for p in trace.prompt_lens:
        a = paged.add_sequence()
        paged.prepare_write(a, 0, p)
        b = shared.fork(root)
        shared.prepare_write(b, trace.shared_prefix, p)
        seqs.append((a, b))
    for s in trace.steps:
        for r, (p, o) in enumerate(zip(trace.prompt_lens, trace.output_lens, strict=True)):
            a, b = seqs[r]
            if s == o:  # finished at the previous step
                paged.free_sequence(a)
                shared.free_sequence(b)
            if s >= o:
                continue
            paged.prepare_write(a, p + s, p + s + 1)
            shared.prepare_write(b, p + s, p + s + 1)
            reserved["max"] += max_seq_len
            reserved["bound"] += p + max_out
            used["private"] += p + s + 1
            used["shared"] += p + s + 1 - trace.shared_prefix
        used["shared"] += trace.shared_prefix  # stored once while any request is live
        reserved["paged"] += paged.blocks_in_use * block_size
        reserved["shared"] += shared.blocks_in_use * block_size
    n = len(trace.steps)
    return [
        WasteReport("contiguous, max length", reserved["max"] / n, used["private"] / n),
        WasteReport("contiguous, prompt + max output", reserved["bound"] / n, used["private"] / n),
        WasteReport("paged", reserved["paged"] / n, used["private"] / n),
        WasteReport("paged + shared prefix", reserved["shared"] / n, used["shared"] / n),
    ]


# --- bounded caches: attention sinks and heavy hitters -----------------------------------------


class SinkCache:
    """StreamingLLM for one layer: the first ``n_sink`` tokens plus the last ``window`` tokens.

    A query at position p sees keys at positions j <= p with j < n_sink or j > p - window. Keys
    no later query can see are dropped at the next call, so the cache holds at most
    n_sink + window - 1 + (new tokens) entries and a prefill chunk is masked exactly as if its
    tokens had been fed one by one.
    """

    def __init__(self, n_sink: int = 4, window: int = 256) -> None:
        check_count(n_sink, "n_sink", minimum=0, fix="StreamingLLM keeps 4")
        check_count(window, "window", fix="e.g. 256 recent tokens")
        self.n_sink, self.window = n_sink, window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None  # [n] positions of the stored keys

    def visible(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[t, n] mask: causal, and either a sink or inside the query's window."""
        kept = (k_pos[None, :] < self.n_sink) | (k_pos[None, :] > q_pos[:, None] - self.window)
        return position_mask(q_pos, k_pos) & kept

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        if self.k is None:
            self.k, self.v, self.pos = k, v, input_pos.clone()
        else:
            keep = self.visible(input_pos[:1], self.pos)[0]
            self.k = torch.cat([self.k[:, :, keep], k], dim=2)
            self.v = torch.cat([self.v[:, :, keep], v], dim=2)
            self.pos = torch.cat([self.pos[keep], input_pos])
        gqa = kv_group(q, k) > 1
        if q.shape[2] == 1:  # everything kept is visible to the newest token
            return F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=gqa)
        mask = self.visible(input_pos, self.pos)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=gqa)

    @property
    def size(self) -> int:
        return 0 if self.pos is None else int(self.pos.numel())


class H2OCache:
    """Heavy-hitter oracle for one layer: ``recent`` newest tokens + top accumulated attention.

    Each call appends the new keys, attends with explicit softmax weights (keys are per-head
    subsets, so positions are tracked per K/V head), adds every key's received attention
    (summed over queries and the query heads of its group) to its score, then evicts down to
    ``budget`` entries per K/V head. A prefill chunk therefore sees up to (chunk - 1) tokens
    beyond the budget before the eviction that follows it.
    """

    def __init__(self, budget: int = 256, recent: int | None = None) -> None:
        check_count(budget, "budget", fix="e.g. 256 kept tokens per head")
        recent = budget // 2 if recent is None else check_count(recent, "recent", minimum=0)
        if recent > budget:
            raise ValueError(f"Need budget >= 1 and 0 <= recent <= budget; got {budget}, {recent}.")
        self.budget, self.recent = budget, recent
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None  # [b, kv_heads, n]
        self.score: Tensor | None = None  # [b, kv_heads, n] accumulated attention

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        b, g, t, _ = k.shape
        pos = input_pos.expand(b, g, t)
        fresh = torch.zeros(b, g, t, dtype=torch.float32, device=k.device)
        if self.k is None:
            self.k, self.v, self.pos, self.score = k, v, pos.clone(), fresh
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self.pos = torch.cat([self.pos, pos], dim=2)
            self.score = torch.cat([self.score, fresh], dim=2)
        group = kv_group(q, k)
        mask = repeat_kv(position_mask(input_pos, self.pos), group) if t > 1 else None
        weights = attention_weights(q, self.k, mask)  # [b, H, t, n]
        out = weights @ repeat_kv(self.v, group)
        n = self.pos.shape[-1]
        self.score += weights.float().sum(2).view(b, g, group, n).sum(2)
        self.evict()
        return out

    def evict(self) -> None:
        n = self.pos.shape[-1]
        if n <= self.budget:
            return
        old = n - self.recent  # entries are kept in position order: the newest are last
        heavy = self.score[..., :old].topk(self.budget - self.recent, dim=-1).indices
        newest = torch.arange(old, n, device=heavy.device).expand(*heavy.shape[:-1], self.recent)
        keep = torch.cat([heavy.sort(dim=-1).values, newest], dim=-1)
        gather = keep[..., None].expand(-1, -1, -1, self.k.shape[-1])
        self.k, self.v = self.k.gather(2, gather), self.v.gather(2, gather)
        self.pos, self.score = self.pos.gather(2, keep), self.score.gather(2, keep)

    @property
    def size(self) -> int:
        return 0 if self.pos is None else int(self.pos.shape[-1])


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
