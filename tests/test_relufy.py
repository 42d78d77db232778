"""ReLUfication and distillation fine-tuning on tiny random models."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from conftest import tiny_model
from minisparse.io.hf import compare_logits, to_hf
from minisparse.measure import machine
from minisparse.relufy import finetune as F
from minisparse.relufy import (
    load_relufied,
    relufied_stage,
    relufy,
    result_dir,
    save_relufied,
    weights_equal,
)


def tiny(seed: int = 0):
    return tiny_model(seed=seed, std=0.2, n_layers=2, dim=32, head_dim=8, ffn_dim=64)


def batches(seed: int, n: int = 12, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 97, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("stage", [1, 2])
def test_relufy_changes_only_the_activations(stage):
    model = tiny()
    toks = batches(1, 2)
    before = model(toks)
    relu = relufy(model, stage)
    assert weights_equal(model, relu)  # same weights, same names
    assert torch.equal(model(toks), before)  # the input model is untouched
    assert isinstance(model.layers[0].mlp.act, nn.SiLU) and relufied_stage(model) == 0
    assert relufied_stage(relu) == stage and relu.config.hidden_act == "relu"
    assert model.config.hidden_act == "silu"
    assert not torch.allclose(relu(toks), before)
    layer = relu.layers[1]
    kinds = [type(m) for m in (layer.attn_in_act, layer.mlp_in_act)]
    assert kinds == ([nn.Identity] * 2 if stage == 1 else [nn.ReLU] * 2)


def test_stage1_exports_to_a_relu_llama_and_stage2_refuses():
    relu = relufy(tiny(), 1)
    parity = compare_logits(relu, to_hf(relu), batches(2, 2))
    assert parity.max_abs_diff < 1e-4 and parity.same_argmax
    with pytest.raises(ValueError, match="cannot express"):
        to_hf(relufy(tiny(), 2))


def test_relufy_rejects_unknown_stage():
    with pytest.raises(ValueError, match="stage"):
        relufy(tiny(), 3)


def loss_on(student, teacher, toks, config) -> float:
    with torch.no_grad():
        return F.distillation_loss(student(toks), teacher(toks), toks, config)[0].item()


@pytest.mark.parametrize("trainable", ["mlp", "all", "lora"])
def test_finetune_lowers_the_loss_and_trains_only_its_set(trainable):
    teacher = tiny()
    student = relufy(teacher, 1)
    frozen = {k: v.clone() for k, v in student.state_dict().items()}
    config = F.FinetuneConfig(
        steps=12, batch_size=4, lr=3e-3, warmup=2, trainable=trainable, bf16=False
    )
    toks = batches(3, n=4)
    first = loss_on(student, teacher, toks, config)
    result = F.finetune(student, teacher, toks, config, progress=False)
    assert loss_on(result.model, teacher, toks, config) < 0.8 * first
    changed = {k for k, v in result.model.state_dict().items() if not torch.equal(v, frozen[k])}
    assert changed - {"lm_head.weight"} == set(result.trained)  # lm_head is the tied embedding
    if trainable == "mlp":
        assert changed and all(".mlp." in k for k in changed)
    if trainable == "lora":  # merged back: plain linears, every projection updated
        assert not any(isinstance(m, F.LoRALinear) for m in result.model.modules())
        assert len(changed) == 7 * 2
    assert not any(p.requires_grad for p in result.model.parameters())
    assert len(result.history) == 12 and "sparsity" in result.history[0]


def test_lora_starts_at_the_base_and_merges_exactly():
    base = nn.Linear(20, 12)
    lora = F.LoRALinear(base, rank=4, alpha=8.0)
    x = torch.randn(5, 20)
    assert torch.equal(lora(x), base(x))
    with torch.no_grad():
        lora.B.normal_()
    y = lora(x)
    merged = lora.merged()
    assert torch.allclose(merged(x), y, atol=1e-5)


def test_learning_rate_schedule():
    c = F.FinetuneConfig(steps=110, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert F.lr_at(0, c) == pytest.approx(0.1)
    assert F.lr_at(9, c) == pytest.approx(1.0)
    assert F.lr_at(60, c) == pytest.approx(0.55)
    assert F.lr_at(109, c) == pytest.approx(0.1, abs=1e-3)
    rates = [F.lr_at(s, c) for s in range(10, 110)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_batch_order_visits_every_window_once_per_epoch():
    rows = torch.cat([F.batch_order(10, 4, s, seed=1) for s in range(5)])  # 2 epochs
    assert sorted(rows[:10].tolist()) == list(range(10))
    assert sorted(rows[10:20].tolist()) == list(range(10))
    assert not torch.equal(rows[:10], rows[10:20])


def test_resuming_from_a_checkpoint_gives_the_same_model(tmp_path):
    teacher = tiny()
    config = F.FinetuneConfig(
        steps=6, batch_size=4, lr=3e-3, warmup=1, bf16=False, checkpoint_every=3
    )
    straight = F.finetune(relufy(teacher, 1), teacher, batches(4), config, progress=False)
    part = F.finetune(
        relufy(teacher, 1), teacher, batches(4), config, tmp_path, progress=False, until=3
    )
    assert len(part.history) == 3
    resumed = F.finetune(relufy(teacher, 1), teacher, batches(4), config, tmp_path, progress=False)
    assert [h["step"] for h in resumed.history] == list(range(1, 7))
    assert weights_equal(resumed.model, straight.model)
    other = dataclasses.replace(config, lr=1e-3)
    with pytest.raises(ValueError, match="other settings"):
        F.finetune(relufy(teacher, 1), teacher, batches(4), other, tmp_path, progress=False)


def test_saved_relufied_model_loads_back(tmp_path):
    teacher = tiny()
    config = F.FinetuneConfig(steps=2, batch_size=4, lr=3e-3, warmup=1, bf16=False)
    result = F.finetune(relufy(teacher, 2), teacher, batches(5), config, progress=False)
    path = result_dir(2, "mlp", tmp_path) / "model.safetensors"
    save_relufied(result.model, path, 2, {"trained": result.trained})
    loaded, info = load_relufied(teacher, 2, "mlp", root=tmp_path)
    assert info["trained"] == result.trained
    assert weights_equal(loaded, result.model) and relufied_stage(loaded) == 2
    with pytest.raises(FileNotFoundError, match="minisparse relufy --stage 1"):
        load_relufied(teacher, 1, "mlp", root=tmp_path)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="trainable"):
        F.FinetuneConfig(trainable="embeddings")
    with pytest.raises(ValueError, match="kd_weight"):
        F.FinetuneConfig(kd_weight=2.0)


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu avx2 fma", False), ("avx2 avx512f avx512_bf16", True), ("avx2 amx_bf16 amx_tile", True)],
)
def test_bf16_autocast_is_used_only_where_the_hardware_has_it(monkeypatch, flags, native):
    info = f"processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: {flags}\n"
    monkeypatch.setattr(F, "cpu_info", lambda: info)
    monkeypatch.setattr(machine, "cpu_info", lambda: info)
    cpu = torch.device("cpu")
    assert F.native_bf16(cpu) is native
    assert F.cpu_name() == "Test CPU 9000"
    assert F.autocast(F.FinetuneConfig(), cpu).fast_dtype == torch.bfloat16
    assert F.autocast(F.FinetuneConfig(), cpu)._enabled is native
    assert F.autocast(F.FinetuneConfig(bf16=True), cpu)._enabled
    assert not F.autocast(F.FinetuneConfig(bf16=False), cpu)._enabled


def test_relufy_and_finetune_reuses_given_measurements(tmp_path, monkeypatch):
    """Measurements the caller already has are reported as given, and not taken again."""
    from minisparse.relufy import recipe as R

    calls = []

    def fake_measure(model, ids):
        calls.append(relufied_stage(model))
        return {"ppl": float(len(calls))}

    monkeypatch.setattr(R, "corpus", lambda split: split)
    monkeypatch.setattr(R, "encode", lambda tokenizer, text: batches(7, n=40, seq=16).view(-1))
    monkeypatch.setattr(R, "measure", fake_measure)
    config = F.FinetuneConfig(steps=2, batch_size=2, lr=1e-3, warmup=1, bf16=False)
    dense = {"ppl": 123.0}
    _, report = R.relufy_and_finetune(
        tiny(),
        None,
        1,
        config,
        seq_len=16,
        eval_tokens=64,
        root=tmp_path,
        progress=False,
        measured={"dense": dense},
    )
    assert report["dense"] is dense
    assert calls[0] == 1  # only the swapped model was measured before training
    assert report["swapped"] == {"ppl": 1.0}
    before = len(calls)
    R.relufy_and_finetune(
        tiny(), None, 1, config, seq_len=16, eval_tokens=64, root=tmp_path / "b", progress=False
    )
    assert calls[before : before + 2] == [0, 1]  # without them: the dense model, then the swapped
