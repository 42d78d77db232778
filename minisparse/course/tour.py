"""The tour: a five-minute first contact with the real model, run by ``minisparse tour``.

1. load the embedded SmolLM2-135M-Instruct (from the weight cache after the first time);
2. chat: answer a question with greedy decoding, streamed;
3. check minisparse's logits against transformers' own model loaded from the same GGUF;
4. a first look at the MLP activations: how many are exactly zero (SiLU: almost none);
5. save one figure and print a short report.

The figure goes to ``minisparse-tour.png`` in minisparse's cache folder (``cache_dir()``; set
``MINISPARSE_CACHE`` to move it), never into the current directory, unless ``out`` (the
command's ``--out``) names another file. The tour prints where it went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.hooks import mlp_activations, zero_fraction
from ..core.model import Transformer, check_count, param_bytes
from ..io.data import corpus, token_batches
from ..io.hf import Parity, compare_logits
from ..io.loading import cache_dir, load, load_hf_reference
from ..measure.plots import activation_histogram
from ..runtime.generate import generate

__all__ = [
    "FIGURE_NAME",
    "QUESTION",
    "ActivationSummary",
    "describe",
    "figure_path",
    "run_tour",
    "summarize_activations",
]

QUESTION = "In one sentence, why does a language model need a KV cache?"
FIGURE_NAME = "minisparse-tour.png"


def figure_path(out: str | Path | None = None) -> Path:
    """Where the tour saves its figure: ``out`` if given, else the cache folder."""
    return Path(out).expanduser() if out is not None else cache_dir() / FIGURE_NAME


@dataclass
class ActivationSummary:
    """Sparsity of the MLP activations act(W_gate x) over some tokens."""

    tokens: int
    exact_zero: float
    below: dict[float, float] = field(default_factory=dict)  # threshold -> share with |a| <= t
    per_layer_below_0_01: list[float] = field(default_factory=list)


def summarize_activations(
    acts: dict[str, torch.Tensor], thresholds: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
) -> ActivationSummary:
    """Exact-zero and near-zero shares of the MLP activations, overall and per layer."""
    every = torch.cat([a.flatten() for a in acts.values()])
    return ActivationSummary(
        tokens=next(iter(acts.values())).shape[0],
        exact_zero=zero_fraction(every),
        below={t: zero_fraction(every, t) for t in thresholds},
        per_layer_below_0_01=[zero_fraction(a, 1e-2) for a in acts.values()],
    )


def describe(model: Transformer) -> str:
    """One paragraph about the model's shape and size."""
    c = model.config
    return (
        f"{c.n_layers} layers, dim {c.dim}, FFN {c.ffn_dim}, {c.n_heads} query heads / "
        f"{c.n_kv_heads} KV heads of {c.head_dim}, vocab {c.vocab_size}, "
        f"{model.num_parameters() / 1e6:.1f} M parameters, "
        f"{param_bytes(model) / 1e6:.0f} MB in {str(model.dtype).removeprefix('torch.')}"
    )


def run_tour(out: str | Path | None = None, max_new_tokens: int = 48) -> dict[str, Any]:
    """Run the tour, print as it goes, and return the measured numbers.

    The figure goes to ``figure_path(out)``: ``out`` when given, else the cache folder.
    """
    out = figure_path(out)
    check_count(max_new_tokens, "max_new_tokens")
    report: dict[str, Any] = {}
    print("1/5 Loading the embedded SmolLM2-135M-Instruct ...", flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load()
    report["load_s"] = time.perf_counter() - t0
    print(
        f"    {describe(model)}\n    loaded in {report['load_s']:.1f} s "
        f"(weight cache: {cache_dir()})"
    )

    from ..kernels.cpu_build import describe_build
    from ..measure.machine import cpu_name
    from ..runtime.step import decode_library

    t0 = time.perf_counter()
    decode_library()  # compiled (and its build chosen) once per machine: not part of the chat
    report["build"] = describe_build()
    print(f"    {report['build']} (ready in {time.perf_counter() - t0:.1f} s)")
    print(f"2/5 Chat. Q: {QUESTION}\n    A: ", end="", flush=True)
    t0 = time.perf_counter()
    answer = generate(
        model,
        tokenizer,
        [{"role": "user", "content": QUESTION}],
        max_new_tokens=max_new_tokens,
        stream=True,
    )
    seconds = time.perf_counter() - t0
    report["answer"] = tokenizer.decode(answer, skip_special_tokens=True)
    report["chat_tok_s"] = len(answer) / seconds
    print(
        f"    {len(answer)} tokens at {report['chat_tok_s']:.1f} tokens/s (prefill included; "
        f"{cpu_name()}, {torch.get_num_threads()} threads)"
    )

    print(
        "3/5 Checking logits against transformers' own model (loads the GGUF, ~20 s) ...",
        flush=True,
    )
    hf_model, _ = load_hf_reference()
    tokens = token_batches(tokenizer, corpus(split="eval"), seq_len=64, n=1)
    parity: Parity = compare_logits(model, hf_model.eval(), tokens)
    del hf_model
    report["parity"] = parity
    print(
        f"    64 tokens: max |logit difference| = {parity.max_abs_diff:.2e}, "
        f"same top-1 token at {parity.argmax_agreement:.0%} of positions"
    )

    print("4/5 Recording the MLP activations act(W_gate x) on 256 tokens of text ...", flush=True)
    acts = mlp_activations(model, token_batches(tokenizer, corpus(split="eval"), 256, 1))
    summary = summarize_activations(acts)
    report["activations"] = summary
    print(
        f"    exactly zero: {summary.exact_zero:.3%}; "
        + ", ".join(f"|a| <= {t:g}: {v:.1%}" for t, v in summary.below.items())
    )

    print(f"5/5 Saving the activation histogram to {out}")
    every = torch.cat([a.flatten() for a in acts.values()])
    fig = activation_histogram(every, "SmolLM2-135M: SiLU MLP activations, all 30 layers")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    report["figure"] = out
    print(
        "\nDone. SiLU leaves almost no exact zeros: making them appear (ReLU, thresholds) and "
        "turning them into skipped work is what the rest of the course is about. Open "
        "notebooks/00_tour.ipynb next."
    )
    return report
