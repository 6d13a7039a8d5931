"""A Llama-2 family decoder in Flax, run as a `lax.scan` over stacked layers.

Parameters are an explicit pytree (`Params`) passed into jitted step functions:

    {"embed": {"embedding": [V, D]},
     "layers": {<DecoderLayer params, each with a leading [num_layers] axis>},
     "final_norm": {"scale": [D]},
     "lm_head": {"kernel": [D, V]}}          # absent when embeddings are tied

Dense kernels are stored `[in, out]` (Flax), i.e. transposed w.r.t. PyTorch.
Stacking the layers keeps compile time independent of depth, and a layer-group
segment (CPU-assisted LoRA, a later stage) is a scan over a slice of the stack.

The attention itself is not part of the Flax layer: `DecoderLayer.qkv` projects and
rotates, the caller attends over the paged KV cache (`attention.py`), and
`DecoderLayer.finish` applies the output projection and the MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from configs import ModelConfig
from jlora.adapters.backends import LoraBackend, LoraWeights, Segments
from jlora.model.attention import causal_attention, paged_decode_attention, write_kv
from jlora.model.kv_cache import KVCache

Params = dict[str, Any]  # the model's parameter pytree (layout in the module docstring)
# A layer's LoRA hook: (projection name, its input h, its output y) -> y plus the rows'
# LoRA deltas (y itself where the projection or the row is not adapted).
LoraFn = Callable[[str, jax.Array, jax.Array], jax.Array]


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

    def project(self, name: str, h: jax.Array, lora: LoraFn | None) -> jax.Array:
        """The projection `name` of h, plus the rows' LoRA deltas when there are any."""
        y = getattr(self, name)(h)
        return y if lora is None else lora(name, h, y)

    def qkv(
        self, x: jax.Array, positions: jax.Array, lora: LoraFn | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [..., T, D], positions: i32[..., T] -> q [..., T, H, hd], k, v [..., T, KVH, hd]."""
        cfg = self.config
        h = self.attn_norm(x)
        lead = h.shape[:-1]
        q = self.project("q_proj", h, lora).reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = self.project("k_proj", h, lora).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = self.project("v_proj", h, lora).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    def finish(self, x: jax.Array, attn: jax.Array, lora: LoraFn | None = None) -> jax.Array:
        """Residual output projection, then the residual SwiGLU MLP. attn: [..., T, H*hd]."""
        h = x + self.project("o_proj", attn, lora)
        m = self.mlp_norm(h)
        act = nn.silu(self.project("gate_proj", m, lora)) * self.project("up_proj", m, lora)
        return h + self.project("down_proj", act, lora)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Used only to initialise parameters (attention replaced by q itself)."""
        q, _, _ = self.qkv(x, positions)
        return self.finish(x, q.reshape(*q.shape[:-2], -1))


class Llama:
    """The model: parameter initialisation and the two step bodies (prefill, decode).

    Both bodies are pure functions meant to be wrapped in `jax.jit` by the engine.
    """

    def __init__(
        self, config: ModelConfig, dtype: Any = jnp.float32, lora: LoraBackend | None = None
    ) -> None:
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.lora = lora  # the batched-LoRA backend; None serves the base model only
        self.layer = DecoderLayer(config, self.dtype)
        self.final_norm = RMSNorm(config.rms_norm_eps, self.dtype)

    # -- parameters ------------------------------------------------------------

    def init_params(self, seed: int) -> Params:
        """Seeded random weights (normal(0.02) kernels, unit norms), for benchmarks."""
        cfg = self.config
        k_embed, k_layers, k_head = jax.random.split(jax.random.PRNGKey(seed), 3)
        dummy = jnp.zeros((1, cfg.hidden_size), self.dtype)
        pos = jnp.zeros((1,), jnp.int32)

        def init_layer(key: jax.Array) -> Params:
            return self.layer.init(key, dummy, pos)["params"]

        params: Params = {
            "embed": {
                "embedding": (
                    0.02 * jax.random.normal(k_embed, (cfg.vocab_size, cfg.hidden_size))
                ).astype(self.dtype)
            },
            "layers": jax.jit(jax.vmap(init_layer))(jax.random.split(k_layers, cfg.num_layers)),
            "final_norm": {"scale": jnp.ones((cfg.hidden_size,), self.dtype)},
        }
        if not cfg.tie_embeddings:
            params["lm_head"] = {
                "kernel": (
                    0.02 * jax.random.normal(k_head, (cfg.hidden_size, cfg.vocab_size))
                ).astype(self.dtype)
            }
        return params

    def param_shapes(self) -> Params:
        """The parameter pytree as `jax.ShapeDtypeStruct`s (no allocation)."""
        return jax.eval_shape(lambda: self.init_params(0))

    # -- step bodies -------------------------------------------------------------

    def _logits(self, params: Params, x: jax.Array) -> jax.Array:
        """x: [..., D] -> fp32 logits [..., V]."""
        h = self.final_norm.apply({"params": params["final_norm"]}, x)
        if self.config.tie_embeddings:
            return jnp.einsum(
                "...d,vd->...v", h, params["embed"]["embedding"], preferred_element_type=jnp.float32
            )
        return jnp.einsum(
            "...d,dv->...v", h, params["lm_head"]["kernel"], preferred_element_type=jnp.float32
        )

    def _lora_fn(self, weights: LoraWeights | None, apply) -> LoraFn | None:
        """A layer's LoRA hook over the slots' targets: `apply(weights, target, h, y)`.

        The slots are indexed by layer inside the backend rather than scanned over, so
        a step reads only the rows' adapters, not every slot of every layer.
        """
        if weights is None:
            return None
        if self.lora is None:
            raise ValueError("LoRA weights were passed to a model built without a backend")

        def lora(target: str, h: jax.Array, y: jax.Array) -> jax.Array:
            if target not in weights:
                return y
            rows = h.reshape(-1, h.shape[-1])  # decode passes [S, 1, in] or [S, in]
            return apply(weights, target, rows, y.reshape(rows.shape[0], -1)).reshape(y.shape)

        return lora

    def _scan_layers(self, params: Params, x: jax.Array, cache: KVCache, layer_fn):
        """Run `layer_fn(layer_params, layer_index, x, cache) -> (x, cache)` over the stack."""

        def body(carry, xs):
            x, cache = carry
            layer_params, index = xs
            return layer_fn(layer_params, index, x, cache), None

        indices = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params["layers"], indices))
        return x, cache

    def prefill(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run one prompt, write its keys/values into its blocks, return the last logits.

        tokens: i32[T] (padded to a bucket length T); length: i32[] real tokens (1..T);
        block_table: i32[max_blocks] (entries past the prompt may be the sentinel);
        lora_weights, segments: the device adapter slots and which rows use which slot
        (both None, or both given when the model has a LoRA backend).
        Returns fp32 logits [V] at position length-1, and the updated cache.
        """
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        blocks = jnp.where(
            positions < length, block_table[positions // cache.block_size], cache.num_blocks
        )
        offsets = positions % cache.block_size
        x = jnp.take(params["embed"]["embedding"], tokens, axis=0)  # [T, D]

        def layer_fn(layer_params, index, x, cache):
            layer = self.layer.bind({"params": layer_params})
            lora = self._lora_fn(
                lora_weights, lambda w, t, h, y: self.lora.sgmv(w, t, index, h, y, segments)
            )
            q, k, v = layer.qkv(x, positions, lora)
            cache = KVCache(
                k=write_kv(cache.k, index, blocks, offsets, k),
                v=write_kv(cache.v, index, blocks, offsets, v),
            )
            return layer.finish(x, causal_attention(q, k, v, length), lora), cache

        x, cache = self._scan_layers(params, x, cache, layer_fn)
        return self._logits(params, x[length - 1]), cache

    def decode(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        positions: jax.Array,
        block_tables: jax.Array,
        lora_weights: LoraWeights | None = None,
        lora_idx: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One token for each of S slots.

        tokens, positions: i32[S]; block_tables: i32[S, max_blocks]. An idle slot has an
        all-sentinel block table: its write is dropped and its logits are meaningless.
        lora_weights, lora_idx: the device adapter slots and each row's slot, i32[S]
        (-1: the base model), both given when the model has a LoRA backend.
        Returns fp32 logits [S, V] and the updated cache.
        """
        rows = jnp.arange(tokens.shape[0])
        blocks = block_tables[rows, positions // cache.block_size]
        offsets = positions % cache.block_size
        x = jnp.take(params["embed"]["embedding"], tokens, axis=0)  # [S, D]

        def layer_fn(layer_params, index, x, cache):
            layer = self.layer.bind({"params": layer_params})
            lora = self._lora_fn(
                lora_weights, lambda w, t, h, y: self.lora.bgmv(w, t, index, h, y, lora_idx)
            )
            q, k, v = layer.qkv(x[:, None], positions[:, None], lora)  # [S, 1, ...]
            cache = KVCache(
                k=write_kv(cache.k, index, blocks, offsets, k[:, 0]),
                v=write_kv(cache.v, index, blocks, offsets, v[:, 0]),
            )
            attn = paged_decode_attention(
                q[:, 0], cache.k[index], cache.v[index], block_tables, positions
            )
            return layer.finish(x, attn, lora), cache

        x, cache = self._scan_layers(params, x, cache, layer_fn)
        return self._logits(params, x), cache
