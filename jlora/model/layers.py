"""The decoder layer of the Llama family in Flax: RMSNorm, rotary embeddings (with
Llama 3's or linear scaling), the attention's projections (with Qwen2's q/k/v biases, or
Llama's attention_bias) and the SwiGLU MLP.

The attention itself is not part of the layer: `DecoderLayer.qkv` projects and rotates,
the caller attends over the paged KV cache (attention.py), and `DecoderLayer.finish`
applies the output projection and the MLP. Each group of projections that shares an
input goes through a LoRA hook (`LoraFn`) the caller supplies, so the model decides how
adapters are applied (llama.py) and the layer knows nothing of them.

A bias of a column-parallel projection (q, k, v, gate, up) is its Dense's, split like its
output; that of a row-parallel one (o, down) is a parameter of its own
(`o_proj_bias`, `down_proj_bias`), added once after the partial outputs are summed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from configs import ModelConfig

Projections = tuple[jax.Array, ...]
# A layer's LoRA hook for projections sharing an input: (their names, the input h, a
# function computing their base outputs from h) -> the outputs plus the rows' LoRA
# deltas (the base output itself where a projection or a row is not adapted). The hook
# decides when the base projections run, so CPU work can overlap them.
LoraFn = Callable[[tuple[str, ...], jax.Array, Callable[[jax.Array], Projections]], Projections]
# A layer's base projections: (their names, their shared input h) -> h @ W for each; by
# default the layer's own Dense kernels, or another source of the same kernels.
DenseFn = Callable[[tuple[str, ...], jax.Array], Projections]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) * scale, computed in fp32."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf.astype(self.dtype) * scale).astype(self.dtype)


@functools.cache
def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """f32[head_dim / 2]: RoPE's angle per position of each pair of dimensions, scaled as
    `config.rope_scaling` says (transformers' `ROPE_INIT_FUNCTIONS`, in the same order of
    float32 operations)."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / np.float32(config.rope_theta) ** exponents).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    if scaling.type == "linear":
        return (inv_freq / factor).astype(np.float32)
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, Hugging Face layout (rotate the two halves of each head).

    x: [..., T, heads, head_dim]; positions: i32[..., T]; inv_freq: f32[head_dim / 2]
    (`inverse_frequencies`).
    """
    head_dim = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, d]
    xf = x.astype(jnp.float32)
    half = head_dim // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Bias(nn.Module):
    """A bias of its own: a row-parallel projection's, added after the partial sums."""

    features: int
    dtype: Any

    @nn.compact
    def __call__(self, y: jax.Array) -> jax.Array:
        return y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    attn_reduce: str | None = None  # mesh axis to sum o_proj's partial outputs over
    mlp_reduce: str | None = None  # mesh axis to sum down_proj's partial outputs over

    def setup(self) -> None:
        cfg = self.config

        def dense(features: int, bias: bool = False) -> nn.Dense:
            return nn.Dense(
                features,
                use_bias=bias,
                dtype=self.dtype,
                param_dtype=self.dtype,
                kernel_init=nn.initializers.normal(0.02),
            )

        self.attn_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.q_proj = dense(cfg.q_size, cfg.qkv_bias)
        self.k_proj = dense(cfg.kv_size, cfg.qkv_bias)
        self.v_proj = dense(cfg.kv_size, cfg.qkv_bias)
        self.o_proj = dense(cfg.hidden_size)
        if cfg.o_bias:
            self.o_proj_bias = Bias(cfg.hidden_size, self.dtype)
        self.mlp_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.gate_proj = dense(cfg.intermediate_size, cfg.mlp_bias)
        self.up_proj = dense(cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = dense(cfg.hidden_size)
        if cfg.mlp_bias:
            self.down_proj_bias = Bias(cfg.hidden_size, self.dtype)

    def project(
        self,
        names: tuple[str, ...],
        h: jax.Array,
        lora: LoraFn | None,
        dense: DenseFn | None = None,
    ) -> Projections:
        """The projections `names` of their shared input h, plus the rows' LoRA deltas."""

        def base(h: jax.Array) -> Projections:
            if dense is not None:
                return dense(names, h)
            return tuple(getattr(self, name)(h) for name in names)

        return base(h) if lora is None else lora(names, h, base)

    def qkv(
        self,
        x: jax.Array,
        positions: jax.Array,
        lora: LoraFn | None = None,
        dense: DenseFn | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [..., T, D], positions: i32[..., T] -> q [..., T, H, hd], k, v [..., T, KVH, hd].
        dense: where the projections' kernels come from (None: this layer's own)."""
        cfg = self.config
        h = self.attn_norm(x)
        lead = h.shape[:-1]
        q, k, v = self.project(("q_proj", "k_proj", "v_proj"), h, lora, dense)
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        inv_freq = inverse_frequencies(cfg)
        return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v

    def finish(
        self,
        x: jax.Array,
        attn: jax.Array,
        lora: LoraFn | None = None,
        dense: DenseFn | None = None,
    ) -> jax.Array:
        """Residual output projection, then the residual SwiGLU MLP. attn: [..., T, H*hd]."""
        cfg = self.config
        (out,) = self.project(("o_proj",), attn, lora, dense)
        if self.attn_reduce is not None:
            out = jax.lax.psum(out, self.attn_reduce)
        if cfg.o_bias:
            out = self.o_proj_bias(out)
        h = x + out
        gate, up = self.project(("gate_proj", "up_proj"), self.mlp_norm(h), lora, dense)
        (down,) = self.project(("down_proj",), nn.silu(gate) * up, lora, dense)
        if self.mlp_reduce is not None:
            down = jax.lax.psum(down, self.mlp_reduce)
        if cfg.mlp_bias:
            down = self.down_proj_bias(down)
        return h + down

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Used only to initialise parameters (attention replaced by q itself)."""
        q, _, _ = self.qkv(x, positions)
        return self.finish(x, q.reshape(*q.shape[:-2], -1))
