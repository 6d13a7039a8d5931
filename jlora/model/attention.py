"""Attention over the paged KV cache.

Grouped-query attention throughout: `num_heads` query heads share `num_kv_heads`
key/value heads in groups of `num_heads // num_kv_heads`. The prefill forms go through
`jax.nn.dot_product_attention`, which picks the backend's best implementation (cuDNN's
fused kernel on GPU), except on CPU: there a prompt's causal attention goes in query
chunks that skip most masked keys (`_chunked_causal`), and a cached prefix's attention
loops over the key blocks it reaches (`_chunked_prefix`), each product one batched
matmul over the KV heads. Decode, one query per sequence, is two einsums over the
gathered blocks (the fused form's layout changes cost more than its products:
`paged_decode_attention`), or, with `decode_attention="pallas"`, one Triton kernel
walking each row's blocks (`paged_decode_attention_kernel`). A packed prefill (several
prompts in one call) passes its block-diagonal causal mask explicitly, so its scores
cover every pair of the call's tokens, the other prompts'. On one CPU device in fp32
the engine runs decode and packed prefill attention as host kernels instead
(jlora/model/host/attention.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jlora.model.dots import einsum_f32
from jlora.model.kv_cache import layer_rows
from pallas_kernels.common import KernelArgumentError
from pallas_kernels.decode_attention import check_decode_attention_args, decode_attention

CAUSAL_CHUNKS = 8  # query chunks of a prompt's causal attention, at most
MIN_CHUNK = 16  # query rows per chunk, at least
KEY_BLOCKS = 8  # blocks of keys per chunk of a prefix attention's loop


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array) -> jax.Array:
    """Causal self-attention within one padded prompt.

    Semantics: out[t] = softmax_{j <= t, j < length}(q[t]·k[j] / sqrt(d)) · v[j].

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; length: i32[] (real tokens;
    rows t >= length are padding and their output is unspecified, so for the real rows
    the causal mask alone does: j <= t < length).
    Returns [T, heads * head_dim] in q's dtype.

    On CPU, in query chunks (`_chunked_causal`); elsewhere one causal call, which a
    GPU's fused kernel masks block by block itself.
    """
    seq, heads, head_dim = q.shape
    if jax.default_backend() != "cpu":
        out = jax.nn.dot_product_attention(
            q[None], k[None], v[None], is_causal=True, key_value_seq_lengths=length[None]
        )
        return out.reshape(seq, heads * head_dim)
    return _chunked_causal(q, k, v)


def _chunked_causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`causal_attention` on XLA:CPU: up to CAUSAL_CHUNKS chunks of queries (of at least
    MIN_CHUNK rows), each attending to the keys up to its last row only, so the scores
    skip most of the masked upper triangle and each chunk's fit in cache.

    Each chunk's scores and output are one batched matmul over the KV heads, the
    queries of a head's group stacked as rows (`_by_kv_head`): [kvh, group * chunk, d]
    @ [kvh, d, T]. Letting XLA pick the layouts of the 4-D einsum (or the fused form's,
    which copies the keys for every query head) costs 1.6-2.6x as much at T = 512-1024
    on SmolLM2's heads.
    """
    seq, heads, head_dim = q.shape
    keys = jnp.transpose(k, (1, 2, 0))  # [kvh, d, T]
    values = jnp.transpose(v, (1, 0, 2))  # [kvh, T, d]
    size = max(MIN_CHUNK, -(-seq // CAUSAL_CHUNKS))
    index = jnp.arange(seq)
    outs = []
    for start in range(0, seq, size):
        end = min(start + size, seq)
        rows = _by_kv_head(q[start:end], k.shape[1])  # [kvh, group * rows, d]
        scores = einsum_f32("kmd,kdt->kmt", rows, keys[:, :, :end])
        visible = jnp.tile(index[None, :end] <= index[start:end, None], (heads // k.shape[1], 1))
        weights = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
        out = einsum_f32("kmt,ktd->kmd", weights.astype(v.dtype), values[:, :end])
        outs.append(_by_query(out, end - start).astype(q.dtype))
    return jnp.concatenate(outs) if len(outs) > 1 else outs[0]


def _by_kv_head(q: jax.Array, kv_heads: int) -> jax.Array:
    """Scaled queries [T, heads, d] as [kv_heads, group * T, d]: row j * T + t is query t
    of the group's head j."""
    seq, heads, head_dim = q.shape
    scaled = (q * jnp.asarray(head_dim**-0.5, q.dtype)).reshape(seq, kv_heads, -1, head_dim)
    return jnp.transpose(scaled, (1, 2, 0, 3)).reshape(kv_heads, -1, head_dim)


def _by_query(out: jax.Array, seq: int) -> jax.Array:
    """`_by_kv_head`'s inverse for the output: [kv_heads, group * T, d] -> [T, heads * d]."""
    kv_heads, _, head_dim = out.shape
    out = jnp.transpose(out.reshape(kv_heads, -1, seq, head_dim), (2, 0, 1, 3))
    return out.reshape(seq, -1)


def packed_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, prompt: jax.Array, longest: int | None = None
) -> jax.Array:
    """Causal self-attention within each of several prompts packed back to back.

    Semantics: out[t] = softmax_{j <= t, prompt[j] == prompt[t]}(q[t]·k[j] / sqrt(d)) · v[j]:
    a token never sees another prompt's tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; prompt: i32[T], each token's
    prompt index (>= 0), non-decreasing (padding rows share an index of their own, and
    their output is unspecified). longest: None, or (static) the most tokens a prompt
    has: the queries then attend in chunks of C = longest // 2, each chunk to itself
    and the 2C keys before it, all a prompt that long can reach; the scores cost
    T·3C instead of T² (on SmolLM2's heads at T = 512, C = 32 takes under a third of
    the time of attending to all the keys), and the result is the same.
    Returns [T, heads * head_dim] in q's dtype.
    """
    seq, heads, head_dim = q.shape
    chunk = max(1, (longest or 0) // 2)
    if longest is None or seq <= 3 * chunk:  # the window would hold every key anyway
        index = jnp.arange(seq)
        visible = (prompt[:, None] == prompt[None, :]) & (index[None, :] <= index[:, None])
        out = jax.nn.dot_product_attention(q[None], k[None], v[None], mask=visible[None, None])
        return out.reshape(seq, heads * head_dim)
    chunks = -(-seq // chunk)
    tail = chunks * chunk - seq  # rows that round T up to whole chunks
    before = 2 * chunk  # key rows ahead of the first chunk, never visible

    def in_chunks(x: jax.Array, lead: int = 0) -> jax.Array:
        """x after `lead` rows of zeros and before `tail`, as [chunks (+ lead / C), C, ...]."""
        width = [(lead, tail)] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, width).reshape(-1, chunk, *x.shape[1:])

    def windows(x: jax.Array) -> jax.Array:
        """[chunks + 2, C, ...] -> [chunks, 3C, ...]: each chunk's keys and the 2C before."""
        return jnp.concatenate([x[j : j + chunks] for j in range(3)], axis=1)

    # Prompt -1 marks the rows ahead, -2 the tail (visible to the tail's queries alone).
    prompts = jnp.concatenate([jnp.full(before, -1), prompt, jnp.full(tail, -2)])
    index = jnp.arange(-before, seq + tail)
    query_prompt, query_index = (x[before:].reshape(chunks, chunk) for x in (prompts, index))
    key_prompt, key_index = (windows(x.reshape(-1, chunk)) for x in (prompts, index))
    visible = (query_prompt[:, :, None] == key_prompt[:, None, :]) & (
        key_index[:, None, :] <= query_index[:, :, None]
    )  # [chunks, C, 3C]
    out = jax.nn.dot_product_attention(
        in_chunks(q),
        windows(in_chunks(k, before)),
        windows(in_chunks(v, before)),
        mask=visible[:, None],
    )
    return out.reshape(-1, heads * head_dim)[:seq]


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """One new token per sequence attending to its whole cached history.

    Semantics: out[s] = softmax_{j <= positions[s]}(q[s]·K_s[j] / sqrt(d)) · V_s[j], where
    K_s[j] = k_pages[block_tables[s, j // block_size], j % block_size].

    q: [S, heads, head_dim]; k_pages, v_pages: [num_blocks, block_size, kv_heads, head_dim]
    (one layer); block_tables: i32[S, max_blocks]; positions: i32[S] (the new token's
    position, already written to the cache). Returns [S, heads * head_dim] in q's dtype.

    Two einsums over the gathered blocks, not `jax.nn.dot_product_attention`: one query
    per sequence makes the products small, and the fused attention's layout changes (its
    keys transposed to [S, heads, T, d], with every query head's copy of the group's
    keys) cost more on XLA:CPU than the products themselves. Here each KV head's keys
    are read once for its group of query heads; scores and softmax are fp32.
    """
    slots, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    group = heads // kv_heads
    keys = jnp.take(k_pages, block_tables, axis=0, mode="clip")  # [S, MB, bs, kvh, d]
    values = jnp.take(v_pages, block_tables, axis=0, mode="clip")
    keys = keys.reshape(slots, -1, kv_heads, head_dim)  # [S, T, kvh, d]
    values = values.reshape(slots, -1, kv_heads, head_dim)
    grouped = q.reshape(slots, kv_heads, group, head_dim) * jnp.asarray(head_dim**-0.5, q.dtype)
    scores = einsum_f32("skgd,stkd->sktg", grouped, keys)  # [S, kvh, T, group]
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]  # [S, T]
    scores = jnp.where(visible[:, None, :, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=2).astype(values.dtype)
    out = einsum_f32("sktg,stkd->skgd", weights, values)
    return out.reshape(slots, heads * head_dim).astype(q.dtype)


def paged_decode_attention_kernel(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    interpret: bool | None = None,
) -> jax.Array:
    """`paged_decode_attention` by the Triton kernel of pallas_kernels/decode_attention,
    the same arguments and result; `interpret` (None: off a GPU) runs it interpreted."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out = decode_attention(q, k_pages, v_pages, block_tables, positions, interpret=interpret)
    return out.reshape(q.shape[0], -1)


def check_decode_kernel(config: Any, block_size: int) -> None:
    """ValueError naming decode_attention where `config`'s shapes (one shard's: its query
    and KV heads, head_dim) and `block_size` are not ones the kernel takes."""
    q = jax.ShapeDtypeStruct((1, config.num_heads, config.head_dim), jnp.float32)
    pages = jax.ShapeDtypeStruct((1, block_size, config.num_kv_heads, config.head_dim), jnp.float32)
    tables, positions = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1, 1), (1,)))
    try:
        check_decode_attention_args(q, pages, pages, tables, positions)
    except KernelArgumentError as err:
        raise ValueError(f"decode_attention='pallas' cannot serve this model: {err}") from None


def paged_prefix_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_table: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """A prompt's new tokens attending to its cached prefix and, causally, to each other.

    Semantics: out[t] = softmax_{j <= positions[t]}(q[t]·K[j] / sqrt(d)) · V[j], where
    K[j] = k_cache[layer, block_table[j // block_size], j % block_size].

    q: [T, heads, head_dim], the new tokens (padded); k_cache, v_cache: [layers,
    num_blocks, block_size, kv_heads, head_dim] (the new tokens' keys already written);
    layer: i32[]; block_table: i32[max_blocks] (sentinel entries are read clipped, and
    masked); positions: i32[T], each query's position (rows past the real tokens are
    padding and their output is unspecified). Returns [T, heads * head_dim].
    """
    seq, heads, head_dim = q.shape
    if jax.default_backend() == "cpu":
        return _chunked_prefix(q, k_cache, v_cache, layer, block_table, positions)
    k_pages, v_pages = k_cache[layer], v_cache[layer]
    kv_heads = k_pages.shape[2]
    keys = jnp.take(k_pages, block_table, axis=0, mode="clip")  # [MB, bs, kvh, d]
    values = jnp.take(v_pages, block_table, axis=0, mode="clip")
    keys = keys.reshape(-1, kv_heads, head_dim)  # [MB*bs, kvh, d]
    values = values.reshape(-1, kv_heads, head_dim)
    visible = jnp.arange(keys.shape[0])[None, :] <= positions[:, None]  # [T, MB*bs]
    out = jax.nn.dot_product_attention(q[None], keys[None], values[None], mask=visible[None, None])
    return out.reshape(seq, heads * head_dim)


def _chunked_prefix(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_table: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """`paged_prefix_attention` on XLA:CPU: the keys in chunks of KEY_BLOCKS blocks, as
    many as the last query reaches (a loop of run-time length, with an online softmax),
    not the whole table: a 512-token chunk after 256 cached tokens reads 48 of a 2048-
    token table's 128 blocks, about a sixth of the time of attending to the whole table
    on SmolLM2's heads. Each chunk's products are batched matmuls over the KV heads, as
    in `_chunked_causal`. The blocks are gathered from the whole cache (`layer_rows`):
    gathering from `k_cache[layer]` copies the layer's pages out of the cache first,
    which makes any call after a cached prefix cost far more than a plain prefill,
    whatever its length.
    """
    seq, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = k_cache.shape
    chunks = -(-block_table.shape[0] // KEY_BLOCKS)
    table = jnp.pad(  # whole chunks; the sentinel is read clipped, and masked
        block_table, (0, chunks * KEY_BLOCKS - block_table.shape[0]), constant_values=num_blocks
    )
    rows = _by_kv_head(q, kv_heads)  # [kvh, group * T, d]
    query_positions = jnp.tile(positions, heads // kv_heads)  # [group * T]
    width = KEY_BLOCKS * block_size

    def gathered(cache: jax.Array, blocks: jax.Array) -> jax.Array:
        """The chunk's keys or values, [kvh, width, d] (a block's rows gathered whole)."""
        chunk = layer_rows(cache, layer, blocks)
        return jnp.transpose(chunk.reshape(width, kv_heads, head_dim), (1, 0, 2))

    def chunk(c, carry):
        most, total, out = carry  # [kvh, group * T] (x2), [kvh, group * T, d]
        blocks = jax.lax.dynamic_slice_in_dim(table, c * KEY_BLOCKS, KEY_BLOCKS)
        scores = einsum_f32("kmd,ktd->kmt", rows, gathered(k_cache, blocks))
        key_positions = c * width + jnp.arange(width)
        visible = key_positions[None, :] <= query_positions[:, None]
        scores = jnp.where(visible[None], scores, -jnp.inf)
        # Chunk 0 holds key 0, which every query sees: `most` is finite from then on.
        new_most = jnp.maximum(most, jnp.max(scores, axis=-1))
        weights = jnp.exp(scores - new_most[..., None])
        kept = jnp.exp(most - new_most)
        values = gathered(v_cache, blocks).astype(jnp.float32)
        out = out * kept[..., None] + jnp.einsum("kmt,ktd->kmd", weights, values)
        return new_most, total * kept + jnp.sum(weights, axis=-1), out

    reached = jnp.minimum(jnp.max(positions) // width + 1, chunks)
    most, total, out = jax.lax.fori_loop(
        0,
        reached,
        chunk,
        (
            jnp.full(rows.shape[:2], -jnp.inf, jnp.float32),
            jnp.zeros(rows.shape[:2], jnp.float32),
            jnp.zeros(rows.shape, jnp.float32),
        ),
    )
    return _by_query(out / total[..., None], seq).astype(q.dtype)


def write_kv(
    pages: jax.Array, layer: jax.Array, blocks: jax.Array, offsets: jax.Array, new: jax.Array
) -> jax.Array:
    """pages[layer, blocks[i], offsets[i]] = new[i]; a block index out of range is dropped.

    pages: [layers, num_blocks, block_size, kv_heads, head_dim]; blocks, offsets: i32[N];
    new: [N, kv_heads, head_dim].
    """
    return pages.at[layer, blocks, offsets].set(new.astype(pages.dtype), mode="drop")
