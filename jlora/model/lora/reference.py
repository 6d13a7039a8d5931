"""The reference backend: plain jnp on Punica's stacked layout, every slot padded.

    weights[target] = {"a": [L, N, in, R], "b": [L, N, R, out],
                       "rank": i32[N] (0: the slot's adapter does not adapt target)}

An adapter crosses the host-to-device link rank-exact (base.py); `install` pads it
into its slot on the device.

Padding is exact: padded columns of x @ A are zeros, and the matching rows of B are
zeros, so they add nothing. A decode step's LoRA takes one of two forms, chosen by its
row bucket and the slot count (both static, so each compiled step holds one form;
`ReferenceBackend.over_slots`): a per-row gather of each row's slot (cost ∝ rows ×
max_rank, like BGMV, but the gather copies each row's factors first), or one product
over every slot, each row's other slots zeroed between the two halves (it reads each
slot once, in place; cost ∝ rows × slots × max_rank in flops). Where the slots are
many (adapters in the pool's pages), the product may run over the batch's own adapters
instead, when they are at most `batch_slots` (decided at run time, else the gather).
On one CPU device the pooled form's products are served by host kernels instead
(`jlora.model.host.backend.HostPooledBackend`). A prefill's LoRA costs
∝ rows × max_rank times the segments that have an adapter (each is a masked product
over every row, or over its `Segments.window` rows where the segments are bounded: a
packed prefill's, whose LoRA then costs about its prompt rows' worth, not the
segments' times the call's). When no row's adapter adapts a target (no row has an
adapter, or theirs leave that projection alone), a `lax.cond` skips that target's LoRA
work entirely: slots hold every target the engine serves (EngineConfig.lora_targets),
and q/v adapters in all-seven slots then cost what their two targets do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jlora.model.dots import einsum_f32
from jlora.model.kv_cache import layer_rows
from jlora.model.lora.base import (
    POOL,
    KVPagesBackend,
    LoraWeights,
    StackedSlotsBackend,
    rank_bucket,
)


def _masked(xa: jax.Array, live: jax.Array | None) -> jax.Array:
    """xa with the columns `live` leaves out zeroed (no mask: xa)."""
    return xa if live is None else jnp.where(live, xa, jnp.zeros((), xa.dtype))


def _add_where(adapted: jax.Array, y: jax.Array, delta: jax.Array) -> jax.Array:
    """y + delta (in fp32, rounded once) on adapted rows; other rows keep y's bits."""
    return jnp.where(adapted[:, None], (y.astype(jnp.float32) + delta).astype(y.dtype), y)


def _adapting(ranks: jax.Array, slots: jax.Array) -> jax.Array:
    """Which of `slots` (-1: none) hold an adapter of this target (rank > 0): bool[...]"""
    return (slots >= 0) & (ranks[jnp.maximum(slots, 0)] > 0)


def unless_none(adapting: jax.Array, compute, y: jax.Array) -> jax.Array:
    """compute() if any row's (or segment's) adapter adapts the target, else y: a batch
    of base-model rows, or of adapters that leave this projection alone, skips its LoRA
    work (and reads no adapter weights) at run time."""
    return jax.lax.cond(jnp.any(adapting), compute, lambda: y)


DECODE_FORMS = ("auto", "gather", "over-slots")  # ReferenceBackend.decode_form's values


class ReferenceBackend(StackedSlotsBackend):
    """Plain jnp: a per-row gather or a product over every slot for decode, one masked
    product per segment for prefill."""

    name = "reference"
    # A segment costs reading its adapter (2.6 MB a SmolLM2 layer at rank 64 on every
    # target) plus its window's products, which grow with its rows: at about 32 rows the
    # two take as long as each other.
    segment_rows = 32
    # Decode's form: "auto" (`over_slots` decides), "gather" or "over-slots" (forced: the
    # benchmark's, bench.lora_decode --reference-forms).
    decode_form = "auto"
    # Where there are many slots (adapters in the pool's pages: a slot per page), "auto"
    # may still take the product over the batch's own adapters when they are at most
    # this many (0: never); the engine sets it to max_loras.
    batch_slots = 0
    a_axis = 2  # A [in, R] as stored (StackedSlotsBackend)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        return weights[target]["a"][layer, slots], weights[target]["b"][layer, slots]

    # The products' reading of the factors (`_stored`): A's dims as held ([in, rank]).
    a_dims = "ir"

    def _stored(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        """The factors of `slots` (i32[...] >= 0) as the products read them: A as
        `a_dims` says, B [..., R, out]; rank rows past an adapter's rank are zeros, or
        hold finite values that `_live` masks."""
        return self.factors(weights, target, layer, slots)

    def _every_slot(self, weights, target, layer) -> tuple[jax.Array, jax.Array]:
        """`_stored` of every slot, in slot order (read in place where the layout can)."""
        return weights[target]["a"][layer], weights[target]["b"][layer]

    def _live(self, weights, target, slots) -> jax.Array | None:
        """bool[..., R]: the rank rows of `slots`' adapters that `_stored` may hold
        other values past (None: none do, the rows past a rank are zeros)."""
        return None

    def _shrink_rows(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """x[s] @ A[s] for each row s (a: `_stored`'s, per row), in fp32."""
        return einsum_f32("si,sir->sr", x, a)

    def _expand_rows(self, xa: jax.Array, b: jax.Array) -> jax.Array:
        """xa[s] @ B[s] for each row s (b: `_stored`'s, per row), in fp32."""
        return einsum_f32("sr,sro->so", xa, b)

    def _per_segment(self, weights, target, layer, slots):
        """g -> `_stored` of segment g's adapter (one slot), for the segments' loop."""
        return lambda g: self._stored(weights, target, layer, jnp.maximum(slots[g], 0)[None])

    def num_slots(self, weights: LoraWeights, target: str) -> int:
        return weights[target]["rank"].shape[0]

    def over_slots(self, rows: int, slots: int) -> bool:
        """Whether a decode of `rows` rows over `slots` slots takes the product over every
        slot rather than the per-row gather. On XLA:CPU the gather's copy costs the
        same per row and rank unit whatever the slots, and the product's cost per row,
        slot and rank unit is an eighth to a twentieth of that, the smaller the more
        rows (its GEMMs grow more efficient with rows): the product wins while
        2 × slots < rows + 8, a rule fitted on SmolLM2's seven targets at 8-32 rows."""
        if self.decode_form != "auto":
            return self.decode_form == "over-slots"
        return 2 * slots < rows + 8

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        adapting = _adapting(weights[target]["rank"], idx)
        slots = self.num_slots(weights, target)

        def gathered() -> jax.Array:
            safe = jnp.maximum(idx, 0)
            a, b = self._stored(weights, target, layer, safe)
            xa = _masked(self._shrink_rows(x, a).astype(x.dtype), self._live(weights, target, safe))
            return _add_where(adapting, y, self._expand_rows(xa, b))

        def over(ids: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
            """The product over slots `ids` (i32[K]; `slots` for none) whose factors are
            a and b, each row's other slots zeroed between the two halves."""
            xa = einsum_f32(f"si,n{self.a_dims}->snr", x, a).astype(x.dtype)  # every slot
            mine = idx[:, None] == ids[None, :]  # [S, K]: the row's own
            live = self._live(weights, target, jnp.minimum(ids, slots - 1))  # [K, R] or None
            mine = mine[:, :, None] if live is None else mine[:, :, None] & live[None]
            xa = jnp.where(mine, xa, jnp.zeros((), x.dtype))
            return _add_where(adapting, y, einsum_f32("snr,nro->so", xa, b))

        def through_every_slot() -> jax.Array:
            return over(jnp.arange(slots), *self._every_slot(weights, target, layer))

        def through_the_batchs_slots() -> jax.Array:
            """`over` the batch's own slots where they are at most k = batch_slots (a
            static bound), else `gathered`."""
            k = self.batch_slots
            # Sorted: the batch's distinct slots, then `slots` (base rows, the fill); so
            # the (k+1)-th is `slots` exactly when there are at most k of them.
            distinct = jnp.unique(jnp.where(idx >= 0, idx, slots), size=k + 1, fill_value=slots)
            ids = distinct[:k]

            def product() -> jax.Array:
                return over(ids, *self._stored(weights, target, layer, jnp.minimum(ids, slots - 1)))

            return jax.lax.cond(distinct[k] == slots, product, gathered)

        rows = x.shape[0]
        if self.over_slots(rows, slots):
            compute = through_every_slot
        elif 0 < self.batch_slots < slots and self.over_slots(rows, self.batch_slots):
            compute = through_the_batchs_slots
        else:
            compute = gathered
        return unless_none(adapting, compute, y)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        rows = jnp.arange(x.shape[0])
        slots, starts = jnp.asarray(segments.slot), jnp.asarray(segments.start)
        adapting = _adapting(weights[target]["rank"], slots)  # [G]
        window = min(segments.window or x.shape[0], x.shape[0])
        factors_of = self._per_segment(weights, target, layer, slots)

        def segment(g, carry):
            """Segment g's delta over the `window` rows from its start (every row when
            unbounded), the rest of the window left as it was."""
            delta, adapted = carry
            slot = jnp.maximum(slots[g], 0)[None]
            a, b = factors_of(g)
            low = jnp.clip(starts[g], 0, x.shape[0] - window)
            xs = jax.lax.dynamic_slice_in_dim(x, low, window)
            xa = einsum_f32(f"ti,{self.a_dims}->tr", xs, a[0]).astype(x.dtype)
            live = self._live(weights, target, slot)
            part = einsum_f32("tr,ro->to", _masked(xa, None if live is None else live[0]), b[0])
            seen = low + rows[:window]
            inside = (seen >= starts[g]) & (seen < starts[g + 1]) & adapting[g]
            old = jax.lax.dynamic_slice_in_dim(delta, low, window)
            was = jax.lax.dynamic_slice_in_dim(adapted, low, window)
            delta = jax.lax.dynamic_update_slice_in_dim(
                delta, jnp.where(inside[:, None], part, old), low, 0
            )
            return delta, jax.lax.dynamic_update_slice_in_dim(adapted, was | inside, low, 0)

        def skipping(g, carry):
            """`segment`, at no cost for an empty or base-model segment or one whose
            adapter leaves the target alone."""
            rows_there = (starts[g + 1] > starts[g]) & (starts[g] < x.shape[0])
            return jax.lax.cond(rows_there & adapting[g], lambda: segment(g, carry), lambda: carry)

        def compute() -> jax.Array:
            carry = (jnp.zeros(y.shape, jnp.float32), jnp.zeros(x.shape[0], bool))
            if slots.shape[0] == 1:  # one prompt's prefill
                delta, adapted = segment(0, carry)
            else:  # a loop: the compiled step does not grow with the segments; it stops
                # after the last segment with rows (a packed prefill's empty ones, which
                # pad it to its segment count, come last)
                used = jnp.max(
                    jnp.where(starts[1:] > starts[:-1], jnp.arange(1, len(slots) + 1), 0)
                )
                delta, adapted = jax.lax.fori_loop(0, used, skipping, carry)
            return _add_where(adapted, y, delta)

        return unless_none(adapting, compute, y)


class PooledReferenceBackend(KVPagesBackend, ReferenceBackend):
    """The reference backend over adapters that live in the KV cache's own pages.

    FastLibra §4.3 ("Unified Caching Pool for LoRAs and KVs"): one pool of pages holds
    both, so device memory goes to KV or to adapters as the load asks (base.py,
    `KVPagesBackend`). An adapter takes, per target it adapts, the pages its rank rows
    fill: Q rows (its rank bucket, `rank_bucket`, as they cross the link) of
    A^T [Q, in] laid out across the pages' key halves in order, and of B [Q, out] across
    their value halves, at every layer (so a read gathers each factor from one array, and
    copies nothing more). So a rank-8 adapter takes about half the pages of a rank-16
    one, and the number resident follows from their ranks (`pool_pages`), not from a
    slot count.

        weights[target] = {"pages": i32[N, M] (the slot's pages, M for the slots' rank
                                       R; past the adapter's own, repeats of its first),
                           "rank": i32[N] (0: the slot's adapter leaves target alone)}
        weights[POOL] = {"k": cache.k, "v": cache.v} (`with_pool`, at each use)

    Reading a slot gathers the key halves of its first pages at the layer for A^T [R, in]
    and the value halves for B [R, out]. A slot's table lists its adapter's own pages
    alone (past them, its first again), which its install wrote whole (zeros past its
    rows): the rank rows read past the adapter's rank hold finite values, and the
    products zero their columns of x @ A (`_live`). The arithmetic is the reference
    backend's.
    One device only: on a tensor-parallel mesh a page's values are split over the
    devices by KV head, which a rank row does not follow (the engine keeps stacked
    slots there; the pool is then a ledger for adapters).
    """

    a_dims = "ri"  # A^T, rank rows

    def __init__(self, page_width: int) -> None:
        super().__init__(page_width)
        self._rows = 0  # the slots' rank R (`allocate`)

    def pages_for(self, rows: int, shape: tuple[int, int]) -> int:
        """Pages `rows` rank rows of a target of (in, out) features fill: A^T's in their
        key halves, B's in their value halves."""
        return max(self._halves(rows, width) for width in shape)

    def _halves(self, rows: int, width: int) -> int:
        return math.ceil(rows * width / (self.page_width // 2))

    def target_pages(self, rank: int, target: str) -> int:
        return self.pages_for(rank_bucket(rank, self._rows), self._shapes[target])

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        assert rank_shards == 1, "a pooled backend runs on one device"
        self._rows, self._shapes = self.rank_dim(max_rank), dict(shapes)
        return {
            target: {
                "pages": jnp.zeros((num_slots, self.pages_for(self._rows, shape)), jnp.int32),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, shape in shapes.items()
        }

    def _dest(self, target, pages, rank, packed):
        """The pages themselves: the rows fill them in order."""
        return pages

    def _write(self, cache, target, layer_start, packed, width):
        """A^T's rows across the pages' key halves in order, B's across their value
        halves (zeros past the last row); the table: the pages, then the first again."""
        dest = jnp.asarray(packed["dest"])
        where = (layer_start + jnp.arange(packed["a"].shape[0])[:, None], dest[None, :])
        written = {
            half: cache[half].at[where].set(self._paged(packed[part], cache[half], len(dest)))
            for half, part in (("k", "a"), ("v", "b"))
        }
        table = jnp.concatenate([dest, jnp.full(width - dest.shape[0], dest[0], jnp.int32)])
        return written, table

    def _paged(self, rows: jax.Array, half: jax.Array, count: int) -> jax.Array:
        """[G, Q, width] rank rows -> [G, count, *block] as `count` pages' halves of the
        cache's `half` array hold them, zeros past the last row."""
        layers, flat = rows.shape[0], rows.astype(half.dtype).reshape(rows.shape[0], -1)
        flat = jnp.pad(flat, ((0, 0), (0, count * self.page_width // 2 - flat.shape[1])))
        return flat.reshape(layers, count, *half.shape[2:])

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        a, b = self._stored(weights, target, layer, slots)
        live = self._live(weights, target, slots)[..., None]
        zero = jnp.zeros((), a.dtype)
        return jnp.swapaxes(jnp.where(live, a, zero), -1, -2), jnp.where(live, b, zero)

    def _stored(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        """A^T [..., R, in] and B [..., R, out] from the slots' pages, unmasked: each
        factor one gather at (layer, page) (never the layer's whole slice of the cache).
        A slot's table holds its adapter's own pages alone, which its install wrote
        whole (zeros past its rows), so rows past its rank hold finite values."""
        w, pool = weights[target], weights[POOL]
        fan_in, fan_out = self._shapes[target]
        table = w["pages"][slots]  # [..., M]

        def rows(half: jax.Array, width: int) -> jax.Array:
            pages = layer_rows(half, layer, table[..., : self._halves(self._rows, width)])
            flat = pages.reshape(*table.shape[:-1], -1)[..., : self._rows * width]
            return flat.reshape(*table.shape[:-1], self._rows, width)

        return rows(pool["k"], fan_in), rows(pool["v"], fan_out)

    def _every_slot(self, weights, target, layer) -> tuple[jax.Array, jax.Array]:
        return self._stored(weights, target, layer, jnp.arange(self.num_slots(weights, target)))

    def _per_segment(self, weights, target, layer, slots):
        """Every segment's factors gathered before the loop: a read of the cache inside
        a loop makes XLA copy the whole cache (the loop holds its operands)."""
        a, b = self._stored(weights, target, layer, jnp.maximum(slots, 0))
        return lambda g: (a[g][None], b[g][None])

    def _live(self, weights, target, slots) -> jax.Array:
        return jnp.arange(self._rows) < weights[target]["rank"][slots][..., None]

    # Each row's two products as a product and a sum, which XLA:CPU fuses with the
    # gather of the pages: its batched dots over gathered pages take longer, 1.2x for
    # x @ A^T and 2.2x for xa @ B (16 rows of rank 16).
    def _shrink_rows(self, x: jax.Array, a: jax.Array) -> jax.Array:
        return jnp.sum(x.astype(jnp.float32)[:, None, :] * a.astype(jnp.float32), axis=-1)

    def _expand_rows(self, xa: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(xa.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32), axis=1)
