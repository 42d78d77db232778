"""Chapter 02's builds: tiled attention with the online softmax, and a paged cache's block table.

``tiled_attention`` is graded against the library's (``core.attention.tiled_attention``) on odd
shapes, key counts that are not a multiple of the block, decode-sized queries after a cache, and
scores large enough that ``exp`` overflows float32 unless the running maximum is subtracted. It
then runs inside the real model through ``attention_with`` (chapter 01's plug).

The optional challenge ``h2o_keep`` is H2O's eviction rule (which entries a heavy-hitter cache
keeps), checked against ``kvcache.eviction.h2o_keep`` and then run as the rule of the chapter's
``H2OCache`` on the real model.

``BlockManager`` is a class; its check drives it through a random script of requests (new
sequences, prompts and appended tokens, forks that share a prefix, rewrites of the last token,
frees) and stores a number per written position in a simulated pool: every live sequence must
read back exactly what was written to it (so a block shared by a fork is copied before a write)
and the free list must hold as many blocks as the library's after every step (no leak, no block
allocated too early, none freed while a fork still uses it). It then runs as the bookkeeping of
``kvcache.PagedKVCache(..., manager=BlockManager)`` on the real model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...core.attention import tiled_attention
from ...kvcache.eviction import h2o_keep
from ...kvcache.paged import BlockManager
from ..grading import Exercise, draw_int, equal, loose, register

__all__: list[str] = []

Cases = list[tuple[Any, ...]]


def _tiled_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = (  # batch, heads, kv_heads, t, n, dim, block
        (1, 1, 1, 1, 1, 4, 1), (1, 2, 1, 5, 5, 8, 2), (2, 4, 2, 7, 7, 8, 3),
        (1, 3, 3, 1, 13, 4, 4), (1, 6, 2, 4, 11, 8, 5), (2, 2, 1, 9, 9, 16, 16),
    )  # fmt: skip
    for batch, heads, kv_heads, t, n, dim, block in shapes:
        q = torch.randn(batch, heads, t, dim, generator=gen)
        k = torch.randn(batch, kv_heads, n, dim, generator=gen)
        v = torch.randn(batch, kv_heads, n, dim, generator=gen)
        out.append((q, k, v, block))
    q, k = (torch.randn(1, 2, 6, 16, generator=gen) * 8 for _ in range(2))  # scores ~ +-200
    out.append((q, k, torch.randn(1, 2, 6, 16, generator=gen), 4))
    return out


def _tiled(q: Tensor, k: Tensor, v: Tensor, block: int) -> Tensor:
    return tiled_attention(q, k, v, causal=True, block_q=block, block_k=block)


register(
    "tiled_attention",
    Exercise(
        "02",
        "tiled_attention(q [b, H, t, d], k [b, G, n, d], v [b, G, n, d], block) -> [b, H, t, d]: "
        "causal GQA attention (queries the last t of the n tokens, scores q k^T / sqrt(d)) "
        "computed over blocks of `block` keys with an online softmax: a running max m, running "
        "sum l and running output a per query row, rescaled by exp(m_old - m_new) at each "
        "block; O = a / l",
        _tiled,
        _tiled_cases,
        loose,
        "for each block: s = q k^T / sqrt(d) (future keys -inf), m_new = max(m, s.amax(-1)), "
        "p = exp(s - m_new), l = l exp(m - m_new) + p.sum(-1), a = a exp(m - m_new) + p v. "
        "Without the running max exp overflows on large scores; the last block may be short",
        core=True,
    ),
)


def _script_cases(gen: torch.Generator) -> Cases:
    """(n_blocks, block_size, script) per case; a script step is ("add",), ("fork", i),
    ("write", i, count, back) or ("free", i), i indexing the live sequences."""
    out: Cases = []
    for block_size in (1, 3, 4, 16):
        script: list[tuple[int | str, ...]] = [("add",)]
        live = 1
        for _ in range(24):
            roll = draw_int(gen, 0, 10)
            i = draw_int(gen, 0, live) if live else 0
            if live == 0 or roll == 0:
                script.append(("add",))
                live += 1
            elif roll <= 2:
                script.append(("fork", i))
                live += 1
            elif roll == 3 and live > 1:
                script.append(("free", i))
                live -= 1
            else:  # append tokens; now and then rewrite the last one first (a rolled-back draft)
                script.append(("write", i, draw_int(gen, 1, 8), int(roll == 9)))
        out.append((256, block_size, script))
    return out


def _drive(manager_class: Any, n_blocks: int, block_size: int, script: list[tuple]) -> list:
    """Run ``script`` on a manager; after each step: (free blocks, what each sequence reads)."""
    manager = manager_class(n_blocks, block_size)
    pool: dict[int, int] = {}  # physical slot -> the number written there
    live: list[int] = []
    lengths: dict[int, int] = {}
    stamp, trace = 0, []
    for step in script:
        if step[0] == "add":
            live.append(manager.add_sequence())
            lengths[live[-1]] = 0
        elif step[0] == "fork":
            parent = live[step[1]]
            live.append(manager.fork(parent))
            lengths[live[-1]] = lengths[parent]
        elif step[0] == "free":
            manager.free_sequence(live.pop(step[1]))
        else:
            seq, count, back = live[step[1]], step[2], step[3]
            start = max(0, lengths[seq] - back)
            end = start + count
            for src, dst in manager.prepare_write(seq, start, end):
                for o in range(block_size):
                    if src * block_size + o in pool:
                        pool[dst * block_size + o] = pool[src * block_size + o]
            table = list(manager.table(seq))
            for p in range(start, end):
                stamp += 1
                pool[table[p // block_size] * block_size + p % block_size] = stamp
            lengths[seq] = max(lengths[seq], end)
        reads = []
        for seq in live:
            table = list(manager.table(seq))
            slots = [
                table[p // block_size] * block_size + p % block_size for p in range(lengths[seq])
            ]
            reads.append([pool.get(s, -1) for s in slots])
        trace.append((len(manager.free), reads))
    return trace


def _run_script(manager_class: Any, args: tuple[Any, ...]) -> list:
    return _drive(manager_class, *args)


def _same_trace(got: Any, expected: Any) -> bool:
    return got == expected


register(
    "block_manager",
    Exercise(
        "02",
        "BlockManager(n_blocks, block_size): a class with add_sequence() -> seq id, fork(seq) -> "
        "a new id sharing seq's blocks, free_sequence(seq), prepare_write(seq, start, end) -> "
        "[(src, dst)] block copies (positions start..end-1 made writable: blocks allocated on "
        "demand, a shared block copied before it is written), table(seq) -> its physical "
        "blocks, and `free`, the list of free blocks",
        BlockManager,
        _script_cases,
        _same_trace,
        "a reference count per block: fork adds 1 to each shared block, free_sequence takes 1 "
        "and frees a block at 0. prepare_write appends blocks while len(table) * block_size < "
        "end (not <=), then copies every block of start..end-1 whose count is > 1 (take a fresh "
        "block, return (old, new), drop one reference to the old one)",
        run=_run_script,
        core=True,
    ),
)


def _same_entries(got: Any, expected: Tensor) -> bool:
    """The same kept entries per row, in any order (attention does not care about order)."""
    got = torch.as_tensor(got)
    return got.shape == expected.shape and equal(got.sort(-1).values, expected.sort(-1).values)


def _h2o_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for shape, budget, recent in (
        ((1, 1, 5), 8, 4),  # fewer entries than the budget: all kept
        ((1, 2, 9), 6, 3), ((2, 3, 17), 8, 0), ((1, 3, 12), 5, 5), ((1, 1, 40), 16, 8),
    ):  # fmt: skip
        out.append((torch.rand(*shape, generator=gen), budget, recent))
    return out


register(
    "h2o_keep",
    Exercise(
        "02",
        "h2o_keep(score [b, g, n], budget, recent) -> long [b, g, min(n, budget)]: the indices of "
        "the entries H2O keeps (any order): the budget - recent largest scores among the first "
        "n - recent entries, and the last `recent` entries",
        h2o_keep,
        _h2o_cases,
        _same_entries,
        "when n <= budget keep all (arange(n)); else topk(budget - recent) over score[..., :n - "
        "recent] only (the newest are kept anyway, and must not be counted twice), plus "
        "n - recent .. n - 1",
    ),
)
