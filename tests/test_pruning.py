"""Pruning algorithms: SparseGPT against a column-by-column float64 reference, magnitude, Wanda
and SparseGPT on whole (tiny) models against a sequential reference written here with hooks
on the full model, the patterns they produce, the sweep and its JSON, the CLI's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.cli import main
from minisparse.pruning import (
    TARGETS,
    SweepConfig,
    input_norms,
    prune,
    run_sweep,
    sparsegpt_prune,
    sweep_grid,
    sweep_rows,
    wanda_score,
    weight_sparsity,
)

# --------------------------------------------------------------------------------------------
# References (float64, dense, one column at a time)
# --------------------------------------------------------------------------------------------


def lowest_per_row(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep mask: False at the k lowest scores of every row."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    order = torch.argsort(scores, dim=1)
    for r in range(scores.shape[0]):
        keep[r, order[r, :k]] = False
    return keep


def sparsegpt_reference(w, h, sparsity, pattern="unstructured", blocksize=128, damp=0.01):
    """SparseGPT by the textbook: the inverse Hessian of the columns not yet visited is
    inv(H[c:, c:]); a column's saliency is w² / that inverse's first diagonal entry; every
    pruned column's error goes to the later columns by the OBS update, at once."""
    w = w.double().clone()
    h = h.double().clone()
    cols = w.shape[1]
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    nm = None if pattern == "unstructured" else tuple(int(p) for p in pattern.split(":"))
    if nm is not None:
        blocksize = math.ceil(blocksize / nm[1]) * nm[1]
    out = torch.zeros_like(w)
    keep = torch.ones_like(w, dtype=torch.bool)
    for c in range(cols):
        if nm is None and c % blocksize == 0:
            end = min(c + blocksize, cols)
            obs = torch.stack([torch.linalg.inv(h[j:, j:])[0, 0] for j in range(c, end)])
            pruned = round(sparsity * end) - round(sparsity * c)
            keep[:, c:end] = lowest_per_row(w[:, c:end] ** 2 / obs, pruned)
        if nm is not None and c % nm[1] == 0:
            n, m = nm
            obs = torch.stack([torch.linalg.inv(h[j:, j:])[0, 0] for j in range(c, c + m)])
            keep[:, c : c + m] = lowest_per_row(w[:, c : c + m] ** 2 / obs, m - n)
        h_inv = torch.linalg.inv(h[c:, c:])
        q = w[:, c] * keep[:, c]
        w[:, c:] -= torch.outer((w[:, c] - q) / h_inv[0, 0], h_inv[0])
        out[:, c] = q
    return out


def correlated_inputs(gen, n=384, cols=48, outliers=3):
    """Rows with correlated features, a few of them 10x larger (LLM-like outlier channels)."""
    x = torch.randn(n, cols, dtype=torch.float64, generator=gen)
    x = x @ torch.randn(cols, cols, dtype=torch.float64, generator=gen) / cols**0.5
    x[:, :outliers] *= 10
    return x


def output_error(x, w, w_hat):
    return float((x @ (w - w_hat).T).pow(2).sum())


# --------------------------------------------------------------------------------------------
# SparseGPT on one matrix
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "sparsity", "blocksize", "seed"),
    [
        ("unstructured", 0.5, 16, 0),
        ("unstructured", 0.3, 7, 1),  # blocks that do not divide the columns
        ("unstructured", 0.7, 128, 2),  # one block
        ("2:4", 0.5, 6, 3),  # rounded up to 8
        ("4:8", 0.5, 16, 4),
        ("1:4", 0.75, 128, 5),
    ],
)
def test_sparsegpt_matches_reference(pattern, sparsity, blocksize, seed):
    gen = torch.Generator().manual_seed(seed)
    x = correlated_inputs(gen, cols=40)
    x[:, 5] = 0.0  # a dead input
    w = torch.randn(12, 40, dtype=torch.float64, generator=gen)
    h = x.T @ x
    before = w.clone()
    got = sparsegpt_prune(w, h, sparsity, pattern, blocksize=blocksize, damp=0.02)
    want = sparsegpt_reference(w, h, sparsity, pattern, blocksize, damp=0.02)
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert torch.all(got[:, 5] == 0)
    assert torch.equal(w, before)
    kept = got != 0
    assert (got[kept] - w[kept]).abs().max() > 1e-3  # the kept weights absorbed the errors


def test_sparsegpt_leaves_input_and_keeps_dtype():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(8, 16, generator=gen)
    before = w.clone()
    x = correlated_inputs(gen, cols=16).float()
    out = sparsegpt_prune(w, x.T @ x, 0.5)
    assert torch.equal(w, before)
    assert out.dtype == torch.float32 and out.shape == w.shape


@pytest.mark.parametrize(("sparsity", "cols"), [(0.1, 40), (0.5, 40), (0.6, 37), (0.25, 64)])
def test_sparsegpt_unstructured_share_per_row(sparsity, cols):
    gen = torch.Generator().manual_seed(7 + cols)
    x = correlated_inputs(gen, cols=cols).float()
    w = torch.randn(10, cols, generator=gen)
    out = sparsegpt_prune(w, x.T @ x, sparsity, blocksize=16)
    assert torch.all((out == 0).sum(1) == round(sparsity * cols))


@pytest.mark.parametrize(("pattern", "n", "m"), [("2:4", 2, 4), ("4:8", 4, 8), ("1:2", 1, 2)])
def test_sparsegpt_nm_pattern_per_group(pattern, n, m):
    gen = torch.Generator().manual_seed(10 + m)
    x = correlated_inputs(gen, cols=48).float()
    w = torch.randn(10, 48, generator=gen)
    out = sparsegpt_prune(w, x.T @ x, 1 - n / m, pattern, blocksize=12)
    zeros = (out == 0).reshape(10, 48 // m, m).sum(-1)
    assert torch.all(zeros == m - n)


@pytest.mark.parametrize(("pattern", "sparsity"), [("unstructured", 0.5), ("2:4", 0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_sparsegpt_reconstructs_better_than_magnitude_and_wanda(pattern, sparsity, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    x = correlated_inputs(gen, n=512, cols=64, outliers=4)
    w = torch.randn(24, 64, dtype=torch.float64, generator=gen)
    nm = None if pattern == "unstructured" else (2, 4)

    def masked(scores):
        if nm is None:
            return w * lowest_per_row(scores, round(sparsity * 64))
        groups = scores.reshape(24, 16, 4)
        keep = lowest_per_row(groups.reshape(-1, 4), 2).reshape(24, 64)
        return w * keep

    magnitude = output_error(x, w, masked(w.abs()))
    wanda = output_error(x, w, masked(w.abs() * x.pow(2).sum(0).sqrt()))
    sparsegpt = output_error(x, w, sparsegpt_prune(w, x.T @ x, sparsity, pattern))
    assert sparsegpt < wanda < magnitude


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.0}, "sparsity must be in"),
        ({"sparsity": -0.1}, "sparsity must be in"),
        ({"pattern": "3:5"}, "not a multiple of 5"),
        ({"pattern": "2:4", "sparsity": 0.3}, "pass sparsity=0.5"),
        ({"pattern": "dense"}, "pattern must be"),
        ({"blocksize": 0}, "blocksize must be at least 1"),
        ({"damp": -1.0}, "damp must be"),
        ({"hessian": torch.eye(5)}, "hessian must be"),
    ],
)
def test_sparsegpt_refuses_bad_input(kwargs, message):
    args = {"weight": torch.ones(3, 8), "hessian": torch.eye(8), "sparsity": 0.5, **kwargs}
    with pytest.raises(ValueError, match=message):
        sparsegpt_prune(**args)


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------


def calibration_tokens(seed=0, batch=3, seq=24):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, seq), generator=gen)


def layer_inputs(model, layer, tokens):
    """The inputs of each projection of ``layer`` when the full model runs ``tokens``."""
    names = TARGETS["all"]
    store = {}

    def keep(name):
        return lambda _m, args: store.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]))

    hooks = [layer.get_submodule(name).register_forward_pre_hook(keep(name)) for name in names]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return store


def sequential_reference(model, tokens, prune_layer):
    """Prune a copy block by block; block l's inputs come from the full copy with blocks
    0..l-1 already pruned (hooks on the model's own forward, no shared code)."""
    import copy

    ref = copy.deepcopy(model)
    for layer in ref.layers:
        inputs = layer_inputs(ref, layer, tokens)
        prune_layer(layer, inputs)
    return ref


def projections(model, names=TARGETS["all"]):
    return {f"{i}.{n}": layer.get_submodule(n).weight for i, layer in enumerate(model.layers)
            for n in names}  # fmt: skip


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_magnitude_prunes_smallest_per_row_and_copies():
    model = tiny_model(seed=1)
    before = state(model)
    out = prune(model, "magnitude", 0.4, targets="mlp")
    for key, value in state(model).items():  # the input is unchanged
        assert torch.equal(value, before[key]), key
    assert out is not model
    for key, w in projections(model).items():
        got = projections(out)[key]
        if "mlp" in key:
            want = w * lowest_per_row(w.double().abs(), round(0.4 * w.shape[1]))
            assert torch.equal(got, want.to(w.dtype)), key
        else:
            assert torch.equal(got, w), key
    assert torch.equal(out.embed.weight, model.embed.weight)
    assert torch.equal(out.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_wanda_is_sequential_like_the_reference(pattern):
    model = tiny_model(seed=2, std=0.2).double()
    tokens = calibration_tokens(1)

    def wanda_layer(layer, inputs):
        for name in TARGETS["all"]:
            linear = layer.get_submodule(name)
            w = linear.weight.detach()
            scores = w.abs() * inputs[name].pow(2).sum(0).sqrt()
            if pattern == "unstructured":
                keep = lowest_per_row(scores, round(0.5 * w.shape[1]))
            else:
                keep = lowest_per_row(scores.reshape(-1, 4), 2).reshape(w.shape)
            linear.weight.data = w * keep

    got = prune(model, "wanda", 0.5, pattern, tokens)
    want = sequential_reference(model, tokens, wanda_layer)
    for key, w in projections(want).items():
        assert torch.equal(projections(got)[key], w), key

    # the test tells sequential from one-shot: block 1 measured on the dense block 0 differs
    dense_inputs = layer_inputs(model, model.layers[1], tokens)
    w = model.layers[1].mlp.down_proj.weight.detach()
    x_norm = input_norms(dense_inputs["mlp.down_proj"])
    one_shot = w * lowest_per_row(wanda_score(w, x_norm), 40)
    if pattern == "unstructured":
        assert not torch.equal(one_shot, got.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize(("pattern", "targets"), [("unstructured", "all"), ("4:8", "mlp")])
def test_sparsegpt_model_like_the_reference(pattern, targets):
    model = tiny_model(seed=3, std=0.2).double()
    tokens = calibration_tokens(2)
    groups = [("attn.q_proj", "attn.k_proj", "attn.v_proj"), ("attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]  # fmt: skip

    def sparsegpt_layer(layer, inputs):
        for group in groups:
            group = [n for n in group if n in TARGETS[targets]]
            if not group:
                continue
            x = inputs[group[0]]
            weights = [layer.get_submodule(n).weight.detach() for n in group]
            pruned = sparsegpt_reference(torch.cat(weights), x.T @ x, 0.5, pattern, 32)
            for name, part in zip(group, pruned.split([w.shape[0] for w in weights]), strict=True):
                layer.get_submodule(name).weight.data = part

    got = prune(model, "sparsegpt", 0.5, pattern, tokens, targets=targets, blocksize=32)
    want = sequential_reference(model, tokens, sparsegpt_layer)
    for key, w in projections(want).items():
        torch.testing.assert_close(projections(got)[key], w, rtol=1e-8, atol=1e-10)
        assert torch.equal(projections(got)[key] == 0, w == 0), key
    shares = weight_sparsity(got)
    assert shares["down_proj"] == 0.5
    assert shares["q_proj"] == (0.5 if targets == "all" else 0.0)


def test_plug_points_run_the_whole_model():
    model = tiny_model(seed=4)
    tokens = calibration_tokens(3)
    seen = []

    def largest_first(weight, x_norm):  # prunes the largest weights instead
        seen.append(x_norm is not None)
        return -weight.abs()

    def first_half(scores, sparsity, pattern):  # prunes the first columns of every row
        keep = torch.ones_like(scores, dtype=torch.bool)
        keep[:, : round(sparsity * scores.shape[1])] = False
        return keep

    out = prune(model, "wanda", 0.25, calibration=tokens, score_fn=largest_first)
    assert len(seen) == 2 * 7 and all(seen)
    for key, w in projections(model).items():
        want = w * lowest_per_row(-w.double().abs(), round(0.25 * w.shape[1]))
        assert torch.equal(projections(out)[key], want.to(w.dtype)), key
    out = prune(model, "magnitude", 0.25, mask_fn=first_half)
    for key, w in projections(out).items():
        assert torch.all(w[:, : round(0.25 * w.shape[1])] == 0), key
        assert torch.all(w[:, round(0.25 * w.shape[1]) :] != 0), key
    with pytest.raises(ValueError, match=r"mask_fn \(or select_fn\) must return a bool mask"):
        prune(model, "magnitude", 0.5, mask_fn=lambda s, sp, p: torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="select_fn scores and selects in one function"):
        prune(model, "wanda", 0.5, calibration=tokens, select_fn=first_half, mask_fn=first_half)
    with pytest.raises(ValueError, match="sparsegpt chooses its mask"):
        prune(model, "sparsegpt", 0.5, calibration=tokens, select_fn=first_half)


def test_weight_sparsity_counts_zeros():
    model = tiny_model(seed=5)
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight[:3] = 0.0  # 3 rows of 48 inputs
        model.layers[1].mlp.down_proj.weight[:, :8] = 0.0  # 8 of 80 inputs in 48 rows
    shares = weight_sparsity(model)
    q = model.layers[0].attn.q_proj.weight
    assert shares["q_proj"] == 3 * 48 / (2 * q.numel())
    assert shares["down_proj"] == 48 * 8 / (2 * 48 * 80)
    total = sum(int((w == 0).sum()) for w in projections(model).values())
    assert shares["total"] == total / sum(w.numel() for w in projections(model).values())
    assert shares["up_proj"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.0}, "sparsity must be in"),
        ({"method": "obs"}, "Unknown pruning method"),
        ({"pattern": "1:5"}, "not a multiple of 5"),
        ({"pattern": "2:4", "sparsity": 0.3}, "pass sparsity=0.5"),
        ({"method": "wanda", "calibration": None}, "pass calibration="),
        ({"method": "sparsegpt", "calibration": None}, "pass calibration="),
        ({"targets": "attn"}, "targets must be one of"),
        ({"method": "sparsegpt", "score_fn": lambda w, x: w}, "mask_fn and select_fn apply"),
        ({"method": "sparsegpt", "damp": -1.0}, "damp must be"),
        ({"calibration": torch.zeros(2, 3)}, "token ids"),
    ],
)
def test_prune_refuses_bad_input_before_work(kwargs, message, monkeypatch):
    import copy

    model = tiny_model()

    def no_work(*args, **kw):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(copy, "deepcopy", no_work)
    args = {"method": "wanda", "calibration": calibration_tokens(), **kwargs}
    with pytest.raises(ValueError, match=message):
        prune(model, **args)


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


def test_sweep_grid_and_configs():
    grid = sweep_grid()
    assert len(grid) == 1 + 3 * (7 + 2) + 7
    assert len(sweep_grid([0.5])) == 1 + 3 * (1 + 2) + 1
    assert SweepConfig("sparsegpt", "2:4", 0.5) in grid
    assert SweepConfig("teal", "dynamic", 0.7) in grid
    for bad, message in [
        (("wanda", "2:4", 0.3), "pass sparsity=0.5"),
        (("dense", "dense", 0.5), "dense runs with"),
        (("teal", "unstructured", 0.5), "teal runs with"),
        (("obs", "unstructured", 0.5), "Unknown method"),
    ]:
        with pytest.raises(ValueError, match=message):
            SweepConfig(*bad)


def reference_ppl(model, windows):
    with torch.no_grad():
        logits = model(windows).double()
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), windows[:, 1:], reduction="none")
    return math.exp(float(nll.mean(1).mean()))


def test_sweep_rows_and_report(tmp_path):
    model = tiny_model(seed=6, std=0.1)
    held_out = calibration_tokens(7, batch=4, seq=32)
    configs = [("dense", "dense", 0.0), ("magnitude", "4:8", 0.5), ("teal", "dynamic", 0.5)]
    out = tmp_path / "sweep.json"
    report = run_sweep(model, None, out, "test", configs=[SweepConfig(*c) for c in configs],
                       calibration=calibration_tokens(8), eval_ids=held_out,
                       progress=False)  # fmt: skip
    rows = report["rows"]
    assert [(r["method"], r["pattern"], r["sparsity"]) for r in rows] == configs
    assert rows[0]["ppl"] == pytest.approx(reference_ppl(model, held_out), rel=1e-6)
    pruned = prune(model, "magnitude", 0.5, "4:8")
    assert rows[1]["ppl"] == pytest.approx(reference_ppl(pruned, held_out), rel=1e-6)
    for row in rows:
        assert row["lo"] <= row["ppl"] <= row["hi"]
    assert rows[2]["ppl"] != rows[0]["ppl"]
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["command"] == "test"
    assert saved["literature"]["ppl"]["wanda"] == 7.26
    assert {"machine", "protocol"} <= set(saved)
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temporary left
    again = sweep_rows(model, None, configs[:1], eval_ids=held_out, progress=False)
    assert again == rows[:1]


def test_cli_refuses_bad_arguments(capsys):
    assert main(["prune", "--sparsity", "1.5"]) == 2
    assert "sparsity" in capsys.readouterr().err
    assert main(["prune", "--pattern", "2:4", "--sparsity", "0.3"]) == 2
    assert "pass sparsity=0.5" in capsys.readouterr().err
    assert main(["prune", "--sweep", "--method", "wanda"]) == 2
    assert "leave out --method" in capsys.readouterr().err
    assert main(["prune", "--sweep", "--shares", "0.5,x"]) == 2
    assert "--shares is a list" in capsys.readouterr().err
    assert main(["prune", "--sweep", "--shares", "0.5,1.0"]) == 2
    assert "sparsity must be in" in capsys.readouterr().err
