"""Chapter 04: one step of repairing the ReLU student by distillation from the dense teacher."""

import torch
import torch.nn.functional as F


def distillation_step(student, teacher, tokens, optimizer, config):
    # bf16 autocast where the CPU multiplies bf16 natively (config.bf16): a speed matter only
    fast = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bool(config.bf16))
    with torch.no_grad(), fast:
        teacher_logits = teacher(tokens).float()  # a target: no gradients into the teacher
    with fast:
        logits = student(tokens).float()
    vocab, T = logits.shape[-1], config.temperature
    log_s = F.log_softmax(logits.reshape(-1, vocab) / T, dim=-1)
    log_t = F.log_softmax(teacher_logits.reshape(-1, vocab) / T, dim=-1)
    # KL(teacher || student) per position, averaged over all b * t positions; T^2 keeps the
    # gradient's size independent of the temperature (Hinton et al.)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * T**2
    # next-token cross-entropy: position i predicts token i + 1
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss = config.kd_weight * kl + (1 - config.kd_weight) * ce
    optimizer.zero_grad()  # this step's gradients only
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    return loss.detach(), kl.detach(), ce.detach()
