"""The shape of a Llama-family decoder: one dataclass that every other module reads.

A decoder of the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) is fixed by a handful of
numbers: the vocabulary V, the model width d (``dim``), L layers, n_heads query heads and
n_kv_heads key/value heads of ``head_dim`` each, the MLP width (``ffn_dim``), the RoPE base
theta and the RMSNorm epsilon. Leaving out the norms, its parameters count

    V d (embedding; twice with an untied LM head)
    + L (d head_dim (2 n_heads + 2 n_kv_heads) + 3 d ffn_dim)   (attention + gated MLP)

which is 134.5 M for SmolLM2-135M (the defaults below).

``ModelConfig`` holds these numbers, checks them once (counts >= 1, n_heads a multiple of
n_kv_heads for grouped-query attention, a known activation) and reads them from a transformers
``LlamaConfig`` (``from_hf``), including the RoPE variants that stretch the positions
(``rope_scaling``: llama3, linear, ...). ``ACTIVATIONS`` names the MLP activations a config may
ask for: SiLU for the SwiGLU MLP (Shazeer, 2020), ReLU and GELU for the chapters that change it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from .checks import check_count

__all__ = [
    "ACTIVATIONS",
    "ModelConfig",
]


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
}


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 8192
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    rope_scaling: dict[str, Any] | None = None  # transformers' RoPE variant (llama3, linear, ...)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            check_count(getattr(self, name), name)
        check_count(self.ffn_dim, "ffn_dim")
        check_count(self.max_seq_len, "max_seq_len")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                "choose n_kv_heads among the divisors of n_heads."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"Unknown activation {self.hidden_act!r}; use one of {sorted(ACTIVATIONS)}."
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers ``LlamaConfig`` (or a compatible one)."""
        n_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        rope = dict(
            getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None)
            or {}
        )
        theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
        eos = hf_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=hf_config.vocab_size,
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            ffn_dim=hf_config.intermediate_size,
            rope_theta=float(theta),
            norm_eps=float(hf_config.rms_norm_eps),
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_seq_len=int(getattr(hf_config, "max_position_embeddings", 2048)),
            hidden_act=hf_config.hidden_act,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
            rope_scaling=rope if scaled else None,
        )
