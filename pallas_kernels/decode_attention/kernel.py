"""Paged decode attention as one Triton Pallas kernel, in place of XLA's gather of every
row's blocks and its reductions.

Grid (S, kv_heads): program (s, h) holds the `group` query heads that share KV head h
(GQA: heads // kv_heads of them, a power of two) and walks row s's blocks in order,
reading each block's keys and values of head h once for the whole group, through the
row's block table, up to the block that holds its position; an online softmax (a
running maximum and sum, fp32) carries across blocks, so nothing of size T is kept.
Scores are elementwise products and a sum (no dot: a group of 1 to 8 heads is below
Triton's smallest dot). Entries of the last block past the position are masked.

Arithmetic, as `jlora.model.attention.paged_decode_attention`: q is scaled by
head_dim**-0.5 in q's dtype; scores, softmax and the weighted sum of values in fp32;
the result rounded to q's dtype once. A block table entry past the cache (an idle row's
sentinel) is clamped into it: its result is meaningless, and nothing is written.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common


def check_decode_attention_args(q: Any, k_pages: Any, v_pages: Any, tables: Any, positions: Any):
    """Checks shapes and dtypes (see `decode_attention`); returns the group size."""
    common.expect(len(q.shape) == 3, f"q has shape {tuple(q.shape)}, expected [S, heads, d]")
    rows, heads, head_dim = q.shape
    common.expect_dtype("q", q, common.FLOAT_DTYPES)
    common.expect_shape("k_pages", k_pages, (None, None, None, head_dim))
    common.expect_shape("v_pages", v_pages, tuple(k_pages.shape))
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        common.expect_dtype(name, pages, (q.dtype,))
    kv_heads = k_pages.shape[2]
    common.expect(
        heads % kv_heads == 0, f"q has {heads} heads, not a multiple of kv_heads={kv_heads}"
    )
    group = heads // kv_heads
    for name, size in (("heads // kv_heads", group), ("block_size", k_pages.shape[1]),
                       ("head_dim", head_dim)):  # fmt: skip
        common.expect(size & (size - 1) == 0, f"{name}={size} must be a power of two (Triton)")
    common.expect_shape("tables", tables, (rows, None))
    common.expect_dtype("tables", tables, (jnp.int32,))
    common.expect_shape("positions", positions, (rows,))
    common.expect_dtype("positions", positions, (jnp.int32,))
    return group


def _kernel(
    tables_ref,  # [S, max_blocks]
    positions_ref,  # [S]
    q_ref,  # [group, d]: row s's query heads of KV head h
    k_ref,  # [num_blocks, block_size, kv_heads, d]
    v_ref,  # [num_blocks, block_size, kv_heads, d]
    o_ref,  # [group, d]
):
    row, head = pl.program_id(0), pl.program_id(1)
    num_blocks, block_size, _, head_dim = k_ref.shape
    position = positions_ref[row]
    q = (q_ref[...] * jnp.asarray(head_dim**-0.5, q_ref.dtype)).astype(jnp.float32)
    group = q.shape[0]

    def step(j, carry):
        top, total, acc = carry  # [group], [group], [group, d]
        page = jnp.minimum(tables_ref[row, j], num_blocks - 1)
        keys = k_ref[page, :, head, :].astype(jnp.float32)  # [block_size, d]
        values = v_ref[page, :, head, :].astype(jnp.float32)
        scores = jnp.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [group, block_size]
        token = j * block_size + lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        scores = jnp.where(token <= position, scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        weights = jnp.exp(scores - new_top[:, None])
        fade = jnp.exp(top - new_top)
        total = total * fade + jnp.sum(weights, axis=1)
        acc = acc * fade[:, None] + jnp.sum(weights[:, :, None] * values[None, :, :], axis=1)
        return new_top, total, acc

    start = (
        jnp.full((group,), -jnp.inf, jnp.float32),
        jnp.zeros((group,), jnp.float32),
        jnp.zeros((group, head_dim), jnp.float32),
    )
    _, total, acc = lax.fori_loop(0, position // block_size + 1, step, start)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Semantics: out[s, i] = softmax_{j <= positions[s]}(q[s, i] · K_s[j] / sqrt(d)) · V_s[j]
    with K_s[j] = k_pages[tables[s, j // block_size], j % block_size, i // group] (and V
    alike), group = heads // kv_heads.

    Args:
      q: [S, heads, d], f32 or bf16: each row's new token's queries.
      k_pages, v_pages: [num_blocks, block_size, kv_heads, d], q's dtype: one layer's
        cache, the new token's keys and values already written.
      tables: i32[S, max_blocks]: each row's blocks, in order (entries past its position's
        block are not read; one past the cache is clamped into it).
      positions: i32[S], >= 0: each row's new token's position.
      interpret: run the Pallas interpreter (any backend) instead of Triton.
    group, block_size and d must be powers of two.
    Returns:
      [S, heads, d] in q's dtype.
    """
    group = check_decode_attention_args(q, k_pages, v_pages, tables, positions)
    rows, heads, head_dim = q.shape
    heads_spec = pl.BlockSpec((None, group, head_dim), lambda s, h: (s, h, 0))
    return pl.pallas_call(
        _kernel,
        grid=(rows, heads // group),
        in_specs=[
            common.whole(tables.shape),
            common.whole(positions.shape),
            heads_spec,
            common.whole(k_pages.shape),
            common.whole(v_pages.shape),
        ],
        out_specs=heads_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="decode_attention",
    )(tables, positions, q, k_pages, v_pages)
