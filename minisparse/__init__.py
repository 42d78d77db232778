"""minisparse: a small, tested library for fast LLM inference, companion to the notebook course.

Start with::

    import minisparse
    model, tokenizer = minisparse.load()          # the embedded SmolLM2-135M, offline
    ids = minisparse.generate(model, tokenizer, "The KV cache", max_new_tokens=20)
    print(tokenizer.decode(ids))
"""

from . import deprecated
from .core.model import ModelConfig, Transformer
from .files.cache import cache_dir
from .io.loading import ModelLoadError, load
from .runtime.generate import generate

deprecated.install()  # old module paths still import for one release, with a warning

__version__ = "0.2.0"

__all__ = ["ModelConfig", "ModelLoadError", "Transformer", "cache_dir", "generate", "load"]
