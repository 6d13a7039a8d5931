"""The decoder layer of the Llama family in Flax: RMSNorm, rotary embeddings, the
attention's projections and the SwiGLU MLP.

The attention itself is not part of the layer: `DecoderLayer.qkv` projects and rotates,
the caller attends over the paged KV cache (attention.py), and `DecoderLayer.finish`
applies the output projection and the MLP. Each group of projections that shares an
input goes through a LoRA hook (`LoraFn`) the caller supplies, so the model decides how
adapters are applied (llama.py) and the layer knows nothing of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, Hugging Face layout (rotate the two halves of each head).

    x: [..., T, heads, head_dim]; positions: i32[..., T].
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, d]
    xf = x.astype(jnp.float32)
    half = head_dim // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    attn_reduce: str | None = None  # mesh axis to sum o_proj's partial outputs over
    mlp_reduce: str | None = None  # mesh axis to sum down_proj's partial outputs over

    def setup(self) -> None:
        cfg = self.config

        def dense(features: int) -> nn.Dense:
            return nn.Dense(
                features,
                use_bias=False,
                dtype=self.dtype,
                param_dtype=self.dtype,
                kernel_init=nn.initializers.normal(0.02),
            )

        self.attn_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.q_proj = dense(cfg.q_size)
        self.k_proj = dense(cfg.kv_size)
        self.v_proj = dense(cfg.kv_size)
        self.o_proj = dense(cfg.hidden_size)
        self.mlp_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        self.gate_proj = dense(cfg.intermediate_size)
        self.up_proj = dense(cfg.intermediate_size)
        self.down_proj = dense(cfg.hidden_size)

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
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    def finish(
        self,
        x: jax.Array,
        attn: jax.Array,
        lora: LoraFn | None = None,
        dense: DenseFn | None = None,
    ) -> jax.Array:
        """Residual output projection, then the residual SwiGLU MLP. attn: [..., T, H*hd]."""
        (out,) = self.project(("o_proj",), attn, lora, dense)
        if self.attn_reduce is not None:
            out = jax.lax.psum(out, self.attn_reduce)
        h = x + out
        gate, up = self.project(("gate_proj", "up_proj"), self.mlp_norm(h), lora, dense)
        (down,) = self.project(("down_proj",), nn.silu(gate) * up, lora, dense)
        if self.mlp_reduce is not None:
            down = jax.lax.psum(down, self.mlp_reduce)
        return h + down

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Used only to initialise parameters (attention replaced by q itself)."""
        q, _, _ = self.qkv(x, positions)
        return self.finish(x, q.reshape(*q.shape[:-2], -1))
