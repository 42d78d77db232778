"""Drafts for speculative decoding: cheap ways to guess the target's next few tokens.

A draft proposes up to gamma tokens d_1..d_gamma after the context; the target then checks them
all in one pass (``speculative.speculative_generate``). A draft is worth its cost when it agrees
with the target often (acceptance α, see ``theory``) and costs little per step
(cost ratio c = draft step / target step): the speedup is about
(1 − α^(γ+1)) / ((1 − α)(γ c + 1)).

Every draft here is a ``Draft``: ``propose(ids, gamma, sampling, generator)`` returns the
proposed tokens and, when it sampled them, their distributions q [k, vocab] (None when they
were chosen deterministically: verification then treats q as a point mass).

* ``ModelDraft``: any ``Transformer`` with the target's vocabulary, with its own KV cache. It
  feeds only the tokens after the longest common prefix with what it has cached, so a rejection
  costs nothing to undo.
* ``early_exit_draft``: the target's first n layers, then its final norm and LM head. No extra
  weights; the cost ratio is about n / L plus the LM head (self-speculation, LayerSkip).
* ``sparse_draft``: the target with calibrated sparse MLPs (chapter 07): it skips a share of
  the MLP weights that a column-sparse kernel need not read.
* ``int8_draft``: the target with weight-only int8 linear layers (chapter 09): a quarter of
  the bytes, and close to lossless, so α is close to 1.
* ``prompt_lookup_draft``: no model at all. Find the last n tokens earlier in the context and
  propose what followed them; free, and strong whenever the output copies the input.

References: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (2023); Elhoushi et al., "LayerSkip: Enabling Early Exit Inference and
Self-Speculative Decoding" (2024); Saxena, "Prompt Lookup Decoding" (2023).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.model import Block, Transformer, check_count, make_cache
from ..quant.apply import quantize_model
from ..runtime.decoder import MAX_TOKENS, Decoder
from ..sparse.swap import sparse_mlps
from ..sparsity.thresholds import cats_thresholds
from .sampling import Sampling


class Draft:
    """Proposes up to gamma tokens to follow a context.

    ``propose`` returns the tokens and, for a sampling draft, their distributions q [k, vocab]
    (None when the tokens were chosen deterministically). ``calls`` counts the forward passes
    the draft made since ``reset``.
    """

    name = "draft"
    vocab_size: int | None = None  # None: works with any vocabulary
    tokenizer: Any = None  # the draft's own tokenizer, when it has one (checked against target)

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, max_seq_len: int) -> None:
        """Prepare for a new sequence of at most ``max_seq_len`` tokens."""
        self.calls = 0

    def prefill(self, ids: list[int]) -> None:
        """Take in the prompt ``ids`` before the first proposal (a model draft fills its cache
        with all but the last token, as the target does); nothing for a draft without state."""

    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# A model as the draft
# --------------------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ModelDraft(Draft):
    """A ``Transformer`` as the draft, with its own static KV cache.

    The cache remembers which tokens it holds; on each call only the tokens after the longest
    common prefix with the new context are fed (after a rejection that is the target's
    correction token, after a full acceptance the last draft token and the bonus token).
    """

    def __init__(self, model: Transformer, tokenizer: Any = None, name: str = "model") -> None:
        super().__init__()
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.vocab_size = model.config.vocab_size
        self.cache: nn.ModuleList | None = None
        self.decoder: Decoder | None = None
        self.cached: list[int] = []

    def reset(self, max_seq_len: int) -> None:
        super().reset(max_seq_len)
        m = self.model
        self.cache = make_cache(m.config, 1, max_seq_len, m.dtype, m.device)
        self.decoder = Decoder(m, self.cache) if Decoder.supports(m) else None
        self.cached = []

    def _check_reset(self) -> None:
        if self.cache is None:
            raise RuntimeError(
                "Call reset(max_seq_len) before prefill or propose (speculative_generate does)."
            )

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        self._check_reset()
        if len(ids) > 1:
            device = self.model.device
            prefix = torch.tensor([ids[:-1]], device=device)
            self.model(prefix, torch.arange(len(ids) - 1, device=device), self.cache)
            self.cached = ids[:-1]

    @torch.inference_mode()
    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        self._check_reset()
        device = self.model.device
        start = min(common_prefix(self.cached, ids), len(ids) - 1)
        tokens = torch.tensor([ids[start:]], device=device)
        pos = torch.arange(start, len(ids), device=device)
        out: list[int] = []
        qs: list[Tensor] = []
        for _ in range(gamma):
            if self.decoder is not None and tokens.shape[1] <= MAX_TOKENS:  # the compiled step
                logits = self.decoder.forward(tokens[0].tolist(), int(pos[0]))[-1]
            else:
                hidden = self.model.hidden_states(tokens, pos, self.cache)
                logits = self.model.lm_head(hidden[0, -1])
            self.calls += 1
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = sampling.probs(logits)
                token = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            out.append(token)
            tokens = torch.tensor([[token]], device=device)
            pos = pos[-1:] + 1
        self.cached = ids + out[:-1]  # the last proposal was never fed
        return out, (torch.stack(qs) if qs else None)


# --------------------------------------------------------------------------------------------
# Drafts made from the target itself
# --------------------------------------------------------------------------------------------


def model_with_layers(model: Transformer, layers: Sequence[nn.Module]) -> Transformer:
    """A ``Transformer`` that shares ``model``'s embedding, final norm and LM head, with ``layers``.

    No weight is copied: the shell is built on the meta device and its modules are replaced by
    the given ones.
    """
    config = dataclasses.replace(model.config, n_layers=len(layers))
    with torch.device("meta"):
        shell = Transformer(config)
    shell.embed, shell.norm, shell.lm_head = model.embed, model.norm, model.lm_head
    shell.layers = nn.ModuleList(layers)
    shell.inv_freq = model.inv_freq
    shell.rope_scale = model.rope_scale
    return shell.eval()


def early_exit_draft(model: Transformer, n_layers: int) -> ModelDraft:
    """The first ``n_layers`` layers of ``model``, then its final norm and LM head.

    A draft step costs about (n_layers / L) of the layers' bytes plus the whole LM head, and
    needs no extra memory. Without training for it (LayerSkip does), early layers predict the
    final token less often, so acceptance grows with ``n_layers``.
    """
    total = model.config.n_layers
    whole = isinstance(n_layers, int) and not isinstance(n_layers, bool)
    if not whole or not 1 <= n_layers <= total:
        raise ValueError(
            f"n_layers must be between 1 and the model's {total} layers, got {n_layers!r}."
        )
    return ModelDraft(
        model_with_layers(model, model.layers[:n_layers]), name=f"early exit {n_layers}"
    )


def sparse_draft(model: Transformer, calibration_tokens: Tensor, sparsity: float) -> ModelDraft:
    """``model`` with chapter 07's sparse MLPs: per-layer thresholds skip ``sparsity`` of neurons.

    Thresholds are calibrated on ``calibration_tokens`` [batch, seq] (``cats_thresholds``);
    attention, norms, embedding and LM head are shared with ``model``.
    """
    thresholds = cats_thresholds(model, calibration_tokens, sparsity)
    mlps = sparse_mlps(model, thresholds)
    layers = []
    for layer, mlp in zip(model.layers, mlps, strict=True):
        with torch.device("meta"):
            block = Block(model.config)
        block.attn_norm, block.attn, block.mlp_norm = layer.attn_norm, layer.attn, layer.mlp_norm
        block.mlp = mlp
        layers.append(block)
    return ModelDraft(model_with_layers(model, layers), name=f"sparse {sparsity:.0%}")


def int8_draft(model: Transformer) -> ModelDraft:
    """``model`` with weight-only int8 linear layers, LM head included (``quant.Int8Linear``).

    Round-to-nearest with one scale per output channel (chapter 09): close to lossless, so the
    draft agrees with the target almost always, and it streams a quarter of the linear layers'
    bytes.
    """
    return ModelDraft(quantize_model(model, bits=8, packed=True, progress=False), name="int8")


# --------------------------------------------------------------------------------------------
# No model: prompt lookup
# --------------------------------------------------------------------------------------------


class PromptLookupDraft(Draft):
    """No model: find the last n tokens earlier in the context and propose what followed them.

    Tries n = ``ngram`` down to ``min_ngram`` and uses the most recent earlier occurrence with a
    continuation. When nothing matches it proposes nothing and the target decodes one token as
    usual. Free to run, and strong when the output copies the input (editing, summarising,
    answering from a document, code).
    """

    def __init__(self, ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        check_count(ngram, "ngram", fix="e.g. 3")
        check_count(min_ngram, "min_ngram", fix="e.g. 1")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(
                f"Need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}; "
                "try ngram=3, min_ngram=1."
            )
        self.ngram, self.min_ngram = ngram, min_ngram
        self.name = f"prompt lookup ({ngram}-gram)"

    def lookup(self, ids: Sequence[int], gamma: int) -> list[int]:
        """The up to ``gamma`` tokens after the latest earlier match of ids' last n-gram."""
        for n in range(min(self.ngram, len(ids) - 1), self.min_ngram - 1, -1):
            pattern = list(ids[-n:])
            for start in range(len(ids) - n - 1, -1, -1):  # latest first, excluding the suffix
                if list(ids[start : start + n]) == pattern:
                    return list(ids[start + n : start + n + gamma])
        return []

    def propose(
        self,
        ids: list[int],
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> tuple[list[int], Tensor | None]:
        self.calls += 1
        return self.lookup(ids, gamma), None


def prompt_lookup_draft(ngram: int = 3, min_ngram: int = 1) -> PromptLookupDraft:
    """A ``PromptLookupDraft`` matching n-grams of length ``ngram`` down to ``min_ngram``."""
    return PromptLookupDraft(ngram, min_ngram)


# --------------------------------------------------------------------------------------------
# Checking a draft against the target
# --------------------------------------------------------------------------------------------


def as_draft(draft: Draft | Transformer) -> Draft:
    """A ``Draft`` from a draft or a plain ``Transformer`` (wrapped in ``ModelDraft``)."""
    if isinstance(draft, Draft):
        return draft
    if isinstance(draft, Transformer):
        return ModelDraft(draft)
    raise TypeError(
        f"draft must be a minisparse Transformer or a Draft (e.g. prompt_lookup_draft()), "
        f"got {type(draft).__name__}."
    )


def check_compatible(target: Transformer, tokenizer: Any, draft: Draft) -> None:
    """A draft must speak the target's vocabulary: same size, and the same tokenizer if known."""
    vocab = target.config.vocab_size
    if draft.vocab_size is not None and draft.vocab_size != vocab:
        raise ValueError(
            f"The draft's vocabulary has {draft.vocab_size} tokens, the target's {vocab}; "
            "use a draft from the same model family (same tokenizer), or prompt_lookup_draft()."
        )
    if draft.tokenizer is not None and tokenizer is not None:
        if draft.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "The draft's tokenizer differs from the target's, so their token ids mean "
                "different things; use a draft that shares the target's tokenizer."
            )


__all__ = [
    "Draft",
    "ModelDraft",
    "PromptLookupDraft",
    "as_draft",
    "check_compatible",
    "common_prefix",
    "early_exit_draft",
    "int8_draft",
    "model_with_layers",
    "prompt_lookup_draft",
    "sparse_draft",
]
