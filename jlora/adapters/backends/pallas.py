"""The Pallas backends: BGMV over stacked slots, MBGMV over a page pool.

Both prefill with SGMV, which reads a pool of rank rows through a page table; the
stacked slots of BGMV are such a pool with the trivial table (`stacked_pages`).
Kernels run compiled (Triton) on a GPU and with `interpret=True` anywhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters.backends.base import (
    HostTensors,
    LoraBackend,
    LoraWeights,
    Payload,
    set_slot,
)
from pallas_kernels.bgmv import bgmv
from pallas_kernels.common import stacked_pages
from pallas_kernels.mbgmv import mbgmv
from pallas_kernels.sgmv import sgmv, sgmv_reference

MIN_RANK_DIM = 16  # Triton's dots in SGMV need every dimension >= 16


def rank_dim(max_rank: int) -> int:
    """The kernels' rank dimension R: a power of two, at least MIN_RANK_DIM."""
    return max(MIN_RANK_DIM, 1 << (max_rank - 1).bit_length())


def rank_rows(tensors: HostTensors, shapes, rdim: int, dtype) -> Payload:
    """One adapter as rank rows, per target: {"a": [L, R, in] (A^T, zero-padded),
    "b": [L, R, out], "rank": i32 (0 for a target the adapter does not adapt)}."""
    layers = next(iter(tensors.values()))[0].shape[0]
    payload: Payload = {}
    for target, (fan_in, fan_out) in shapes.items():
        a = np.zeros((layers, rdim, fan_in), dtype)
        b = np.zeros((layers, rdim, fan_out), dtype)
        rank = 0
        if target in tensors:
            lora_a, lora_b = tensors[target]
            rank = lora_a.shape[-1]
            a[:, :rank] = lora_a.transpose(0, 2, 1)
            b[:, :rank] = lora_b
        payload[target] = {"a": a, "b": b, "rank": np.int32(rank)}
    return payload


class _PallasBackend(LoraBackend):
    def __init__(self, interpret: bool | None = None) -> None:
        self.interpret = jax.default_backend() != "gpu" if interpret is None else interpret

    def _prefill(self, y, x, a_pool, b_pool, segments, pages, ranks, layer) -> jax.Array:
        """SGMV, or its jnp reference where compiled Triton dots cannot take the shapes."""
        args = (y, x, a_pool, b_pool, segments.slot, segments.start, pages, ranks, layer)
        if self.interpret or (x.shape[-1] % 16 == 0 and y.shape[-1] % 16 == 0):
            return sgmv(*args, interpret=self.interpret)
        return sgmv_reference(*args)


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

    def allocate(self, *, num_layers, num_slots, max_rank, shapes, dtype) -> LoraWeights:
        rdim = rank_dim(max_rank)
        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, rdim, fan_in), dtype),
                "b": jnp.zeros((num_layers, num_slots, rdim, fan_out), dtype),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype) -> Payload:
        return rank_rows(tensors, shapes, rank_dim(max_rank), dtype)

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        return set_slot(weights, slot, layer_start, payload)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        w = weights[target]
        return jnp.swapaxes(w["a"][layer, slots], 1, 2), w["b"][layer, slots]

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        w = weights[target]
        return bgmv(y, x, w["a"], w["b"], idx, w["rank"], layer, interpret=self.interpret)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        w = weights[target]
        layers, slots, rdim, fan_in = w["a"].shape
        a_pool = w["a"].reshape(layers, slots * rdim, fan_in)
        b_pool = w["b"].reshape(layers, slots * rdim, -1)
        pages = stacked_pages(slots, rdim)
        return self._prefill(y, x, a_pool, b_pool, segments, pages, w["rank"], layer)


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
        "rank": (),
        "dest": ("index",),
        "pages": ("index",),
    }

    def allocate(self, *, num_layers, num_slots, max_rank, shapes, dtype) -> LoraWeights:
        self.pool = PagePool(num_slots, max_rank)
        rdim = rank_dim(max_rank)
        return {
            target: {
                "a": jnp.zeros((num_layers, self.pool.num_pages, fan_in), dtype),
                "b": jnp.zeros((num_layers, self.pool.num_pages, fan_out), dtype),
                "pages": jnp.zeros((num_slots, rdim), jnp.int32),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype) -> Payload:
        rdim = rank_dim(max_rank)
        rank = next(iter(tensors.values()))[0].shape[-1]
        pages = self.pool.assign(slot, rank)
        table = np.full(rdim, pages[0] if pages else 0, np.int32)
        table[:rank] = pages
        payload = rank_rows(tensors, shapes, rdim, dtype)
        for packed in payload.values():
            dest = np.full(rdim, self.pool.num_pages, np.int32)  # out of bounds: dropped
            if packed["rank"]:  # 0 where the adapter does not adapt the target
                dest[:rank] = pages
            packed |= {"dest": dest, "pages": table}
        return payload

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        installed: LoraWeights = {}
        for target, w in weights.items():
            p = payload[target]
            layers = (layer_start + jnp.arange(p["a"].shape[0]))[:, None]  # [G, 1]
            dest = p["dest"][None, :]  # [1, R]
            installed[target] = {
                "a": w["a"].at[layers, dest].set(p["a"], mode="drop"),
                "b": w["b"].at[layers, dest].set(p["b"], mode="drop"),
                "pages": w["pages"].at[slot].set(p["pages"]),
                "rank": w["rank"].at[slot].set(p["rank"]),
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

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        w = weights[target]
        return self._prefill(y, x, w["a"], w["b"], segments, w["pages"], w["rank"], layer)
