"""The pooled reference backend on one CPU device: its products by host kernels.

`HostPooledBackend` is `PooledReferenceBackend` (the adapters in the KV cache's pages,
plain jnp) whose decode and prefill products, in fp32, run as Numba kernels that XLA:CPU
calls (`bgmv.py`: each row's pages read in place; `sgmv.py`: each segment's rank rows
copied out of its pages and multiplied by BLAS). Everything else (the layout, installs,
merging's factors) is the reference's, so the two serve the same adapters from the same
pages. A batch none of whose rows' adapters adapts a target skips its products at run
time, as the reference's forms do. The engine selects it where the cache lies in host
memory (`jlora.model.lora.backends.make_backend`, `host=True`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlora.model.host import bgmv as host_bgmv
from jlora.model.host import sgmv as host_sgmv
from jlora.model.lora.base import POOL
from jlora.model.lora.reference import PooledReferenceBackend, unless_none


class HostPooledBackend(PooledReferenceBackend):
    """See the module docstring."""

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        """The Numba kernel that reads each row's pages in place (bgmv.py), in fp32;
        other dtypes take the reference's forms."""
        pool = weights[POOL]
        if not host_bgmv.usable(x.dtype, pool["k"].dtype):
            return super().bgmv(weights, target, layer, x, y, idx)
        table, rank = _tables(weights[target], idx)

        def compute() -> jax.Array:
            return host_bgmv.bgmv(x, y, pool["k"], pool["v"], table, rank, layer)

        return unless_none(rank > 0, compute, y)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        """The Numba kernel that copies each segment's rank rows out of its pages and
        runs its products as BLAS calls (sgmv.py), in fp32; other dtypes take the
        reference's loop."""
        pool = weights[POOL]
        if not host_bgmv.usable(x.dtype, pool["k"].dtype):
            return super().sgmv(weights, target, layer, x, y, segments)
        table, rank = _tables(weights[target], jnp.asarray(segments.slot))

        def compute() -> jax.Array:
            return host_sgmv.sgmv(x, y, pool["k"], pool["v"], table, rank, segments.start, layer)

        return unless_none(rank > 0, compute, y)


def _tables(w, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The host kernels' page tables and ranks of `slots` (-1: rank 0) for target weights
    `w`."""
    safe = jnp.maximum(slots, 0)
    return w["pages"][safe], jnp.where(slots >= 0, w["rank"][safe], 0)
