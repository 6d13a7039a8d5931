"""MBGMV in plain jnp: every row's rank rows gathered through its page table, fp32 sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mbgmv.kernel import check_mbgmv_args


def mbgmv_reference(y, x, a_pool, b_pool, idx, pages, ranks, layer) -> jax.Array:
    """Semantics: y[s] += sum_{j < ranks[n]} (x[s] . a_pool[layer, pages[n, j]])
    * b_pool[layer, pages[n, j]] for every row s with n = idx[s] >= 0.

    The same arguments and arithmetic as `mbgmv` (see it for shapes and invariants),
    without Pallas: every row gathers all R rank rows of its slot and zeroes those at
    or beyond the rank before multiplying (they may hold NaN). Rows with idx[s] == -1
    are returned bit-identical.
    """
    check_mbgmv_args(y, x, a_pool, b_pool, idx, pages, ranks)
    has_adapter = idx >= 0
    slot = jnp.where(has_adapter, idx, 0)
    row_pages = pages[slot]  # [S, R]
    in_rank = jnp.arange(pages.shape[1]) < ranks[slot][:, None]  # [S, R]
    a = a_pool[layer][row_pages][..., : x.shape[1]]  # [S, R, in]: a row's first values
    b = b_pool[layer][row_pages][..., : y.shape[1]]  # [S, R, out]
    a, b = (jnp.where(in_rank[..., None], w, 0) for w in (a, b))
    exact = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    shrunk = jnp.einsum("si,sri->sr", x, a, **exact).astype(x.dtype)
    delta = jnp.einsum("sr,sro->so", shrunk, b, **exact)
    updated = (y.astype(jnp.float32) + delta).astype(y.dtype)
    return jnp.where(has_adapter[:, None], updated, y)
