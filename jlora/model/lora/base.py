"""Batched LoRA: the interface the model calls, and the types that cross it.

For each adapted projection y = x @ W of a layer, a backend adds the LoRA delta of
each row's adapter (Toppings §2.1, Eq. 1: y' = xW + xAB), with the scaling already
folded into B by the host store:

    decode  (BGMV form):  y[s] += x[s] @ A[layer, idx[s]] @ B[layer, idx[s]]
    prefill (SGMV form):  y[t] += x[t] @ A[layer, slot[g]] @ B[layer, slot[g]]
                          for the segment g with start[g] <= t < start[g + 1]

A slot index of -1 means "no adapter": that row of y is returned bit-identical.
Arithmetic, in every backend: x @ A accumulates in fp32 and is rounded to x.dtype (as
PEFT's two Linear layers do), @ B accumulates in fp32 and is added to y in fp32.

The device layout (`allocate`) is the backend's choice: stacked slots padded to a
rank (reference, BGMV), a pool of rank-row pages (MBGMV), or pages of the KV cache
itself (`pooled`: the reference backend on one device, FastLibra's unified pool). Every
backend keeps one entry per target, so a target no slot holds is absent from the
weights. A pooled backend's weights are page tables; the model hands it the KV cache
with them (`with_pool`, under the key POOL) wherever it computes or installs a LoRA.

What crosses the host-to-device link is rank-exact, in every backend: `pack` keeps
only the adapter's own targets and its rank rows (`exact_rows`: rank rounded up to a
power of two, `rank_bucket`, so that few shapes compile), and `install`, on the
device, pads them to the slots' rank and writes zeros for the targets the adapter
does not adapt.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jlora.model.dots import einsum_f32

LoraWeights = dict[str, dict[str, jax.Array]]  # target -> device arrays, layout by backend
HostTensors = dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L,in,r], B [L,r,out])
Packed = dict[str, dict[str, Any]]  # one adapter, packed for `install` (numpy or device)
# The parts of a payload that hold one entry per layer (leading axis); every other part
# (ranks, page tables) describes the whole slot.
LAYER_PARTS = ("a", "b")
POOL = "pool"  # a pooled backend's weights: the KV cache's {"k", "v"} under this key


@struct.dataclass
class Segments:
    """Prefill rows grouped by adapter (the SGMV form).

    slot: i32[G], the device slot of each segment's adapter (-1: no adapter).
    start: i32[G + 1], non-decreasing row offsets; segment g is rows
      start[g]:start[g + 1]; rows at or after start[G] have no adapter.
    window: (static) no segment has more rows than this (None: no bound), so a
      backend may compute each segment over a window of this many rows from its start
      instead of over every row (a packed prefill's segments hold short prompts).
    """

    slot: jax.Array | np.ndarray
    start: jax.Array | np.ndarray
    window: int | None = struct.field(pytree_node=False, default=None)

    @staticmethod
    def single(slot: int, rows: int) -> Segments:
        """One segment covering `rows` rows (host-side numpy, ready to pass to a step)."""
        return Segments(slot=np.array([slot], np.int32), start=np.array([0, rows], np.int32))


class LoraBackend(abc.ABC):
    """How adapters sit in device memory and how the batched delta is added.

    `layout` names the dims of each part of the slots, and `payload_layout` those of
    each part of a packed adapter, for the sharding rules (jlora/model/sharding.py):
    "layers", "slot", "page", "index" (never split), "rank", and "in" / "out" (the
    base projection's input and output dims).
    """

    name: str
    layout: dict[str, tuple[str, ...]]
    payload_layout: dict[str, tuple[str, ...]]
    # The most rows a packed prefill's LoRA segment should hold (`Segments.window`), for
    # a backend whose SGMV costs a segment's window, not its rows; None: no bound.
    segment_rows: int | None = None
    # Whether the adapters live in the KV cache's pages (`with_pool`).
    pooled = False

    def with_pool(self, weights: LoraWeights, pool: Any) -> LoraWeights:
        """The weights a step or an install takes, given the KV cache `pool` (a
        `KVCache`): a pooled backend's carry the cache's arrays under POOL; every other
        backend's are the weights alone."""
        return weights

    def rank_dim(self, max_rank: int, shards: int = 1) -> int:
        """The slots' rank dimension for adapters of rank <= max_rank, split over
        `shards` devices (fully-sharded splits A on its rank): a multiple of `shards`,
        each device's part as the backend needs it. Rows past a rank are zeros."""
        return shards * math.ceil(max_rank / shards)

    @abc.abstractmethod
    def allocate(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        dtype: Any,
        rank_shards: int = 1,
    ) -> LoraWeights:
        """Zeroed device slots for `num_slots` adapters of rank <= max_rank.

        shapes: target -> (in_features, out_features), the targets the slots hold.
        rank_shards: the devices a "rank" dim of the layout is split over (`rank_dim`).
        """

    @abc.abstractmethod
    def pack(
        self,
        tensors: HostTensors,
        *,
        slot: int | None,
        shapes: dict[str, tuple[int, int]],
        max_rank: int,
        dtype: Any,
        rank_shards: int = 1,
        pages: Sequence[int] | None = None,
    ) -> Packed:
        """One adapter's host tensors as they cross the link to `slot` (numpy, `dtype`).

        Rank-exact: per target of `shapes` that the adapter adapts, A's and B's rank
        rows (`exact_factors`, over `rank_dim(max_rank, rank_shards)` rows, split in
        `rank_shards`), plus the backend's few per-slot values; nothing for the other
        targets. slot None: a stand-in of the right shapes, for compiling
        `install` (no slot state, such as pages, is touched). pages: a pooled backend's
        pool pages for the adapter (`pool_pages` of them; None with slot None).
        Called on the transfer thread, one adapter at a time (and, with slot None, on
        any thread).
        """

    @abc.abstractmethod
    def install(
        self, weights: LoraWeights, slot: jax.Array, layer_start: jax.Array, payload: Packed
    ) -> LoraWeights:
        """Write a packed adapter's layers into slot `slot`, from layer `layer_start` on.

        payload may hold all layers or a layer group (`layer_group`): its per-layer
        parts have G <= L entries, written to layers [layer_start, layer_start + G).
        The padding happens here: rank rows past the payload's are zeros, and so is
        every target of `weights` the payload lacks (rank 0). A pooled backend's
        `weights` carry the KV cache (`with_pool`), which it writes the adapter into and
        returns with them. Traceable; jit it with donation (one compiled variant per
        payload shape).
        """

    @abc.abstractmethod
    def bgmv(
        self,
        weights: LoraWeights,
        target: str,
        layer: jax.Array,
        x: jax.Array,
        y: jax.Array,
        idx: jax.Array,
    ) -> jax.Array:
        """Decode form. x: [S, in]; y: [S, out]; idx: i32[S] (-1: no adapter) -> y'."""

    @abc.abstractmethod
    def sgmv(
        self,
        weights: LoraWeights,
        target: str,
        layer: jax.Array,
        x: jax.Array,
        y: jax.Array,
        segments: Segments,
    ) -> jax.Array:
        """Prefill form. x: [T, in]; y: [T, out]; segments as in `Segments` -> y'."""

    # -- the two halves, for a LoRA split across devices (fully-sharded) ------------

    @abc.abstractmethod
    def factors(
        self, weights: LoraWeights, target: str, layer: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """The adapters of `slots` (i32[S], >= 0) at `layer`, as plain factors:
        A [S, in, R] and B [S, R, out] (this device's part of each), rank rows past an
        adapter's rank zero."""

    def shrink(
        self,
        weights: LoraWeights,
        target: str,
        layer: jax.Array,
        x: jax.Array,
        rows: Rows,
        rank_part: jax.Array | None = None,
    ) -> jax.Array:
        """Semantics: xa[t] = x[t] @ A[slot(t)] in fp32, zero where a row has no adapter.

        rows: i32[T] slots per row (decode) or `Segments` (prefill). Returns f32[T, R].
        rank_part: where this device holds only part k of A's rank rows (R of them:
        rows [k R, (k + 1) R) of each adapter), k. With `expand`, the BGMV/SGMV product
        in two halves, so a collective can run between them. This default is plain jnp
        over gathered factors (whose rank rows past a rank are zeros, so it needs no k);
        the Pallas backends run their kernels' halves.
        """
        return self._per_adapter(weights, target, layer, rows, x, 0)[0]

    def expand(
        self,
        weights: LoraWeights,
        target: str,
        layer: jax.Array,
        xa: jax.Array,
        y: jax.Array,
        rows: Rows,
    ) -> jax.Array:
        """Semantics: y[t] += xa[t] @ B[slot(t)] in fp32, rounded to y.dtype once; rows
        without an adapter keep y's bits. xa: [T, R] in y's dtype (the caller rounds
        `shrink`'s)."""
        delta, adapted = self._per_adapter(weights, target, layer, rows, xa, 1)
        return jnp.where(adapted[:, None], (y.astype(jnp.float32) + delta).astype(y.dtype), y)

    def _per_adapter(
        self, weights: LoraWeights, target: str, layer: jax.Array, rows: Rows, lhs, which: int
    ) -> tuple[jax.Array, jax.Array]:
        """lhs @ (A, B)[which] of each row's adapter; rows without one are zero."""
        if not isinstance(rows, Segments):  # decode: a gathered factor per row
            factor = self.factors(weights, target, layer, jnp.maximum(rows, 0))[which]
            product = einsum_f32("tk,tkn->tn", lhs, factor)
            return jnp.where((rows >= 0)[:, None], product, 0.0), rows >= 0
        index = jnp.arange(lhs.shape[0])
        slots, starts = jnp.asarray(rows.slot), jnp.asarray(rows.start)

        def factor_of(slot: jax.Array) -> jax.Array:
            return self.factors(weights, target, layer, jnp.maximum(slot, 0)[None])[which][0]

        def segment(g, carry):  # prefill: one factor per segment
            out, adapted = carry
            part = einsum_f32("tk,kn->tn", lhs, factor_of(slots[g]))
            inside = (index >= starts[g]) & (index < starts[g + 1]) & (slots[g] >= 0)
            return jnp.where(inside[:, None], part, out), adapted | inside

        def skipping(g, carry):  # an empty or base-model segment costs nothing
            inside = (index >= starts[g]) & (index < starts[g + 1]) & (slots[g] >= 0)
            return jax.lax.cond(jnp.any(inside), lambda: segment(g, carry), lambda: carry)

        width = jax.eval_shape(factor_of, jnp.int32(0)).shape[-1]
        carry = (jnp.zeros((lhs.shape[0], width), jnp.float32), jnp.zeros(lhs.shape[0], bool))
        if slots.shape[0] == 1:  # one prompt's prefill
            return segment(0, carry)
        return jax.lax.fori_loop(0, slots.shape[0], skipping, carry)  # a packed prefill's


Rows = jax.Array | Segments  # the rows' adapters: i32[T] slots (decode) or segments (prefill)


class StackedSlotsBackend(LoraBackend):
    """Punica's stacked layout, which the reference and BGMV backends share: every slot
    holds R = rank_dim(max_rank) rank rows of each target (zeros past its adapter's
    rank), the slots of a layer side by side.

        weights[target] = {"a": [L, N, R, in] (A^T's rank rows; `a_axis` 1) or
                                [L, N, in, R] (A as stored; `a_axis` 2),
                           "b": [L, N, R, out],
                           "rank": i32[N] (0: the slot's adapter does not adapt target)}

    A packed adapter holds its own rank rows alone (`exact_factors`: A's rank on
    `a_axis`); `install` pads them to R on the device (`padded_factors`).
    """

    a_axis: int  # where A's rank dim sits in a payload's [L, ., .] (a slot's, one further)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "a_axis" in cls.__dict__:  # the layouts follow from it
            a = ("rank", "in") if cls.a_axis == 1 else ("in", "rank")
            cls.layout = {
                "a": ("layers", "slot", *a),
                "b": ("layers", "slot", "rank", "out"),
                "rank": ("slot",),
            }
            cls.payload_layout = {"a": ("layers", *a), "b": ("layers", "rank", "out"), "rank": ()}

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        rdim = self.rank_dim(max_rank, rank_shards)

        def a_shape(fan_in: int) -> tuple[int, int]:
            return (rdim, fan_in) if self.a_axis == 1 else (fan_in, rdim)

        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, *a_shape(fan_in)), dtype),
                "b": jnp.zeros((num_layers, num_slots, rdim, fan_out), dtype),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1, pages=None) -> Packed:
        """`exact_factors`, and each target's "rank": i32."""
        rdim = self.rank_dim(max_rank, rank_shards)
        payload = exact_factors(tensors, shapes, rdim, rank_shards, dtype, a_axis=self.a_axis)
        for target, packed in payload.items():
            packed["rank"] = np.int32(tensors[target][0].shape[-1])
        return payload

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        padded: Packed = {}
        for target, w in weights.items():
            rdim, fan_in = w["b"].shape[2], w["a"].shape[3 if self.a_axis == 1 else 2]
            widths = (fan_in, w["b"].shape[-1])
            a, b = padded_factors(payload, target, rdim, widths, w["a"].dtype, self.a_axis)
            rank = payload[target]["rank"] if target in payload else np.int32(0)
            padded[target] = {"a": a, "b": b, "rank": rank}
        return set_slot(weights, slot, layer_start, padded)


class KVPagesBackend(LoraBackend):
    """What a backend whose adapters live in the KV cache's own pages shares (FastLibra
    §4.3, the unified pool; one device): a page is a KV block of every layer, holding
    `page_width` values at each layer, half in the keys' array and half in the values';
    an adapter takes, per target it adapts, the pages its rank rows fill
    (`target_pages`), dealt out target by target from those the memory manager reserved
    for it (`pack`). Its weights are page tables; the cache comes with them under POOL
    (`with_pool`)."""

    pooled = True
    # A slot: a page table (a backend's own kind of entries) and the adapter's rank per
    # target; a payload: A^T's and B's rank rows, where they go ("dest"), and the rank.
    layout = {"pages": ("slot", "index"), "rank": ("slot",)}
    payload_layout = {
        "a": ("layers", "rank", "in"),
        "b": ("layers", "rank", "out"),
        "dest": ("index",),
        "rank": (),
    }

    def __init__(self, page_width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.page_width = page_width
        self._shapes: dict[str, tuple[int, int]] = {}  # target -> (in, out), at `allocate`

    def with_pool(self, weights: LoraWeights, pool: Any) -> LoraWeights:
        return {**weights, POOL: {"k": pool.k, "v": pool.v}}

    @abc.abstractmethod
    def target_pages(self, rank: int, target: str) -> int:
        """The pages an adapter of `rank` takes for `target` (one of the slots')."""

    def pool_pages(self, rank: int, targets: Sequence[str]) -> int:
        """The pages an adapter of `rank` on `targets` takes (those the slots hold)."""
        return sum(self.target_pages(rank, t) for t in targets if t in self._shapes)

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        """Writes each target's rank rows into the adapter's pages of the cache
        (`_write`) and its page table and rank into slot `slot`; a target the payload
        lacks gets rank 0."""
        cache, out = weights[POOL], {}
        for target, w in weights.items():
            if target == POOL:
                continue
            width = w["pages"].shape[1]
            if target in payload:
                cache, table = self._write(cache, target, layer_start, payload[target], width)
                rank = payload[target]["rank"]
            else:
                table, rank = jnp.zeros(width, jnp.int32), 0
            out[target] = {
                "pages": w["pages"].at[slot].set(table),
                "rank": w["rank"].at[slot].set(rank),
            }
        return {**out, POOL: cache}

    @abc.abstractmethod
    def _write(
        self,
        cache: dict[str, jax.Array],
        target: str,
        layer_start: jax.Array,
        packed: dict[str, Any],
        width: int,
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """One target's packed rank rows (layers from `layer_start` on) written into the
        cache ({"k", "v"}): the cache, and the slot's page table row (`width` entries)."""

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1, pages=None):
        """{"a": A^T [L, Q, in], "b": [L, Q, out], "dest": where its rows go (`_dest`),
        "rank": i32} per target the adapter adapts; its `pages` dealt out target by
        target, in order (None: a stand-in's, 0, 1, ...)."""
        payload = exact_factors(tensors, shapes, self.rank_dim(max_rank), 1, dtype, a_axis=1)
        taken = 0
        for target, packed in payload.items():
            rank = tensors[target][0].shape[-1]
            count = self.target_pages(rank, target)
            share = range(taken, taken + count) if pages is None else pages[taken : taken + count]
            if len(share) < count:
                raise ValueError(f"{len(pages or ())} pool pages for an adapter that fills more")
            packed["dest"] = self._dest(target, np.asarray(share, np.int32), rank, packed)
            packed["rank"] = np.int32(rank)
            taken += count
        return payload

    @abc.abstractmethod
    def _dest(self, target: str, pages: np.ndarray, rank: int, packed: dict[str, Any]) -> Any:
        """Where `target`'s packed rows go, given its share of the adapter's pages (the
        payload's "dest", which `_write` reads)."""


def rank_bucket(rank: int, rows: int) -> int:
    """The rank rows an adapter of rank `rank` sends for `rows` rows of a slot: the next
    power of two (1, 2, 4, ...), at most `rows`."""
    return min(rows, 1 << max(rank - 1, 0).bit_length())


def exact_rows(factor: np.ndarray, rows: int, shards: int, dtype: Any, axis: int = 1) -> np.ndarray:
    """A factor's rank rows as they cross the link: its rank `axis` (r long; 1 for
    [L, r, width]) cut to Q, zero past r, for slots of `rows` rank rows. Q =
    rank_bucket(r, rows) rounded up to a multiple of `shards`, the devices the payload's
    rank rows are split over (the slots' too, fully-sharded A; 1 elsewhere), so each
    receives Q / shards of them."""
    rank = factor.shape[axis]
    shape = list(factor.shape)
    shape[axis] = shards * math.ceil(rank_bucket(rank, rows) / shards)
    out = np.zeros(shape, dtype)
    np.moveaxis(out, axis, 0)[:rank] = np.moveaxis(factor, axis, 0)
    return out


def padded_rows(exact: jax.Array, rows: int, axis: int = 1) -> jax.Array:
    """On the device, `exact_rows` padded with zero rows to the slots' rank: [G, Q, width]
    -> [G, rows, width] (rank `axis`). Where both are split over devices, the real rows
    move to the device whose part of the slot holds them (a collective between devices,
    never the host link)."""
    padding = [(0, 0)] * exact.ndim
    padding[axis] = (0, rows - exact.shape[axis])
    return jnp.pad(exact, padding)


def layer_group(payload: Packed, start: int, stop: int) -> Packed:
    """The layers [start, stop) of a packed adapter (the per-slot parts whole)."""
    return {
        target: {
            part: value[start:stop] if part in LAYER_PARTS else value
            for part, value in parts.items()
        }
        for target, parts in payload.items()
    }


def exact_factors(
    tensors: HostTensors,
    shapes: dict[str, tuple[int, int]],
    rows: int,
    shards: int,
    dtype: Any,
    a_axis: int,
) -> Packed:
    """`pack`'s common part: per target of `shapes` that `tensors` adapts, {"a": A's rank
    rows, "b": B's [L, P, out]} (`exact_rows`; A's split over `shards` devices where the
    slots split it, B's never). a_axis: A's rank axis in the payload, 2 for A [L, in, Q]
    as stored, 1 for A^T [L, Q, in] (rank rows)."""
    return {
        target: {
            "a": exact_rows(
                np.moveaxis(tensors[target][0], 2, a_axis), rows, shards, dtype, a_axis
            ),
            "b": exact_rows(tensors[target][1], rows, 1, dtype),
        }
        for target in shapes
        if target in tensors
    }


def padded_factors(
    payload: Packed, target: str, rows: int, widths: tuple[int, int], dtype: Any, a_axis: int
) -> tuple[jax.Array, jax.Array]:
    """On the device: `target`'s A and B padded to `rows` rank rows from the payload's
    (`padded_rows`; A's rank on `a_axis`, as in `exact_factors`; B [G, rows, out]);
    zeros where the payload does not adapt `target`. widths: (in, out)."""
    if target in payload:
        a, b = payload[target]["a"], payload[target]["b"]
        return padded_rows(a, rows, a_axis), padded_rows(b, rows)
    layers, (fan_in, fan_out) = next(iter(payload.values()))["b"].shape[0], widths
    a_shape = [layers, fan_in]
    a_shape.insert(a_axis, rows)
    return jnp.zeros(a_shape, dtype), jnp.zeros((layers, rows, fan_out), dtype)


def set_slot(
    weights: LoraWeights, slot: jax.Array, layer_start: jax.Array, payload: Packed
) -> LoraWeights:
    """`install` for stacked layouts, once `payload` is padded to them: every array of
    it written into slot `slot` of its counterpart in `weights`: a per-layer part
    [G, ...] into layers [layer_start, layer_start + G) of [L, N, ...], a per-slot part
    into [N]."""

    def put(part: str, stacked: jax.Array, value: Any) -> jax.Array:
        if part not in LAYER_PARTS:
            return stacked.at[slot].set(value)
        value = jnp.asarray(value, stacked.dtype)[:, None]
        start = (layer_start, slot) + (0,) * (stacked.ndim - 2)
        return jax.lax.dynamic_update_slice(stacked, value, start)

    return {
        target: {part: put(part, array, payload[target][part]) for part, array in parts.items()}
        for target, parts in weights.items()
    }


class CpuLora(Protocol):
    """The host side of CPU-assisted LoRA: two ops of the jitted prefill that make host
    callbacks (jlora/device/cpu_assist/callbacks.py).

    For one input group of one layer: `submit` hands the real rows of the group's whole
    input x (f32[T, in], rows >= length are padding) to the CPU workers and returns a
    ticket (i32[], 0 when the adapter adapts nothing in the group); `collect` waits for
    x·A·B of every projection of the group that the device slots hold, f32[shape],
    side by side in INPUT_GROUPS order, zero where the adapter does not adapt a
    projection and on padding rows: shard `shard`'s part of them (its columns of a
    column-parallel group; for a row-parallel group the whole delta on shard 0, to be
    summed with the partial outputs, and zeros elsewhere). Every shard makes both
    calls; the workers compute once.

    Where the products cannot overlap the base projections (`overlapped` is false: they
    run on the threads that would compute those), `apply` is the pair in one callback.
    """

    overlapped: bool

    def submit(
        self, group: int, shard: jax.Array, layer: jax.Array, x: jax.Array, length: jax.Array
    ) -> jax.Array: ...

    def collect(
        self, group: int, shard: jax.Array, ticket: jax.Array, shape: tuple[int, int]
    ) -> jax.Array: ...

    def apply(
        self,
        group: int,
        shard: jax.Array,
        layer: jax.Array,
        x: jax.Array,
        length: jax.Array,
        shape: tuple[int, int],
    ) -> jax.Array: ...
