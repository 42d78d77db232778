"""Chapter 12: NF4 quantization of each block of a row (QLoRA's 4-bit NormalFloat)."""

import torch

from minisparse.quant.nf4 import NF4_LEVELS


def nf4_quantize(w, block_size):
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // block_size, block_size)
    absmax = blocks.abs().amax(dim=-1)  # one scale per block: its largest |w|
    normed = blocks / absmax.clamp_min(1e-12)[..., None]  # in [-1, 1]; a zero block stays 0
    distance = (normed[..., None] - NF4_LEVELS.to(w.dtype)).abs()  # [rows, blocks, block, 16]
    codes = distance.argmin(dim=-1).to(torch.uint8)  # the nearest of the 16 levels
    return codes.reshape(rows, cols), absmax
