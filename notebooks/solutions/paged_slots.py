"""Chapter 02: where a position of a sequence lives in a paged KV cache."""

import torch


def paged_slots(table: list[int], block_size: int, positions: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(table, dtype=torch.long)
    block = table[positions // block_size]  # the physical block of each logical block
    return block * block_size + positions % block_size  # its first slot, plus the offset
