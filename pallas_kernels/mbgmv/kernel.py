"""MBGMV (S-LoRA): each decode row applies its own adapter at its own rank, read from a page pool.

Two pallas_calls, as in Punica and S-LoRA. Shrink: one program per (row, chunk of
rank rows, block of `in`) multiplies its block of x[s] by that chunk of the slot's A,
gathered through the page table, into its part of f32[S, K, R] (K: the `in` blocks,
rounded up to a power of two, `common.shrink_parts`); programs at or past the slot's
rank only write zeros, so the loads are proportional to the sum of the rows' ranks
(never the batch's largest rank). One load per program keeps thousands in flight: a
loop per row over its chunks and blocks left the GPU waiting on each load in turn.
Expand: one program per (row, out tile) sums the row's parts into v = x @ A, rounded to
x.dtype (`common.summed_parts`: no reduce launch of XLA's in between), and adds v[s] @ B
to y in place, looping over the slot's rank chunks. A chunk's rank rows are gathered
from the pool through the slot's page table; rows of the last chunk at or beyond the
rank are masked out before they are multiplied, so whatever their pages hold (NaN
included) is ignored.

`mbgmv_shrink` (the parts summed) and `mbgmv_expand` (from v) are the two halves alone,
for a LoRA split across devices (a collective runs on v between them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

IN_BLOCK_CAP = 512  # `in` elements of a gathered chunk per shrink program
OUT_BLOCK_CAP = 512  # `out` elements per expand program
EXPAND_CHUNK = common.RANK_CHUNK  # rank rows per step of expand's loop (a power of two)


def check_mbgmv_args(y, x, a_pool, b_pool, idx, pages, ranks) -> int:
    """Checks shapes and dtypes (see `mbgmv`); returns the rank chunk, min(8, R).

    Raises KernelArgumentError naming the offending argument.
    """
    rows, _, _ = common.expect_activations(y, x)
    common.expect_pool(x, y, a_pool, b_pool)
    common.expect_shape("idx", idx, (rows,))
    common.expect_dtype("idx", idx, (jnp.int32,))
    return common.expect_page_table(pages, ranks)


def _chunk_pages_and_mask(pages_ref, slot, rank, chunk_index, chunk, num_pages):
    """The pool pages of one chunk of a slot's rank rows, and which of them are < rank."""
    first = chunk_index * chunk
    # An entry beyond the rank is never used, but is clamped so the gather stays in the pool.
    chunk_pages = jnp.clip(pages_ref[slot, pl.ds(first, chunk)], 0, num_pages - 1)  # [chunk]
    in_rank = first + lax.broadcasted_iota(jnp.int32, (chunk,), 0) < rank  # [chunk]
    return chunk_pages, in_rank


def _shrink_kernel(
    idx_ref,  # [S]
    layer_ref,  # [1]
    ranks_ref,  # [N]
    pages_ref,  # [N, R]
    x_ref,  # [S, in]
    a_ref,  # [L, P, in]
    v_ref,  # [chunk]: part k of chunk c of row s of v f32[S, K, R]; 0 past the rank
    *,
    chunk: int,
    block_in: int,
    in_blocks: int,
):
    row, c, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[row]
    num_pages = a_ref.shape[1]
    rank = ranks_ref[jnp.maximum(slot, 0)]
    v_ref[...] = jnp.zeros(v_ref.shape, jnp.float32)

    @pl.when((slot >= 0) & (c * chunk < rank) & (k < in_blocks))
    def _():
        chunk_pages, in_rank = _chunk_pages_and_mask(pages_ref, slot, rank, c, chunk, num_pages)
        cols = pl.ds(k * block_in, block_in)
        a = a_ref[layer_ref[0], chunk_pages, cols]  # [chunk, block_in]
        a = jnp.where(in_rank[:, None], a.astype(jnp.float32), 0.0)
        x = x_ref[row, cols].astype(jnp.float32)  # [block_in]
        v_ref[...] = jnp.sum(a * x[None, :], axis=1)


def _expand_kernel(
    idx_ref,  # [S]
    layer_ref,  # [1]
    ranks_ref,  # [N]
    pages_ref,  # [N, R]
    v_ref,  # [K, R]: this row's parts of x @ A (f32), or v itself ([1, R], x's dtype)
    b_ref,  # [L, P, out]
    y_ref,  # [block_out]
    o_ref,  # [block_out], aliased to y
    *,
    chunk: int,
    block_out: int,
):
    row = pl.program_id(0)
    cols = pl.ds(pl.program_id(1) * block_out, block_out)
    slot = idx_ref[row]
    num_pages = b_ref.shape[1]

    @pl.when(slot >= 0)
    def _():
        layer = layer_ref[0]
        rank = ranks_ref[slot]

        def rank_chunk(c, acc):
            chunk_pages, in_rank = _chunk_pages_and_mask(pages_ref, slot, rank, c, chunk, num_pages)
            b = b_ref[layer, chunk_pages, cols]  # [chunk, block_out]
            b = jnp.where(in_rank[:, None], b.astype(jnp.float32), 0.0)
            v = common.summed_parts(v_ref, c * chunk, chunk, o_ref.dtype)  # [chunk]
            return acc + jnp.sum(v[:, None] * b, axis=0)

        acc = lax.fori_loop(
            0, pl.cdiv(rank, chunk), rank_chunk, jnp.zeros((block_out,), jnp.float32)
        )
        o_ref[...] = (y_ref[...].astype(jnp.float32) + acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def mbgmv(y, x, a_pool, b_pool, idx, pages, ranks, layer, *, interpret: bool = False) -> jax.Array:
    """Semantics: y[s] += sum_{j < ranks[n]} (x[s] . a_pool[layer, pages[n, j]])
    * b_pool[layer, pages[n, j]] for every row s with n = idx[s] >= 0.

    x @ A is accumulated in fp32 and rounded to x.dtype, then @ B is accumulated in
    fp32 and added to y in fp32 (common.py). Rows with idx[s] == -1 are not written:
    they stay bit-identical. Each row reads only its own rank's rows of the pool.

    Args:
      y: [S, out], float32 or bfloat16; the returned array is its updated copy.
      x: [S, in], y's dtype.
      a_pool: [L, P, >= in], x's dtype: a pool of rank rows; page p is one row of some
        adapter's A^T for every layer (its first `in` values; common.py).
      b_pool: [L, P, >= out], x's dtype: the matching rows of the adapters' B.
      idx: i32[S] in [-1, N): each row's slot, -1 for no adapter.
      pages: i32[N, R], R a power of two: pages[n, j] is the page of slot n's rank row j;
        entries at j >= ranks[n] are ignored (valid pages in [0, P) by contract).
      ranks: i32[N] in [0, R]: each slot's rank (0: nothing is added).
      layer: i32 scalar in [0, L): the layer whose rows are read.
      interpret: run the Pallas interpreter (CPU) instead of compiling for GPU.

    Returns:
      [S, out] in y's dtype.

    It computes `mbgmv_expand(y, mbgmv_shrink(x, ...).astype(x.dtype), ...)`, the
    expand summing the shrink's parts itself.
    """
    chunk = check_mbgmv_args(y, x, a_pool, b_pool, idx, pages, ranks)
    tables = _tables(idx, pages, ranks, layer)
    parts = _shrink_parts(x, a_pool, tables, chunk, interpret)
    return _expand(y, parts, b_pool, tables, interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def mbgmv_shrink(x, a_pool, idx, pages, ranks, layer, *, interpret: bool = False) -> jax.Array:
    """MBGMV's first half: v[s, j] = x[s] . a_pool[layer, pages[n, j]] in f32 for
    j < ranks[n], n = idx[s]; 0 past the rank and on rows without an adapter.
    Returns f32[S, R] (R = pages.shape[1])."""
    common.expect_shrink_operands(x, "a_pool", a_pool, (None, None))
    chunk = _check_routing(idx, pages, ranks, x.shape[0])
    tables = _tables(idx, pages, ranks, layer)
    return jnp.sum(_shrink_parts(x, a_pool, tables, chunk, interpret), axis=1)


def _shrink_parts(x, a_pool, tables, chunk: int, interpret: bool) -> jax.Array:
    """The shrink's parts of x @ A, f32[S, K, R] (module docstring)."""
    rows, fan_in = x.shape
    block_in = common.pow2_block(fan_in, IN_BLOCK_CAP)
    rank_dim, in_parts = tables[3].shape[1], common.shrink_parts(fan_in, block_in)
    kernel = functools.partial(
        _shrink_kernel, chunk=chunk, block_in=block_in, in_blocks=fan_in // block_in
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, in_parts, rank_dim), jnp.float32),
        grid=(rows, rank_dim // chunk, in_parts),
        in_specs=[
            *(common.whole(t.shape) for t in tables),
            common.whole(x.shape),
            common.whole(a_pool.shape),
        ],
        out_specs=pl.BlockSpec((None, None, chunk), lambda s, c, k: (s, k, c)),
        interpret=interpret,
        compiler_params=common.triton_params(),
        name="mbgmv_shrink",
    )(*tables, x, a_pool)


@functools.partial(jax.jit, static_argnames=("interpret",))
def mbgmv_expand(y, v, b_pool, idx, pages, ranks, layer, *, interpret: bool = False) -> jax.Array:
    """MBGMV's second half: y[s] += sum_{j < ranks[n]} v[s, j] * b_pool[layer,
    pages[n, j]] in f32, n = idx[s], rounded to y.dtype once; rows without an adapter
    are not written. v: [S, R] in y's dtype (the caller rounds `mbgmv_shrink`'s)."""
    common.expect_expand_operands(y, v, "b_pool", b_pool, (None,), pages.shape[1])
    _check_routing(idx, pages, ranks, y.shape[0])
    tables = _tables(idx, pages, ranks, layer)
    return _expand(y, v[:, None, :], b_pool, tables, interpret)


def _expand(y, parts, b_pool, tables, interpret: bool) -> jax.Array:
    """y += (the summed parts, rounded) @ B, rows with an adapter; parts: [S, K, R], f32
    parts or ([S, 1, R]) v in y's dtype."""
    chunk = min(EXPAND_CHUNK, tables[3].shape[1])
    rows, fan_out = y.shape
    block_out = common.pow2_block(fan_out, OUT_BLOCK_CAP)
    row_tile = pl.BlockSpec((None, block_out), lambda s, t: (s, t))
    return pl.pallas_call(
        functools.partial(_expand_kernel, chunk=chunk, block_out=block_out),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(rows, fan_out // block_out),
        in_specs=[
            *(common.whole(t.shape) for t in tables),
            pl.BlockSpec((None, *parts.shape[1:]), lambda s, t: (s, 0, 0)),
            common.whole(b_pool.shape),
            row_tile,
        ],
        out_specs=row_tile,
        input_output_aliases={len(tables) + 2: 0},
        interpret=interpret,
        compiler_params=common.triton_params(),
        name="mbgmv_expand",
    )(*tables, parts, b_pool, y)


def _tables(idx, pages, ranks, layer) -> tuple[jax.Array, ...]:
    """What both kernels read first: idx, the layer as i32[1], ranks and pages."""
    return idx, common.as_layer(layer), ranks, pages


def _check_routing(idx, pages, ranks, rows: int) -> int:
    common.expect_shape("idx", idx, (rows,))
    common.expect_dtype("idx", idx, (jnp.int32,))
    return common.expect_page_table(pages, ranks)
