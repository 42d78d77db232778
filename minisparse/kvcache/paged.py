"""The paged KV cache (vLLM's PagedAttention): block tables, on-demand blocks, shared prefixes.

A static cache reserves ``max_seq_len`` slots per sequence up front; a server that does so for
every request wastes whatever each request does not use, and cannot share anything between
requests. vLLM stores the cache the way an operating system stores memory:

* the KV memory is a pool of physical **blocks** of ``block_size`` tokens;
* each sequence has a **block table**: its logical block i (positions i·B .. i·B + B − 1) lives
  in physical block ``table[i]``, so position p is at slot

      table[p // B] · B + p % B;

* blocks are taken from a free list when a sequence first writes into them, so a sequence of
  n tokens holds ⌈n / B⌉ blocks and wastes at most B − 1 slots (one partial block);
* sequences with a common prompt prefix point at the same blocks (a reference count per block);
  the first write into a shared block copies it (**copy-on-write**), as ``fork`` in an OS.

``BlockManager`` does the bookkeeping with no tensors; ``PagedKVCache`` adds the key and value
pools and speaks the static cache's ``update`` protocol, so ``model(tokens, input_pos, cache)``
runs unchanged. ``simulate_waste`` replays a trace of requests and compares the memory each
storage scheme reserves with what it actually uses.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..core.model import ModelConfig, check_count


class OutOfBlocks(MemoryError):
    """The block pool is exhausted."""


def table_slots(table: list[int], block_size: int, positions: Tensor) -> Tensor:
    """Physical slot table[p // B] * B + p % B of each position p (B = ``block_size``)."""
    blocks = torch.tensor(table, dtype=torch.long)
    positions = positions.cpu()
    return blocks[positions // block_size] * block_size + positions % block_size


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
        return table_slots(self.table(seq), self.block_size, positions)

    @property
    def blocks_in_use(self) -> int:
        return self.n_blocks - len(self.free)


class PagedKVCache:
    """A paged KV cache for a whole model: one block pool per layer, shared block tables.

    ``cache[i]`` is layer i's view with the static cache's ``update`` protocol, so
    ``model(tokens, input_pos, cache)`` works unchanged. It runs the *active* sequence
    (``use(seq)``); ``fork()`` starts a sequence that shares the active one's prefix.
    ``manager`` makes the bookkeeping (default ``BlockManager``; any class with its
    ``add_sequence``, ``fork``, ``free_sequence``, ``prepare_write`` and ``table`` will do, such
    as the one chapter 02's learner writes).
    """

    def __init__(
        self,
        config: ModelConfig,
        n_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        manager: Callable[[int, int], BlockManager] = BlockManager,
    ) -> None:
        self.manager = manager(n_blocks, block_size)
        self.block_size = block_size
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
        bs = self.block_size
        for src, dst in self.manager.prepare_write(self.active, int(input_pos[0]), end):
            self.k[:, :, dst * bs : (dst + 1) * bs] = self.k[:, :, src * bs : (src + 1) * bs]
            self.v[:, :, dst * bs : (dst + 1) * bs] = self.v[:, :, src * bs : (src + 1) * bs]
        table = self.manager.table(self.active)
        slots = table_slots(table, bs, input_pos).to(self.k.device)
        self.k[layer].index_copy_(1, slots, k[0])
        self.v[layer].index_copy_(1, slots, v[0])
        every = table_slots(table, bs, torch.arange(end)).to(self.k.device)
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


__all__ = [
    "BlockManager",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedLayer",
    "Trace",
    "WasteReport",
    "random_trace",
    "simulate_waste",
    "table_slots",
]
