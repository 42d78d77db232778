"""Export: take a model out of the course into the formats real inference engines load.

* **Hugging Face** (``export_hf``): a safetensors checkpoint and ``config.json`` that
  ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads, and so do vLLM, TGI and
  llama.cpp's ``convert_hf_to_gguf.py``. A ReLU model of chapter 04 (stage 1) is a Llama with
  ``hidden_act="relu"``; anything Llama cannot express (thresholds, a stage-2 ReLU after the
  norms, sparse or split MLPs) is refused with the reason.
* **GGUF** (``export_gguf``): llama.cpp's single-file format, written with the ``gguf``
  package: the model's hyper-parameters under ``llama.*`` keys, the tokenizer copied from the
  GGUF the model came from, and the tensors in llama.cpp's names and layout. Two details of
  that layout: (1) llama.cpp applies RoPE to *adjacent* pairs (x_2i, x_2i+1) while Llama
  checkpoints rotate the two halves (x_i, x_i+d/2), so the rows of W_q and W_k are permuted
  per head, row (h, half, i) -> (h, i, half), which turns one convention into the other; (2)
  1-D tensors (the norms) stay float32, as llama.cpp expects. ``dtype``: ``f32``, ``f16``, or
  ``q8_0`` (blocks of 32 weights sharing one fp16 scale: 8.5 bits per weight), or ``q4_1``
  (blocks of 32 4-bit codes with an fp16 scale and minimum: 5 bits per weight; every matrix,
  the tied embedding included, which is chapter 09's int4 format byte for byte in size and
  so the like-for-like file to time it against). llama.cpp's
  Llama graph has SiLU MLPs only, so a ReLU model is refused here (export it to HF instead).
* **Predictors and a placement** (``save_sidecars``): saved beside the model as safetensors,
  as PowerInfer ships its predictors with its model. Layout: ``predictors.safetensors`` is
  ``Predictors.save``'s file (per layer ``neurons.{l}.*`` tensors, JSON metadata with the
  kind, ranks and cut-offs); ``placement.safetensors`` holds ``hot.{l}``, one uint8 tensor of
  0/1 per layer (1 = on the fast device), and metadata ``policy``, ``budget_bytes``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from ..core.model import Transformer
from ..deprecated import old_name
from .export_checks import (
    EXPORT_MARK,
    check_export_folder,
    check_plain_mlps,
    check_writable_folder,
)
from .hf import check_exportable, to_hf

__all__ = [
    "GGUF_DTYPES",
    "GGUF_LAYER_NAMES",
    "GGUF_TOP_NAMES",
    "add_tensor",
    "check_gguf_exportable",
    "copy_tokenizer",
    "export_gguf",
    "export_hf",
    "gguf_tensors",
    "permute_for_gguf",
    "save_sidecars",
]

GGUF_DTYPES = ("f32", "f16", "q8_0", "q4_1")
#: minisparse parameter name (after ``layers.{i}.``) -> llama.cpp tensor name (after ``blk.{i}.``)
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.q_proj.weight": "attn_q.weight",
    "attn.k_proj.weight": "attn_k.weight",
    "attn.v_proj.weight": "attn_v.weight",
    "attn.o_proj.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_TOP_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def export_hf(
    model: Transformer,
    directory: str | Path,
    tokenizer: Any = None,
    sidecars: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and ``tokenizer``, and ``save_sidecars``' ``predictors`` / ``placement``
    given in ``sidecars``) as a transformers Llama checkpoint in ``directory``.

    The checkpoint is written in a temporary folder and put in place at the end
    (``cache.write_dir_atomic``): an interrupted export leaves the folder that was there, and
    a new one holds no stale file of an earlier export. A non-empty folder that is not an
    earlier export (no ``EXPORT_MARK`` file) is refused (``check_export_folder``).
    """
    from ..files.cache import write_dir_atomic

    check_plain_mlps(model)
    check_exportable(model)
    out = Path(directory)
    check_export_folder(out)
    check_writable_folder(out)

    def write(folder: Path) -> None:
        (folder / EXPORT_MARK).write_text(json.dumps({"exported_by": "minisparse export"}))
        to_hf(model).save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if sidecars:
            save_sidecars(folder, **sidecars)

    write_dir_atomic(out, write, shared=True)
    return out


def permute_for_gguf(w: Tensor, n_heads: int) -> Tensor:
    """Rows of W_q / W_k from the half-split RoPE pairing to llama.cpp's adjacent pairing."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_tensors(model: Transformer) -> dict[str, Tensor]:
    """The model's tensors under llama.cpp's names, W_q and W_k permuted."""
    c = model.config
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_embeddings:
            continue
        if name in GGUF_TOP_NAMES:
            out[GGUF_TOP_NAMES[name]] = value
            continue
        _, index, rest = name.split(".", 2)
        if rest not in GGUF_LAYER_NAMES:
            raise ValueError(
                f"{name} has no llama.cpp name; biases and extra tensors are not supported."
            )
        if rest == "attn.q_proj.weight":
            value = permute_for_gguf(value, c.n_heads)
        elif rest == "attn.k_proj.weight":
            value = permute_for_gguf(value, c.n_kv_heads)
        out[f"blk.{index}.{GGUF_LAYER_NAMES[rest]}"] = value
    return out


def check_gguf_exportable(model: Transformer, dtype: str) -> None:
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"Unknown GGUF dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}.")
    check_plain_mlps(model)
    check_exportable(model)
    c = model.config
    if c.hidden_act != "silu":
        raise ValueError(
            f"llama.cpp's Llama graph has SiLU MLPs only; this model's is {c.hidden_act!r}. "
            "Export it with --format hf instead."
        )
    if c.attention_bias or c.mlp_bias:
        raise ValueError("GGUF export supports bias-free Llama models only.")
    if c.rope_scaling:
        raise ValueError("GGUF export does not write RoPE scaling; export with --format hf.")
    if dtype in ("q8_0", "q4_1"):
        odd = sorted({d for d in (c.dim, c.ffn_dim, c.n_heads * c.head_dim) if d % 32})
        if odd:
            raise ValueError(
                f"{dtype} needs rows in multiples of 32 weights; this model has {odd}."
            )


def export_gguf(
    model: Transformer,
    path: str | Path,
    dtype: str = "f32",
    tokenizer_gguf: str | Path | None = None,
    name: str = "minisparse export",
) -> Path:
    """Write ``model`` as a llama.cpp GGUF file (see the module docstring).

    ``tokenizer_gguf``: a GGUF file whose tokenizer (``tokenizer.*`` keys) is copied, e.g. the
    one the model was loaded from; without it the file holds no tokenizer. The file is written
    under a temporary name and renamed at the end: an interrupted export leaves the file that
    was there.
    """
    from ..files.cache import write_file_atomic

    check_gguf_exportable(model, dtype)
    out = Path(path)
    check_writable_folder(out)
    write_file_atomic(
        out, lambda tmp: write_gguf(model, tmp, dtype, tokenizer_gguf, name), shared=True
    )
    return out


def write_gguf(
    model: Transformer, out: Path, dtype: str, tokenizer_gguf: str | Path | None, name: str
) -> None:
    """The GGUF file's contents, written at ``out`` (``export_gguf`` gives a temporary path)."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.dim)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    }
    writer.add_file_type(file_type[dtype])
    if tokenizer_gguf is not None:
        copy_tokenizer(gguf.GGUFReader(str(tokenizer_gguf)), writer)
    for tensor_name, value in gguf_tensors(model).items():
        add_tensor(writer, tensor_name, value.detach().float().cpu().numpy(), dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(writer: Any, name: str, array: np.ndarray, dtype: str) -> None:
    import gguf

    if array.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, array.astype(np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        kind = getattr(gguf.GGMLQuantizationType, dtype.upper())
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def copy_tokenizer(reader: Any, writer: Any) -> None:
    """Copy every ``tokenizer.*`` key of a GGUF file to the writer, with its value types."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def save_sidecars(
    directory: str | Path, predictors: Any = None, placement: Any = None, prefix: str = ""
) -> list[Path]:
    """Predictors and a placement beside an exported model (see the module docstring), as
    ``{prefix}predictors.safetensors`` and ``{prefix}placement.safetensors``, each written
    atomically by the object's own ``save(path)`` (``Predictors.save``, ``Placement.save``).
    Beside a GGUF file the prefix is the file's stem and a dot, so that two exports in one
    folder keep their own."""
    from ..files.cache import write_file_atomic

    out = Path(directory)
    written = []
    if predictors is not None:
        path = out / f"{prefix}predictors.safetensors"
        write_file_atomic(path, predictors.save, shared=True)
        written.append(path)
    if placement is not None:
        path = out / f"{prefix}placement.safetensors"
        write_file_atomic(path, placement.save, shared=True)
        written.append(path)
    return written


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)
