"""GGUF files: metadata -> ModelConfig and tokenizer fields, tensors -> Params.

Tensors are dequantized to fp32 and then cast to the serving dtype: the common
block formats (Q4_0, Q4_1, Q8_0) here, a whole tensor in a few vectorised numpy
operations (`dequantize`; the `gguf` package's own works a group of rows at a time,
most of a warm start's loading), every other format with the `gguf` package.
llama.cpp stores the q and k projections with the rows of each head interleaved for
its RoPE kernel; we undo that permutation so that the weights (and PEFT adapters
trained against them) are in Hugging Face layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from configs import ModelConfig
from jlora.model.gguf_format import GGUFFormatError, read_gguf
from jlora.model.llama import Params
from jlora.model.weights import (
    LAYER_MODULES,
    Progress,
    Put,
    WeightsError,
    assemble_params,
    default_device,
)

# Hugging Face layer tensor -> GGUF tensor name inside `blk.{i}.`
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
assert set(_GGUF_LAYER) == set(LAYER_MODULES.values())

# ggml block formats dequantized here: type -> (values per block, bytes per block)
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray | None:
    """fp32 values of `data` (the raw bytes of a tensor in ggml block format
    `type_name`), flat; None for a format not handled here. Each block starts with
    its scale d (fp16); Q4_1 then has its offset m (fp16). Q8_0: d·q, q int8; Q4_0:
    d·(q - 8), Q4_1: d·q + m, q the 4-bit values (the first half of a block in the low
    nibbles of its 16 bytes, the second half in the high ones)."""
    if type_name not in _BLOCKS:
        return None
    size, nbytes = _BLOCKS[type_name]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, nbytes)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    values = np.empty((blocks.shape[0], size), np.float32)
    if type_name == "Q8_0":
        values[:] = blocks[:, 2:].view(np.int8)
    else:
        quants = blocks[:, 2:] if type_name == "Q4_0" else blocks[:, 4:]
        values[:, : size // 2] = quants & 0x0F
        values[:, size // 2 :] = quants >> 4
        if type_name == "Q4_0":
            values -= 8
    values *= scale
    if type_name == "Q4_1":
        values += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return values.reshape(-1)


class GGUFFile:
    """An opened GGUF file: decoded metadata fields and lazily dequantized tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise WeightsError(f"{path}: no such file")
        try:
            self.fields, self._tensors = read_gguf(path)
        except GGUFFormatError as err:
            raise WeightsError(f"{path}: not a valid GGUF file ({err})") from err

    def field(self, key: str) -> Any:
        if key not in self.fields:
            raise WeightsError(f"{self.path}: GGUF metadata field {key} is missing")
        return self.fields[key]

    def config(self, name: str = "") -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise WeightsError(
                f"{self.path}: general.architecture={arch!r} is not supported in a GGUF file "
                "(only 'llama'): serve the model's Hugging Face directory instead"
            )
        if "rope_freqs.weight" in self._tensors:
            raise WeightsError(
                f"{self.path}: tensor rope_freqs.weight (Llama 3.1's scaled RoPE as llama.cpp "
                "stores it) is not supported in a GGUF file: serve the model's Hugging Face "
                "directory, whose rope_scaling jlora reads"
            )
        heads = int(self.field("llama.attention.head_count"))
        vocab = self.fields.get("llama.vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        return ModelConfig(
            name=name or self.fields.get("general.name") or self.path.stem,
            vocab_size=int(vocab),
            hidden_size=int(self.field("llama.embedding_length")),
            intermediate_size=int(self.field("llama.feed_forward_length")),
            num_layers=int(self.field("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.fields.get("llama.attention.head_count_kv", heads)),
            head_dim=int(self.fields.get("llama.attention.key_length", 0)),
            rope_theta=float(self.fields.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.field("llama.attention.layer_norm_rms_epsilon")),
            max_context=int(self.fields.get("llama.context_length", 4096)),
            tie_embeddings="output.weight" not in self._tensors,
        )

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized fp32 tensor in PyTorch layout (rows = output features)."""
        import gguf

        if name not in self._tensors:
            raise WeightsError(f"{self.path}: tensor {name} is missing")
        info = self._tensors[name]
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        fast = dequantize(info.data, ggml_type.name)
        if fast is not None:
            return fast.reshape(info.shape)
        try:
            array = gguf.quants.dequantize(info.data, ggml_type)
        except (NotImplementedError, ValueError) as err:
            raise WeightsError(
                f"{self.path}: tensor {name} of type {ggml_type.name} cannot be dequantized ({err})"
            ) from err
        return np.asarray(array, dtype=np.float32).reshape(info.shape)

    def params(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        progress: Progress | None = None,
        put: Put = default_device,
    ) -> Params:
        def tensor(hf_name: str) -> np.ndarray:
            if hf_name == "model.embed_tokens.weight":
                return self.tensor("token_embd.weight")
            if hf_name == "model.norm.weight":
                return self.tensor("output_norm.weight")
            if hf_name == "lm_head.weight":
                return self.tensor("output.weight")
            _, _, index, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}.weight
            array = self.tensor(f"blk.{index}.{_GGUF_LAYER[rest.removesuffix('.weight')]}.weight")
            if rest.startswith("self_attn.q_proj"):
                return unpermute_rope_rows(array, config.num_heads)
            if rest.startswith("self_attn.k_proj"):
                return unpermute_rope_rows(array, config.num_kv_heads)
            return array

        return assemble_params(config, tensor, dtype, progress, put)


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, d/2, 1, d/2+1, ...) -> (0..d).

    llama.cpp's converter reshapes each head's rows as [2, d/2] and swaps to [d/2, 2];
    the inverse reshapes as [d/2, 2] and swaps back.
    """
    out_features = weight.shape[0]
    half = out_features // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
