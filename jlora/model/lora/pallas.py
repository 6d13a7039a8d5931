"""The Pallas backends: BGMV over stacked slots, MBGMV over a page pool of its own or
over the KV cache's pages (`PooledMbgmvBackend`, FastLibra's unified pool).

Both prefill with SGMV, which reads a pool of rank rows through a page table; the
stacked slots of BGMV are such a pool with the trivial table (`stacked_pages`).
Kernels run compiled (Triton) on a GPU and with `interpret=True` anywhere else.

BGMV keeps stacked slots wherever it runs: its kernel's point is reading a slot's R
rank rows as one contiguous block, which pages dealt out by a pool are not; over pages
it would be MBGMV reading up to the batch's largest rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from configs import ConfigError
from jlora.model.lora.base import (
    POOL,
    KVPagesBackend,
    LoraBackend,
    LoraWeights,
    Packed,
    Rows,
    Segments,
    StackedSlotsBackend,
    exact_factors,
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

    def _pool(self, weights: LoraWeights, target: str, part: str) -> tuple[jax.Array, jax.Array]:
        """A target's A or B slots (part "a" or "b") as a pool of rank rows [L, P, >= in
        or out] and its page table i32[N, R] (in a split LoRA, R may differ between A's
        part on this device and B)."""
        raise NotImplementedError

    def _pools(self, weights: LoraWeights, target: str) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`_pool` of A and of B, and the page table they share (the fused kernels')."""
        (a_pool, pages), (b_pool, _) = (self._pool(weights, target, p) for p in ("a", "b"))
        return a_pool, b_pool, pages

    def _dots_take(self, *dims: int) -> bool:
        """Whether SGMV runs at these feature sizes: compiled Triton dots need multiples
        of 16 (tiny test models compiled on a GPU fall back to jnp); interpreted, any."""
        return self.interpret or all(dim % 16 == 0 for dim in dims)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        a_pool, b_pool, pages = self._pools(weights, target)
        ranks = weights[target]["rank"]
        args = (y, x, a_pool, b_pool, segments.slot, segments.start, pages, ranks, layer)
        if self._dots_take(x.shape[-1], y.shape[-1]):
            return sgmv(*args, interpret=self.interpret)
        return sgmv_reference(*args)

    def shrink(self, weights, target, layer, x, rows: Rows, rank_part=None) -> jax.Array:
        a_pool, pages = self._pool(weights, target, "a")
        ranks = weights[target]["rank"]
        if rank_part is not None:  # this device holds rank rows [k R, (k + 1) R) of each
            ranks = jnp.clip(ranks - rank_part * pages.shape[1], 0, pages.shape[1])
        if not isinstance(rows, Segments):
            return self._decode_shrink(weights, target, x, rows, ranks, layer)
        if not self._dots_take(x.shape[-1]):
            return super().shrink(weights, target, layer, x, rows, rank_part)
        return sgmv_shrink(
            x, a_pool, rows.slot, rows.start, pages, ranks, layer, interpret=self.interpret
        )

    def expand(self, weights, target, layer, xa, y, rows: Rows) -> jax.Array:
        b_pool, pages = self._pool(weights, target, "b")
        if not isinstance(rows, Segments):
            return self._decode_expand(weights, target, xa, y, rows, layer)
        if not self._dots_take(y.shape[-1]):
            return super().expand(weights, target, layer, xa, y, rows)
        return sgmv_expand(
            y, xa, b_pool, rows.slot, rows.start, pages, weights[target]["rank"], layer,
            interpret=self.interpret,
        )  # fmt: skip

    def _decode_shrink(self, weights, target, x, idx, ranks, layer) -> jax.Array:
        raise NotImplementedError

    def _decode_expand(self, weights, target, xa, y, idx, layer) -> jax.Array:
        raise NotImplementedError


class BgmvBackend(StackedSlotsBackend, _PallasBackend):
    """Punica's layout: every slot holds R rank rows, R = rank_dim(max_rank).

        weights[target] = {"a": [L, N, R, in] (rank rows of A^T), "b": [L, N, R, out],
                           "rank": i32[N] (0: the slot's adapter does not adapt target)}

    Decode reads, for every row, the batch's largest rank (cost ∝ rows × max rank).
    """

    name = "bgmv"
    a_axis = 1  # A^T's rank rows [R, in] (StackedSlotsBackend)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        w = weights[target]
        return jnp.swapaxes(w["a"][layer, slots], 1, 2), w["b"][layer, slots]

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        w = weights[target]
        return bgmv(y, x, w["a"], w["b"], idx, w["rank"], layer, interpret=self.interpret)

    def _pool(self, weights, target, part):
        stacked = weights[target][part]
        layers, slots, rdim, width = stacked.shape
        return stacked.reshape(layers, slots * rdim, width), stacked_pages(slots, rdim)

    def _decode_shrink(self, weights, target, x, idx, ranks, layer) -> jax.Array:
        a = weights[target]["a"]
        return bgmv_shrink(x, a, idx, ranks, layer, interpret=self.interpret)

    def _decode_expand(self, weights, target, xa, y, idx, layer) -> jax.Array:
        w = weights[target]
        return bgmv_expand(y, xa, w["b"], idx, w["rank"], layer, interpret=self.interpret)


def _page_table(dest: jax.Array, width: int, rank: jax.Array) -> jax.Array:
    """A slot's page-table row of `width` entries: `dest`'s first `rank`, then its first
    again (entries past the rank are never read, but stay valid pages)."""
    table = jnp.pad(dest, (0, width - dest.shape[0]))
    return jnp.where(jnp.arange(width) < rank, table, dest[0])


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
        self._shapes = dict(shapes)
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

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1, pages=None) -> Packed:
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
            rows = jnp.sum(dest < w["a"].shape[1]).astype(jnp.int32)  # in the pool: the rank's
            rank = rows if target in payload else jnp.int32(0)
            installed[target] = {
                "pages": w["pages"].at[slot].set(_page_table(dest, rdim, rows)),
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
        table = weights[target]["pages"][slots]  # [S, R]
        live = jnp.arange(table.shape[1])[None, :] < weights[target]["rank"][slots][:, None]

        def rows(part: str, width: int) -> jax.Array:  # [S, R, width], zeros past a rank
            pool, _ = self._pool(weights, target, part)
            return jnp.where(live[:, :, None], pool[layer, table][..., :width], 0)

        fan_in, fan_out = self._shapes[target]
        return jnp.swapaxes(rows("a", fan_in), 1, 2), rows("b", fan_out)

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        a_pool, b_pool, pages = self._pools(weights, target)
        ranks = weights[target]["rank"]
        return mbgmv(y, x, a_pool, b_pool, idx, pages, ranks, layer, interpret=self.interpret)

    def _pool(self, weights, target, part):
        return weights[target][part], weights[target]["pages"]

    def _decode_shrink(self, weights, target, x, idx, ranks, layer) -> jax.Array:
        a_pool, pages = self._pool(weights, target, "a")
        return mbgmv_shrink(x, a_pool, idx, pages, ranks, layer, interpret=self.interpret)

    def _decode_expand(self, weights, target, xa, y, idx, layer) -> jax.Array:
        b_pool, pages = self._pool(weights, target, "b")
        ranks = weights[target]["rank"]
        return mbgmv_expand(y, xa, b_pool, idx, pages, ranks, layer, interpret=self.interpret)


class PooledMbgmvBackend(KVPagesBackend, MbgmvBackend):
    """MBGMV over adapters that live in the KV cache's own pages (FastLibra §4.3, the
    unified pool: base.py, `KVPagesBackend`; one device).

    MBGMV reads each rank row whole from a pool [L, P, width], through a page table. So
    a target's rank rows lie whole in pages: at each layer a page's key half holds
    `per_page` rows of A^T, each `row_width` values apart (the smallest divisor of the
    half at least the target's widest side, max(in, out)), and its value half the same
    rows of B. The kernels read the cache as it is, viewed [L, pages × per_page,
    row_width] (a reshape: no copy), through page tables of such view rows, and read a
    row's first in (or out) values (pallas_kernels/common.py). An adapter of rank r
    takes ceil(r / per_page) pages of each target it adapts: its own rank, not a
    bucket's, so the number resident follows from their ranks.

        weights[target] = {"pages": i32[N, R] (the view rows of slot n's rank rows;
                                       past its rank, its first again),
                           "rank": i32[N] (0: the slot's adapter leaves target alone)}
        weights[POOL] = {"k": cache.k, "v": cache.v} (`with_pool`, at each use)

    Rows past a rank read whatever their page holds (a KV block's values, say): the
    kernels mask them. A target whose rows are wider than a page's half has no layout:
    ConfigError, naming block_size.
    """

    def __init__(self, page_width: int, interpret: bool | None = None) -> None:
        super().__init__(page_width, interpret=interpret)
        self._row_width: dict[str, int] = {}  # target -> its view rows' width

    def _per_page(self, target: str) -> int:
        return self.page_width // 2 // self._row_width[target]

    def target_pages(self, rank: int, target: str) -> int:
        return math.ceil(rank / self._per_page(target))

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        assert rank_shards == 1, "a pooled backend runs on one device"
        half = self.page_width // 2
        self._shapes = dict(shapes)
        for target, shape in shapes.items():
            widest = max(shape)
            if widest > half:
                raise ConfigError(
                    f"lora_backend='mbgmv' with lora_pool='kv' lays each rank row whole in "
                    f"a page's half, {half} values (block_size x KV heads x head_dim), and "
                    f"{target}'s rows are {widest} wide: raise block_size "
                    f"{math.ceil(widest / half)}-fold or more, or use lora_pool 'slots'"
                )
            self._row_width[target] = next(w for w in range(widest, half + 1) if half % w == 0)
        rdim = self.rank_dim(max_rank)
        return {
            target: {
                "pages": jnp.zeros((num_slots, rdim), jnp.int32),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target in shapes
        }

    def _dest(self, target, pages, rank, packed):
        """i32[Q]: the view row of each rank row (out of bounds past the rank: dropped)."""
        per_page, rows = self._per_page(target), np.arange(packed["a"].shape[1])
        page = pages[np.minimum(rows, rank - 1) // per_page]
        dest = np.where(rows < rank, page * per_page + rows % per_page, np.iinfo(np.int32).max)
        return dest.astype(np.int32)

    def _write(self, cache, target, layer_start, packed, width):
        """Each rank row into its view row (A^T's of the keys', B's of the values'; rows
        past the rank dropped); the table: the rows, then the first again."""
        dest = jnp.asarray(packed["dest"])
        where = ((layer_start + jnp.arange(packed["a"].shape[0]))[:, None], dest[None, :])
        written = {}
        for half, part, features in zip("kv", "ab", self._shapes[target], strict=True):
            rows = self._view(cache[half], target).at[(*where, slice(0, features))]
            written[half] = rows.set(packed[part].astype(cache[half].dtype), mode="drop").reshape(
                cache[half].shape
            )
        return written, _page_table(dest, width, packed["rank"])

    def _view(self, half: jax.Array, target: str) -> jax.Array:
        """The cache's keys or values [L, blocks, ...] as `target`'s rank rows
        [L, blocks × per_page, row_width]: a reshape, no copy."""
        return half.reshape(half.shape[0], -1, self._row_width[target])

    def _pool(self, weights, target, part):
        half = weights[POOL]["k" if part == "a" else "v"]
        return self._view(half, target), weights[target]["pages"]
