"""BGMV (Punica's batched gather matrix-vector product) as two Triton Pallas kernels.

Each decode row gathers its own adapter slot from a stacked layout and, as in Punica,
every row is padded to the batch's largest rank R_batch: a row reads cdiv(R_batch, chunk)
chunks of rank rows in each half, so the cost is proportional to |S| * R_batch. Rank rows
at or beyond the row's own rank are masked to zero before they are multiplied.

1. shrink, grid (S, R / chunk, K): each program multiplies one block of x[s] by one
   chunk of rank rows of A^T (elementwise and a sum, no dot) into its part of
   f32[S, K, R], K = in / block_in rounded up to a power of two (`common.shrink_parts`;
   the parts past the last block are zeros). One load per program, so thousands of
   them are in flight at once: a loop over rank chunks and `in` blocks per row left the
   GPU waiting on each load in turn;
2. expand, grid (S, out tiles): sums row s's parts into v = x @ A^T, rounds it to
   x.dtype (common.py's arithmetic rule), and adds v @ B[:, tile] to y[s, tile] in place
   (y's buffer is the output), only for rows with an adapter. Summing the parts in
   XLA would cost a reduce launch per projection, 384 of them in a Llama-2-7B decode
   step.

`bgmv_shrink` (the parts summed) and `bgmv_expand` (from v) are the two halves alone,
for a LoRA split across devices (a collective runs on v between them).
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


def _routing(idx: jax.Array, ranks: jax.Array, layer: Any) -> tuple[jax.Array, ...]:
    """What both kernels read first: idx, ranks, the layer as i32[1] and R_batch."""
    return idx, ranks, common.as_layer(layer), batch_rank(idx, ranks)


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
    in_blocks: int,
):
    row, c, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[row]
    v_ref[...] = jnp.zeros(v_ref.shape, jnp.float32)

    @pl.when((slot >= 0) & (c * chunk < batch_rank_ref[0]) & (k < in_blocks))
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
    v_ref,  # [K, R]: row s's parts of x @ A^T (f32), or v itself ([1, R], x.dtype)
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
            v = common.summed_parts(v_ref, c * chunk, chunk, out_ref.dtype)  # 0 past the rank
            b = b_ref[layer, slot, pl.ds(c * chunk, chunk), pl.ds(tile * block_out, block_out)]
            b = jnp.where(keep[:, None], b, 0)  # [chunk, block_out]
            prod = v[:, None] * b.astype(jnp.float32)
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
    It computes `bgmv_expand(y, bgmv_shrink(x, ...).astype(x.dtype), ...)`, the expand
    summing the shrink's parts itself.

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
    chunk = check_bgmv_args(y, x, a, b, idx, ranks)
    routing = _routing(idx, ranks, layer)
    parts = _shrink_parts(x, a, routing, chunk, interpret)
    return _expand(y, parts, b, routing, interpret)


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
    routing = _routing(idx, ranks, layer)
    return jnp.sum(_shrink_parts(x, a, routing, chunk, interpret), axis=1)


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
    routing = _routing(idx, ranks, layer)
    return _expand(y, v[:, None, :], b, routing, interpret)


def _shrink_parts(x, a, routing, chunk: int, interpret: bool) -> jax.Array:
    """The shrink's parts of x @ A^T, f32[S, K, R] (module docstring, step 1)."""
    rows, fan_in = x.shape
    rank_dim = a.shape[2]
    block_in = common.pow2_block(fan_in, IN_BLOCK_CAP)
    in_parts = common.shrink_parts(fan_in, block_in)
    kernel = functools.partial(
        _shrink_kernel, chunk=chunk, block_in=block_in, in_blocks=fan_in // block_in
    )
    return pl.pallas_call(
        kernel,
        grid=(rows, rank_dim // chunk, in_parts),
        in_specs=[
            *(common.whole(r.shape) for r in routing),
            common.whole(x.shape),
            common.whole(a.shape),
        ],
        out_specs=pl.BlockSpec((None, None, chunk), lambda s, c, k: (s, k, c)),
        out_shape=jax.ShapeDtypeStruct((rows, in_parts, rank_dim), jnp.float32),
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="bgmv_shrink",
    )(*routing, x, a)


def _expand(y, parts, b, routing, interpret: bool) -> jax.Array:
    """y += (the summed parts, rounded) @ B, rows with an adapter (module docstring, step 2);
    parts: [S, K, R], f32 parts or ([S, 1, R]) v in y's dtype."""
    chunk = min(EXPAND_CHUNK, b.shape[2])
    rows, fan_out = y.shape
    block_out = common.pow2_block(fan_out, OUT_BLOCK_CAP)
    tile_spec = pl.BlockSpec((None, block_out), lambda s, t: (s, t))
    return pl.pallas_call(
        functools.partial(_expand_kernel, chunk=chunk),
        grid=(rows, fan_out // block_out),
        in_specs=[
            *(common.whole(r.shape) for r in routing),
            pl.BlockSpec((None, *parts.shape[1:]), lambda s, t: (s, 0, 0)),
            common.whole(b.shape),
            tile_spec,
        ],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={len(routing) + 2: 0},
        compiler_params=common.triton_params(),
        interpret=interpret,
        name="bgmv_expand",
    )(*routing, parts, b, y)
