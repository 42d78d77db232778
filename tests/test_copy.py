"""Every model state the library creates survives copying, saving and moving; one in-place rule.

States: relufied (stages 1 and 2), thresholded, masked, quantized (fake RTN, W8A8, packed int8,
packed int4 with and without the CPU kernel), LoRA, streaming GEMV (input-major weights) and
offloaded (hot/cold MLPs).
Each must give the same logits after ``copy.deepcopy``, after ``torch.save(state_dict)`` /
``torch.load(weights_only=True)`` / ``load_state_dict`` into the same structure built from other
weights, and after a device / dtype round trip.

The convention: a function whose name ends in ``_`` changes the model it is given and returns
that same object; a function without it returns a new model and leaves its argument unchanged.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

from conftest import tiny_model
from minisparse import quant as Q
from minisparse import sparsity as S
from minisparse.core import model as M
from minisparse.core.attention import regroup_kv_heads
from minisparse.offload import Placement
from minisparse.offload.hybrid import apply
from minisparse.relufy import finetune as F
from minisparse.relufy import relufy
from minisparse.sparse import masked_mlps, swap_mlps
from minisparse.sparsity.methods import unchanged

TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60, 9]])
#: Sizes where the int4 CPU kernel applies (rows % 16 == 0, rows of 64 columns).
INT4_SHAPE = {"dim": 64, "ffn_dim": 128, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16}


def thresholded(seed: int) -> nn.Module:
    """Thresholds that differ per seed, so a reload must carry them (as extra state)."""
    model = tiny_model(seed=seed)
    t = 0.01 * (seed + 1)
    return S.apply_thresholds_(model, {"mlp_act": [t, 2 * t], "down_in": [t / 2, t]})


def masked(seed: int) -> nn.Module:
    model = tiny_model(seed=seed)
    swap_mlps(model, masked_mlps(model, thresholds=0.01))
    return model


def lora(seed: int) -> nn.Module:
    model = F.add_lora_(tiny_model(seed=seed), rank=4, alpha=8.0, seed=seed)
    with torch.no_grad():  # B starts at zero: give the adapters an effect to preserve
        for module in model.modules():
            if isinstance(module, F.LoRALinear):
                module.B.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return model


def offloaded(seed: int) -> nn.Module:
    """Chapter 08's hot/cold split, with a placement that does not depend on the seed."""
    n = tiny_model().config.ffn_dim
    hot = [torch.arange(n) % 3 == 0, torch.arange(n) < 20]
    return apply(tiny_model(seed=seed), Placement(hot, 0, 0.0, "by hand", 1), thresholds=0.01)


def streaming(seed: int) -> nn.Module:
    return M.use_streaming_gemv_(tiny_model(seed=seed))


STATES: dict[str, Callable[[int], nn.Module]] = {
    "dense": lambda seed: tiny_model(seed=seed),
    "relufied stage 1": lambda seed: relufy(tiny_model(seed=seed), 1),
    "relufied stage 2": lambda seed: relufy(tiny_model(seed=seed), 2),
    "thresholded": thresholded,
    "masked": masked,
    "fake int4 g16": lambda seed: Q.quantize_model(
        tiny_model(seed=seed), bits=4, group_size=16, progress=False
    ),
    "W8A8": lambda seed: Q.quantize_model(tiny_model(seed=seed), act_bits=8, progress=False),
    "packed int8": lambda seed: Q.quantize_model(
        tiny_model(seed=seed), bits=8, packed=True, progress=False
    ),
    "packed int4, torch path": lambda seed: Q.quantize_model(
        tiny_model(seed=seed), bits=4, group_size=16, packed=True, progress=False
    ),
    "packed int4, CPU kernel": lambda seed: Q.quantize_model(
        tiny_model(seed=seed, **INT4_SHAPE), bits=4, group_size=32, packed=True, progress=False
    ),
    "lora": lora,
    "streaming GEMV": streaming,
    "offloaded (hot/cold)": offloaded,
}


@torch.inference_mode()
def logits(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of 8 tokens and a single-token step (the streaming GEMV's path)."""
    return model(TOKENS), model(TOKENS[:, :1])


def assert_same_logits(a: nn.Module, b: nn.Module) -> None:
    for x, y in zip(logits(a), logits(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("state", list(STATES))
def test_deepcopy_gives_the_same_outputs_and_an_independent_model(state):
    model = STATES[state](0)
    clone = copy.deepcopy(model)
    assert_same_logits(model, clone)
    before = logits(model)[0]
    with torch.no_grad():
        for t in [*clone.parameters(), *clone.buffers()]:
            if t.is_floating_point():
                t.mul_(1.5)
    assert torch.equal(logits(model)[0], before)  # the copy shares nothing


@pytest.mark.parametrize("state", list(STATES))
def test_state_dict_round_trip_through_torch_save_weights_only(state):
    model = STATES[state](0)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    other = STATES[state](1)  # same structure, other weights (and thresholds)
    assert not torch.equal(logits(other)[0], logits(model)[0])
    other.load_state_dict(saved)
    assert_same_logits(model, other)


@pytest.mark.parametrize("state", list(STATES))
def test_device_and_dtype_round_trip(state):
    model = STATES[state](0)
    reference = logits(model)
    model.to("cpu")
    model.to(torch.float64).to(torch.float32)
    for x, y in zip(reference, logits(model), strict=True):
        assert torch.equal(x, y)


def test_packed_layers_keep_their_kernel_dtypes_when_the_model_is_cast():
    model = STATES["packed int4, CPU kernel"](0)
    layer = model.layers[0].mlp.up_proj
    assert isinstance(layer, Q.Int4Linear) and layer.fast
    int8 = STATES["packed int8"](0).layers[0].mlp.up_proj
    for module in (model, int8):
        module.to(torch.bfloat16)
    assert layer.scales_and_zeros.dtype == torch.bfloat16 and layer.packed.dtype == torch.uint8
    assert int8.q.dtype == torch.int8 and int8.scale.dtype == torch.bfloat16
    assert int8.bias is None or int8.bias.dtype == torch.float32
    assert model(TOKENS).dtype == torch.bfloat16  # the output follows the activations


def test_a_threshold_travels_in_the_state_dict():
    source, target = thresholded(3), thresholded(0)
    target.load_state_dict(source.state_dict())
    assert target.layers[1].mlp.act.threshold == source.layers[1].mlp.act.threshold
    assert target.layers[1].mlp.act.threshold == pytest.approx(0.08)


# --- in place vs copy ---------------------------------------------------------------------------


def snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str], dict]:
    """Everything a function could change: tensors, module types, config."""
    state = {k: copy.deepcopy(v) for k, v in model.state_dict().items()}  # extra state too
    return state, [type(m).__name__ for m in model.modules()], model.config.to_dict()


def assert_unchanged(model: nn.Module, before: tuple) -> None:
    state, types, config = snapshot(model)
    assert types == before[1] and config == before[2]
    assert state.keys() == before[0].keys()
    for k, v in state.items():
        same = torch.equal(v, before[0][k]) if isinstance(v, torch.Tensor) else v == before[0][k]
        assert same, k


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "relufy": lambda m: relufy(m, 2),
    "quantize_model rtn": lambda m: Q.quantize_model(m, bits=4, group_size=16, progress=False),
    "quantize_model packed": lambda m: Q.quantize_model(m, packed=True, progress=False),
    "regroup_kv_heads": lambda m: regroup_kv_heads(m, 1),
    "hybrid.apply": lambda m: apply(
        m, Placement([torch.arange(80) < 40] * 2, 0, 0.0, "by hand", 1), thresholds=0.02
    ),
}


@pytest.mark.parametrize("name", list(COPIES))
def test_functions_without_underscore_return_a_new_model_and_leave_the_argument(name):
    model = tiny_model(seed=5)
    before = snapshot(model)
    new = COPIES[name](model)
    assert new is not model
    assert_unchanged(model, before)
    assert not torch.equal(logits(new)[0], logits(model)[0])


def registered_copies() -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Every registered technique that makes a model from a model, read from the registries:
    one registered later is checked here at once. (``relu`` is left out: it loads chapter 04's
    saved fine-tune; ``relufy`` above is its copy rule.)"""
    calib = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    rows: dict[str, Callable[[nn.Module], nn.Module]] = {
        f"weight format {name}": lambda m, name=name: Q.low_bit(m, name)
        for name, fmt in Q.WEIGHT_FORMATS.items()
        if fmt.bits is not None
    }
    for name, method in S.SPARSITY_METHODS.items():
        if method.model is not unchanged and name != "relu":
            rows[f"sparsity method {name}"] = lambda m, f=method.model: f(m, calib, 0.5)
    return rows


@pytest.mark.parametrize("name", list(registered_copies()))
def test_registered_techniques_return_a_new_model_and_leave_the_argument(name):
    model = tiny_model(seed=5, **INT4_SHAPE)
    before = snapshot(model)
    new = registered_copies()[name](model)
    assert new is not model
    assert_unchanged(model, before)
    assert not torch.equal(logits(new)[0], logits(model)[0])


def changed(model: nn.Module, before: tuple) -> bool:
    try:
        assert_unchanged(model, before)
    except AssertionError:
        return True
    return False


def add_then_merge(model: nn.Module) -> nn.Module:
    F.add_lora_(model, rank=2, alpha=4.0)
    for module in model.modules():
        if isinstance(module, F.LoRALinear):
            nn.init.ones_(module.B)
    return F.merge_lora_(model)


IN_PLACE: dict[str, Callable[[nn.Module], nn.Module]] = {
    "apply_thresholds_": lambda m: S.apply_thresholds_(m, {"mlp_act": 0.01}),
    "remove_thresholds_": lambda m: S.remove_thresholds_(S.apply_thresholds_(m, {"mlp_act": 0.1})),
    "add_lora_": lambda m: F.add_lora_(m, rank=2, alpha=4.0),
    "merge_lora_": add_then_merge,
    "select_trainable_": lambda m: F.select_trainable_(m, F.FinetuneConfig(trainable="lora")),
    "use_input_major_weights_": M.use_input_major_weights_,
    "use_streaming_gemv_": M.use_streaming_gemv_,
    "use_output_major_weights_": lambda m: M.use_output_major_weights_(
        M.use_input_major_weights_(m)
    ),
    "init_weights_": lambda m: M.init_weights_(m, seed=9),
    "untie_lm_head_": Q.untie_lm_head_,
}


#: These change the weights' memory layout or undo what they were given: the values stay.
SAME_VALUES = (
    "remove_thresholds_",
    "use_input_major_weights_",
    "use_streaming_gemv_",
    "use_output_major_weights_",
)


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_functions_with_underscore_change_the_model_and_return_it(name):
    model = tiny_model(seed=6)
    before = snapshot(model)
    assert IN_PLACE[name](model) is model
    if name in SAME_VALUES:
        assert_unchanged(model, before)
    else:
        assert changed(model, before)


def test_layout_functions_change_the_layout_in_place():
    model = tiny_model(seed=7)
    weight = model.layers[0].mlp.up_proj.weight
    assert not M.is_input_major(weight)
    M.use_input_major_weights_(model)
    assert M.is_input_major(model.layers[0].mlp.up_proj.weight)


def test_finetune_trains_the_student_itself():
    teacher, student = tiny_model(seed=8), relufy(tiny_model(seed=8), 1)
    batches = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(0))
    config = F.FinetuneConfig(steps=1, batch_size=2, warmup=0, bf16=False)
    before = snapshot(teacher)
    result = F.finetune_(student, teacher, batches, config, progress=False)
    assert result.model is student
    assert_unchanged(teacher, before)


def test_old_names_are_the_in_place_functions():
    assert S.apply_thresholds is S.apply_thresholds_
    assert S.remove_thresholds is S.remove_thresholds_
    assert F.add_lora is F.add_lora_ and F.finetune is F.finetune_
    assert M.use_streaming_gemv is M.use_streaming_gemv_
    assert M.use_input_major_weights is M.use_input_major_weights_
    assert M.use_output_major_weights is M.use_output_major_weights_
    assert M.init_weights is M.init_weights_
    model = F.add_lora_(tiny_model(seed=9), rank=2, alpha=4.0)
    assert F.merge_lora(model) == [  # the old merge_lora still returns the merged names
        f"layers.{i}.{part}.{name}.weight"
        for i in range(2)
        for part, names in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for name in (f"{n}_proj" for n in names)
    ]
