"""BGMV (Punica's batched gather matrix-vector product) as two Triton Pallas kernels.

Each decode row gathers its own adapter slot from a stacked layout and, as in Punica,
every row is padded to the batch's largest rank R_batch: a row reads cdiv(R_batch, chunk)
chunks of rank rows in each half, so the cost is proportional to |S| * R_batch. Rank rows
at or beyond the row's own rank are masked to zero before they are multiplied.

1. shrink, grid (S, R / chunk, in / block_in): each program multiplies one block of x[s]
   by one chunk of rank rows of A^T (elementwise and a sum, no dot) into its part of
   f32[S, in / block_in, R]; the parts are summed (XLA) into v = x @ A^T, f32[S, R].
   One load per program, so thousands of them are in flight at once: a loop over rank
   chunks and `in` blocks per row left the GPU waiting on each load in turn;
2. v is rounded to x.dtype (common.py's arithmetic rule);
3. expand, grid (S, out tiles): y[s, tile] += v[s] @ B[:, tile], written in place
   (y's buffer is the output), and only for rows with an adapter.

`bgmv_shrink` and `bgmv_expand` are the two halves alone, for a LoRA split across
devices (a collective runs on v between them).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

IN_BLOCK_CAP = 512  # `in` elements per shrink program
OUT_BLOCK_CAP = 512  # `out` elements per expand program
EXPAND_CHUNK = common.RANK_CHUNK  # rank rows per step of expand's loop (a power of two)


def check_bgmv_args(y: Any, x: Any, a: Any, b: Any, idx: Any, ranks: Any) -> int:
    """Checks shapes and dtypes (see `bgmv`); returns the rank chunk, min(8, R)."""
    common.expect_activations(y, x)
    chunk = _check_shrink_args(x, a, idx, ranks)
    common.expect_shape("b", b, (*a.shape[:3], y.shape[1]))
    common.expect_dtype("b", b, (x.dtype,))
    return chunk


def _check_shrink_args(x: Any, a: Any, idx: Any, ranks: Any) -> int:
    common.expect_shrink_operands(x, "a", a, (None, None, None))
    _check_routing(idx, ranks, x.shape[0], a.shape[1])
    return common.expect_rank_dim("a", a.shape[2])


def _check_expand_args(y: Any, v: Any, b: Any, idx: Any, ranks: Any) -> int:
    common.expect_expand_operands(y, v, "b", b, (None, None))
    _check_routing(idx, ranks, y.shape[0], b.shape[1])
    return common.expect_rank_dim("b", b.shape[2])


def _check_routing(idx: Any, ranks: Any, rows: int, slots: int) -> None:
    common.expect_shape("idx", idx, (rows,))
    common.expect_dtype("idx", idx, (jnp.int32,))
    common.expect_shape("ranks", ranks, (slots,))
    common.expect_dtype("ranks", ranks, (jnp.int32,))


def batch_rank(idx: jax.Array, ranks: jax.Array) -> jax.Array:
    """R_batch, i32[1]: the largest rank among rows with an adapter (0 if none)."""
    row_ranks = jnp.where(idx >= 0, ranks[jnp.maximum(idx, 0)], 0)
    return jnp.max(row_ranks, initial=0).reshape(1)


def _shrink_kernel(
    idx_ref,  # [S]
    ranks_ref,  # [N]
    layer_ref,  # [1]
    batch_rank_ref,  # [1]
    x_ref,  # [S, in]
    a_ref,  # [L, N, R, in]
    v_ref,  # [chunk]: part k of chunk c of row s of v f32[S, K, R]
    *,
    chunk: int,
    block_in: int,
):
    row, c, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[row]
    v_ref[...] = jnp.zeros(v_ref.shape, jnp.float32)

    @pl.when((slot >= 0) & (c * chunk < batch_rank_ref[0]))
    def _():
        keep = (c * chunk + jnp.arange(chunk)) < ranks_ref[slot]  # [chunk]
        cols = pl.ds(k * block_in, block_in)
        x = x_ref[row, cols].astype(jnp.float32)  # [block_in]
        a = a_ref[layer_ref[0], slot, pl.ds(c * chunk, chunk), cols]  # [chunk, block_in]
        a = jnp.where(keep[:, None], a, 0).astype(jnp.float32)
        v_ref[...] = jnp.sum(a * x[None, :], axis=1)


def _expand_kernel(
    idx_ref,  # [S]
    ranks_ref,  # [N]
    layer_ref,  # [1]
    batch_rank_ref,  # [1]
    v_ref,  # [R]: row s of v, x.dtype
    b_ref,  # [L, N, R, out]
    y_ref,  # [block_out]
    out_ref,  # [block_out], aliased to y
    *,
    chunk: int,
):
    row, tile = pl.program_id(0), pl.program_id(1)
    slot = idx_ref[row]
    block_out = out_ref.shape[0]

    @pl.when(slot >= 0)
    def _():
        rank = ranks_ref[slot]
        layer = layer_ref[0]

        def rank_step(c, acc):
            keep = (c * chunk + jnp.arange(chunk)) < rank  # [chunk]
            v = v_ref[pl.ds(c * chunk, chunk)]  # [chunk]: zero at or beyond the rank
            b = b_ref[layer, slot, pl.ds(c * chunk, chunk), pl.ds(tile * block_out, block_out)]
            b = jnp.where(keep[:, None], b, 0)  # [chunk, block_out]
            prod = v.astype(jnp.float32)[:, None] * b.astype(jnp.float32)
            return acc + jnp.sum(prod, axis=0)

        steps = pl.cdiv(batch_rank_ref[0], chunk)
        acc = lax.fori_loop(0, steps, rank_step, y_ref[...].astype(jnp.float32))
        out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def bgmv(
    y: jax.Array,
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    idx: jax.Array,
    ranks: jax.Array,
    layer: Any,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Punica BGMV: every row gathers its adapter slot, padded to the batch's max rank.

    Semantics: for each row s with n = idx[s] >= 0 and r = ranks[n],
        y[s] += (x[s] @ a[layer, n, :r].T) @ b[layer, n, :r]
    with common.py's arithmetic (x @ A in f32, rounded to x.dtype; @ B in f32; added to
    y in f32 and rounded once). Rows with idx[s] == -1 are not written (bit-identical).
    Every row reads cdiv(R_batch, 8) chunks of rank rows, R_batch = max over adapted
    rows of ranks[idx[s]]; rows at or beyond a slot's rank are ignored (may hold NaN).
    It is `bgmv_expand(y, bgmv_shrink(x, ...).astype(x.dtype), ...)`.

    Args:
      y: [S, out], f32 or bf16; the updated copy is returned.
      x: [S, in], y's dtype.
      a: [L, N, R, in], x's dtype: slot n's rank rows of A^T, stacked; R a power of two.
      b: [L, N, R, out], x's dtype: slot n's rank rows of B.
      idx: i32[S], each row's slot in [0, N), or -1 for no adapter.
      ranks: i32[N], each slot's rank in [0, R] (0: the slot leaves its rows unchanged).
      layer: i32 scalar (python int or 0-d array) in [0, L).
      interpret: run the kernels in Pallas interpret mode (any backend).
    Returns:
      y's updated copy, [S, out], y.dtype.
    """
    check_bgmv_args(y, x, a, b, idx, ranks)
    v = bgmv_shrink(x, a, idx, ranks, layer, interpret=interpret)
    return bgmv_expand(y, v.astype(x.dtype), b, idx, ranks, layer, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def bgmv_shrink(
    x: jax.Array, a: jax.Array, idx: jax.Array, ranks: jax.Array, layer: Any, *, interpret=False
) -> jax.Array:
    """BGMV's first half: v[s, :r] = x[s] @ a[layer, idx[s], :r].T in f32, r the slot's
    rank; v is 0 past it and on rows without an adapter. Returns f32[S, R].

    Alone, it serves a LoRA split across devices: a device holding rank rows
    [k, k + R) of every slot passes ranks clipped to them, `clip(ranks - k, 0, R)`.
    """
    chunk = _check_shrink_args(x, a, idx, ranks)
    rows, fan_in = x.shape
    rank_dim = a.shape[2]
    block_in = common.pow2_block(fan_in, IN_BLOCK_CAP)
    routing = (idx, ranks, common.as_layer(layer), batch_rank(idx, ranks))
    parts = pl.pallas_call(
        functools.partial(_shrink_kernel, chunk=chunk, block_in=block_in),
        grid=(rows, rank_dim // chunk, fan_in // block_in),
        in_specs=[
            *(common.whole(r.shape) for r in routing),
            common.whole(x.shape),
            common.whole(a.shape),
        ],
        out_specs=pl.BlockSpec((None, None, chunk), lambda s, c, k: (s, k, c)),
        out_shape=jax.ShapeDtypeStruct((rows, fan_in // block_in, rank_dim), jnp.float32),
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="bgmv_shrink",
    )(*routing, x, a)
    return jnp.sum(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def bgmv_expand(
    y: jax.Array,
    v: jax.Array,
    b: jax.Array,
    idx: jax.Array,
    ranks: jax.Array,
    layer: Any,
    *,
    interpret: bool = False,
) -> jax.Array:
    """BGMV's second half: y[s] += v[s, :r] @ b[layer, idx[s], :r] in f32, r the slot's
    rank, rounded to y.dtype once; rows without an adapter are not written.

    v: [S, R], y's dtype (the caller rounds `bgmv_shrink`'s f32 result, common.py).
    """
    _check_expand_args(y, v, b, idx, ranks)
    chunk = min(EXPAND_CHUNK, b.shape[2])
    rows, fan_out = y.shape
    block_out = common.pow2_block(fan_out, OUT_BLOCK_CAP)
    routing = (idx, ranks, common.as_layer(layer), batch_rank(idx, ranks))
    tile_spec = pl.BlockSpec((None, block_out), lambda s, t: (s, t))
    return pl.pallas_call(
        functools.partial(_expand_kernel, chunk=chunk),
        grid=(rows, fan_out // block_out),
        in_specs=[
            *(common.whole(r.shape) for r in routing),
            pl.BlockSpec((None, v.shape[1]), lambda s, t: (s, 0)),
            common.whole(b.shape),
            tile_spec,
        ],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={len(routing) + 2: 0},
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="bgmv_expand",
    )(*routing, v, b, y)
