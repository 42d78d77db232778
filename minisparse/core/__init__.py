"""The model itself (chapters 00-02), in the order the course builds it.

* ``config``: ``ModelConfig``, the few numbers that describe a Llama-family model;
* ``layers``: RMSNorm, the linear layers and the slot modules (the extension point of a block);
* ``rope``: rotary position embeddings;
* ``attention``: attention three ways (the formula, shared key/value heads, tiles);
* ``model``: ``Transformer`` and its contiguous KV cache;
* ``hooks``: reading activations without changing the model;
* ``sampling``: prompts in, tokens out (greedy or sampled), with their checks (the generation
  loop, which uses the compiled step, is ``minisparse.runtime.generate``);
* ``checks``: the argument checks every module uses; ``registry``: the entries of one axis
  (sparsity methods, weight formats, quantization methods, drafts) by name.
"""

__all__: list[str] = []
