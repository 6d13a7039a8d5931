"""Attention as Numba kernels on the host, called from the jitted step: paged decode
attention, and a packed prefill's (at the end).

Semantics are `paged_decode_attention`'s: out[s] = softmax_{j <= positions[s]}(q[s]
K_s[j] / sqrt(d)) V_s[j], fp32 throughout; a sentinel block (an idle row's) is read
clipped to the last block, as `jnp.take(..., mode="clip")` does, and its output is
meaningless.

Why: on XLA:CPU, `paged_decode_attention` gathers every row's blocks up to the batch's
longest bucket into a new array, then reads it twice (two einsums and their layout
changes): for 32 rows of 512 keys, two thirds of a SmolLM2 decode step. The kernel
here reads each row's keys and values in place, straight from the cache's pages, and
only up to the row's own position (a row 100 tokens long reads 100 keys, whatever the
batch's bucket): a 32-row SmolLM2 decode step over up to 512 keys takes about two
thirds of its time with the XLA path.

How: an XLA FFI handler (`jlora.model.host.ffi`: a Numba cfunc that XLA calls itself, no
Python in between) is handed the whole cache's buffers without a copy, with the layer's
index, inside the scan over the layers. It runs the rows on the calling thread, each
with all its heads (a block's keys for every KV head lie side by side: one run of
memory), or on Numba's threads where the rows read many keys (`PARALLEL_KEYS`). Not a
`buffer_callback`: its Python, the GIL and a thread launch each layer cost more than
the kernel saves below 16 rows; through FFI it pays at any batch.
It serves wherever it reads host memory in place (`usable`: a one-device CPU mesh, in
float32); elsewhere the XLA path serves.

A packed prefill's attention (`packed_causal_attention_host`) is a second kernel here,
on the same terms. XLA's form computes each chunk of queries against a window of 3C
keys that other prompts' share, and its batched matmuls over SmolLM2's heads are small.
The kernel takes each prompt and query head in turn, reads its keys and values where
they lie, and makes its two products (scores, then the weighted values) as OpenBLAS
sgemm calls on the XLA thread that calls it: about a third of XLA's time a layer (448
tokens in 12 prompts of 16-64). A prompt's result depends on its own tokens alone,
whatever else shares the call.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numba
import numpy as np
from jax.sharding import Mesh
from numba import cfunc, njit, prange, types

from cpu_offload.kernels import threads
from cpu_offload.kernels.blas import one_blas_thread, sgemm
from jlora.model.host import ffi
from jlora.model.kv_cache import KVCache


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _softmax(row, length, scale):  # pragma: no cover - compiled
    """row[:length] = softmax(row[:length] * scale), in place; the rest is left alone."""
    top = row[0]
    for j in range(1, length):
        top = max(top, row[j])
    total = np.float32(0.0)
    for j in range(length):
        row[j] = np.exp((row[j] - top) * scale)
        total += row[j]
    for j in range(length):
        row[j] /= total


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _heads(q, k, v, layer, tables, positions, out, s, first, last):  # pragma: no cover - compiled
    """Row s, KV heads first..last - 1: scores of their query heads against the row's
    keys, softmax, the weighted sum of its values. q, out: f32[S, H, D]; k, v: f32[L, NB,
    BS, KVH, D]; tables: i32[S, MB]; positions: i32[S]. A block's keys and values for
    all KV heads lie side by side, so a row's whole heads read each block in one run."""
    dim = q.shape[2]
    num_blocks, block_size, kv_heads = k.shape[1], k.shape[2], k.shape[3]
    group = q.shape[1] // kv_heads
    scale = np.float32(1.0 / math.sqrt(dim))
    length = positions[s] + 1
    queries = q[s, first * group : last * group] * scale
    heads = queries.shape[0]
    weights = np.empty((heads, length), np.float32)
    for start in range(0, length, block_size):  # block by block: no division a key
        block = min(tables[s, start // block_size], num_blocks - 1)
        for i in range(min(block_size, length - start)):
            for h in range(first, last):
                key = k[layer, block, i, h]
                for g in range((h - first) * group, (h - first + 1) * group):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += queries[g, d] * key[d]
                    weights[g, start + i] = acc
    for g in range(heads):
        _softmax(weights[g], length, np.float32(1.0))  # the queries are scaled already
    acc_out = np.zeros((heads, dim), np.float32)
    for start in range(0, length, block_size):
        block = min(tables[s, start // block_size], num_blocks - 1)
        for i in range(min(block_size, length - start)):
            for h in range(first, last):
                value = v[layer, block, i, h]
                for g in range((h - first) * group, (h - first + 1) * group):
                    w = weights[g, start + i]
                    for d in range(dim):
                        acc_out[g, d] += w * value[d]
    out[s, first * group : last * group] = acc_out


@njit(fastmath=True, nogil=True, cache=True)
def _attend(q, k, v, layer, tables, positions, out):  # pragma: no cover - compiled
    """Every row, all its heads at once (`_heads`), in turn, on the calling thread."""
    for s in range(q.shape[0]):
        _heads(q, k, v, layer, tables, positions, out, s, 0, k.shape[3])


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _attend_parallel(q, k, v, layer, tables, positions, out, parts):  # pragma: no cover - compiled
    """`_attend` split over Numba's threads (one launch at a time: `threads.lock`), each
    row's KV heads in `parts` jobs (more than one where there are fewer rows than threads)."""
    rows, kv_heads = q.shape[0], k.shape[3]
    for job in prange(rows * parts):
        s = job // parts
        part = job - s * parts
        first = part * kv_heads // parts
        _heads(q, k, v, layer, tables, positions, out, s, first, (part + 1) * kv_heads // parts)


# Keys a step's rows read in all (the sum of their positions) from which the pairs run on
# Numba's threads rather than on the XLA thread that calls: a launch costs about 0.1 ms
# and its threads contend with XLA's own where cores are few. In SmolLM2 decode, at 16
# rows of 64-96 keys the calling thread alone makes the step faster (more so with
# adapters); at 32 rows of 512 keys the threads halve the attention's time a layer.
PARALLEL_KEYS = 4096


@functools.cache
def _handler() -> Any:
    """The FFI target, compiled on first use (not at import: a GPU process never needs
    it): args q, k, v, layer, tables, positions; result out. Not cached on disk (a
    cached copy crashed the next process); the kernels it calls are."""

    @cfunc(types.int64(types.voidptr))
    def handle(frame):  # pragma: no cover - compiled
        if ffi.answered_metadata(frame):
            return 0
        a, f32, i32 = ffi.ARGS, np.float32, np.int32
        q, k, v = (ffi.array_3d(frame, a, 0, f32), ffi.array_5d(frame, a, 1, f32),
                   ffi.array_5d(frame, a, 2, f32))  # fmt: skip
        layer, tables = ffi.scalar(frame, a, 3, i32), ffi.array_2d(frame, a, 4, i32)
        positions, out = ffi.array_1d(frame, a, 5, i32), ffi.array_3d(frame, ffi.RETS, 0, f32)
        if positions.sum() + positions.shape[0] < PARALLEL_KEYS:
            _attend(q, k, v, layer, tables, positions, out)
        else:
            parts = 1 if positions.shape[0] >= numba.get_num_threads() else k.shape[3]
            threads.lock()
            _attend_parallel(q, k, v, layer, tables, positions, out, parts)
            threads.unlock()
        return 0

    return handle


def usable(mesh: Mesh, dtype: Any) -> bool:
    """Whether the kernel can serve decodes over this mesh: it reads the cache in place
    (one CPU device, fp32)."""
    return (
        mesh.devices.size == 1
        and mesh.devices.flat[0].platform == "cpu"
        and np.dtype(dtype) == np.float32
    )


_TARGET = "jlora_paged_decode_attention"


def warm() -> None:
    """Compile the kernel (or load it from Numba's cache) and register its FFI target,
    before a step calls it."""
    ffi.register(_TARGET, _handler())


def paged_decode_attention_host(
    q: jax.Array,
    cache: KVCache,
    layer: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """`paged_decode_attention(q, cache.k[layer], cache.v[layer], ...)` on the host.

    q: [S, heads, head_dim] f32; layer: the layer's index (a traced scalar, or an int);
    block_tables: i32[S, max_blocks]; positions: i32[S]. Returns [S, heads * head_dim].
    """
    slots, heads, head_dim = q.shape
    result = jax.ShapeDtypeStruct(q.shape, q.dtype)
    layer = jnp.asarray(layer, jnp.int32)
    out = ffi.call(_TARGET, _handler(), result, q, cache.k, cache.v, layer, block_tables, positions)
    return out.reshape(slots, heads * head_dim)


@njit(fastmath=True, nogil=True, cache=True)
def _attend_packed(q, k, v, starts, out):  # pragma: no cover - compiled
    """q, out: f32[T, H, D]; k, v: f32[T, KVH, D]; starts: i32[P + 1]. For each prompt
    p (rows starts[p] to starts[p + 1]) and query head h: the scores S = Q_h K^T, each
    row's causal softmax (zeros past its own token), then S V into out's rows, each
    product one sgemm over the rows where they lie (a row-major [n, D] of row stride s
    is a column-major [D, n] of leading dimension s). Rows from starts[P] on: zeros."""
    seq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(dim))
    longest = 1
    for p in range(starts.shape[0] - 1):
        longest = max(longest, min(starts[p + 1], seq) - min(starts[p], seq))
    scores = np.empty((longest, longest), np.float32)  # row t: query t's, by key
    out[min(starts[-1], seq) :] = 0.0
    for p in range(starts.shape[0] - 1):
        first, end = min(starts[p], seq), min(starts[p + 1], seq)
        n = end - first
        if n <= 0:
            continue
        for h in range(heads):
            keys, values = k[first:, h // group], v[first:, h // group]
            # scores^T [keys, queries] = K [keys, D] @ Q_h^T [D, queries], column-major
            sgemm(True, n, n, dim, keys, kv_heads * dim, q[first:, h], heads * dim,
                  0.0, scores, longest)  # fmt: skip
            for t in range(n):
                _softmax(scores[t], t + 1, scale)
                scores[t, t + 1 : n] = 0.0
            # out_h^T [D, queries] = V^T [D, keys] @ scores^T [keys, queries]
            sgemm(False, dim, n, n, values, kv_heads * dim, scores, longest,
                  0.0, out[first:, h], heads * dim)  # fmt: skip


_PACKED_TARGET = "jlora_packed_causal_attention"


@functools.cache
def _packed_handler() -> Any:
    """The packed prefill's FFI target (compiled as `_handler` is): args q, k, v,
    starts; result out. OpenBLAS gets one thread in the process first (its helper
    threads would spin on the cores XLA's threads use: `kernels.one_blas_thread`)."""
    one_blas_thread()

    @cfunc(types.int64(types.voidptr))
    def handle(frame):  # pragma: no cover - compiled
        if ffi.answered_metadata(frame):
            return 0
        a, f32 = ffi.ARGS, np.float32
        _attend_packed(
            ffi.array_3d(frame, a, 0, f32),
            ffi.array_3d(frame, a, 1, f32),
            ffi.array_3d(frame, a, 2, f32),
            ffi.array_1d(frame, a, 3, np.int32),
            ffi.array_3d(frame, ffi.RETS, 0, f32),
        )
        return 0

    return handle


def packed_causal_attention_host(
    q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array
) -> jax.Array:
    """`packed_causal_attention` on the host, each prompt by itself.

    q: [T, heads, head_dim] f32; k, v: [T, kv_heads, head_dim] f32; starts: i32[P + 1],
    non-decreasing from 0: prompt p is rows starts[p] to starts[p + 1], rows from
    starts[P] on are padding (their output is zeros). Returns [T, heads * head_dim].
    """
    seq, heads, head_dim = q.shape
    result = jax.ShapeDtypeStruct(q.shape, q.dtype)
    starts = jnp.asarray(starts, jnp.int32)
    out = ffi.call(_PACKED_TARGET, _packed_handler(), result, q, k, v, starts)
    return out.reshape(seq, heads * head_dim)
