"""Chapter 06: training one layer's predictor (DejaVu / PowerInfer) with a weighted BCE."""

import math

import torch
import torch.nn.functional as F


def train_predictor(predictor, x, y, epochs, batch_size, lr, pos_weight, seed):
    if epochs == 0:
        return predictor.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)  # one generator: a new order every epoch
    opt = torch.optim.Adam(predictor.parameters(), lr=lr)
    steps = epochs * math.ceil(x.shape[0] / batch_size)  # batches, the last one short
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    weight = torch.tensor(pos_weight, device=x.device)  # a miss costs more than a false alarm
    predictor.train().requires_grad_(True)
    with torch.enable_grad():  # the chapter may call it under no_grad
        for _ in range(epochs):
            for idx in torch.randperm(x.shape[0], generator=gen).split(batch_size):
                logits = predictor(x[idx])
                loss = F.binary_cross_entropy_with_logits(logits, y[idx].float(), pos_weight=weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()  # the one-cycle schedule moves every batch
    return predictor.eval().requires_grad_(False)
