"""The paged KV cache as it lives on the device.

Memory layout: one buffer for keys and one for values, each
`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns a
list of blocks (its block table, allocated on the host by
`jlora.engine.memory.pool.PagePool`); token t of the sequence lives at
`(table[t // block_size], t % block_size)`. The block index `num_blocks` is the
"nowhere" sentinel: writes to it are dropped, which is how padding tokens and
idle decode slots leave the cache untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v: jax.Array  # [layers, num_blocks, block_size, kv_heads, head_dim]

    @classmethod
    def zeros(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
    ) -> KVCache:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def layer_rows(stack: jax.Array, layer: jax.Array | int, index: jax.Array) -> jax.Array:
    """stack[layer, index] for a layer-stacked array [L, N, ...] (a cache half: the
    pages), as one gather over its rows `layer * N + index` of the array viewed as
    [L * N, ...]. Gathering from `stack[layer]` instead lets XLA:CPU hoist the slice out
    of an enclosing loop and copy the layer's pages first (50 MB a layer for a
    4096-block SmolLM2 cache); indexing both axes at once gathers a decode step's
    adapter pages about 1.3x slower than this (16 rows of rank 16 on q and v). index:
    clipped into range."""
    rows = stack.reshape(stack.shape[0] * stack.shape[1], *stack.shape[2:])
    index = jnp.clip(index, 0, stack.shape[1] - 1)
    return rows.at[layer * stack.shape[1] + index].get(mode="promise_in_bounds")
