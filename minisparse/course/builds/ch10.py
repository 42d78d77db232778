"""Chapter 10's builds: the speculative decoding loop, and the rejection-sampling step.

**The loop** (``speculative_decode``). Greedy speculative decoding with a target and a draft
model, each with its own static KV cache. The target's cache holds every token of the context
but the last. Each *pass*: the draft proposes k = min(γ, tokens still wanted − 1) tokens
d_1..d_k greedily; the target runs once over [x_last, d_1, .., d_k] and its argmax a_i at each
of those positions decides: d_i is accepted while d_i = a_i, and after the n accepted drafts
the target's own a_{n+1} is emitted (the correction at a rejection, the *bonus* token after k
acceptances), so a pass emits n + 1 tokens. Then both caches roll back: a static cache writes
position p in place and attention reads the positions below the last one written, so rolling
back is writing the next pass from the first position that does not hold an accepted token.

Its check drives the learner's loop and the library's (``speculative_generate`` with a
``ModelDraft``) on fresh tiny random models in float64 (a draft equal to the target, one close
to it, one unrelated; γ from 1 to 5; prompts of one token and more; one token wanted) and
compares the tokens of every pass, so a missing bonus token (more passes) or an off-by-one in
the accepted count shows. It also records every call of both models (the tokens fed and their
positions, by hooks on the embedding and the first layer) and replays the caches: each call
may only see positions that hold the accepted context (and, for the draft, its current
proposals), so a cache that was not rolled back, whose rejected keys stay visible, fails
even where the tokens come out right.

**The step** (``speculative_step``). Speculative sampling (Leviathan et al. 2023, Chen et al.
2023) accepts d_i ~ q_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
it draws from the residual r = max(0, p_i − q_i) / Σ max(0, p_i − q_i), after k acceptances
from p_{k+1}. The random numbers are inputs, so the result is exact: u_i decides draft i
(accepted when u_i q_i(d_i) < p_i(d_i)), and u_{k+1} draws the token by inverse CDF, the
smallest x with Σ_{y <= x} r(y) > u_{k+1} Σ r. It is graded against the library's
``verify_sampled(..., uniforms=u)``.

The chapter then decodes the real model with the learner's loop (``passes_stats`` turns its
passes into the library's ``SpeculativeStats``) and checks the learner's step's law by
sampling.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...core.model import ModelConfig, Transformer, init_weights
from ...speculative.drafts import ModelDraft
from ...speculative.loop import SpeculativeStats, speculative_generate, verify_sampled
from ..grading import Exercise, register

__all__ = ["passes_stats"]

Cases = list[tuple[Any, ...]]
Passes = list[list[int]]


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


class _Tiny(Transformer):
    """A tiny random Transformer that names itself in one line in the check's messages."""

    label = "model"

    def __repr__(self) -> str:
        return f"<tiny {self.label}, vocab {self.config.vocab_size}>"


def _tiny(seed: int, vocab: int, label: str) -> Transformer:
    config = ModelConfig(
        vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
        rope_theta=10000.0, max_seq_len=64, tie_embeddings=False, eos_token_ids=[],
    )  # fmt: skip
    # float64: the learner's loop and the library's agree to the last bit on every argmax
    model = init_weights(_Tiny(config), seed=seed, std=0.1).double().eval()
    model.label = label
    return model


def _near(model: Transformer, gen: torch.Generator, noise: float = 0.01) -> Transformer:
    """A copy of ``model`` with slightly perturbed weights: it agrees with it most of the time."""
    near = copy.deepcopy(model)
    near.label = "draft"
    with torch.no_grad():
        for p in near.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return near


def _loop_cases(gen: torch.Generator) -> Cases:
    """(target, draft, prompt, gamma, max_new_tokens) per case."""
    vocab = int(torch.randint(40, 90, (1,), generator=gen))
    seeds = torch.randint(0, 2**30, (2,), generator=gen).tolist()
    target, other = _tiny(seeds[0], vocab, "target"), _tiny(seeds[1], vocab, "draft")

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    return [
        (target, _near(target, gen), prompt(6), 4, 17),  # acceptances and rejections
        (target, _near(target, gen, 0.0), prompt(5), 3, 11),  # always accepted: bonus tokens
        (target, other, prompt(1), 2, 7),  # almost always rejected; a one-token prompt
        (target, _near(target, gen), prompt(4), 1, 9),
        (target, _near(target, gen), prompt(3), 5, 1),  # one token wanted: nothing to propose
        (target, _near(target, gen), prompt(7), 5, 16),
    ]


def _library_loop(
    target: Transformer, draft: Transformer, prompt: list[int], gamma: int, max_new_tokens: int
) -> Passes:
    out, stats = speculative_generate(
        target, None, prompt, ModelDraft(draft), gamma, max_new_tokens, stop_at_eos=False
    )
    passes, start = [], 0
    for n in stats.per_pass:
        passes.append(out[start : start + n])
        start += n
    return passes


class _Calls:
    """Every forward call of some models, in order: (model name, tokens fed, positions)."""

    def __init__(self, models: dict[str, Transformer]) -> None:
        self.log: list[tuple[str, list[int], list[int]]] = []
        self.handles = []
        for name, model in models.items():
            self.handles.append(model.embed.register_forward_pre_hook(self._tokens(name)))
            self.handles.append(model.layers[0].register_forward_pre_hook(self._positions(name)))

    def _tokens(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            self.log.append((name, args[0].reshape(-1).tolist(), []))

        return hook

    def _positions(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            last = next(e for e in reversed(self.log) if e[0] == name)
            last[2].extend(args[3].reshape(-1).tolist())

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _sees_wrong_key(
    who: str, written: dict[int, int], tokens: list[int], positions: list[int], seq: list[int]
) -> str:
    """What is wrong with one call, which sees positions 0..max(positions), when positions
    0..len(seq)-1 should hold ``seq`` ("" if nothing); then record what it wrote."""
    fed = dict(zip(positions, tokens, strict=False))
    for p in range(max(positions, default=-1) + 1):
        token = fed.get(p, written.get(p))
        if token is None:
            return f"{who} reads position {p}, never written"
        if p >= len(seq) or token != seq[p]:
            return f"{who} reads position {p}: a rejected token"
    written.update(fed)
    return ""


def _cache_problem(
    log: list[tuple[str, list[int], list[int]]], prompt: list[int], passes: Passes
) -> str:
    """Replay both caches pass by pass: the first call that sees a wrong key, or "caches ok".

    Draft calls are checked against the context plus the proposals the target then verifies;
    a target pass must start at the last token of the context (its cache holds the rest)."""
    written: dict[str, dict[int, int]] = {"target": {}, "draft": {}}
    context, done, drafts = list(prompt), 0, []
    for name, tokens, positions in log:
        if name == "draft":
            drafts.append((tokens, positions))
            continue
        if positions and max(positions) < len(prompt) - 1:  # the prefill of the prompt
            problem = _sees_wrong_key(
                "the target's prefill", written["target"], tokens, positions, context
            )
            if problem:
                return problem
            continue
        if done == len(passes):
            return f"the target ran more than the {len(passes)} passes returned"
        done += 1
        if min(positions, default=-1) != len(context) - 1:
            return (
                f"target pass {done} starts at {min(positions, default=-1)}, not {len(context) - 1}"
            )
        seq = context + tokens[1:]
        for d_tokens, d_positions in drafts:
            problem = _sees_wrong_key(
                f"the draft (pass {done})", written["draft"], d_tokens, d_positions, seq
            )
            if problem:
                return problem
        drafts = []
        problem = _sees_wrong_key(f"target pass {done}", written["target"], tokens, positions, seq)
        if problem:
            return problem
        context += passes[done - 1]
    if done != len(passes):
        return f"{len(passes)} passes returned, but the target ran {done}"
    return "caches ok"


def _run_loop(impl: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Passes]:
    """(what the cache replay found, the tokens of every pass) of one decoding run."""
    target, draft, prompt = args[0], args[1], args[2]
    calls = _Calls({"target": target, "draft": draft})
    try:
        passes = impl(*args)
    finally:
        calls.close()
    chunks = [[int(t) for t in chunk] for chunk in passes]
    return _cache_problem(calls.log, list(prompt), chunks), chunks


def _same_run(got: Any, expected: Any) -> bool:
    return got == expected


register(
    "speculative_decode",
    Exercise(
        "10",
        "speculative_decode(target, draft, prompt, gamma, max_new_tokens) -> passes: greedy "
        "speculative decoding; two models called as model(tokens [1, t], positions [t], cache) "
        "-> logits [1, t, vocab], each with its own cache (make_cache(model.config, 1, n, "
        "model.dtype)). The target's cache holds every token but the last; per pass the draft "
        "proposes k = min(gamma, tokens still wanted - 1) greedy tokens, the target runs once "
        "over [last, d_1..d_k], drafts are accepted while they equal its argmax, its own argmax "
        "follows them (the correction, or the bonus token after k acceptances), and both "
        "caches roll back to the accepted tokens. Returns the tokens of each pass (a list of "
        "lists, max_new_tokens tokens in all)",
        _library_loop,
        _loop_cases,
        _same_run,
        "a pass over [last, d_1..d_k] at positions L-1..L-1+k (L = tokens so far) gives the "
        "argmax a_0..a_k; n = the number of leading i with d_{i+1} == a_i; emit d_1..d_n and "
        "then a_n (after k acceptances that is the bonus token). The next target pass writes "
        "from position L + n, and the draft feeds again from its first position that does not "
        "hold an accepted token: positions beyond hold rejected drafts",
        run=_run_loop,
        core=True,
    ),
)


def passes_stats(passes: Passes, gamma: int, max_new_tokens: int) -> SpeculativeStats:
    """The library's statistics of a greedy run from the tokens of its passes: a pass that
    emitted m tokens accepted m - 1 of the k = min(gamma, still wanted - 1) it was offered."""
    stats = SpeculativeStats()
    for chunk in passes:
        k = min(gamma, max_new_tokens - stats.new_tokens - 1)
        stats.target_calls += 1
        stats.proposed += k
        stats.accepted += len(chunk) - 1
        stats.judged += min(len(chunk), k)
        stats.new_tokens += len(chunk)
        stats.per_pass.append(len(chunk))
    return stats


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------


def _probs(gen: torch.Generator, rows: int, vocab: int, zeros: float = 0.0) -> Tensor:
    """Random distributions [rows, vocab] in float64, a share ``zeros`` of each row set to 0."""
    p = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        p = p * (torch.rand(rows, vocab, generator=gen, dtype=torch.float64) >= zeros)
        p[:, 0] += 1e-3  # never an all-zero row
    return p / p.sum(-1, keepdim=True)


def _drafts_from(q: Tensor, gen: torch.Generator) -> list[int]:
    return [int(torch.multinomial(row, 1, generator=gen)) for row in q]


def _step_cases(gen: torch.Generator) -> Cases:
    """(p [k + 1, vocab], q [k, vocab], drafts, u [k + 1]) per case."""
    out: Cases = []
    for k, vocab, zeros in ((0, 5, 0.0), (1, 7, 0.0), (3, 13, 0.3), (6, 50, 0.5), (4, 9, 0.0)):
        p, q = _probs(gen, k + 1, vocab, zeros), _probs(gen, k, vocab, zeros)
        u = torch.rand(k + 1, generator=gen, dtype=torch.float64)
        out.append((p, q, _drafts_from(q, gen), u))
    # a deterministic draft: q is a point mass on each proposal
    p = _probs(gen, 4, 11)
    drafts = p[:3].argmax(-1).tolist()
    q = torch.nn.functional.one_hot(torch.tensor(drafts), 11).double()
    out.append((p, q, drafts, torch.rand(4, generator=gen, dtype=torch.float64)))
    # a draft the target gives probability 0: always rejected, redrawn where p > q
    p, q = _probs(gen, 3, 8, 0.5), _probs(gen, 2, 8)
    drafts = [int(torch.nonzero(p[0] == 0)[0]) if bool((p[0] == 0).any()) else 1, 2]
    out.append((p, q, drafts, torch.rand(3, generator=gen, dtype=torch.float64)))
    # u close to 1 for the draw: the last tokens of the distribution
    p, q = _probs(gen, 3, 10), _probs(gen, 2, 10)
    u = torch.tensor([0.5, 0.5, 1 - 1e-9], dtype=torch.float64)
    out.append((p, q, _drafts_from(q, gen), u))
    return out


def _library_step(p: Tensor, q: Tensor, drafts: list[int], u: Tensor) -> tuple[int, int]:
    return verify_sampled(p, q, drafts, uniforms=u)


def _same_step(got: Any, expected: Any) -> bool:
    try:
        return tuple(int(v) for v in got) == tuple(expected)
    except (TypeError, ValueError):
        return False


register(
    "speculative_step",
    Exercise(
        "10",
        "speculative_step(p [k + 1, vocab], q [k, vocab], drafts (k ints), u [k + 1]) -> "
        "(n_accepted, next_token): speculative sampling with the random numbers given. Draft "
        "i is accepted when u[i] * q[i, d_i] < p[i, d_i] (probability min(1, p/q)); at the "
        "first rejection the next token is drawn from the residual max(0, p_i - q_i) "
        "normalised (p_i itself where that is all zero), after k acceptances from p[k]; the "
        "draw takes u[k] by inverse CDF: the smallest x with cumsum(r)[x] > u[k] * sum(r)",
        _library_step,
        _step_cases,
        _same_step,
        "stop at the first i with u[i] * q[i, d_i] >= p[i, d_i]; then r = (p[i] - q[i])"
        ".clamp_min(0) (p[i] if r sums to 0), else r = p[k]. The token is torch.searchsorted("
        "r.cumsum(0), u[k] * r.sum(), right=True): u[k], never u[i], draws it",
        core=True,
    ),
)
