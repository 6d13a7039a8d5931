"""Attention over the paged KV cache.

Grouped-query attention throughout: `num_heads` query heads share `num_kv_heads`
key/value heads in groups of `num_heads // num_kv_heads`. Both forms go through
`jax.nn.dot_product_attention`, which picks the backend's best implementation
(cuDNN's fused kernel on GPU; on CPU its XLA form measured ~30% faster than a plain
masked einsum at T=512: 10.4 vs 15.0 ms per SmolLM2 layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array) -> jax.Array:
    """Causal self-attention within one padded prompt.

    Semantics: out[t] = softmax_{j <= t, j < length}(q[t]·k[j] / sqrt(d)) · v[j].

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; length: i32[] (real tokens;
    rows t >= length are padding and their output is unspecified).
    Returns [T, heads * head_dim] in q's dtype.
    """
    seq, heads, head_dim = q.shape
    out = jax.nn.dot_product_attention(
        q[None], k[None], v[None], is_causal=True, key_value_seq_lengths=length[None]
    )
    return out.reshape(seq, heads * head_dim)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """One new token per sequence attending to its whole cached history.

    Semantics: out[s] = softmax_{j <= positions[s]}(q[s]·K_s[j] / sqrt(d)) · V_s[j], where
    K_s[j] = k_pages[block_tables[s, j // block_size], j % block_size].

    q: [S, heads, head_dim]; k_pages, v_pages: [num_blocks, block_size, kv_heads, head_dim]
    (one layer); block_tables: i32[S, max_blocks]; positions: i32[S] (the new token's
    position, already written to the cache). Returns [S, heads * head_dim].
    """
    slots, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    keys = jnp.take(k_pages, block_tables, axis=0, mode="clip")  # [S, MB, bs, kvh, d]
    values = jnp.take(v_pages, block_tables, axis=0, mode="clip")
    out = jax.nn.dot_product_attention(
        q[:, None],
        keys.reshape(slots, -1, kv_heads, head_dim),  # [S, MB*bs, kvh, d]
        values.reshape(slots, -1, kv_heads, head_dim),
        key_value_seq_lengths=positions + 1,
    )
    return out.reshape(slots, heads * head_dim)


def paged_prefix_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """A prompt's new tokens attending to its cached prefix and, causally, to each other.

    Semantics: out[t] = softmax_{j <= positions[t]}(q[t]·K[j] / sqrt(d)) · V[j], where
    K[j] = k_pages[block_table[j // block_size], j % block_size].

    q: [T, heads, head_dim], the new tokens (padded); k_pages, v_pages: [num_blocks,
    block_size, kv_heads, head_dim] (one layer, the new tokens' keys already written);
    block_table: i32[max_blocks] (sentinel entries are read clipped, and masked);
    positions: i32[T], each query's position (rows past the real tokens are padding and
    their output is unspecified). Returns [T, heads * head_dim].
    """
    seq, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    keys = jnp.take(k_pages, block_table, axis=0, mode="clip")  # [MB, bs, kvh, d]
    values = jnp.take(v_pages, block_table, axis=0, mode="clip")
    keys = keys.reshape(-1, kv_heads, head_dim)  # [MB*bs, kvh, d]
    values = values.reshape(-1, kv_heads, head_dim)
    visible = jnp.arange(keys.shape[0])[None, :] <= positions[:, None]  # [T, MB*bs]
    out = jax.nn.dot_product_attention(q[None], keys[None], values[None], mask=visible[None, None])
    return out.reshape(seq, heads * head_dim)


def write_kv(
    pages: jax.Array, layer: jax.Array, blocks: jax.Array, offsets: jax.Array, new: jax.Array
) -> jax.Array:
    """pages[layer, blocks[i], offsets[i]] = new[i]; a block index out of range is dropped.

    pages: [layers, num_blocks, block_size, kv_heads, head_dim]; blocks, offsets: i32[N];
    new: [N, kv_heads, head_dim].
    """
    return pages.at[layer, blocks, offsets].set(new.astype(pages.dtype), mode="drop")
