"""Chapter 04: the loss that repairs a ReLUfied student: distillation from the dense teacher."""

import torch
import torch.nn.functional as F


def distillation_loss(
    student, teacher, tokens, temperature: float, kd_weight: float
) -> torch.Tensor:
    vocab = student.shape[-1]
    T = temperature
    log_s = F.log_softmax(student.float().reshape(-1, vocab) / T, dim=-1)
    log_t = F.log_softmax(teacher.float().reshape(-1, vocab) / T, dim=-1)
    # KL(teacher || student) per position, averaged over all b * t positions; T^2 keeps the
    # gradient's size independent of the temperature (Hinton et al.)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * T**2
    # next-token cross-entropy: position i predicts token i + 1
    ce = F.cross_entropy(student[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    return kd_weight * kl + (1 - kd_weight) * ce
