"""The attention forms (jlora/model/attention.py) against a naive fp32 loop.

The reference is one query at a time: softmax over the keys it may see, written out
in numpy. Lengths straddle the CPU path's chunks (at least 16 query rows, at most 8
chunks) and its tail; groups of 1 and 3 query heads per KV head.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.model.attention import (
    KEY_BLOCKS,
    causal_attention,
    paged_decode_attention,
    paged_prefix_attention,
)
from tests.tolerances import assert_close


def naive(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: int) -> np.ndarray:
    """One query's attention. q: [H, d]; keys, values: [T, KVH, d]; the first `visible`
    keys count. Returns [H * d] in fp32."""
    heads, head_dim = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((heads, head_dim), np.float64)
    for head in range(heads):
        k, v = keys[:visible, head // group], values[:visible, head // group]
        scores = k.astype(np.float64) @ q[head] / np.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[head] = weights @ v / weights.sum()
    return out.reshape(-1).astype(np.float32)


def random(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("seq, length", [(1, 1), (16, 5), (17, 17), (40, 33), (130, 130)])
def test_causal_attention_is_each_querys_softmax_over_the_keys_up_to_it(
    heads, kv_heads, seq, length
):
    q, k, v = (random((seq, h, 8), seed) for seed, h in enumerate((heads, kv_heads, kv_heads)))
    out = causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(length))
    assert out.shape == (seq, heads * 8)
    expected = np.stack([naive(q[t], k, v, t + 1) for t in range(length)])
    assert_close(out[:length], expected, np.float32, np.float32, scope="op")


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2)])
def test_paged_decode_attention_reads_each_sequence_through_its_block_table(heads, kv_heads):
    """Three sequences over shuffled blocks of 4 tokens; the last's table ends in the
    sentinel (clipped, and past its position, so never seen)."""
    blocks, block_size, head_dim = 9, 4, 8
    k_pages = random((blocks, block_size, kv_heads, head_dim), 1)
    v_pages = random((blocks, block_size, kv_heads, head_dim), 2)
    q = random((3, heads, head_dim), 3)
    tables = np.array([[4, 0, 7], [2, 8, 1], [5, 3, blocks]], np.int32)
    positions = np.array([9, 0, 6], np.int32)
    out = paged_decode_attention(*map(jnp.asarray, (q, k_pages, v_pages, tables, positions)))
    expected = []
    for row, (table, position) in enumerate(zip(tables, positions, strict=True)):
        keys = k_pages[np.minimum(table, blocks - 1)].reshape(-1, kv_heads, head_dim)
        values = v_pages[np.minimum(table, blocks - 1)].reshape(-1, kv_heads, head_dim)
        expected.append(naive(q[row], keys, values, position + 1))
    assert_close(out, np.stack(expected), np.float32, np.float32, scope="op")


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("cached, new", [(0, 5), (8, 8), (28, 19), (60, 4)])
def test_prefix_attention_sees_the_cached_prefix_and_the_new_tokens_up_to_each(
    heads, kv_heads, cached, new
):
    """A 20-block table of 4-token blocks, shuffled, its tail the sentinel; `cached`
    tokens there already and `new` more written after them; padded to 24 query rows.
    Chunks of KEY_BLOCKS blocks: the prefixes end inside the first, second and third."""
    blocks, block_size, head_dim, rows = 24, 4, 8, 24
    assert KEY_BLOCKS * block_size < 28 + 19 <= 2 * KEY_BLOCKS * block_size
    k_cache = random((3, blocks, block_size, kv_heads, head_dim), 1)  # layer 1's is read
    v_cache = random((3, blocks, block_size, kv_heads, head_dim), 2)
    q = random((rows, heads, head_dim), 3)
    used = -(-(cached + new) // block_size)
    table = np.full(20, blocks, np.int32)
    table[:used] = np.random.default_rng(4).permutation(blocks)[:used]
    positions = (cached + np.arange(rows)).astype(np.int32)
    out = paged_prefix_attention(
        *map(jnp.asarray, (q, k_cache, v_cache, np.int32(1), table, positions))
    )
    keys = k_cache[1, table[:used]].reshape(-1, kv_heads, head_dim)
    values = v_cache[1, table[:used]].reshape(-1, kv_heads, head_dim)
    expected = np.stack([naive(q[t], keys, values, cached + t + 1) for t in range(new)])
    assert_close(out[:new], expected, np.float32, np.float32, scope="op")
