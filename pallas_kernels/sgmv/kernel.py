"""SGMV (Punica): prefill rows grouped by adapter into segments, each segment's LoRA as tiled dots.

Two pallas_calls, as in Punica. Shrink: one program per tile of BLOCK_T rows computes
v = x @ A for the tile, visiting each segment that overlaps the tile and has an
adapter: it gathers the slot's R rank rows of A^T through its page table and runs a
[BLOCK_T, block_in] x [block_in, R] dot per block of `in`, keeping the result only for
the tile's rows inside the segment. Expand: one program per (row tile, out tile)
adds v @ B the same way. Rank rows at or beyond a slot's rank are masked out before
the dots, so whatever their pages hold (NaN included) is ignored; rows outside every
adapted segment are written back with their own bits.

`sgmv_shrink` and `sgmv_expand` are the two halves alone, for a LoRA split across devices
(a collective runs on v between them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

BLOCK_T = 16  # rows per tile: the smallest M of a Triton dot
IN_BLOCK_CAP = 256  # `in` elements per step of shrink's inner loop
OUT_BLOCK_CAP = 256  # `out` elements per expand program
DOT_MIN = 16  # Triton dots need every dimension >= 16


def check_sgmv_args(
    y, x, a_pool, b_pool, seg_slot, seg_start, pages, ranks, *, compiled: bool = False
) -> tuple[int, int, int, int]:
    """Checks shapes and dtypes (see `sgmv`); returns (rows, in, out, R).

    `compiled` also checks what the compiled Triton dots need: `in` and `out`
    multiples of 16 and R >= 16. Raises KernelArgumentError naming the argument.
    """
    rows, fan_in, fan_out = common.expect_activations(y, x)
    common.expect_pool(x, y, a_pool, b_pool)
    rank_dim = _check_segments(seg_slot, seg_start, pages, ranks, compiled)
    for name, dim in (("x (in)", fan_in), ("y (out)", fan_out)):
        _check_compiled(name, dim, compiled)
    return rows, fan_in, fan_out, rank_dim


def _check_segments(seg_slot, seg_start, pages, ranks, compiled: bool) -> int:
    """The segments and the page table (R >= 16 where `compiled`); returns R."""
    common.expect_shape("seg_slot", seg_slot, (None,))
    common.expect_dtype("seg_slot", seg_slot, (jnp.int32,))
    common.expect_shape("seg_start", seg_start, (seg_slot.shape[0] + 1,))
    common.expect_dtype("seg_start", seg_start, (jnp.int32,))
    common.expect_page_table(pages, ranks)
    rank_dim = pages.shape[1]
    common.expect(
        not compiled or rank_dim >= DOT_MIN,
        f"pages has rank dimension {rank_dim}; compiled Triton dots need R >= 16",
    )
    return rank_dim


def _check_compiled(name: str, dim: int, compiled: bool) -> None:
    common.expect(
        not compiled or dim % DOT_MIN == 0,
        f"{name} has feature size {dim}; compiled Triton dots need a multiple of 16",
    )


def _segment(g, first_row, seg_slot_ref, seg_start_ref, ranks_ref, block_t):
    """Segment g seen from the tile at `first_row`: (active, rows in it [block_t],
    slot clamped to a valid index, rank). `active`: it overlaps the tile, has an
    adapter and a rank > 0."""
    start, end, slot = seg_start_ref[g], seg_start_ref[g + 1], seg_slot_ref[g]
    slot_index = jnp.maximum(slot, 0)
    rank = ranks_ref[slot_index]
    active = (start < first_row + block_t) & (end > first_row) & (slot >= 0) & (rank > 0)
    rows = first_row + lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    return active, (rows >= start) & (rows < end), slot_index, rank


def _slot_pages_and_mask(pages_ref, slot, rank, rank_dim, num_pages):
    """The pool pages of a slot's R rank rows, and which of them are < rank."""
    # An entry beyond the rank is never used, but is clamped so the gather stays in the pool.
    slot_pages = jnp.clip(pages_ref[slot], 0, num_pages - 1)  # [R]
    return slot_pages, lax.broadcasted_iota(jnp.int32, (rank_dim,), 0) < rank


def _shrink_kernel(
    layer_ref,  # [1]
    seg_slot_ref,  # [G]
    seg_start_ref,  # [G + 1]
    ranks_ref,  # [N]
    pages_ref,  # [N, R]
    x_ref,  # [block_t, in]
    a_ref,  # [L, P, in]
    v_ref,  # [block_t, R] f32: the tile's x @ A; 0 for rows in no adapted segment
    *,
    block_in: int,
):
    block_t, rank_dim = v_ref.shape
    first_row = pl.program_id(0) * block_t
    layer = layer_ref[0]

    def shrink(slot, rank):
        slot_pages, in_rank = _slot_pages_and_mask(pages_ref, slot, rank, rank_dim, a_ref.shape[1])

        def in_block(k, acc):
            cols = pl.ds(k * block_in, block_in)
            a = a_ref[layer, slot_pages, cols]  # [R, block_in]
            a = jnp.where(in_rank[:, None], a, 0)
            x = x_ref[:, cols]  # [block_t, block_in]
            return acc + plgpu.dot(x, a, trans_b=True, precision=lax.Precision.HIGHEST)

        zeros = jnp.zeros((block_t, rank_dim), jnp.float32)
        return lax.fori_loop(0, x_ref.shape[1] // block_in, in_block, zeros)

    def segment(g, v):
        active, in_segment, slot, rank = _segment(
            g, first_row, seg_slot_ref, seg_start_ref, ranks_ref, block_t
        )
        return lax.cond(
            active, lambda: jnp.where(in_segment[:, None], shrink(slot, rank), v), lambda: v
        )

    zeros = jnp.zeros((block_t, rank_dim), jnp.float32)
    v_ref[...] = lax.fori_loop(0, seg_slot_ref.shape[0], segment, zeros)


def _expand_kernel(
    layer_ref,  # [1]
    seg_slot_ref,  # [G]
    seg_start_ref,  # [G + 1]
    ranks_ref,  # [N]
    pages_ref,  # [N, R]
    v_ref,  # [block_t, R]: the tile's x @ A, in x's dtype
    b_ref,  # [L, P, out]
    y_ref,  # [block_t, block_out]
    o_ref,  # [block_t, block_out], aliased to y
):
    block_t, block_out = y_ref.shape
    rank_dim = v_ref.shape[1]
    first_row = pl.program_id(0) * block_t
    cols = pl.ds(pl.program_id(1) * block_out, block_out)
    layer = layer_ref[0]
    old = y_ref[...]  # [block_t, block_out]

    def expand(slot, rank):
        slot_pages, in_rank = _slot_pages_and_mask(pages_ref, slot, rank, rank_dim, b_ref.shape[1])
        b = b_ref[layer, slot_pages, cols]  # [R, block_out]
        b = jnp.where(in_rank[:, None], b, 0)
        delta = plgpu.dot(v_ref[...], b, precision=lax.Precision.HIGHEST)
        return old.astype(jnp.float32) + delta

    def segment(g, carry):
        new, covered = carry
        active, in_segment, slot, rank = _segment(
            g, first_row, seg_slot_ref, seg_start_ref, ranks_ref, block_t
        )
        return lax.cond(
            active,
            lambda: (
                jnp.where(in_segment[:, None], expand(slot, rank), new),
                covered | in_segment.astype(jnp.int32),
            ),
            lambda: (new, covered),
        )

    start = (old.astype(jnp.float32), jnp.zeros((block_t,), jnp.int32))
    new, covered = lax.fori_loop(0, seg_slot_ref.shape[0], segment, start)
    # Rows no adapted segment covers are written back with their own bits.
    o_ref[...] = jnp.where(covered[:, None] > 0, new.astype(o_ref.dtype), old)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sgmv(
    y, x, a_pool, b_pool, seg_slot, seg_start, pages, ranks, layer, *, interpret: bool = False
) -> jax.Array:
    """Semantics: y[t] += sum_{j < ranks[n]} (x[t] . a_pool[layer, pages[n, j]])
    * b_pool[layer, pages[n, j]] for every row t of segment g (seg_start[g] <= t <
    seg_start[g + 1]) with n = seg_slot[g] >= 0.

    x @ A is accumulated in fp32 and rounded to x.dtype, then @ B is accumulated in
    fp32 and added to y in fp32 (common.py). Rows of segments with slot -1, rows
    before seg_start[0], rows at or after seg_start[G] and rows of a rank-0 slot are
    not written: they stay bit-identical. A stacked layout a [L, N, R, in] is the pool
    a.reshape(L, N * R, in) with pages = common.stacked_pages(N, R).

    Args:
      y: [T, out], float32 or bfloat16; the returned array is its updated copy.
      x: [T, in], y's dtype.
      a_pool: [L, P, >= in], x's dtype: a pool of rank rows; page p is one row of some
        adapter's A^T for every layer (its first `in` values; common.py).
      b_pool: [L, P, >= out], x's dtype: the matching rows of the adapters' B.
      seg_slot: i32[G] in [-1, N): each segment's slot, -1 for no adapter; a slot may
        appear in several segments.
      seg_start: i32[G + 1], non-decreasing, seg_start[G] <= T: segment g is rows
        seg_start[g] <= t < seg_start[g + 1] (possibly empty).
      pages: i32[N, R], R a power of two: pages[n, j] is the page of slot n's rank row j;
        entries at j >= ranks[n] are ignored (valid pages in [0, P) by contract).
      ranks: i32[N] in [0, R]: each slot's rank (0: nothing is added).
      layer: i32 scalar in [0, L): the layer whose rows are read.
      interpret: run the Pallas interpreter (CPU) instead of compiling for GPU; it
        accepts any sizes, while the compiled dots need `in`, `out` multiples of 16
        and R >= 16.

    It is `sgmv_expand(y, sgmv_shrink(x, ...).astype(x.dtype), ...)`.
    """
    check_sgmv_args(y, x, a_pool, b_pool, seg_slot, seg_start, pages, ranks, compiled=not interpret)
    segments = (seg_slot, seg_start, pages, ranks, layer)
    v = sgmv_shrink(x, a_pool, *segments, interpret=interpret)
    return sgmv_expand(y, v.astype(x.dtype), b_pool, *segments, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sgmv_shrink(
    x, a_pool, seg_slot, seg_start, pages, ranks, layer, *, interpret: bool = False
) -> jax.Array:
    """SGMV's first half: v[t, j] = x[t] . a_pool[layer, pages[n, j]] in f32 for
    j < ranks[n], n the slot of t's segment; 0 past the rank and on rows in no adapted
    segment. Returns f32[T, R] (R = pages.shape[1])."""
    common.expect_shrink_operands(x, "a_pool", a_pool, (None, None))
    rank_dim = _check_segments(seg_slot, seg_start, pages, ranks, not interpret)
    _check_compiled("x (in)", x.shape[1], not interpret)
    rows, fan_in = x.shape
    if rows == 0 or seg_slot.shape[0] == 0:
        return jnp.zeros((rows, rank_dim), jnp.float32)
    x_tiles = _pad_rows(x)
    indices = (common.as_layer(layer), seg_slot, seg_start, ranks, pages)
    v = pl.pallas_call(
        functools.partial(_shrink_kernel, block_in=common.pow2_block(fan_in, IN_BLOCK_CAP)),
        grid=(x_tiles.shape[0] // BLOCK_T,),
        in_specs=[
            *(common.whole(i.shape) for i in indices),
            pl.BlockSpec((BLOCK_T, fan_in), lambda t: (t, 0)),
            common.whole(a_pool.shape),
        ],
        out_specs=pl.BlockSpec((BLOCK_T, rank_dim), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((x_tiles.shape[0], rank_dim), jnp.float32),
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="sgmv_shrink",
    )(*indices, x_tiles, a_pool)
    return v[:rows]


@functools.partial(jax.jit, static_argnames=("interpret",))
def sgmv_expand(
    y, v, b_pool, seg_slot, seg_start, pages, ranks, layer, *, interpret: bool = False
) -> jax.Array:
    """SGMV's second half: y[t] += sum_{j < ranks[n]} v[t, j] * b_pool[layer,
    pages[n, j]] in f32, n the slot of t's segment, rounded to y.dtype once; rows in no
    adapted segment are not written. v: [T, R] in y's dtype (the caller rounds
    `sgmv_shrink`'s)."""
    common.expect_expand_operands(y, v, "b_pool", b_pool, (None,), pages.shape[1])
    rank_dim = _check_segments(seg_slot, seg_start, pages, ranks, not interpret)
    _check_compiled("y (out)", y.shape[1], not interpret)
    rows, fan_out = y.shape
    if rows == 0 or seg_slot.shape[0] == 0:
        return y
    v_tiles, y_tiles = _pad_rows(v), _pad_rows(y)
    block_out = common.pow2_block(fan_out, OUT_BLOCK_CAP)
    indices = (common.as_layer(layer), seg_slot, seg_start, ranks, pages)
    y_tiles = pl.pallas_call(
        _expand_kernel,
        grid=(y_tiles.shape[0] // BLOCK_T, fan_out // block_out),
        in_specs=[
            *(common.whole(i.shape) for i in indices),
            pl.BlockSpec((BLOCK_T, rank_dim), lambda t, o: (t, 0)),
            common.whole(b_pool.shape),
            pl.BlockSpec((BLOCK_T, block_out), lambda t, o: (t, o)),
        ],
        out_specs=pl.BlockSpec((BLOCK_T, block_out), lambda t, o: (t, o)),
        out_shape=jax.ShapeDtypeStruct(y_tiles.shape, y.dtype),
        input_output_aliases={len(indices) + 2: 0},
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="sgmv_expand",
    )(*indices, v_tiles, b_pool, y_tiles)
    return y_tiles[:rows]


def _pad_rows(array: jax.Array) -> jax.Array:
    """Rows padded to a multiple of BLOCK_T (padded rows lie in no segment)."""
    padded = pl.cdiv(array.shape[0], BLOCK_T) * BLOCK_T
    return jnp.pad(array, ((0, padded - array.shape[0]), (0, 0)))
