"""minisparse.peft: QLoRA on an NF4 base, Houlsby adapters, 2:4 recovery (tiny models)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import IdTokenizer, tiny_model
from minisparse.peft import (
    HoulsbyAdapter,
    adapter_decode_cost,
    add_adapters_,
    load_recovered,
    merge_qlora,
    prune_24,
    qlora_,
    trainable_state_bytes,
)
from minisparse.peft.recover import base_fingerprint
from minisparse.quant.nf4 import (
    NF4Linear,
    double_dequantize,
    double_quantize,
    nf4_dequantize,
    nf4_quantize,
)
from minisparse.relufy.finetune import FinetuneConfig, finetune_
from minisparse.relufy.lora import LORA_TARGETS, LoRALinear

TOKENS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))


def random_adapters_(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def reference_logits(dense: nn.Module, qlora: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """float64 logits of ``dense`` with every projection replaced by dequant(NF4(W)) + s B A."""
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for layer, qlayer in zip(ref.layers, qlora.layers, strict=True):
            for part in ("attn", "mlp"):
                for name in LORA_TARGETS:
                    if not hasattr(getattr(layer, part), name):
                        continue
                    lin, wrapped = (
                        getattr(getattr(layer, part), name),
                        getattr(getattr(qlayer, part), name),
                    )
                    codes, absmax = nf4_quantize(lin.weight.float(), 16)
                    absmax = double_dequantize(*double_quantize(absmax))
                    w = nf4_dequantize(codes, absmax, 16).double()
                    lin.weight.copy_(w + wrapped.scale * wrapped.B.double() @ wrapped.A.double())
    return ref(tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_qlora_matches_a_float64_reference_and_trains_only_adapters(seed):
    dense = tiny_model(seed=seed)
    model = qlora_(copy.deepcopy(dense), rank=4, alpha=8, block_size=16, seed=seed)
    random_adapters_(model, seed)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
    q = model.layers[0].attn.q_proj
    assert isinstance(q, LoRALinear) and isinstance(q.base, NF4Linear)
    torch.testing.assert_close(
        model(TOKENS).double(), reference_logits(dense, model, TOKENS), atol=2e-4, rtol=1e-4
    )
    # the dense model is untouched and gradients reach A and B only
    assert isinstance(dense.layers[0].attn.q_proj, nn.Linear)
    model(TOKENS).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)


def test_qlora_targets_and_bad_input():
    model = qlora_(tiny_model(), rank=2, block_size=16, targets=("up_proj", "down_proj"))
    assert isinstance(model.layers[1].mlp.up_proj, LoRALinear)
    assert isinstance(model.layers[1].mlp.gate_proj, nn.Linear)
    with pytest.raises(ValueError, match="targets"):
        qlora_(tiny_model(), targets=("w_in",))
    with pytest.raises(ValueError, match="does not divide"):
        qlora_(tiny_model(), block_size=36)
    with pytest.raises(ValueError, match="NF4 base in before"):
        qlora_(qlora_(tiny_model(), rank=2, block_size=16), rank=2, block_size=16)


def test_merge_qlora_gives_a_plain_model_with_the_same_logits():
    model = qlora_(tiny_model(seed=3), rank=4, alpha=8, block_size=16)
    random_adapters_(model, 3)
    before = model(TOKENS).detach()
    merged = merge_qlora(model)
    assert not any(isinstance(m, (NF4Linear, LoRALinear)) for m in merged.modules())
    assert isinstance(model.layers[0].mlp.up_proj, LoRALinear)  # input unchanged
    torch.testing.assert_close(merged(TOKENS), before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(TOKENS), before, atol=0, rtol=0)


def test_trainable_state_bytes_counts_parameters_and_adams_moments():
    dense = tiny_model()
    model = qlora_(copy.deepcopy(dense), rank=4, block_size=16)
    c = dense.config
    per_layer = 4 * (
        (c.dim + c.n_heads * c.head_dim) * 2
        + (c.dim + c.n_kv_heads * c.head_dim) * 2
        + (c.dim + c.ffn_dim) * 3
    )
    state = trainable_state_bytes(model)
    assert state["trainable"] == per_layer * c.n_layers
    assert state["full"] == sum(p.numel() for p in dense.parameters())
    assert state["trainable_bytes"] == 12 * state["trainable"]
    assert state["full_bytes"] == 12 * state["full"]
    assert state["ratio"] == pytest.approx(state["trainable"] / state["full"])


def test_finetune_trains_qlora_and_merges_onto_the_nf4_base():
    dense = tiny_model(seed=4)
    student = prune_24(dense, TOKENS)
    from minisparse.peft.qlora import nf4_base_

    nf4_base_(student, 16)
    nf4 = copy.deepcopy(student)
    train = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(1))
    config = FinetuneConfig(
        steps=2, batch_size=2, trainable="lora", lora_rank=2, warmup=1, lr=1e-2, bf16=False
    )
    result = finetune_(student, dense, train, config, progress=False)
    assert len(result.history) == 2
    merged = result.model
    assert not any(isinstance(m, (NF4Linear, LoRALinear)) for m in merged.modules())
    # merged weight - dequantized NF4 base is a rank-2 update
    diff = merged.layers[0].mlp.up_proj.weight - nf4.layers[0].mlp.up_proj.weight
    assert torch.linalg.matrix_rank(diff.double(), atol=1e-6) == 2


def reference_wanda_24(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest |W_ij| ||X_j|| of every 4 inputs, by brute force in float64."""
    score = w.double().abs() * x.double().reshape(-1, x.shape[-1]).pow(2).sum(0).sqrt()
    keep = torch.zeros_like(score, dtype=torch.bool)
    for i in range(score.shape[0]):
        for g in range(0, score.shape[1], 4):
            top = sorted(range(4), key=lambda k: -float(score[i, g + k]))[:2]
            for k in top:
                keep[i, g + k] = True
    return w * keep


def test_prune_24_is_wanda_on_the_calibration_inputs():
    dense = tiny_model(seed=6)
    pruned = prune_24(dense, TOKENS)
    seen = {}

    def keep_input(module, inputs, output):
        seen["x"] = inputs[0]

    hook = dense.layers[0].attn.q_proj.register_forward_hook(keep_input)  # block 0 sees dense input
    with torch.no_grad():
        dense(TOKENS)
    hook.remove()
    ref = reference_wanda_24(dense.layers[0].attn.q_proj.weight.detach(), seen["x"])
    assert torch.equal(pruned.layers[0].attn.q_proj.weight, ref)
    for name, p in pruned.named_parameters():
        if name.rsplit(".", 2)[-2] in LORA_TARGETS:
            assert (p.reshape(p.shape[0], -1, 4) != 0).sum(-1).max() <= 2, name
    assert float((dense.layers[0].attn.q_proj.weight == 0).float().mean()) == 0  # input unchanged


@pytest.mark.parametrize("seed", [0, 1])
def test_houlsby_adapter_is_a_residual_bottleneck_starting_as_identity(seed):
    dense = tiny_model(seed=seed)
    model = add_adapters_(copy.deepcopy(dense), bottleneck=6, seed=seed)
    torch.testing.assert_close(model(TOKENS), dense(TOKENS), atol=0, rtol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * dense.config.n_layers
    assert all(n.endswith(("down_proj.down", "down_proj.up")) for n in trainable)
    adapter = model.layers[0].mlp.down_proj
    assert isinstance(adapter, HoulsbyAdapter)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        adapter.up.copy_(torch.randn(adapter.up.shape, generator=gen))
    h = torch.randn(3, dense.config.ffn_dim, generator=gen)
    y = h.double() @ adapter.base.weight.double().T
    ref = y + F.relu(y @ adapter.down.double().T) @ adapter.up.double().T
    torch.testing.assert_close(adapter(h).double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="once"):
        add_adapters_(model, 6)
    with pytest.raises(ValueError, match="bottleneck"):
        add_adapters_(tiny_model(), dense.config.dim)


def test_adapter_decode_cost_reports_both_speeds():
    result = adapter_decode_cost(
        tiny_model(), IdTokenizer(), 4, prompt="1 2 3", new_tokens=3, repeats=3
    )
    assert result["plain_tok_s"] > 0 and result["adapters_tok_s"] > 0 and result["slowdown"] > 0
    ratio = result["speed_ratio"]  # adapter / plain speed per round, within the rounds' range
    assert 0 < ratio.low <= ratio.mid <= ratio.high
    assert ratio.mid == pytest.approx(1 / result["slowdown"])
    assert result["adapter_params"] == 2 * 2 * 4 * 48 and result["same_tokens"] is True


def test_saved_adapters_rebuild_the_same_model(tmp_path):
    from safetensors.torch import save_file

    from minisparse.peft.qlora import nf4_base_
    from minisparse.peft.recover import attach_adapters_, read_adapters

    config = FinetuneConfig(trainable="lora", lora_rank=3, lora_alpha=6.0)
    trained = qlora_(tiny_model(seed=2), rank=3, alpha=6.0, block_size=16)
    random_adapters_(trained, 2)
    adapters = {n: p.detach() for n, p in trained.named_parameters() if p.requires_grad}
    rebuilt = attach_adapters_(nf4_base_(tiny_model(seed=2), 16), adapters, config)
    torch.testing.assert_close(rebuilt(TOKENS), trained(TOKENS), atol=0, rtol=0)
    grads = {n for n, p in rebuilt.named_parameters() if p.requires_grad}
    assert grads == set(adapters)
    with pytest.raises(ValueError, match="minisparse recover"):
        attach_adapters_(nf4_base_(tiny_model(), 16), {"layers.0.x.A": torch.ones(1)}, config)
    path = tmp_path / "adapters.safetensors"
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="minisparse recover"):
        read_adapters(path)
    save_file({"a": torch.ones(1)}, str(path), metadata={"config": "{}", "settings": "{}"})
    with pytest.raises(ValueError, match="holds no adapters"):
        read_adapters(path)


def test_pruning_masks_rebuild_the_pruned_weights():
    from minisparse.peft.recover import apply_masks, pruning_masks

    dense = tiny_model(seed=7)
    pruned = prune_24(dense, TOKENS)
    masks = pruning_masks(pruned)
    assert len(masks) == len(LORA_TARGETS) * dense.config.n_layers
    rebuilt = apply_masks(dense, masks)
    for (name, a), b in zip(
        pruned.state_dict().items(), rebuilt.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert float((dense.layers[0].mlp.up_proj.weight == 0).float().mean()) == 0


def test_load_recovered_names_the_command_and_checks_the_base(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="minisparse recover"):
        load_recovered(tiny_model(), root=tmp_path)
    a = qlora_(tiny_model(seed=0), rank=2, block_size=16)
    b = qlora_(tiny_model(seed=1), rank=2, block_size=16)
    assert base_fingerprint(a) != base_fingerprint(b)
    assert base_fingerprint(a) == base_fingerprint(copy.deepcopy(a))
