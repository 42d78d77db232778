"""minisparse: a small, tested library for fast LLM inference, companion to the notebook course.

Start with::

    import minisparse
    model, tokenizer = minisparse.load()          # the embedded SmolLM2-135M, offline
    ids = minisparse.generate(model, tokenizer, "The KV cache", max_new_tokens=20)
    print(tokenizer.decode(ids))
"""

from .cache import cache_dir
from .generate import generate
from .loading import ModelLoadError, load
from .model import ModelConfig, Transformer

__version__ = "0.1.0"

__all__ = ["ModelConfig", "ModelLoadError", "Transformer", "cache_dir", "generate", "load"]
