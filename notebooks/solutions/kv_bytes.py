"""Chapter 02: the size of an fp16 KV cache."""


def kv_bytes(layers: int, kv_heads: int, head_dim: int, seq: int, batch: int) -> int:
    return 2 * layers * kv_heads * head_dim * seq * batch * 2  # keys and values, 2 bytes each
