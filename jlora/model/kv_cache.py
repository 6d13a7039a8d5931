"""The paged KV cache as it lives on the device.

Memory layout: one buffer for keys and one for values, each
`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns a
list of blocks (its block table, allocated on the host by
`jlora.memory.pool.PagePool`); token t of the sequence lives at
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
