"""Speculative decoding: the reference is target-only decoding.

Greedy runs must give exactly the target's greedy tokens; sampled runs must have exactly the
target's distribution (an analytic check and chi-square tests with fixed seeds, which also
reject a deliberately wrong rule); the theory is checked against a Monte-Carlo simulation.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from minisparse import speculative as S
from minisparse.core.model import make_cache, rope_cos_sin
from minisparse.core.sampling import logits_to_probs
from minisparse.runtime.generate import generate
from minisparse.speculative import loop as speculative_loop

VOCAB = 97


def random_prompts(n: int, seed: int, length: tuple[int, int] = (3, 20)) -> list[list[int]]:
    """Random token prompts; half of them repeat a chunk so prompt lookup finds matches."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        size = int(torch.randint(length[0], length[1], (), generator=gen))
        ids = torch.randint(0, VOCAB, (size,), generator=gen).tolist()
        prompts.append(ids + ids[: size // 2] if i % 2 else ids)
    return prompts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X^2 >= observed) for observed ``counts`` against expected ``probs`` (cells with p > 0).

    Cells with zero expected mass must be empty; a count there is an outright failure.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if (counts[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.fixture(scope="module")
def target():
    # Untied embeddings: with tied ones a random model mostly repeats its input token, and any
    # two random models would agree on that.
    return tiny_model(seed=0, max_seq_len=256, tie_embeddings=False)


def tiny_drafts(target) -> dict[str, S.Draft]:
    calibration = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    return {
        "other model": S.ModelDraft(tiny_model(seed=1, max_seq_len=256, tie_embeddings=False)),
        "early exit": S.early_exit_draft(target, 1),
        "sparse": S.sparse_draft(target, calibration, 0.5),
        "int8": S.int8_draft(target),
        "prompt lookup": S.prompt_lookup_draft(ngram=2),
    }


# ---- greedy: identical tokens ------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equals_target_greedy_for_every_draft(target, gamma):
    prompts = random_prompts(10, seed=gamma)
    wants = [generate(target, None, ids, max_new_tokens=24) for ids in prompts]
    accepted, rejected = {}, {}
    for name, draft in tiny_drafts(target).items():
        accepted[name] = rejected[name] = 0
        for ids, want in zip(prompts, wants, strict=True):
            got, stats = S.speculative_generate(target, None, ids, draft, gamma, 24)
            assert got == want, (name, ids)
            assert stats.new_tokens == len(got) == 24
            assert stats.accepted <= stats.judged <= stats.proposed <= gamma * stats.target_calls
            accepted[name] += stats.accepted
            rejected[name] += stats.judged - stats.accepted
    # Both paths are exercised: drafts that agree (int8) and drafts that are often rejected.
    assert accepted["int8"] > 50 and rejected["other model"] > 10 and rejected["early exit"] > 10


def test_greedy_stops_at_end_of_sequence_like_generate():
    probe = tiny_model(seed=3)
    ids = [5, 6, 7, 5, 6]
    stop = generate(probe, None, ids, max_new_tokens=12)[6]
    model = tiny_model(seed=3, eos_token_ids=[stop])
    want = generate(model, None, ids, max_new_tokens=12)
    assert want[-1] == stop and len(want) < 12
    free = generate(model, None, ids, max_new_tokens=12, stop_at_eos=False)
    assert len(free) == 12 and free[: len(want)] == want
    for draft in (S.int8_draft(model), S.prompt_lookup_draft(2)):
        got, stats = S.speculative_generate(model, None, ids, draft, gamma=4, max_new_tokens=12)
        assert got == want and stats.new_tokens == len(want)
        on, _ = S.speculative_generate(
            model, None, ids, draft, gamma=4, max_new_tokens=12, stop_at_eos=False
        )
        assert on == free


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_new_tokens_is_respected(target, max_new):
    ids = [1, 2, 3, 1, 2, 3, 1, 2]
    want = generate(target, None, ids, max_new_tokens=max_new)
    got, _ = S.speculative_generate(target, None, ids, S.int8_draft(target), 4, max_new)
    assert got == want and len(got) == max_new


def test_single_token_prompt(target):
    want = generate(target, None, [7], max_new_tokens=10)
    got, _ = S.speculative_generate(target, None, [7], S.early_exit_draft(target, 1), 3, 10)
    assert got == want


def test_real_model_greedy_identical(embedded):
    model, tokenizer = embedded
    code = "x = 0\nfor item in items:\n    if item.ready:\n        x += 1\nprint(x)"
    prompts = [
        [{"role": "user", "content": f"Rename the variable x to count in this code:\n\n{code}"}],
        [
            {
                "role": "user",
                "content": 'Translate this JSON to YAML:\n{"name": "minisparse", "version": "0.1"}',
            }
        ],
    ]
    for prompt in prompts:
        want = generate(model, tokenizer, prompt, max_new_tokens=20)
        for draft in (S.prompt_lookup_draft(), S.int8_draft(model)):
            got, stats = S.speculative_generate(model, tokenizer, prompt, draft, 4, 20)
            assert got == want, (prompt, draft.name)
            assert stats.accepted > 5, (prompt, draft.name)  # drafts were accepted


# ---- the KV cache rolls back by overwriting ----------------------------------------------------


def test_cache_overwrite_after_rollback_equals_uncached():
    model = tiny_model(seed=2)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, VOCAB, (1, 14), generator=gen)
    b = torch.randint(0, VOCAB, (1, 6), generator=gen)
    cache = make_cache(model.config, 1, 40)
    with torch.inference_mode():
        model(a, torch.arange(14), cache)  # 14 positions written
        got = model(b, torch.arange(9, 15), cache)  # roll back to 9, then write 6 new tokens
        want = model(torch.cat([a[:, :9], b], 1))[:, 9:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_draft_reuses_its_cache_after_rejections():
    draft_model = tiny_model(seed=4)
    draft = S.ModelDraft(draft_model)
    draft.reset(64)
    greedy = S.Sampling()
    prompt = [3, 1, 4, 1, 5]
    first, q = draft.propose(prompt, 4, greedy, None)
    assert q is None and draft.calls == 4
    # The target kept one draft token and corrected the next one; then all four and a bonus.
    for ids in ([*prompt, first[0], (first[1] + 1) % VOCAB], [*prompt, *first, 9]):
        got, _ = draft.propose(ids, 3, greedy, None)
        fresh = S.ModelDraft(draft_model)
        fresh.reset(64)
        assert got == fresh.propose(ids, 3, greedy, None)[0]
        assert got == generate(draft_model, None, ids, max_new_tokens=3)


def test_a_model_draft_reads_the_prompt_in_prefill_not_in_its_first_proposal(target, monkeypatch):
    """speculative_generate gives a model draft the prompt before decoding (its prefill, timed
    apart by the benchmark); the draft then holds all but the last token, and its proposals
    equal those of a draft that read the prompt inside its first proposal."""
    draft_model = tiny_model(seed=4)
    prompt = random_prompts(1, seed=12, length=(9, 10))[0]
    filled, fresh = S.ModelDraft(draft_model), S.ModelDraft(draft_model)
    for d in (filled, fresh):
        d.reset(32)
    filled.prefill(prompt)
    assert filled.cached == prompt[:-1] and filled.calls == 0
    assert filled.propose(prompt, 3, S.Sampling(), None) == fresh.propose(
        prompt, 3, S.Sampling(), None
    )
    seen: list[list[int]] = []
    monkeypatch.setattr(S.ModelDraft, "prefill", lambda self, ids: seen.append(list(ids)))
    S.speculative_generate(target, None, prompt, S.ModelDraft(draft_model), 2, 4)
    assert seen == [prompt]


# ---- sampling: the target's distribution, exactly ----------------------------------------------


def random_distributions(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """Peaky random distributions with some exact zeros (float64)."""
    p = torch.softmax(3 * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
    p[torch.rand(n, vocab, generator=gen) < 0.2] = 0
    p[:, 0] += 1e-3  # never all zero
    return p / p.sum(-1, keepdim=True)


def test_emitted_distribution_equals_target_analytically():
    gen = torch.Generator().manual_seed(0)
    p, q = random_distributions(gen, 50, 11), random_distributions(gen, 50, 11)
    for pi, qi in zip(p, q, strict=True):
        torch.testing.assert_close(S.emitted_distribution(pi, qi), pi, rtol=0, atol=1e-12)
        beta = S.acceptance_probability(pi, qi)
        torch.testing.assert_close(beta, 1 - 0.5 * (pi - qi).abs().sum(), rtol=0, atol=1e-12)
        point = S.point_mass(int(torch.argmax(qi)), qi)
        torch.testing.assert_close(S.emitted_distribution(pi, point), pi, rtol=0, atol=1e-12)
    # The residual redraws where the target wants more mass than the draft gives.
    r = S.residual_distribution(p[0], q[0])
    assert torch.all((r > 0) == (p[0] > q[0])) and r.sum().item() == pytest.approx(1.0)


def sample_first_tokens(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token over ``n`` verification steps of 2 drafts."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        if q is None:
            drafts = [int(torch.argmax(p[0])), 0]
        else:
            drafts = [int(torch.multinomial(qi, 1, generator=gen)) for qi in q]
        n_ok, token = S.verify_sampled(p, q, drafts, gen)
        counts[drafts[0] if n_ok > 0 else token] += 1
    return counts


def wrong_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A tempting mistake: redraw from the target itself after a rejection."""
    return p


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_verify_sampled_first_token_has_target_law(monkeypatch, deterministic_draft):
    gen = torch.Generator().manual_seed(1)
    p = random_distributions(gen, 3, 6).float()
    # A draft that puts its mass where the target puts little, so a wrong rule shows.
    q = None if deterministic_draft else p[:2].flip(-1)
    counts = sample_first_tokens(p, q, 4000, seed=2)
    assert chi_square_pvalue(counts, p[0]) > 1e-3
    monkeypatch.setattr(speculative_loop, "residual_distribution", wrong_residual)
    counts = sample_first_tokens(p, q, 4000, seed=2)
    assert chi_square_pvalue(counts, p[0]) < 1e-6  # the test has the power to catch it


def exact_two_token_law(model, ids: list[int], temperature: float) -> torch.Tensor:
    """P(x1, x2 | ids) under the target's sampling distribution, by enumeration."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        p1 = logits_to_probs(model(torch.tensor([ids]))[0, -1], temperature)
        seqs = torch.tensor([[*ids, x] for x in range(vocab)])
        p2 = logits_to_probs(model(seqs)[:, -1], temperature)
    return p1[:, None] * p2


def speculative_two_token_counts(target, draft, ids, n: int, temperature: float) -> torch.Tensor:
    vocab = target.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    for seed in range(n):
        out, _ = S.speculative_generate(
            target, None, ids, draft, gamma=2, max_new_tokens=2, temperature=temperature, seed=seed
        )
        counts[out[0], out[1]] += 1
    return counts


def test_speculative_sampling_matches_target_end_to_end(monkeypatch):
    # A 6-token vocabulary so the joint law of two tokens has 36 cells to compare.
    target = tiny_model(seed=10, vocab_size=6)
    draft = S.ModelDraft(tiny_model(seed=11, vocab_size=6))
    with torch.no_grad():  # sharpen the draft so it disagrees with the target
        draft.model.lm_head.weight.mul_(8)
    ids, temperature = [1, 2, 3], 0.5
    law = exact_two_token_law(target, ids, temperature)
    counts = speculative_two_token_counts(target, draft, ids, 2000, temperature)
    assert chi_square_pvalue(counts, law) > 1e-3
    monkeypatch.setattr(speculative_loop, "residual_distribution", wrong_residual)
    counts = speculative_two_token_counts(target, draft, ids, 2000, temperature)
    assert chi_square_pvalue(counts, law) < 1e-6


def test_sampling_is_reproducible_with_a_seed(target):
    draft = S.ModelDraft(tiny_model(seed=1, max_seq_len=256))
    runs = [
        S.speculative_generate(target, None, [4, 5, 6], draft, 3, 20, temperature=0.8, seed=7)[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_given_uniforms_decide_every_draft_and_draw_by_inverse_cdf():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    # p/q = 0.8 for token 2: accepted below u = 0.8, else redrawn from max(0, p - q) = [.25, .05]
    assert S.verify_sampled(p, q, [2], uniforms=torch.tensor([0.79, 0.95])) == (1, 3)
    assert S.verify_sampled(p, q, [2], uniforms=torch.tensor([0.81, 0.0])) == (0, 0)
    assert S.verify_sampled(p, q, [2], uniforms=torch.tensor([0.81, 0.9])) == (0, 1)
    assert S.verify_sampled(p, q, [3], uniforms=torch.tensor([0.0, 0.5])) == (0, 0)  # p(3) = 0
    assert S.sample_with(p[0], 0.0) == 0 and S.sample_with(p[0], 0.999) == 2  # never token 3


def test_stats_count_the_tokens_of_every_pass(target):
    out, stats = S.speculative_generate(target, None, [4, 5, 6], S.int8_draft(target), 3, 17)
    assert sum(stats.per_pass) == len(out) == 17 and len(stats.per_pass) == stats.target_calls
    assert all(1 <= n <= 4 for n in stats.per_pass)


# ---- theory vs simulation ----------------------------------------------------------------------


def simulated_tokens_per_call(alpha: float, gamma: int, n: int, seed: int) -> torch.Tensor:
    """Tokens per target pass when each draft is accepted independently with probability α."""
    gen = torch.Generator().manual_seed(seed)
    accept = torch.rand(n, gamma, generator=gen, dtype=torch.float64) < alpha
    prefix = accept.long().cumprod(1).sum(1)  # accepted drafts before the first rejection
    return (prefix + 1).double()


@pytest.mark.parametrize(("alpha", "gamma"), [(0.3, 1), (0.6, 4), (0.85, 7), (0.95, 3)])
def test_expected_tokens_per_call_matches_simulation(alpha, gamma):
    sim = simulated_tokens_per_call(alpha, gamma, 200_000, seed=gamma)
    stderr = sim.std().item() / math.sqrt(sim.numel())
    assert S.expected_tokens_per_call(alpha, gamma) == pytest.approx(
        sim.mean().item(), abs=4 * stderr
    )


def test_theory_edge_cases_and_speedup():
    assert S.expected_tokens_per_call(1.0, 4) == 5.0
    assert S.expected_tokens_per_call(0.0, 4) == 1.0
    # Leviathan et al.'s formula when verifying costs one step.
    a, g, c = 0.8, 5, 0.1
    want = (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))
    assert S.expected_speedup(a, g, c) == pytest.approx(want)
    assert S.expected_speedup(a, g, c, verify_cost=2.0) == pytest.approx((1 - a**6) / (1 - a) / 2.5)


@pytest.mark.parametrize(("alpha", "cost"), [(0.6, 0.05), (0.8, 0.2), (0.9, 0.02)])
def test_best_gamma_is_the_argmax_of_simulated_speedup(alpha, cost):
    def verify(g: int) -> float:
        return 1 + 0.1 * g

    simulated = {
        g: simulated_tokens_per_call(alpha, g, 100_000, seed=g).mean().item()
        / (g * cost + verify(g))
        for g in range(1, 13)
    }
    best = S.best_gamma(alpha, cost, verify, max_gamma=12)
    # The simulated optimum may tie with a neighbour within noise; the pick must be as good.
    assert simulated[best] >= max(simulated.values()) * 0.99
    assert S.best_gamma(alpha, 0.0, max_gamma=12) == 12  # free drafts: propose as many as allowed


def test_stats_follow_theory_with_a_bernoulli_draft(target):
    """A draft that proposes the target's greedy token with probability α, else a wrong one."""
    ids = [2, 7, 1, 8]
    reference = generate(target, None, ids, max_new_tokens=200)

    class BernoulliDraft(S.Draft):
        def __init__(self, alpha: float) -> None:
            super().__init__()
            self.alpha, self.gen = alpha, torch.Generator().manual_seed(0)

        def propose(self, context, gamma, sampling, generator):
            done = len(context) - len(ids)
            out = []
            for j in range(done, done + gamma):
                ok = torch.rand((), generator=self.gen) < self.alpha
                out.append(reference[j] if ok else (reference[j] + 1) % VOCAB)
            return out, None

    alpha, gamma = 0.7, 4
    got, stats = S.speculative_generate(target, None, ids, BernoulliDraft(alpha), gamma, 200)
    assert got == reference
    full_passes = stats.target_calls - 1  # the last pass may be cut short by max_new_tokens
    sim = simulated_tokens_per_call(alpha, gamma, 100_000, seed=0)
    stderr = sim.std().item() / math.sqrt(full_passes)
    assert stats.tokens_per_call == pytest.approx(
        S.expected_tokens_per_call(alpha, gamma), abs=4 * stderr
    )
    assert stats.alpha == pytest.approx(alpha, abs=0.08)


# ---- drafts ------------------------------------------------------------------------------------


def reference_lookup(ids: list[int], ngram: int, min_ngram: int, gamma: int) -> list[int]:
    for n in range(ngram, min_ngram - 1, -1):
        if n >= len(ids):
            continue
        suffix = tuple(ids[-n:])
        starts = [s for s in range(len(ids) - n) if tuple(ids[s : s + n]) == suffix]
        if starts:
            return ids[max(starts) + n : max(starts) + n + gamma]
    return []


def test_prompt_lookup_matches_reference_on_random_sequences():
    gen = torch.Generator().manual_seed(3)
    found = 0
    for _ in range(300):
        ids = torch.randint(0, 4, (int(torch.randint(1, 30, (), generator=gen)),), generator=gen)
        ids = ids.tolist()
        for ngram, min_ngram in ((3, 1), (2, 2), (4, 3)):
            draft = S.prompt_lookup_draft(ngram, min_ngram)
            got = draft.lookup(ids, 5)
            assert got == reference_lookup(ids, ngram, min_ngram, 5)
            found += bool(got)
    assert found > 300


def test_early_exit_draft_shares_weights_and_equals_truncated_model():
    model = tiny_model(seed=6, n_layers=3)
    draft = S.early_exit_draft(model, 2).model
    assert draft.embed.weight is model.embed.weight and draft.layers[1] is model.layers[1]
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the reference: the first two blocks by hand
        x = model.embed(tokens)
        cos, sin = rope_cos_sin(model.inv_freq, torch.arange(9), x.dtype)
        for layer in model.layers[:2]:
            x = layer(x, cos, sin, torch.arange(9), None)
        want = model.lm_head(model.norm(x))
        torch.testing.assert_close(draft(tokens), want, rtol=0, atol=0)


def test_sampling_drafts_return_their_distributions():
    draft = S.ModelDraft(tiny_model(seed=4))
    draft.reset(32)
    tokens, q = draft.propose([1, 2, 3], 3, S.Sampling(0.7), torch.Generator().manual_seed(0))
    assert q is not None and q.shape == (3, VOCAB)
    assert all(q[i, t] > 0 for i, t in enumerate(tokens))
    torch.testing.assert_close(q.sum(-1), torch.ones(3))


# ---- clear errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [0, -2, 1.5])
def test_bad_gamma(target, gamma):
    with pytest.raises(ValueError, match="gamma"):
        S.speculative_generate(target, None, [1, 2], S.prompt_lookup_draft(), gamma, 4)


def test_mismatched_vocabulary_and_tokenizer(target):
    other = tiny_model(seed=1, vocab_size=50)
    with pytest.raises(ValueError, match="same model family"):
        S.speculative_generate(target, None, [1, 2], other, 2, 4)

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    draft = S.ModelDraft(tiny_model(seed=1), tokenizer=Tok({"a": 0}))
    with pytest.raises(ValueError, match="shares the target's tokenizer"):
        S.speculative_generate(target, Tok({"b": 0}), [1, 2], draft, 2, 4)


def test_other_bad_inputs(target):
    lookup = S.prompt_lookup_draft()
    with pytest.raises(ValueError, match="prompt is empty"):
        S.speculative_generate(target, None, [], lookup, 2, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        S.speculative_generate(target, None, [1], lookup, 2, 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        S.speculative_generate(target, None, [1], lookup, 2, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        S.speculative_generate(target, None, [1] * 250, lookup, 2, 10)
    with pytest.raises(TypeError, match="must be a minisparse Transformer or a Draft"):
        S.speculative_generate(target, None, [1], "draft", 2, 4)
    with pytest.raises(ValueError, match="n_layers must be between 1"):
        S.early_exit_draft(target, 0)
    with pytest.raises(ValueError, match="min_ngram <= ngram"):
        S.prompt_lookup_draft(ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="alpha is a probability"):
        S.expected_tokens_per_call(1.2, 3)
    with pytest.raises(ValueError, match="cost_ratio"):
        S.expected_speedup(0.5, 3, -0.1)


# ---- the benchmark -----------------------------------------------------------------------------


def test_bench_rows_on_tiny_models(target):
    from minisparse.bench import speculative as B

    drafts = {"int8": S.int8_draft(target), "lookup": S.prompt_lookup_draft(2)}
    costs = B.step_costs(target, drafts, (1, 3), context=8, repeats=2, warmup=1)
    assert set(costs) == {"target step ms", "verify 1", "verify 3", "int8"}
    assert all(v > 0 for v in costs.values())
    prompts = random_prompts(3, seed=9)
    rows = B.bench_speculative(
        target, None, prompts, drafts, 3, 12, repeats=1, warmup=0, costs=costs, progress=False
    )
    assert [r.draft for r in rows] == ["int8", "lookup"]
    for r in rows:
        assert r.same_tokens and r.new_tokens == 36
        assert r.speedup == pytest.approx(r.plain_s / r.speculative_s)  # one round
        assert r.prefill_s > 0 and r.plain_prefill_s > 0
        c = costs.get(r.draft, 0.0)
        assert r.predicted == pytest.approx(S.expected_speedup(r.alpha, 3, c, costs["verify 3"]))
        assert 0 < r.cap < float("inf") and r.realized == pytest.approx(r.speedup / r.cap)
    assert "same tokens" in B.format_rows(rows)


def test_bench_with_adaptive_gamma_predicts_from_the_passes_own_choices(target):
    """gamma="auto": each draft chooses per pass; the tokens are the plain ones and the
    prediction is the theory summed over the passes that were run (checked by hand here)."""
    from minisparse.bench import speculative as B

    drafts = {"int8": S.int8_draft(target), "lookup": S.prompt_lookup_draft(2)}
    costs = {"int8": 0.4, **{f"verify {g}": 1.0 + 0.1 * g for g in range(1, 8)}}
    rows = B.bench_speculative(
        target, None, random_prompts(2, seed=4), drafts, "auto", 16, repeats=1, warmup=0,
        costs=costs, progress=False,
    )  # fmt: skip
    assert [(r.gamma, r.same_tokens) for r in rows] == [("auto", True)] * 2
    one = S.AdaptiveGamma(7, 0.4, {g: costs[f"verify {g}"] for g in range(1, 8)})
    _, st = S.speculative_generate(target, None, [3, 1, 4, 1, 5], drafts["int8"], one, 16)
    assert len(st.per_pass_gamma) == st.target_calls
    tokens = sum(
        1 if k == 0 else S.expected_tokens_per_call(st.alpha, k) for k in st.per_pass_gamma
    )
    cost = sum(1 if k == 0 else 0.4 * k + 1 + 0.1 * k for k in st.per_pass_gamma)
    got = B.predicted_from_passes(st.alpha, st.per_pass_gamma, 0.4, costs)
    assert got == pytest.approx(tokens / cost)
    measured = {"verify 2": 1.2, "verify 4": 1.6}  # v(k) between measured passes: a line
    assert [B.verify_cost(k, measured) for k in (0, 1, 2, 3, 5)] == pytest.approx(
        [1.0, 1.1, 1.2, 1.45, 1.75]
    )
    with pytest.raises(ValueError, match="lack the verification pass for gamma"):
        B.bench_speculative(target, None, [[1, 2]], drafts, "auto", 4, costs={"verify 4": 1.0})
    with pytest.raises((ValueError, TypeError), match="'auto'"):
        B.check_bench_counts("often", 4, 1, 0)


def test_bench_decodes_each_answer_to_where_plain_decoding_ends_it():
    """An answer that ends early (end of turn) is timed to its end, not past it: every variant
    decodes each prompt to the plain answer's length, and the tokens are the plain answers."""
    from minisparse.bench import speculative as B

    probe = tiny_model(seed=3, std=0.3)  # varied greedy text (small weights repeat a token)
    short = [5, 6, 7, 5, 6]
    free = generate(probe, None, short, max_new_tokens=12)
    end = next(j for j in range(3, 12) if free[j] not in free[:j])  # first seen at j >= 3
    model = tiny_model(seed=3, std=0.3, eos_token_ids=[free[end]])
    prompts = [short, *random_prompts(2, seed=10)]
    answers = [generate(model, None, p, max_new_tokens=12) for p in prompts]
    assert len(answers[0]) == end + 1 and sum(map(len, answers)) < 36  # one ends early
    drafts = {"lookup": S.prompt_lookup_draft(2)}
    costs = {"verify 3": 1.0}
    rows = B.bench_speculative(
        model, None, prompts, drafts, 3, 12, repeats=1, warmup=0, costs=costs, progress=False
    )
    assert rows[0].same_tokens and rows[0].new_tokens == sum(map(len, answers))
    first = tiny_model(seed=3, std=0.3, eos_token_ids=[answers[0][0]])  # short: a 1-token answer
    with pytest.raises(ValueError, match="single token"):
        B.bench_speculative(first, None, [short], drafts, 3, 12, costs=costs, progress=False)


def test_bench_rejects_unknown_names(target):
    from minisparse.bench import speculative as B

    assert len(B.chat_prompts("all")) == len(B.PROMPTS["grounded"]) + len(B.PROMPTS["open"])
    with pytest.raises(ValueError, match="Unknown prompt set"):
        B.chat_prompts("poems")
    with pytest.raises(ValueError, match="Unknown drafts"):
        B.make_drafts(target, None, ("medusa",))


def test_teacher_forced_alpha_against_a_loop():
    target, other = tiny_model(seed=0, tie_embeddings=False), tiny_model(seed=1)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        p_logits, q_logits = target(tokens), other(tokens)
    same, beta = [], []
    for b in range(2):
        for t in range(10):
            same.append(float(p_logits[b, t].argmax() == q_logits[b, t].argmax()))
            p = logits_to_probs(p_logits[b, t], 0.7)
            q = logits_to_probs(q_logits[b, t], 0.7)
            beta.append(
                float(sum(min(pi, qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=True)))
            )
    assert S.teacher_forced_alpha(target, other, tokens) == pytest.approx(sum(same) / 20)
    sampled = S.teacher_forced_alpha(target, other, tokens, S.Sampling(0.7))
    assert sampled == pytest.approx(sum(beta) / 20, rel=1e-5)
    assert 0 < sampled < 1
    assert S.teacher_forced_alpha(target, target, tokens) == 1.0


# ---- adaptive gamma ----------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("slope", [0.0, 0.05, 0.4])
@pytest.mark.parametrize("cost", [0.0, 0.2])
def test_choose_gamma_is_the_brute_force_best_including_no_drafts(alpha, slope, cost):
    """choose_gamma against a direct search over k = 0..7 of E[tokens] / (k c + v(k)), where
    k = 0 (a plain step) gives exactly 1."""
    v = S.linear_verify_cost(slope)

    def speed(k):
        if k == 0:
            return 1.0
        tokens = sum(alpha**j for j in range(k + 1))
        return tokens / (k * cost + v(k))

    got = S.choose_gamma(alpha, cost, v, 7)
    assert speed(got) == pytest.approx(max(speed(k) for k in range(8)))
    if alpha < slope / (1 + slope) and cost == 0.0:  # one draft does not pay for its token
        assert got == 0


def test_adaptive_estimate_is_the_forgetting_beta_mean():
    policy = S.AdaptiveGamma(prior_alpha=0.4, prior_weight=3.0, memory=0.8)
    a = n = 0.0
    for acc, judged in [(4, 4), (0, 1), (2, 3), (0, 0), (1, 1)]:
        policy.update(acc, judged)
        a, n = 0.8 * a + acc, 0.8 * n + judged
        assert policy.alpha == pytest.approx((a + 0.4 * 3.0) / (n + 3.0))
    policy.reset()
    assert policy.alpha == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_gamma": 0}, "gamma"),
        ({"memory": 0.0}, "memory"),
        ({"prior_alpha": 1.5}, "prior_alpha"),
        ({"cost_ratio": -1.0}, "cost_ratio"),
        ({"verify_cost": {1: 1.0, 2: 1.1}, "max_gamma": 3}, "no cost for gamma \\[3\\]"),
    ],
)
def test_adaptive_gamma_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S.AdaptiveGamma(**kwargs)


def test_adaptive_gamma_keeps_greedy_tokens_and_drafts_by_acceptance(target):
    """The tokens equal plain greedy decoding; a draft that is always right is given the most
    drafts per pass, one that is always wrong soon none (a plain step each), while a free one
    is still judged on those steps."""
    ids = [2, 7, 1, 8]
    reference = generate(target, None, ids, max_new_tokens=60)

    class FixedDraft(S.Draft):
        def __init__(self, right: bool) -> None:
            super().__init__()
            self.right = right

        def propose(self, context, gamma, sampling, generator):
            self.calls += 1
            done = len(context) - len(ids)
            tokens = reference[done : done + gamma]
            return (tokens if self.right else [(t + 1) % VOCAB for t in tokens]), None

    for right in (True, False):
        policy = S.AdaptiveGamma(max_gamma=6, verify_cost=S.linear_verify_cost(0.05))
        got, stats = S.speculative_generate(target, None, ids, FixedDraft(right), policy, 60)
        assert got == reference
        if right:
            assert set(stats.per_pass_gamma[2:-1]) == {6} and stats.tokens_per_call > 5
        else:  # once the optimistic prior has faded (about 30 judged drafts)
            assert set(stats.per_pass_gamma[40:]) == {0} and stats.accepted == 0
            assert policy.judged > 1  # the plain steps still judged the free draft
    for name, draft in tiny_drafts(target).items():  # every real draft, adaptive, same tokens
        cost = 0.0 if name == "prompt lookup" else 0.3
        policy = S.AdaptiveGamma(cost_ratio=cost)
        got, _ = S.speculative_generate(target, None, ids, draft, policy, 40)
        assert got == reference[:40], name
