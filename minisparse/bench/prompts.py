"""The chat prompts the decode benchmarks share: "grounded" ones, whose answers repeat their
prompt (code to edit, text to convert: where prompt lookup finds matches), and "open" ones."""

from __future__ import annotations

__all__ = ["PROMPTS", "chat_prompts"]

PROMPTS: dict[str, list[str]] = {
    "grounded": [
        "Correct the spelling mistakes in this sentence and write it out again: The quick brown "
        "fox jumpd over the lazzy dog and ran into the forrest.",
        "Rewrite this Python function with a docstring, keeping the code the same:\n\n"
        "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)",
        "Add type hints to this function and return the whole function:\n\n"
        "def greet(name, times):\n    for i in range(times):\n        print('Hello, ' + name)",
        "Convert this list into a numbered list: apples, bananas, cherries, dates, elderberries, "
        "figs, grapes.",
        "Summarise this paragraph in one sentence: The KV cache stores the keys and values of "
        "every previous token, so that each new token only needs to compute its own query, key "
        "and value. Without the cache, the model would recompute the keys and values of the "
        "whole sequence at every step.",
        "Fix the bug in this code and show the corrected code:\n\ndef factorial(n):\n"
        "    if n == 0:\n        return 0\n    return n * factorial(n - 1)",
        "Rename the variable x to count in this code:\n\nx = 0\nfor item in items:\n"
        "    if item.ready:\n        x += 1\nprint(x)",
        'Translate this JSON object to YAML:\n{"name": "minisparse", "version": "0.1.0", '
        '"license": "Apache-2.0", "python": ">=3.10"}',
    ],
    "open": [
        "Write a short poem about the sea.",
        "What are three tips for sleeping well?",
        "Explain what a neural network is to a child.",
        "Tell me a story about a robot who learns to paint.",
    ],
}


def chat_prompts(kind: str = "all") -> list[list[dict[str, str]]]:
    """The benchmark's prompts as chat messages: "grounded", "open" or "all"."""
    if kind not in (*PROMPTS, "all"):
        raise ValueError(f"Unknown prompt set {kind!r}; use one of {[*PROMPTS, 'all']}.")
    kinds = list(PROMPTS) if kind == "all" else [kind]
    return [[{"role": "user", "content": text}] for k in kinds for text in PROMPTS[k]]
