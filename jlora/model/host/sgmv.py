"""SGMV over adapters in the KV cache's pages, as a Numba kernel XLA calls through FFI:
the pooled reference backend's prefill on a CPU (jlora/model/host/bgmv.py is its decode).

Semantics are `ReferenceBackend.sgmv`'s over `PooledReferenceBackend`'s layout: a row
of segment g (rows starts[g] to starts[g + 1]) whose adapter adapts the target
(rank[g] > 0) gets y + (x @ A_g) @ B_g in fp32; every other row keeps y. fp32 only
(`host_bgmv.usable`).

Why: on XLA:CPU the backend's prefill gathers every segment's pages, then loops over
the segments, an iteration at a time with a conditional, slices and updates in each.
For a packed call of 512 rows over 4 rank-16 adapters on all seven targets, this kernel
adds under half the time the loop adds to the base model's, and one prompt per call
costs what it costs through the loop. Batching the loop's segments into one product
each instead (every segment's window of rows gathered) was slower still on the pages.

This kernel copies a segment's rank rows out of its pages once (A^T [r, in] and B
[r, out], only up to the adapter's own rank: 37-98 KB each for SmolLM2 at rank 16) and
runs the segment's two products as OpenBLAS sgemm calls (cpu_offload's `kernels.sgemm`)
on the XLA thread that calls it, y's rows added in the second. On the cores with
OpenBLAS's small-product path, a product of more rows than one call of that path takes
is made in blocks of rows that each take it (`kernels.block_rows`, as the CPU LoRA
kernel makes its products). The path wants A untransposed, so x @ A then first
transposes the copy of A^T: worth it only for more than one block, where it is somewhat
faster at rank 16 and no slower at rank 64; a segment of one block makes x @ A as one
call on A^T as copied.
OpenBLAS runs on one thread in such a process (`kernels.one_blas_thread`): its helper
threads would spin on the cores XLA's threads use.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from numba import cfunc, njit, types

from cpu_offload.kernels.blas import (
    block_rows,
    one_blas_thread,
    sgemm,
    sgemm_blocks,
    small_product_path,
)
from jlora.model.host import ffi
from jlora.model.host.bgmv import page_span


@njit(inline="always")
def _copy_rows(pool, base, table, g, half, dest):  # pragma: no cover - compiled
    """dest (flat) = the first dest.size values laid across segment g's pages."""
    done, count = 0, dest.shape[0]
    while done < count:
        at, n = page_span(base, table, g, half, 0, done, count)
        dest[done : done + n] = pool[at : at + n]
        done += n


@njit(nogil=True, cache=True)
def sgmv_pages(x, y, k, v, table, rank, starts, layer, out, blocks):  # pragma: no cover
    """x: f32[T, in]; y, out: f32[T, out]; k, v: the cache's halves, f32[L, NB, ...];
    table: i32[G, M], each segment's pages; rank: i32[G] (0: its rows keep y);
    starts: i32[G + 1]; layer: i32; blocks: whether each product is made in blocks of
    `block_rows` rows (`kernels.small_product_path()`) rather than in one call."""
    rows, fan_in = x.shape
    fan_out = y.shape[1]
    num_blocks = k.shape[1]
    half = k.size // (k.shape[0] * num_blocks)
    keys, values = k.reshape(-1), v.reshape(-1)
    base = layer * num_blocks
    out[...] = y
    for g in range(rank.shape[0]):
        r, first, end = rank[g], min(starts[g], rows), min(starts[g + 1], rows)
        if r <= 0 or end <= first:
            continue
        a_t = np.empty((r, fan_in), np.float32)  # as the pages hold it
        b = np.empty((r, fan_out), np.float32)
        _copy_rows(keys, base, table, g, half, a_t.reshape(-1))
        _copy_rows(values, base, table, g, half, b.reshape(-1))
        n, xs = end - first, x[first:end]
        xa = np.empty((n, r), np.float32)
        x_rows = block_rows(r, fan_in) if blocks else 0
        if 0 < x_rows < n:  # several blocks: worth transposing A (the module docstring)
            a = np.ascontiguousarray(a_t.T)
            sgemm_blocks(r, n, fan_in, a, r, xs, fan_in, 0.0, xa, r, x_rows)
        else:
            sgemm(True, r, n, fan_in, a_t, fan_in, xs, fan_in, 0.0, xa, r)
        out_rows = block_rows(fan_out, r) if blocks else 0
        sgemm_blocks(fan_out, n, r, b, fan_out, xa, r, 1.0, out[first:end], fan_out, out_rows)


_TARGET = "jlora_sgmv_pages"


@functools.cache
def _handler() -> Any:
    """The FFI target (compiled in each process, as `host_bgmv`'s): args x, y, k, v,
    table, rank, starts, layer; result out. OpenBLAS gets one thread in the process
    first (the module docstring)."""
    one_blas_thread()
    blocks = small_product_path()  # a constant of this process's handler

    @cfunc(types.int64(types.voidptr))
    def handle(frame):  # pragma: no cover - compiled
        if ffi.answered_metadata(frame):
            return 0
        a = ffi.ARGS
        sgmv_pages(
            ffi.array_2d(frame, a, 0, np.float32),
            ffi.array_2d(frame, a, 1, np.float32),
            ffi.array_5d(frame, a, 2, np.float32),
            ffi.array_5d(frame, a, 3, np.float32),
            ffi.array_2d(frame, a, 4, np.int32),
            ffi.array_1d(frame, a, 5, np.int32),
            ffi.array_1d(frame, a, 6, np.int32),
            ffi.scalar(frame, a, 7, np.int32),
            ffi.array_2d(frame, ffi.RETS, 0, np.float32),
            blocks,
        )
        return 0

    return handle


def sgmv(x, y, k, v, table, rank, starts, layer) -> jax.Array:
    """`sgmv_pages` as a step's op (see the module's semantics)."""
    i32 = jax.numpy.int32
    layer, starts = jax.numpy.asarray(layer, i32), jax.numpy.asarray(starts, i32)
    result = jax.ShapeDtypeStruct(y.shape, y.dtype)
    return ffi.call(_TARGET, _handler(), result, x, y, k, v, table, rank, starts, layer)
