"""The pieces of generation that need only the model: prompts in, tokens out.

A prompt is text, a chat (a list of ``{"role", "content"}`` messages, wrapped in the
tokenizer's chat template) or token ids (``encode_prompt``). Sampling turns the last logits z
into probabilities p = softmax(z / T); top-k keeps the k largest, top-p (nucleus) keeps the
smallest set whose mass reaches p; T = 0 means greedy argmax, and top-k / top-p are refused
with it (they would change nothing). ``next_token`` draws one token from them.

Randomness: with a seed a run draws from its own generator (``make_generator``) and repeats
exactly; without one, sampling draws from torch's global generator, so ``torch.manual_seed``
makes it repeatable too.

Every argument is checked before any work: a bad prompt, count or sampling setting raises one
``ValueError`` that names it and says what to pass instead. The loop that uses all of this,
``minisparse.generate``, sits above the runtime (``minisparse.runtime.generate``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..deprecated import old_name
from .model import Transformer, check_count

__all__ = [
    "Prompt",
    "TextStreamer",
    "check_length",
    "check_messages",
    "check_prompt_ids",
    "check_sampling",
    "check_seed",
    "encode_prompt",
    "logits_to_probs",
    "make_generator",
    "next_token",
    "stop_ids",
]

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a string, chat messages (template applied), or token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("The prompt is empty; pass some text, chat messages or token ids.")
        return list(tokenizer(prompt)["input_ids"])  # with BOS where the model expects one
    prompt = list(prompt)
    if not prompt:
        raise ValueError("The prompt is empty; pass some text, chat messages or token ids.")
    if all(isinstance(m, dict) for m in prompt):
        check_messages(prompt)
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise TypeError(
        "prompt must be a string, a list of chat messages ({'role': ..., 'content': ...}) "
        "or a list of token ids."
    )


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Chat messages need a string ``role`` and a non-empty string ``content`` each."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"Chat message {i} must have a string 'role' and 'content', got {m!r}; e.g. "
                "{'role': 'user', 'content': 'Hello'}."
            )
        if not m["content"].strip():
            raise ValueError(
                f"Chat message {i} ({m['role']}) is empty; write something for the model to answer."
            )


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Every prompt token id must be in the model's vocabulary, 0 .. vocab_size - 1."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"Prompt token id {bad[0]} is outside the model's vocabulary (0 .. {vocab_size - 1}); "
            "encode the text with this model's tokenizer."
        )


def check_sampling(
    temperature: float, top_k: int | None = None, top_p: float | None = None
) -> None:
    """Refuse sampling settings that cannot work or would be silently ignored.

    ``temperature``: a finite number >= 0 (0 = greedy). ``top_k``: None or a whole number >= 1.
    ``top_p``: None or a number in (0, 1]. top-k / top-p filter what is *sampled*, so with
    greedy decoding they would do nothing: asking for both is an error.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}.")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"temperature must be >= 0 and finite, got {temperature}; use 0 for greedy "
            "decoding or e.g. 0.7 for sampling."
        )
    if top_k is not None:
        check_count(top_k, "top_k", fix="use None for no limit")
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float))
        or not 0 < top_p <= 1  # False for NaN too
    ):
        raise ValueError(f"top_p must be in (0, 1] (or None for no limit), got {top_p!r}.")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(
            "top_k and top_p choose among sampled tokens, but temperature 0 means greedy "
            "decoding, which ignores them; pass a temperature > 0 (e.g. 0.7) or drop top_k/top_p."
        )


def logits_to_probs(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Sampling distribution over the vocabulary from logits [..., vocab] (temperature > 0)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature must be > 0 for sampling; use 0 only for greedy decoding.")
    z = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token from the last logits [vocab]: argmax when temperature == 0.

    Without a ``generator`` sampling draws from torch's global generator (``torch.manual_seed``).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int) -> int:
    """prompt + new tokens, after checking that they fit the model's context."""
    check_count(max_new_tokens, "max_new_tokens", fix="ask for at least 1 new token")
    total = prompt_len + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"Prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {model.config.max_seq_len} tokens; shorten the prompt or ask "
            "for fewer tokens."
        )
    return total


def check_seed(seed: object) -> None:
    """A seed is None (torch's global generator) or a whole number >= 0."""
    if seed is not None:
        check_count(seed, "seed", minimum=0, fix="or None to use torch's global generator")


def make_generator(
    device: torch.device, seed: int | None, sampling: bool = True
) -> torch.Generator | None:
    """A generator seeded with ``seed``; None without a seed (or when not sampling).

    None makes torch's sampling functions draw from the global generator of ``device``, so
    ``torch.manual_seed(s)`` before a call makes an unseeded run repeatable.
    """
    check_seed(seed)
    if seed is None or not sampling:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def stop_ids(model: Transformer, tokenizer: Any) -> set[int]:
    """Token ids that end generation: the config's EOS ids plus the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class TextStreamer:
    """Print decoded text as tokens arrive (decodes the whole tail so multi-byte pieces join)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.ids: list[int] = []
        self.printed = 0

    def put(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.write(text[self.printed :])
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(text[self.printed :] + "\n")  # whatever was held back for a missing byte


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)
