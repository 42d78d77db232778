"""Benchmark: plain greedy decoding against speculative decoding with each draft.

``minisparse bench speculative`` (or ``python -m minisparse.bench.speculative``) decodes a
fixed set of chat prompts with the target alone and with every draft, interleaved within each
repeat (warm-up first, median of repeats; ``minisparse.measure.timing``'s rules), checks that
the tokens are identical, and prints per draft: the speedup of the decode steps alone (the
prompts' prefill, with a model draft's own, is printed apart), the acceptance α, tokens per
target pass, and the speedup the theory predicts from the measured α and costs.

The costs come from ``step_costs`` (``bench.speculative_costs``): one draft step (c) and one
target pass over γ + 1 tokens (v) in units of one single-token target step, timed side by side
on a filled cache; the table's ``cap`` is what the acceptance allows at those costs and
``real.`` the share of it the loop delivered. ``--gamma auto`` lets every draft choose its
drafts per pass (``speculative.AdaptiveGamma``), so that a draft the text does not suit sits out
instead of slowing decoding down. Each speedup is printed with the 95 % interval of its paired
rounds (``measure.compare.median_interval``).

Prompts: "grounded" ones ask for output that copies the input (editing, code, conversion),
where prompt lookup shines; "open" ones ask for new text."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.model import Transformer, check_count
from ..core.sampling import encode_prompt
from ..measure.compare import Interval, median_interval
from ..measure.machine import machine
from ..measure.timing import interleaved_decode_steps
from ..runtime.decoder import MAX_TOKENS
from ..runtime.generate import generate
from ..sparsity import check_sparsity
from ..speculative.loop import (
    AdaptiveGamma,
    Draft,
    expected_speedup,
    speculative_generate,
)
from ..speculative.registry import DRAFTS, make_draft
from .prompts import PROMPTS, chat_prompts
from .results import result, write_result
from .speculative_costs import predicted_from_passes, step_costs, verify_cost

AUTO = "auto"  # --gamma auto: AdaptiveGamma chooses the drafts of every pass

__all__ = [
    "AUTO",
    "PROMPTS",
    "SpecRow",
    "add_arguments",
    "bench_speculative",
    "chat_prompts",
    "check_arguments",
    "check_bench_counts",
    "format_rows",
    "gamma_arg",
    "main",
    "make_drafts",
    "run",
]


def make_drafts(
    model: Transformer,
    tokenizer: Any,
    names: tuple[str, ...] | None = None,
    sparsity: float = 0.5,
    exit_layers: int | None = None,
) -> dict[str, Draft]:
    """The drafts by name (default: every registered draft, ``speculative.DRAFTS``); a draft
    that calibrates does so on 256 tokens of the training text.

    ``sparsity`` and ``exit_layers`` go to the drafts that take them (the sparse draft's share
    of skipped neurons; the early-exit draft's depth, None: three quarters of the layers).
    """
    names = tuple(DRAFTS) if names is None else names
    unknown = set(names) - set(DRAFTS)
    if unknown:
        raise ValueError(f"Unknown drafts {sorted(unknown)}; choose from {tuple(DRAFTS)}.")
    check_sparsity(sparsity)
    calibration = None
    if any(DRAFTS[name].calibrated for name in names):
        from ..io.data import corpus, token_batches

        calibration = token_batches(tokenizer, corpus(split="train"), 128, 2)
    given = {"sparsity": sparsity, "exit_layers": exit_layers}
    drafts: dict[str, Draft] = {}
    for name in names:
        options = {k: v for k, v in given.items() if k in DRAFTS[name].options}
        drafts[name] = make_draft(name, model, calibration, **options)
    return drafts


@dataclass
class SpecRow:
    """One draft on the prompt set: measured and predicted speedup over plain decoding.

    ``plain_s`` and ``speculative_s`` are seconds per decoded token (decode steps alone, mean
    over the prompts); ``plain_prefill_s`` and ``prefill_s`` the seconds of a prompt's prefill
    and first token (with a model draft, its own prefill too); ``speedup`` is the median over
    rounds of plain's time over the draft's in the same round.
    """

    draft: str
    gamma: int | str  # "auto": AdaptiveGamma chose per pass
    new_tokens: int
    plain_s: float
    speculative_s: float
    speedup: float
    alpha: float
    tokens_per_call: float
    cost_ratio: float
    verify_cost: float
    predicted: float
    same_tokens: bool
    plain_prefill_s: float = 0.0
    prefill_s: float = 0.0
    speedup_low: float = float("nan")  # the 95 % interval of the paired speedup
    speedup_high: float = float("nan")  # (``median_interval`` over the rounds)
    rounds: int = 0
    cap: float = float("nan")  # tokens per pass / cost per pass: what the acceptance allows

    @property
    def realized(self) -> float:
        """The measured speedup as a share of ``cap``: what the loop delivers of what its
        drafts' acceptance and the measured costs allow (1: no overhead at all)."""
        return self.speedup / self.cap

    def interval(self) -> Interval:
        """The paired speedup within its 95 % interval over the rounds."""
        return Interval(self.speedup, self.speedup_low, self.speedup_high)


def bench_speculative(
    target: Transformer,
    tokenizer: Any,
    prompts: list[Any],
    drafts: dict[str, Draft],
    gamma: int | str = 4,
    max_new_tokens: int = 48,
    repeats: int = 3,
    warmup: int = 1,
    costs: dict[str, float] | None = None,
    progress: bool = True,
) -> list[SpecRow]:
    """Plain vs speculative greedy decoding over ``prompts``: decode steps alone, side by side.

    Each prompt's answer is first decoded plainly (up to ``max_new_tokens``, stopping at the
    end of the turn), and its length is then the length every variant decodes it to, exactly.
    Plain decoding and every draft decode all the prompts that way, and in every round also to
    one token (``timing.interleaved_decode_steps``): the difference is the decode steps alone,
    without the prompts' prefill (the target's, and a model draft's own), which is reported
    apart. Tokens and statistics are the last full-length run's. ``costs`` (``step_costs``)
    supply c and v for the prediction; measured when not given.

    ``gamma="auto"``: every draft chooses its drafts before each pass (``AdaptiveGamma``, up
    to ``MAX_TOKENS - 1``, with its c and v from ``costs``, which then need every γ up to
    that); the prediction is then the theory summed over the passes' own choices.
    """
    check_bench_counts(gamma, max_new_tokens, repeats, warmup)
    if not prompts:
        raise ValueError("No prompts to decode; pass at least one (e.g. chat_prompts()).")
    gammas = tuple(range(1, MAX_TOKENS)) if gamma == AUTO else (gamma,)
    if costs is None:
        costs = step_costs(target, drafts, gammas)
    missing = [g for g in gammas if f"verify {g}" not in costs]
    if missing:
        raise ValueError(f"costs lack the verification pass for gamma {missing}; measure them "
                         f"with step_costs(target, drafts, {gammas}).")  # fmt: skip
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    lengths = [len(generate(target, tokenizer, i, max_new_tokens=max_new_tokens)) for i in ids]
    decoded = sum(lengths) - len(ids)  # tokens after each prompt's first one
    if decoded < 1:
        raise ValueError(
            "Every prompt's answer is a single token, so there are no decode steps to time; "
            "use other prompts."
        )
    stats: dict[str, list[Any]] = {name: [] for name in drafts}

    def policy(name: str) -> int | AdaptiveGamma:
        if gamma != AUTO:
            return gamma
        verify = {g: costs[f"verify {g}"] for g in gammas}
        return AdaptiveGamma(MAX_TOKENS - 1, costs.get(name, 0.0), verify)

    def decode_all(name: str) -> Callable[[int], list[int]]:
        """Decodes every prompt to its answer's length (n > 1) or to one token (n = 1),
        plainly or with the draft ``name``."""

        def call(n: int) -> list[int]:
            tokens, runs = [], []
            for prompt, length in zip(ids, lengths, strict=True):
                k = 1 if n == 1 else length
                if name == "plain":
                    tokens += generate(
                        target, tokenizer, prompt, max_new_tokens=k, stop_at_eos=False
                    )
                else:
                    new, st = speculative_generate(
                        target, tokenizer, prompt, drafts[name], policy(name), k,
                        stop_at_eos=False,
                    )  # fmt: skip
                    tokens, runs = tokens + new, [*runs, st]
            if name != "plain":
                stats[name] = runs
            return tokens

        return call

    runs = {name: decode_all(name) for name in ["plain", *drafts]}
    speeds, prefill = interleaved_decode_steps(runs, max_new_tokens, repeats, warmup, progress)
    n = len(ids)
    plain = speeds["plain"]
    # the rounds divide by max_new_tokens - 1; the runs decoded ``decoded`` tokens in all
    scale = (max_new_tokens - 1) / decoded

    def per_token(speed: Any) -> float:
        return statistics.median(speed.rounds) * scale

    rows = []
    for name in drafts:
        kept, speed = stats[name], speeds[name]
        accepted, judged = sum(s.accepted for s in kept), sum(s.judged for s in kept)
        alpha = accepted / judged if judged else 0.0
        c, paired = costs.get(name, 0.0), median_interval(speed.round_speedups(plain))
        used = [k for st in kept for k in st.per_pass_gamma]
        if gamma == AUTO:
            predicted = predicted_from_passes(alpha, used, c, costs)
            v = sum(1.0 if k == 0 else costs[f"verify {k}"] for k in used) / max(len(used), 1)
        else:
            v = costs[f"verify {gamma}"]
            predicted = expected_speedup(alpha, gamma, c, v)
        per_pass = sum(k * c + verify_cost(k, costs) for k in used)
        rows.append(
            SpecRow(
                draft=name,
                gamma=gamma,
                new_tokens=sum(s.new_tokens for s in kept),
                plain_s=per_token(plain),
                speculative_s=per_token(speed),
                speedup=paired.mid,
                speedup_low=paired.low,
                speedup_high=paired.high,
                rounds=len(speed.rounds),
                cap=sum(s.new_tokens for s in kept) / per_pass if per_pass else 1.0,
                alpha=alpha,
                tokens_per_call=sum(s.new_tokens for s in kept) / sum(s.target_calls for s in kept),
                cost_ratio=c,
                verify_cost=v,
                predicted=predicted,
                same_tokens=speed.tokens == plain.tokens,
                plain_prefill_s=prefill["plain"] / n,
                prefill_s=prefill[name] / n,
            )
        )
    return rows


def check_bench_counts(gamma: int | str, max_new_tokens: int, repeats: int, warmup: int) -> None:
    """The benchmark's counts: gamma ("auto" or >= 1), new tokens and repeats >= 1, warm-up
    rounds >= 0."""
    if gamma != AUTO:
        check_count(gamma, "gamma", fix="draft tokens per target pass, e.g. 4, or 'auto'")
    check_count(
        max_new_tokens, "max_new_tokens", minimum=2,
        fix="the decode steps are timed as the difference of an n-token and a 1-token run",
    )  # fmt: skip
    check_count(repeats, "repeats", fix="the benchmark reports the median of the repeats")
    check_count(warmup, "warmup", minimum=0)


def check_arguments(args: argparse.Namespace) -> None:
    """Everything ``run`` can check before it loads the model, as one ValueError."""
    check_bench_counts(args.gamma, args.max_new_tokens, args.repeats, args.warmup)
    check_sparsity(args.sparsity)
    if args.exit_layers is not None:
        check_count(args.exit_layers, "--exit-layers", fix="the early-exit draft keeps >= 1 layer")


def format_rows(rows: list[SpecRow]) -> str:
    head = (
        f"{'draft':<15}{'gamma':>6}{'alpha':>7}{'tok/pass':>9}{'c':>6}{'v':>6}"
        f"{'speedup (95% interval)':>24}{'predicted':>10}{'cap':>6}{'real.':>6}{'prefill':>9}"
        "  same tokens"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.draft:<15}{r.gamma!s:>6}{r.alpha:>7.2f}{r.tokens_per_call:>9.2f}{r.cost_ratio:>6.2f}"
            f"{r.verify_cost:>6.2f}{r.speedup:>8.2f}x ({r.speedup_low:.2f}-{r.speedup_high:.2f})"
            f"{'':>3}{r.predicted:>9.2f}x{r.cap:>5.2f}x{r.realized:>6.0%}"
            f"{1e3 * r.prefill_s:>7.0f}ms  {r.same_tokens}"
        )
    rounds = sorted({r.rounds for r in rows})
    lines.append(
        f"(speedups: median of {'/'.join(map(str, rounds))} paired rounds; cap: tokens per "
        "pass / measured cost per pass (γ c + v); real.: speedup / cap)"
    )
    return "\n".join(lines)


def gamma_arg(text: str) -> int | str:
    """--gamma: a whole number or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gamma takes a whole number >= 1 or 'auto', got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="target model (as for load)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=list(DRAFTS))
    parser.add_argument("--prompts", default="all", choices=[*PROMPTS, "all"])
    parser.add_argument(
        "--gamma", type=gamma_arg, default=4,
        help="draft tokens per target pass, or 'auto': chosen before every pass from the "
        "acceptance seen so far",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens", type=int, default=48, help="longest answer decoded (default 48)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sparsity", type=float, default=0.5, help="sparse draft's sparsity")
    parser.add_argument("--exit-layers", type=int, default=None, help="early-exit draft depth")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def run(args: argparse.Namespace) -> int:
    from ..io.loading import load, resolve_device

    check_arguments(args)
    resolve_device(args.device)
    about = machine()
    print(about.line(), flush=True)
    model, tokenizer = load(args.model, device=args.device)
    drafts = make_drafts(model, tokenizer, tuple(args.drafts), args.sparsity, args.exit_layers)
    kinds = list(PROMPTS) if args.prompts == "all" else [args.prompts]
    gammas = tuple(range(1, MAX_TOKENS)) if args.gamma == AUTO else (args.gamma,)
    costs = step_costs(model, drafts, gammas)
    print(
        f"target step: {costs['target step ms']:.1f} ms; costs in target steps: "
        + ", ".join(f"{k} {v:.2f}" for k, v in costs.items() if k != "target step ms")
    )
    results = {}
    for kind in kinds:
        rows = bench_speculative(
            model,
            tokenizer,
            chat_prompts(kind),
            drafts,
            args.gamma,
            args.max_new_tokens,
            args.repeats,
            args.warmup,
            costs,
        )
        print(
            f"\n{kind} prompts ({len(PROMPTS[kind])}), each decoded to the end of its plain "
            f"answer (at most {args.max_new_tokens} tokens):"
        )
        print(format_rows(rows))
        results[kind] = [asdict(r) for r in rows]
    write_result(args, result(args, about, costs=costs, rows=results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.speculative", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
