"""The SGMV semantics in plain jnp, fp32 (common.py's arithmetic), no Pallas.

Every slot's x @ A is computed for every row and each row keeps its own slot's:
wasteful, but memory stays at the size of the adapters (never a per-row copy of
its weights), so it also serves as the CPU fallback at real shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sgmv.kernel import check_sgmv_args


@jax.jit
def sgmv_reference(y, x, a_pool, b_pool, seg_slot, seg_start, pages, ranks, layer) -> jax.Array:
    """Semantics: y[t] += (x[t] @ A_n) @ B_n for every row t of segment g
    (seg_start[g] <= t < seg_start[g + 1]) with n = seg_slot[g] >= 0; A_n^T's rows and
    B_n's rows are a_pool[layer, pages[n, j]] and b_pool[layer, pages[n, j]], j < ranks[n].

    Arguments as for `sgmv` (kernel.py). Rows in no adapted segment, or whose slot
    has rank 0, are returned bit-identical.
    """
    rows, _, _, rank_dim = check_sgmv_args(y, x, a_pool, b_pool, seg_slot, seg_start, pages, ranks)
    num_segments = seg_slot.shape[0]
    if rows == 0 or num_segments == 0:
        return y
    # Row t's segment: the last g with seg_start[g] <= t (-1 before the first, G after the last).
    segment = jnp.searchsorted(seg_start, jnp.arange(rows), side="right") - 1
    in_a_segment = (segment >= 0) & (segment < num_segments)
    slot = jnp.where(in_a_segment, seg_slot[jnp.clip(segment, 0, num_segments - 1)], -1)
    written = (slot >= 0) & (ranks[jnp.maximum(slot, 0)] > 0)  # [T]

    in_rank = jnp.arange(rank_dim)[None, :] < ranks[:, None]  # [N, R]
    slot_pages = jnp.clip(pages, 0, a_pool.shape[1] - 1)  # [N, R]
    a = a_pool[layer][slot_pages][..., : x.shape[1]]  # [N, R, in]: a row's first values
    b = b_pool[layer][slot_pages][..., : y.shape[1]]  # [N, R, out]
    a, b = (jnp.where(in_rank[..., None], w.astype(jnp.float32), 0.0) for w in (a, b))

    highest = lax.Precision.HIGHEST
    shrunk = jnp.einsum("ti,nri->tnr", x.astype(jnp.float32), a, precision=highest)
    shrunk = shrunk.astype(x.dtype).astype(jnp.float32)  # [T, N, R], rounded as x
    own = jax.nn.one_hot(slot, pages.shape[0], dtype=jnp.float32)  # [T, N]; 0 for slot -1
    delta = jnp.einsum("tnr,nro->to", shrunk * own[..., None], b, precision=highest)
    updated = (y.astype(jnp.float32) + delta).astype(y.dtype)
    return jnp.where(written[:, None], updated, y)
