"""Every worked solution passes its check, and every check fails on a wrong answer."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisparse.course.exercises import EXERCISES, check
from minisparse.course.plug import solution as load_solution

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"


def solution(name: str):
    return load_solution(name, SOLUTIONS)


def test_every_exercise_has_a_solution():
    files = {p.stem for p in SOLUTIONS.glob("*.py")}
    assert files == set(EXERCISES)


@pytest.mark.parametrize("name", sorted(EXERCISES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_worked_solution_passes(name, seed, capsys):
    assert check(name, solution(name), seed=seed)
    assert "correct" in capsys.readouterr().out


def jaccard(a, b, share):
    """The overlap divided by the union of the two top sets instead of by k."""
    k = max(1, round(share * a.numel()))
    top_a = set(a.argsort(descending=True, stable=True)[:k].tolist())
    top_b = set(b.argsort(descending=True, stable=True)[:k].tolist())
    return len(top_a & top_b) / len(top_a | top_b)


def activation_of_product(x, W_gate, W_up, W_down_t, idx, act):
    h = (x @ W_gate[idx].T) * (x @ W_up[idx].T)
    activation = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[act]
    return activation(h) @ W_down_t[idx]


def tiled_heads(q, k, v):
    """K/V heads tiled (head h reads K/V head h % G) instead of repeated in place."""
    group = q.shape[1] // k.shape[1]
    return solution("gqa_attention")(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1))


def window_one_too_long(q_pos, k_pos, n_sink, window):
    p, j = q_pos[:, None], k_pos[None, :]
    return (j <= p) & ((j < n_sink) | (j >= p - window))


def warmup_from_zero(step, lr, warmup, steps, min_lr_ratio):
    if step < warmup:
        return lr * step / warmup
    return solution("lr_schedule")(step, lr, warmup, steps, min_lr_ratio)


def equal_points_beat_each_other(points):
    return [not any(o[0] >= r[0] and o[1] <= r[1] for o in points if o is not r) for r in points]


#: a plausible mistake for each exercise
WRONG = {
    "rms_norm": lambda x, w, eps: (
        (x - x.mean(-1, keepdim=True))
        / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps)
        * w
    ),  # LayerNorm: the mean subtracted
    "sampling_probs": lambda logits, t, k: torch.softmax(logits * t, -1),  # times T, no top-k
    "rope": lambda x, cos, sin: x * cos + torch.roll(x, 1, -1) * sin,  # neighbours, not halves
    "gqa_attention": tiled_heads,
    "kv_bytes": lambda layers, h, d, s, b: layers * h * d * s * b * 2,  # forgot the values
    "sink_visible": window_one_too_long,
    "paged_slots": lambda table, b, pos: torch.tensor(table)[pos // b] + pos % b,  # no * b
    "top_share": lambda v, s: float(v[: round(s * len(v))].sum() / v.sum()),  # not sorted
    "lr_schedule": warmup_from_zero,
    "top_mask": lambda scores, s: solution("top_mask")(scores, 1 - s),  # kept the dropped share
    "drop_heads": lambda x, keep, h: (x.reshape(*x.shape[:-1], -1, h) * keep[..., None, :]).reshape(
        x.shape
    ),  # heads interleaved, not consecutive
    "recall_precision": lambda pred, actual: solution("recall_precision")(pred, actual)[::-1],
    "recall_cutoff": lambda logits, active, r: float(torch.quantile(logits.flatten(), 1 - r)),
    "scatter_gemv": lambda W_t, x, t: (x * (x.abs() > t)) @ W_t,  # 0 x NaN = NaN
    "sparse_ffn": activation_of_product,
    "fast_load": lambda hot, f: sum(float(h.float().mean()) for h in hot) / len(hot),
    "top_overlap": jaccard,
    "quantize_groups": lambda x, bits, g: solution("quantize_groups")(x, bits, x.shape[1]),
    "smoothquant_scales": lambda x, ws, a: solution("smoothquant_scales")(x, ws, 1 - a),
    "verify_greedy": lambda logits, drafts: (len(drafts), int(logits[-1].argmax())),
    "residual": lambda p, q: (p - q).abs() / (p - q).abs().sum().clamp_min(1e-30),
    "speculative_speedup": lambda a, g, c, v: sum(a**j for j in range(1, g + 1)) / (g * c + v),
    "pareto": equal_points_beat_each_other,
    "resident_bytes": lambda m: sum(p.numel() * p.element_size() for p in m.parameters()),
}


def build_mistakes() -> dict[str, list]:
    """The plausible wrong answers of every core build (``WRONG`` of each chapter's
    tests/test_builds_chNN.py, where they are written beside what they get wrong)."""
    builds: dict[str, list] = {}
    for path in sorted(Path(__file__).parent.glob("test_builds_ch*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        builds.update(module.WRONG)
    return builds


BUILD_MISTAKES = build_mistakes()


def test_every_exercise_has_a_wrong_answer():
    """Small exercises here; each core build in its chapter's tests/test_builds_chNN.py."""
    assert set(WRONG) | set(BUILD_MISTAKES) == set(EXERCISES)
    assert all(len(wrong) >= 2 for wrong in BUILD_MISTAKES.values())  # several mistakes each


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_answer_fails_with_a_hint(name, capsys):
    assert not check(name, WRONG[name], seed=0)
    out = capsys.readouterr().out
    assert "mismatch" in out and "hint:" in out


@pytest.mark.parametrize(
    ("name", "mistake"),
    [(n, fn) for n, fns in sorted(BUILD_MISTAKES.items()) for fn in fns],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_each_plausible_mistake_in_a_build_fails_with_a_hint(name, mistake, capsys):
    """...and says where the answer differs: the place in the result (an index, a key, the step
    of a script), not only the first values of both answers."""
    assert not check(name, mistake, seed=0)
    out = capsys.readouterr().out
    assert "mismatch" in out and "hint:" in out
    if EXERCISES[name].accepts is None:  # one right answer: the place where it differs
        assert re.search(r"result(\[[^\]]+\]|\.\w+)*:? |the result", out), out


def test_a_missing_scale_is_found_where_it_differs(capsys):
    """Attention without 1/sqrt(d): the first values of both answers can agree to four digits,
    so the message names the first element that differs and the largest difference."""
    from test_builds_ch02 import tiled

    def unscaled(q, k, v, block):
        return tiled(q * q.shape[-1] ** 0.5, k, v, block)

    assert not check("tiled_attention", unscaled, seed=0)
    out = capsys.readouterr().out
    first = re.search(r"first difference at \[(\d+, ){3}\d+\]: expected (\S+), got (\S+);", out)
    assert first and first.group(2) != first.group(3), out
    assert "largest |difference|" in out and "values beyond 0.0001" in out


def test_a_block_manager_without_copy_on_write_is_found_at_its_step(capsys):
    """The paged cache's script: the message names the step where the traces part, its
    operation (a write into a shared block) and the state both agreed on before it."""
    from test_builds_ch02 import NoCopyOnWrite

    assert not check("block_manager", NoCopyOnWrite, seed=0)
    out = capsys.readouterr().out
    step = re.search(r"the traces part at step (\d+) of \d+, the operation \('write', ", out)
    assert step and int(step.group(1)) > 0, out
    assert "both were (" in out and f"result[{step.group(1)}]" in out


def test_difference_walks_into_containers_and_keeps_nan_and_inf():
    from minisparse.course.feedback import difference, element_index

    assert element_index(7, (2, 2, 3)) == [1, 0, 1]
    e = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    assert difference(e.clone(), e, 1e-5) is None  # NaN matches NaN, inf the same inf
    g = e.clone()
    g[1, 1] = 2.5
    assert difference(g, e, 1e-5).startswith("result: first difference at [1, 1]: expected 2")
    assert difference({"a": [1, (2, g)]}, {"a": [1, (2, e)]}, 1e-5).startswith(
        "result['a'][1][1]: first difference at [1, 1]"
    )
    assert difference([1, 2], [1, 2, 3]) == "result has 2 items, expected 3"
    assert difference(torch.tensor([1, 2]), torch.tensor([1, 3]), 0.5) is not None  # ints: exact
    assert difference(0.1 + 0.2, 0.3, 1e-9) is None and "difference +1" in difference(3, 2)


def test_an_unknown_exercise_is_refused():
    with pytest.raises(ValueError, match="Unknown exercise 'softmax'; choose one of rms_norm"):
        check("softmax", lambda x: x)


def _rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _kv_bytes(layers, kv_heads, head_dim, seq, batch):
    return 2 * 2 * layers * kv_heads * head_dim * seq * batch


def _slow(*args):
    import time

    time.sleep(5)


def _mutating_rms_norm(x, w, eps):
    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # right values, input changed
    return x * w


@pytest.mark.parametrize(
    ("name", "fn", "message"),
    [
        ("kv_bytes", lambda *a: _kv_bytes(*a) + 0.9, "mismatch"),  # int() would have passed it
        ("kv_bytes", lambda *a: str(_kv_bytes(*a)), "mismatch"),
        ("rms_norm", lambda x, w, eps: None, "returned None; write its body"),
        ("rms_norm", lambda x, w, eps: 1 / 0, "raised ZeroDivisionError: division by zero"),
        ("rms_norm", _mutating_rms_norm, "changed its input #1 (tensor"),
        ("rms_norm", _slow, "did not return within 0 s"),
    ],
)
def test_the_checker_is_not_fooled_and_says_why_in_the_learners_terms(
    name, fn, message, capsys, monkeypatch
):
    import minisparse.course.grading as R

    monkeypatch.setattr(R, "TIME_LIMIT", 0.2)
    assert not check(name, fn, seed=0)
    assert message in capsys.readouterr().out
    assert check("kv_bytes", _kv_bytes, seed=0) and check("rms_norm", _rms_norm, seed=0)


@pytest.mark.parametrize("trials", [0, -1, True, 1.5])
def test_trials_must_be_a_positive_count(trials):
    with pytest.raises(ValueError, match="trials must be at least 1"):
        check("kv_bytes", _kv_bytes, trials=trials)


def test_a_learners_except_cannot_swallow_the_time_limit(capsys, monkeypatch):
    import minisparse.course.grading as R

    monkeypatch.setattr(R, "TIME_LIMIT", 0.2)

    def stubborn(x, w, eps):
        import time

        try:
            time.sleep(5)
        except Exception:
            return x  # would pass the limit if it were an Exception
        return x

    assert not check("rms_norm", stubborn, seed=0)
    assert "did not return within" in capsys.readouterr().out
