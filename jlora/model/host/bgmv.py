"""BGMV over adapters in the KV cache's pages, as a Numba kernel XLA calls through FFI:
the pooled reference backend's decode on a CPU.

Semantics are `ReferenceBackend.bgmv`'s over `PooledReferenceBackend`'s layout: a row s
whose adapter adapts the target (rank[s] > 0) gets y[s] + (x[s] @ A_s) @ B_s, in fp32;
A_s^T's rank rows lie across the key halves of its pages in table order, `in` values
each, and B_s's across their value halves, `out` values each. Every other row keeps y[s].
fp32 only (`usable`).

Why: on XLA:CPU the backend's decode gathers each row's pages into a new array, then
reduces it (two fusions a factor, a target and a layer). This kernel reads each row's
rank rows in place, from its own pages, only up to its adapter's own rank, on the XLA
thread that calls it (`jlora.model.host.ffi`, no Python): for 16 rows of rank 16 on q
and v it takes about a quarter of the gathers' and products' time a SmolLM2 layer, and
brings the pooled decode's throughput close to that of stacked slots gathered by XLA.

What bounds it is memory: in a step the rows come from DRAM (the base weights stream
past every cache in between), 71 MB a step for 16 rank-16 adapters on q and v, 13% of
SmolLM2's 538 MB of fp32 weights. With caches flushed the kernel takes little more than
merely reading those bytes does, and less over pages in order (as the pool deals an
adapter's pages) than over scattered ones. None of the variants tried beat it:
prefetching the next row's pages was slower, every row's x·A before any ·B made no
difference, and a parallel launch costs more than the whole call
(cpu_offload/kernels/threads.py). Nor does a spare core wait for it: XLA runs a layer's
q and v calls at once on threads of its own (in nearly every layer), so a helper thread
splitting a call's rows did not shorten a step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from numba import cfunc, njit, types

from jlora.model.host import ffi


@njit(inline="always")
def page_span(base, table, s, half, start, done, count):  # pragma: no cover - compiled
    """Where values start + done, ... of the rows laid across row s's pages (`table[s]`,
    at layer offset `base`) lie in the flat cache half, and how many lie there before
    the page ends: (offset, n)."""
    page, pos = divmod(start + done, half)
    return (base + table[s, page]) * half + pos, min(count - done, half - pos)


@njit(fastmath=True, inline="always")
def _dot_rows(pool, base, table, s, half, start, x):  # pragma: no cover - compiled
    """x · the len(x) values from `start` on of those rows (they may cross pages)."""
    acc = np.float32(0.0)
    done, count = 0, x.shape[0]
    while done < count:
        at, n = page_span(base, table, s, half, start, done, count)
        values, xs = pool[at : at + n], x[done : done + n]  # j >= 0: no wraparound checks
        for j in range(n):
            acc += xs[j] * values[j]
        done += n
    return acc


@njit(fastmath=True, inline="always")
def _add_rows(pool, base, table, s, half, start, w, out):  # pragma: no cover - compiled
    """out += w · the len(out) values from `start` on of those rows."""
    done, count = 0, out.shape[0]
    while done < count:
        at, n = page_span(base, table, s, half, start, done, count)
        values, part = pool[at : at + n], out[done : done + n]
        for j in range(n):
            part[j] += w * values[j]
        done += n


@njit(fastmath=True, nogil=True, cache=True)
def bgmv_pages(x, y, k, v, table, rank, layer, out):  # pragma: no cover - compiled
    """x: f32[S, in]; y, out: f32[S, out]; k, v: the cache's halves, f32[L, NB, ...];
    table: i32[S, M], each row's pages; rank: i32[S] (0: y[s] kept); layer: i32."""
    rows, fan_in = x.shape
    fan_out = y.shape[1]
    num_blocks = k.shape[1]
    half = k.size // (k.shape[0] * num_blocks)
    keys, values = k.reshape(-1), v.reshape(-1)
    base = layer * num_blocks
    for s in range(rows):
        r_s = rank[s]
        if r_s <= 0:
            out[s] = y[s]
            continue
        delta = np.zeros(fan_out, np.float32)
        for r in range(r_s):
            xa = _dot_rows(keys, base, table, s, half, r * fan_in, x[s])
            _add_rows(values, base, table, s, half, r * fan_out, xa, delta)
        for o in range(fan_out):
            out[s, o] = y[s, o] + delta[o]


_TARGET = "jlora_bgmv_pages"


@functools.cache
def _handler() -> Any:
    """The FFI target (compiled in each process, as `host_attention`'s): args x, y, k,
    v, table, rank, layer; result out."""

    @cfunc(types.int64(types.voidptr))
    def handle(frame):  # pragma: no cover - compiled
        if ffi.answered_metadata(frame):
            return 0
        a = ffi.ARGS
        bgmv_pages(
            ffi.array_2d(frame, a, 0, np.float32),
            ffi.array_2d(frame, a, 1, np.float32),
            ffi.array_5d(frame, a, 2, np.float32),
            ffi.array_5d(frame, a, 3, np.float32),
            ffi.array_2d(frame, a, 4, np.int32),
            ffi.array_1d(frame, a, 5, np.int32),
            ffi.scalar(frame, a, 6, np.int32),
            ffi.array_2d(frame, ffi.RETS, 0, np.float32),
        )
        return 0

    return handle


def usable(x_dtype: Any, cache_dtype: Any) -> bool:
    """Whether the kernel can compute this decode: fp32 rows over an fp32 cache."""
    return np.dtype(x_dtype) == np.float32 and np.dtype(cache_dtype) == np.float32


def bgmv(x, y, k, v, table, rank, layer) -> jax.Array:
    """`bgmv_pages` as a step's op (see the module's semantics)."""
    layer = jax.numpy.asarray(layer, jax.numpy.int32)
    result = jax.ShapeDtypeStruct(y.shape, y.dtype)
    return ffi.call(_TARGET, _handler(), result, x, y, k, v, table, rank, layer)
