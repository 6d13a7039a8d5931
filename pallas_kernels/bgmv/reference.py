"""BGMV in plain jnp: the semantics the Pallas kernels are tested against."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.bgmv.kernel import check_bgmv_args


@jax.jit
def bgmv_reference(
    y: jax.Array,
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    idx: jax.Array,
    ranks: jax.Array,
    layer: Any,
) -> jax.Array:
    """BGMV without Pallas: each row's adapter gathered whole, fp32 arithmetic.

    Semantics: for each row s with n = idx[s] >= 0 and r = ranks[n],
        y[s] += (x[s] @ a[layer, n, :r].T) @ b[layer, n, :r]
    x @ A accumulated in fp32 and rounded to x.dtype; @ B in fp32; added to y in fp32
    and rounded to y.dtype once. Rows with idx[s] == -1 keep y's bits.

    Args (as `pallas_kernels.bgmv.bgmv`, checked by the same `check_bgmv_args`):
      y: [S, out], f32 or bf16.
      x: [S, in], y's dtype.
      a: [L, N, R, in], x's dtype: rank rows of A^T per slot; R a power of two.
      b: [L, N, R, out], x's dtype: rank rows of B per slot.
      idx: i32[S], slot in [0, N) or -1 for no adapter.
      ranks: i32[N], slot ranks in [0, R]; rows at or beyond them are ignored.
      layer: i32 scalar in [0, L).
    Returns:
      y's updated copy, [S, out], y.dtype.
    """
    check_bgmv_args(y, x, a, b, idx, ranks)
    slot = jnp.maximum(idx, 0)
    keep = jnp.arange(a.shape[2])[None, :] < ranks[slot][:, None]  # [S, R]
    a_rows = jnp.where(keep[:, :, None], a[layer, slot], 0).astype(jnp.float32)  # [S, R, in]
    b_rows = jnp.where(keep[:, :, None], b[layer, slot], 0).astype(jnp.float32)  # [S, R, out]
    highest = jax.lax.Precision.HIGHEST
    shrunk = jnp.einsum("si,sri->sr", x.astype(jnp.float32), a_rows, precision=highest)
    shrunk = shrunk.astype(x.dtype).astype(jnp.float32)
    delta = jnp.einsum("sr,sro->so", shrunk, b_rows, precision=highest)
    updated = (y.astype(jnp.float32) + delta).astype(y.dtype)
    return jnp.where((idx >= 0)[:, None], updated, y)
