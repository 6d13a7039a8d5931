"""BGMV over adapters in the KV cache's pages, as a Numba kernel XLA calls through FFI:
the pooled reference backend's decode on a CPU.

Why: on XLA:CPU the backend's decode gathers each row's pages into a new array, then
reduces it (two fusions a factor, a target and a layer; for 16 rows of rank 16 on q and
v, about 80 µs of gathers and 100 µs of products a SmolLM2 layer, on 2 Zen 5 cores).
This kernel reads each row's rank rows in place, from its own pages, only up to its
adapter's own rank, on the XLA thread that calls it (`jlora.model.host.ffi`, no Python): 24
µs for q_proj's 16 rows and 18 µs for v_proj's. SmolLM2 decode at batch 16 with 16
rank-16 adapters on q and v went from 0.87 to 0.89-0.91 of the base step's tokens/s
(stacked slots, gathered by XLA: 0.92-0.93), on all seven targets to 0.72 (stacked
slots 0.59-0.75 over two runs; bench/results/2026-11-28-cpu-lora-pool-qv-5.json,
-lora-pool-2.json).

What bounds it is memory: in a step the rows come from DRAM (the base weights stream
past every cache in between), 71 MB a step for 16 rank-16 adapters on q and v, 13% of
SmolLM2's 538 MB of fp32 weights. On a 2-core Zen 4 VM, caches flushed (a scratch
measurement, 2026-11-28), q_proj's 16 rows took 82 µs over pages in order (as the
pool deals an adapter's pages) and 140 µs over scattered ones, where merely reading
their bytes took 53 and 124 µs; 30 µs in the cache. None of the variants tried beat
it: prefetching the next row's pages ran 15-25 µs slower, every row's x·A before any
·B within 10 µs either way, and a parallel launch costs 0.1 ms
(cpu_offload/kernels/threads.py). Nor does a spare core wait for it: XLA runs a layer's q and
v calls at once on its two threads (in 1442 of 1560 layers), so a helper thread
splitting a call's rows left a step's time as it was
(bench/results/2026-11-30-cpu-zen4-issue17-2.md).

Semantics are `ReferenceBackend.bgmv`'s over `PooledReferenceBackend`'s layout: a row s
whose adapter adapts the target (rank[s] > 0) gets y[s] + (x[s] @ A_s) @ B_s, in fp32;
A_s^T's rank rows lie across the key halves of its pages in table order, `in` values
each, and B_s's across their value halves, `out` values each. Every other row keeps y[s].
fp32 only (`usable`).
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
