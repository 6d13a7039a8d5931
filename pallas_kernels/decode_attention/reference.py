"""Paged decode attention as a naive loop: the semantics the kernel is tested against."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention.kernel import check_decode_attention_args


def decode_attention_reference(q, k_pages, v_pages, tables, positions) -> np.ndarray:
    """`decode_attention` in numpy, one row and query head at a time, in fp64 (q scaled in
    its own dtype first, as the kernel does): each row's keys and values gathered token
    by token through its block table, a plain softmax.
    Returns [S, heads, d] as float64 (the caller compares it within the kernel's
    tolerance)."""
    group = check_decode_attention_args(q, k_pages, v_pages, tables, positions)
    head_dim = q.shape[2]
    scaled = jnp.asarray(q) * jnp.asarray(head_dim**-0.5, q.dtype)  # in q's dtype, as the kernel
    q, k, v = (np.asarray(a, np.float64) for a in (scaled, k_pages, v_pages))
    tables, positions = np.asarray(tables), np.asarray(positions)
    rows, heads, _ = q.shape
    block_size = k.shape[1]
    out = np.zeros_like(q)
    for s in range(rows):
        tokens = range(int(positions[s]) + 1)
        cells = [(min(int(tables[s, t // block_size]), k.shape[0] - 1), t % block_size)
                 for t in tokens]  # fmt: skip
        for i in range(heads):
            keys = np.stack([k[page, slot, i // group] for page, slot in cells])
            values = np.stack([v[page, slot, i // group] for page, slot in cells])
            scores = keys @ q[s, i]
            weights = np.exp(scores - scores.max())
            out[s, i] = (weights / weights.sum()) @ values
    return out
