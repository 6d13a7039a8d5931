"""The Pallas backends: BGMV over stacked slots, MBGMV over a page pool.

Both prefill with SGMV, which reads a pool of rank rows through a page table; the
stacked slots of BGMV are such a pool with the trivial table (`stacked_pages`).
Kernels run compiled (Triton) on a GPU and with `interpret=True` anywhere else.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from configs import ConfigError
from jlora.adapters.backends.base import (
    LoraBackend,
    LoraWeights,
    Payload,
    Rows,
    Segments,
    exact_factors,
    padded_factors,
    set_slot,
)
from pallas_kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink
from pallas_kernels.common import is_pow2, stacked_pages
from pallas_kernels.mbgmv import mbgmv, mbgmv_expand, mbgmv_shrink
from pallas_kernels.sgmv import sgmv, sgmv_expand, sgmv_reference, sgmv_shrink

MIN_RANK_DIM = 16  # Triton's dots in SGMV need every dimension >= 16


def kernel_rank_dim(max_rank: int) -> int:
    """The kernels' rank dimension R: a power of two, at least MIN_RANK_DIM."""
    return max(MIN_RANK_DIM, 1 << (max_rank - 1).bit_length())


class _PallasBackend(LoraBackend):
    """What both share: prefill with SGMV over `_pool` (the slots as a pool of rank
    rows and its page table), and the kernels' halves for a split LoRA."""

    def __init__(self, interpret: bool | None = None) -> None:
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret

    def rank_dim(self, max_rank: int, shards: int = 1) -> int:
        """Each device's part a power of two; so is the whole, which `expand` reads
        after the all-gather: ConfigError where `shards` is not one."""
        if not is_pow2(shards):
            raise ConfigError(
                f"lora_backend={self.name!r} with fully-sharded adapters splits every "
                f"slot's rank rows over the tensor={shards} devices, and its kernels need "
                "a power-of-two rank dimension: use a power-of-two mesh, follow-base, or "
                "lora_backend 'mbgmv' or 'reference'"
            )
        return shards * kernel_rank_dim(math.ceil(max_rank / shards))

    def _pool(self, w: dict[str, jax.Array], part: str) -> tuple[jax.Array, jax.Array]:
        """A target's A or B slots (part "a" or "b") as a pool of rank rows [L, P, in or
        out] and its page table i32[N, R] (in a split LoRA, R may differ between A's
        part on this device and B)."""
        raise NotImplementedError

    def _dots_take(self, *dims: int) -> bool:
        """Whether SGMV runs at these feature sizes: compiled Triton dots need multiples
        of 16 (tiny test models compiled on a GPU fall back to jnp); interpreted, any."""
        return self.interpret or all(dim % 16 == 0 for dim in dims)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        w = weights[target]
        (a_pool, pages), (b_pool, _) = self._pool(w, "a"), self._pool(w, "b")
        args = (y, x, a_pool, b_pool, segments.slot, segments.start, pages, w["rank"], layer)
        if self._dots_take(x.shape[-1], y.shape[-1]):
            return sgmv(*args, interpret=self.interpret)
        return sgmv_reference(*args)

    def shrink(self, weights, target, layer, x, rows: Rows, rank_part=None) -> jax.Array:
        w = weights[target]
        a_pool, pages = self._pool(w, "a")
        ranks = w["rank"]
        if rank_part is not None:  # this device holds rank rows [k R, (k + 1) R) of each
            ranks = jnp.clip(ranks - rank_part * pages.shape[1], 0, pages.shape[1])
        if not isinstance(rows, Segments):
            return self._decode_shrink(w, x, rows, ranks, layer)
        if not self._dots_take(x.shape[-1]):
            return super().shrink(weights, target, layer, x, rows, rank_part)
        return sgmv_shrink(
            x, a_pool, rows.slot, rows.start, pages, ranks, layer, interpret=self.interpret
        )

    def expand(self, weights, target, layer, xa, y, rows: Rows) -> jax.Array:
        w = weights[target]
        b_pool, pages = self._pool(w, "b")
        if not isinstance(rows, Segments):
            return self._decode_expand(w, xa, y, rows, layer)
        if not self._dots_take(y.shape[-1]):
            return super().expand(weights, target, layer, xa, y, rows)
        return sgmv_expand(
            y, xa, b_pool, rows.slot, rows.start, pages, w["rank"], layer,
            interpret=self.interpret,
        )  # fmt: skip

    def _decode_shrink(self, w, x, idx, ranks, layer) -> jax.Array:
        raise NotImplementedError

    def _decode_expand(self, w, xa, y, idx, layer) -> jax.Array:
        raise NotImplementedError


class BgmvBackend(_PallasBackend):
    """Punica's layout: every slot holds R rank rows, R = rank_dim(max_rank).

        weights[target] = {"a": [L, N, R, in] (rank rows of A^T), "b": [L, N, R, out],
                           "rank": i32[N] (0: the slot's adapter does not adapt target)}

    Decode reads, for every row, the batch's largest rank (cost ∝ rows × max rank).
    """

    name = "bgmv"
    layout = {
        "a": ("layers", "slot", "rank", "in"),
        "b": ("layers", "slot", "rank", "out"),
        "rank": ("slot",),
    }
    payload_layout = {"a": ("layers", "rank", "in"), "b": ("layers", "rank", "out"), "rank": ()}

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        rdim = self.rank_dim(max_rank, rank_shards)
        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, rdim, fan_in), dtype),
                "b": jnp.zeros((num_layers, num_slots, rdim, fan_out), dtype),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1, pages=None) -> Payload:
        """`exact_factors`, and each target's "rank": i32."""
        rdim = self.rank_dim(max_rank, rank_shards)
        payload = exact_factors(tensors, shapes, rdim, rank_shards, dtype, a_axis=1)
        for target, packed in payload.items():
            packed["rank"] = np.int32(tensors[target][0].shape[-1])
        return payload

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        padded: Payload = {}
        for target, w in weights.items():
            _, _, rdim, fan_in = w["a"].shape
            widths = (fan_in, w["b"].shape[-1])
            a, b = padded_factors(payload, target, rdim, widths, w["a"].dtype, a_axis=1)
            rank = payload[target]["rank"] if target in payload else np.int32(0)
            padded[target] = {"a": a, "b": b, "rank": rank}
        return set_slot(weights, slot, layer_start, padded)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        w = weights[target]
        return jnp.swapaxes(w["a"][layer, slots], 1, 2), w["b"][layer, slots]

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        w = weights[target]
        return bgmv(y, x, w["a"], w["b"], idx, w["rank"], layer, interpret=self.interpret)

    def _pool(self, w, part):
        layers, slots, rdim, width = w[part].shape
        return w[part].reshape(layers, slots * rdim, width), stacked_pages(slots, rdim)

    def _decode_shrink(self, w, x, idx, ranks, layer) -> jax.Array:
        return bgmv_shrink(x, w["a"], idx, ranks, layer, interpret=self.interpret)

    def _decode_expand(self, w, xa, y, idx, layer) -> jax.Array:
        return bgmv_expand(y, xa, w["b"], idx, w["rank"], layer, interpret=self.interpret)


class PagePool:
    """Host-side page allocation of the MBGMV pool: which rank-row pages each slot owns.

    The pool has num_slots × max_rank pages, so assigning a slot at most max_rank
    pages after releasing its old ones always succeeds. Lowest free pages first.
    """

    def __init__(self, num_slots: int, max_rank: int) -> None:
        self.num_pages = num_slots * max_rank
        self._free = set(range(self.num_pages))
        self._owned: dict[int, list[int]] = {}

    def assign(self, slot: int, rank: int) -> list[int]:
        self._free.update(self._owned.pop(slot, []))
        pages = sorted(self._free)[:rank]
        self._free.difference_update(pages)
        self._owned[slot] = pages
        return pages

    def owned(self, slot: int) -> list[int]:
        return list(self._owned.get(slot, []))


class MbgmvBackend(_PallasBackend):
    """S-LoRA's layout: one pool of rank-row pages per target, no padding.

        weights[target] = {"a": [L, P, in] (page p: one rank row of some A^T),
                           "b": [L, P, out], "pages": i32[N, R] (slot n's rank row j is
                           page pages[n, j]), "rank": i32[N]}

    An adapter of rank r takes r pages (`PagePool`, P = N × max_rank), and decode
    reads only each row's own rank (cost ∝ Σ ranks).
    """

    name = "mbgmv"
    layout = {
        "a": ("layers", "page", "in"),
        "b": ("layers", "page", "out"),
        "pages": ("slot", "index"),
        "rank": ("slot",),
    }
    payload_layout = {
        "a": ("layers", "rank", "in"),
        "b": ("layers", "rank", "out"),
        "dest": ("index",),
    }

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        self.pool = PagePool(num_slots, max_rank)
        rdim = self.rank_dim(max_rank)  # the page tables: never split (no "rank" dim)
        return {
            target: {
                "a": jnp.zeros((num_layers, self.pool.num_pages, fan_in), dtype),
                "b": jnp.zeros((num_layers, self.pool.num_pages, fan_out), dtype),
                "pages": jnp.zeros((num_slots, rdim), jnp.int32),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1, pages=None) -> Payload:
        """`exact_factors` (P rank rows each, no padding to R), and each target's
        "dest": i32[P], the pages of the adapter's rank rows (out of bounds past its
        rank: dropped). The pages are assigned here (slot None: none are)."""
        rdim = self.rank_dim(max_rank)
        rank = next(iter(tensors.values()))[0].shape[-1]
        pages = self.pool.assign(slot, rank) if slot is not None else list(range(rank))
        payload = exact_factors(tensors, shapes, rdim, 1, dtype, a_axis=1)
        for packed in payload.values():
            dest = np.full(packed["a"].shape[1], self.pool.num_pages, np.int32)
            dest[:rank] = pages
            packed["dest"] = dest
        return payload

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        """Scatters each rank row to its page; the slot's page table and rank follow
        from `dest` (a target the payload lacks gets rank 0 and the same table)."""
        dest = next(iter(payload.values()))["dest"]  # [P], the same for every target
        installed: LoraWeights = {}
        for target, w in weights.items():
            rdim = w["pages"].shape[1]
            live = dest < w["a"].shape[1]  # [P]
            table = jnp.pad(dest, (0, rdim - dest.shape[0]))  # [R]
            table = jnp.where(jnp.arange(rdim) < jnp.sum(live), table, dest[0])
            rank = jnp.sum(live).astype(jnp.int32) if target in payload else jnp.int32(0)
            installed[target] = {
                "pages": w["pages"].at[slot].set(table),
                "rank": w["rank"].at[slot].set(rank),
            }
            if target not in payload:  # its pages keep what they held: rank 0 reads none
                installed[target] |= {"a": w["a"], "b": w["b"]}
                continue
            p = payload[target]
            layers = (layer_start + jnp.arange(p["a"].shape[0]))[:, None]  # [G, 1]
            installed[target] |= {
                "a": w["a"].at[layers, dest[None, :]].set(p["a"], mode="drop"),
                "b": w["b"].at[layers, dest[None, :]].set(p["b"], mode="drop"),
            }
        return installed

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        w = weights[target]
        pages = w["pages"][slots]  # [S, R]
        live = jnp.arange(pages.shape[1])[None, :] < w["rank"][slots][:, None]  # [S, R]
        a = jnp.where(live[:, :, None], w["a"][layer, pages], 0)  # [S, R, in]
        b = jnp.where(live[:, :, None], w["b"][layer, pages], 0)  # [S, R, out]
        return jnp.swapaxes(a, 1, 2), b

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        w = weights[target]
        return mbgmv(
            y, x, w["a"], w["b"], idx, w["pages"], w["rank"], layer, interpret=self.interpret
        )

    def _pool(self, w, part):
        return w[part], w["pages"]

    def _decode_shrink(self, w, x, idx, ranks, layer) -> jax.Array:
        return mbgmv_shrink(x, w["a"], idx, w["pages"], ranks, layer, interpret=self.interpret)

    def _decode_expand(self, w, xa, y, idx, layer) -> jax.Array:
        return mbgmv_expand(
            y, xa, w["b"], idx, w["pages"], w["rank"], layer, interpret=self.interpret
        )
