"""Conversion between minisparse's ``Transformer`` and transformers' ``LlamaForCausalLM``.

The two hold the same tensors under different names (``layers.3.attn.q_proj.weight`` here,
``model.layers.3.self_attn.q_proj.weight`` there). transformers' model is the reference every
minisparse forward pass is tested against, and ``to_hf`` exports a (modified) model back to the
format real inference engines read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.model import ACTIVATIONS, ModelConfig, Transformer, rope_inv_freq

__all__ = [
    "LAYER_NAMES",
    "TOP_NAMES",
    "Parity",
    "check_exportable",
    "compare_logits",
    "from_hf",
    "hf_config",
    "hf_name",
    "parameter_names",
    "to_hf",
]

TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """The transformers Llama name of a minisparse parameter name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, idx, rest = name.split(".", 2)  # layers.<i>.<module>.<param>
    module, param = rest.rsplit(".", 1)
    return f"model.layers.{idx}.{LAYER_NAMES[module]}.{param}"


def parameter_names(config: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return list(Transformer(config).state_dict().keys())


def from_hf(hf_model: nn.Module) -> Transformer:
    """Copy a transformers Llama model into a new ``Transformer`` (same device and dtype)."""
    config = ModelConfig.from_hf(hf_model.config)
    hf_state = hf_model.state_dict()
    state: dict[str, Tensor] = {}
    for name in parameter_names(config):
        src = hf_name(name)
        if src not in hf_state and name == "lm_head.weight" and config.tie_embeddings:
            src = TOP_NAMES["embed.weight"]
        state[name] = hf_state[src].detach().clone()
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).float()
    rotary = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
    if rotary is not None:  # also covers scaled RoPE variants (llama3, linear, ...)
        model.inv_freq = rotary.inv_freq.detach().float().clone()
        model.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
    param = next(hf_model.parameters())
    return model.to(device=param.device, dtype=param.dtype)


def hf_config(config: ModelConfig) -> Any:
    """A transformers ``LlamaConfig`` with the same shape as ``config``."""
    from transformers import LlamaConfig

    eos = config.eos_token_ids
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"}
        | (config.rope_scaling or {}),
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=config.max_seq_len,
        hidden_act=config.hidden_act,
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
    )


def check_exportable(model: Transformer) -> None:
    """Raise if the model has activations transformers' Llama cannot express."""
    expected = ACTIVATIONS[model.config.hidden_act]
    for i, layer in enumerate(model.layers):
        slots = {
            "attn_in_act": layer.attn_in_act,
            "mlp_in_act": layer.mlp_in_act,
            "mlp.down_in_act": layer.mlp.down_in_act,
        }
        extra = [f"{name}={m}" for name, m in slots.items() if not isinstance(m, nn.Identity)]
        if type(layer.mlp.act) is not expected:
            extra.append(f"mlp.act={layer.mlp.act} (config says {model.config.hidden_act})")
        if extra:
            raise ValueError(
                f"Layer {i} has {', '.join(extra)}, which transformers' Llama cannot express; "
                "export the model before adding thresholds or a stage-2 ReLU "
                "(minisparse.sparsity.remove_thresholds takes thresholds out)."
            )


def to_hf(model: Transformer) -> nn.Module:
    """A transformers ``LlamaForCausalLM`` holding a copy of ``model``'s weights."""
    from transformers import LlamaForCausalLM

    check_exportable(model)

    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config(model.config))
    state = {
        hf_name(k): v.detach().clone(memory_format=torch.contiguous_format)
        for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, assign=True, strict=False)
    if model.config.tie_embeddings:
        hf.tie_weights()
    rotary = hf.model.rotary_emb
    rotary.inv_freq = model.inv_freq.detach().clone().to(model.device)
    rotary.original_inv_freq = rotary.inv_freq
    rotary.attention_scaling = model.rope_scale
    return hf.to(device=model.device, dtype=model.dtype).eval()


@dataclass
class Parity:
    """How closely two models' logits agree on the same tokens."""

    max_abs_diff: float
    argmax_agreement: float  # share of positions with the same top-1 token

    @property
    def same_argmax(self) -> bool:
        return self.argmax_agreement == 1.0


@torch.inference_mode()
def compare_logits(model: Transformer, hf_model: nn.Module, tokens: Tensor) -> Parity:
    """Max |logits difference| and top-1 agreement of ``model`` vs transformers on ``tokens``."""
    ours = model(tokens).float()
    theirs = hf_model(tokens).logits.float()
    return Parity(
        max_abs_diff=float((ours - theirs).abs().max()),
        argmax_agreement=float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    )
