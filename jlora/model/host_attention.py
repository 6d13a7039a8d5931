"""Paged decode attention as a Numba kernel on the host, called from the jitted step.

Why: on XLA:CPU, `paged_decode_attention` gathers every row's blocks up to the batch's
longest bucket into a new array, then reads it twice (two einsums and their layout
changes): about 7.5 ms a SmolLM2 layer for 32 rows of 512 keys, two thirds of a decode
step. The kernel here reads each row's keys and values in place, straight from the
cache's pages, and only up to the row's own position (a row 100 tokens long reads 100
keys, whatever the batch's bucket): a 32-row SmolLM2 decode step over up to 512 keys
took 150-165 ms against 230 with the XLA path (measured side by side on this 2-core
machine; the replay in bench/results/2026-11-27-cpu-replay.md runs it).

How: `jax.experimental.buffer_callback` hands the kernel the whole cache's buffers
without a copy, with the layer's index, inside the scan over the layers; the callback
holds the GIL only to unwrap its arguments, and the kernel (nogil) splits the (row, KV
head) pairs over the cores (Numba's workqueue threads, one launch at a time: see
below). It serves only where it reads host memory in place (`usable`: a one-device CPU
mesh, in float32) and where it pays (`pays`: a decode of at least `MIN_ROWS` rows);
elsewhere the XLA path serves.

Semantics are `paged_decode_attention`'s: out[s] = softmax_{j <= positions[s]}(q[s]
K_s[j] / sqrt(d)) V_s[j], fp32 throughout; a sentinel block (an idle row's) is read
clipped to the last block, as `jnp.take(..., mode="clip")` does, and its output is
meaningless.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numba
import numpy as np
from jax.sharding import Mesh
from numba import njit, prange

from jlora.model.kv_cache import KVCache

# Numba's threads: its workqueue, not GNU OpenMP, which left PyTorch in the same process
# 1.8x slower afterwards (a benchmark's transformers side: 10.9 s before a jlora run,
# 19.6 s after; 12.8 s with the workqueue, jlora as fast). The workqueue must not be
# entered by two threads at once (two engines in one process): `_LAUNCH` serialises.
numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]
_LAUNCH = threading.Lock()


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _attend(q, k, v, layer, tables, positions, out):  # pragma: no cover - compiled
    """q, out: f32[S, H, D]; k, v: f32[L, NB, BS, KVH, D]; tables: i32[S, MB];
    positions: i32[S]. Each (row, KV head) pair: scores of its query heads against the
    row's keys, softmax, the weighted sum of its values."""
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads = k.shape[1], k.shape[2], k.shape[3]
    group = heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(dim))
    for job in prange(rows * kv_heads):
        s = job // kv_heads
        h = job - s * kv_heads
        length = positions[s] + 1
        first = h * group
        queries = q[s, first : first + group] * scale
        weights = np.empty((group, length), np.float32)
        for t in range(length):
            block = min(tables[s, t // block_size], num_blocks - 1)
            key = k[layer, block, t % block_size, h]
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += queries[g, d] * key[d]
                weights[g, t] = acc
        for g in range(group):
            top = weights[g, 0]
            for t in range(1, length):
                top = max(top, weights[g, t])
            total = np.float32(0.0)
            for t in range(length):
                weights[g, t] = np.exp(weights[g, t] - top)
                total += weights[g, t]
            for t in range(length):
                weights[g, t] /= total
        acc_out = np.zeros((group, dim), np.float32)
        for t in range(length):
            block = min(tables[s, t // block_size], num_blocks - 1)
            value = v[layer, block, t % block_size, h]
            for g in range(group):
                w = weights[g, t]
                for d in range(dim):
                    acc_out[g, d] += w * value[d]
        out[s, first : first + group] = acc_out


def _callback(ctx: Any, out: Any, q: Any, k: Any, v: Any, layer: Any, tables: Any, pos: Any):
    del ctx
    args = (np.asarray(q), np.asarray(k), np.asarray(v), int(np.asarray(layer)))
    with _LAUNCH:
        _attend(*args, np.asarray(tables), np.asarray(pos), np.asarray(out))


# Fewer decode rows than this: the XLA path. Each layer's callback has a fixed cost (the
# GIL, the launch: about 0.4 ms), which a small batch's attention does not repay; a
# SmolLM2 step at 4 rows took 60 ms with the kernel against 48 without, at 32 rows of
# 512 keys 150-165 against 230. A Python thread busy beside the engine (staging an
# adapter) also makes each callback wait for the GIL.
MIN_ROWS = 16


def usable(mesh: Mesh, dtype: Any) -> bool:
    """Whether the kernel can serve decodes over this mesh: it reads the cache in place
    (one CPU device, fp32)."""
    return (
        mesh.devices.size == 1
        and mesh.devices.flat[0].platform == "cpu"
        and np.dtype(dtype) == np.float32
    )


def pays(rows: int) -> bool:
    """Whether it pays for a decode of `rows` rows: the batch is large enough."""
    return rows >= MIN_ROWS


def warm() -> None:
    """Compile the kernel now (or load it from Numba's cache), not in the first step."""
    q = np.zeros((1, 1, 1), np.float32)
    kv = np.zeros((1, 1, 1, 1, 1), np.float32)
    with _LAUNCH:
        _attend(q, kv, kv, 0, np.zeros((1, 1), np.int32), np.zeros(1, np.int32), q.copy())


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
    from jax.experimental.buffer_callback import buffer_callback

    slots, heads, head_dim = q.shape
    call = buffer_callback(_callback, jax.ShapeDtypeStruct(q.shape, q.dtype))
    out = call(q, cache.k, cache.v, jnp.asarray(layer, np.int32), block_tables, positions)
    return out.reshape(slots, heads * head_dim)
