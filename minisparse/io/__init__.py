"""Weights and text in and out.

* ``loading``: ``load`` a model from a name, a folder or a GGUF file (``sources``: where a model
  comes from; ``weight_cache``: the cache that makes the second load fast);
* ``hf``: to and from transformers' models, and the logits comparison against them;
* ``export``: to a transformers folder or a GGUF file, atomically (``export_checks``: what it
  refuses before any work);
* ``data``: the course's text; ``eval``: perplexity. (The cache folder and its atomic writes
  are the floor below: ``minisparse.files``.)
"""

__all__: list[str] = []
