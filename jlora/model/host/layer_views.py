"""Each layer's parameters as arrays of their own, sharing the stacked arrays' memory.

Why: inside the `lax.scan` over the stacked layers, XLA:CPU copies each layer's slice
of every weight out of the stack (a dynamic-slice fusion) before the matmul reads it,
so a decode step, bound by the bytes its weights move, moves them twice. Given the
layers as separate arrays, the scan can pick layer i's kernels with a `lax.switch` on
i (`Llama.decode(..., layers=...)`), and each matmul reads its kernel in place.

They cost no memory: the CPU client adopts a 64-byte-aligned host buffer without
copying it, so each per-layer array is a view of its slice of the stacked buffer
(taken through DLPack, so the view holds that buffer and not the stacked `jax.Array`).
`LayerViews` makes them once per stacked array, and forgets them when that array is
dropped (a merged kernel, replaced at unmerge, gets views of its own). Elsewhere (a
GPU, whose client copies host buffers) there are none, and the scan slices the stack.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jlora.model.llama import Params

COPY_LIMIT = 1 << 20  # bytes: a stacked array this small may be split by copying it


def _host_view(shard: jax.Array) -> np.ndarray:
    """A CPU buffer as numpy, without a copy; through DLPack where numpy takes the dtype
    (bfloat16 it does not: then numpy's own view, which jax also hands out uncopied)."""
    try:
        return np.from_dlpack(cast(Any, shard))
    except (BufferError, RuntimeError, TypeError):
        return np.asarray(shard)


def split_layers(stacked: jax.Array) -> list[jax.Array] | None:
    """[stacked[i] for each layer i] on the same devices, each sharing the stacked
    array's memory (the layer axis, the first, is never split over the mesh).

    None where the client would copy instead (a GPU; a layer's slice that is not
    64-byte aligned), unless the whole array is at most COPY_LIMIT bytes (a norm's
    scales): such copies cost nothing worth keeping the slicing scan for.
    """
    sharding = stacked.sharding
    layer_sharding: jax.sharding.Sharding
    if isinstance(sharding, NamedSharding):
        layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    elif isinstance(sharding, SingleDeviceSharding):
        layer_sharding = sharding
    else:
        return None
    per_layer: list[list[jax.Array]] = [[] for _ in range(stacked.shape[0])]
    for shard in stacked.addressable_shards:
        host = _host_view(shard.data)
        for layer, part in enumerate(host):
            view = jax.device_put(part, shard.device)
            if view.unsafe_buffer_pointer() != part.ctypes.data and stacked.nbytes > COPY_LIMIT:
                return None
            per_layer[layer].append(view)
    return [
        jax.make_array_from_single_device_arrays(stacked.shape[1:], layer_sharding, arrays)
        for arrays in per_layer
    ]


class LayerViews:
    """`views(params["layers"])`: [layer i's parameters], each leaf an array of its own
    (`split_layers`), or None if some leaf cannot be split in place. Made on first use
    of each stacked array, forgotten when that array is dropped."""

    def __init__(self) -> None:
        self._split: dict[int, tuple[weakref.ref, list[jax.Array]]] = {}
        self._last: tuple[list[weakref.ref], list[Params]] | None = None  # leaves, views

    def __call__(self, layers: Params) -> list[Params] | None:
        leaves, tree = jax.tree.flatten(layers)
        if (
            self._last is not None
            and len(self._last[0]) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(self._last[0], leaves, strict=True))
        ):  # the same parameters as the last call: every decode step's case
            return self._last[1]
        per_leaf = []
        for leaf in leaves:
            key = id(leaf)
            entry = self._split.get(key)
            if entry is None or entry[0]() is not leaf:
                split = split_layers(leaf)
                if split is None:
                    return None
                entry = self._split[key] = (weakref.ref(leaf, self._forget(key)), split)
            per_leaf.append(entry[1])
        views = [jax.tree.unflatten(tree, arrays) for arrays in zip(*per_leaf, strict=True)]
        self._last = ([weakref.ref(leaf) for leaf in leaves], views)
        return views

    def _forget(self, key: int):
        """A callback for when the stacked array `key` is dropped: drop its views."""

        def forget(_: weakref.ref) -> None:
            self._split.pop(key, None)
            self._last = None

        return forget


class WithLayerViews:
    """A compiled step variant that takes the layers' views as its last argument: called
    like the plain step, it looks them up for the parameters it is given."""

    def __init__(self, executable: Any, views: LayerViews) -> None:
        self.executable = executable
        self.views = views

    def __call__(self, params: Params, *args: Any) -> Any:
        layers = self.views(params["layers"])
        assert layers is not None, "the parameters' layers could not be split as before"
        return self.executable(params, *args, layers)
