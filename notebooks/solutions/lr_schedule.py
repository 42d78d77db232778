"""Chapter 04: the fine-tuning run's learning rate: linear warm-up, then a cosine decay."""

import math


def lr_schedule(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup  # never 0, reaches lr at the end of the warm-up
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)  # 0 .. 1, then stays at 1
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 .. 0
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)
