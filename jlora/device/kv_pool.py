"""The device pool of KV blocks: how many it holds (`size_pool`), and whole blocks copied
out of the cache and back in for the prefix cache's swaps to host memory (`KVBlocks`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from configs import ConfigError, EngineConfig, ModelConfig
from jlora.engine.device_api import HostBlocks
from jlora.link import wait_for_link
from jlora.model.kv_cache import KVCache
from jlora.model.lora.targets import rank_row_bytes, target_shapes
from jlora.model.sharding import TensorParallel


@dataclasses.dataclass(frozen=True)
class _HostParts:
    """Swapped-out KV blocks in host memory: each of this process's devices' part of the
    keys and of the values, and the shape of the whole (padded) copy they came from."""

    shape: tuple[int, ...]
    keys: tuple[tuple[jax.Device, np.ndarray], ...]
    values: tuple[tuple[jax.Device, np.ndarray], ...]


class KVBlocks:
    """Whole KV blocks (every layer, keys and values) copied out of the cache and back
    in: the device engine's prefix-cache swaps (jlora/engine/device_api.py, `kv_snapshot` to
    `kv_restore`), each crossing of the link taking at least its emulated time.

    A copy of n blocks runs at the next power of two, padded with the sentinel
    `num_blocks` (clipped on reads, the copies then cut; dropped on writes), so only
    log2(num_blocks) shapes of each kind compile: one block's at warm-up (`warm`), the
    others on first use (a gather or a scatter: milliseconds). Copies keep the cache's
    layout, [layers, n, block_size, kv_heads, head_dim], and its sharding (split over
    the KV heads under tensor parallelism), so a restore writes each device's heads
    where they are. In host memory each device's part stays apart: `HostBlocks.data`
    is a `_HostParts`, the numpy keys and values of the n blocks on each of this
    process's devices. So a mesh that spans processes swaps too: each process copies
    its own devices' parts out and back (no data crosses between processes), and the
    gather and the scatter, which every process launches, are the only global steps.
    """

    def __init__(self, shardings: KVCache, num_blocks: int, emulated_link_gbps: float) -> None:
        self.shardings = shardings  # the cache's NamedShardings
        self.num_blocks = num_blocks
        self.emulated_link_gbps = emulated_link_gbps

        def gather(cache: KVCache, blocks: jax.Array) -> KVCache:
            return jax.tree.map(lambda pages: jnp.take(pages, blocks, axis=1, mode="clip"), cache)

        def scatter(cache: KVCache, blocks: jax.Array, copies: KVCache) -> KVCache:
            return jax.tree.map(
                lambda pages, new: pages.at[:, blocks].set(new, mode="drop"), cache, copies
            )

        self._gather = jax.jit(gather, out_shardings=shardings)
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=shardings)

    def warm(self, cache: KVCache) -> KVCache:
        """Compile the copies of one block (the size the memory manager swaps) by copying
        nothing: a gather and a scatter of the sentinel alone."""
        nowhere = self._indices(1)
        return self._scatter(cache, nowhere, self._gather(cache, nowhere))

    def _indices(self, count: int, blocks: Sequence[int] = ()) -> np.ndarray:
        """i32[the power of two >= count]: `blocks`, then the sentinel."""
        indices = np.full(1 << max(0, count - 1).bit_length(), self.num_blocks, np.int32)
        indices[: len(blocks)] = blocks
        return indices

    def snapshot(self, cache: KVCache, blocks: Sequence[int]) -> tuple[int, KVCache]:
        """Dispatch the copy of `blocks`; the cache may change once this returns."""
        return len(blocks), self._gather(cache, self._indices(len(blocks), blocks))

    def to_host(self, snapshot: tuple[int, KVCache]) -> HostBlocks:
        count, copies = snapshot
        started = time.perf_counter()
        keys, values = (
            tuple(
                (shard.device, np.asarray(shard.data)[:, :count].copy())
                for shard in pages.addressable_shards
            )
            for pages in (copies.k, copies.v)
        )
        nbytes = sum(part.nbytes for _, part in keys + values)
        wait_for_link(nbytes, self.emulated_link_gbps, started)
        return HostBlocks(count, nbytes, _HostParts(copies.k.shape, keys, values))

    def to_device(self, host: HostBlocks) -> tuple[int, KVCache]:
        """Host blocks on the device, padded to the power of two a restore takes: each
        of this process's devices gets its own part back."""
        started = time.perf_counter()
        parts = cast(_HostParts, host.data)
        width = [(0, 0), (0, parts.shape[1] - host.count)] + [(0, 0)] * 3

        def place(shards: tuple[tuple[jax.Device, np.ndarray], ...], sharding) -> jax.Array:
            arrays = [jax.device_put(np.pad(part, width), device) for device, part in shards]
            return jax.make_array_from_single_device_arrays(parts.shape, sharding, arrays)

        copies = KVCache(
            k=place(parts.keys, self.shardings.k), v=place(parts.values, self.shardings.v)
        )
        jax.block_until_ready(copies)
        wait_for_link(host.nbytes, self.emulated_link_gbps, started)
        return host.count, copies

    def restore(
        self, cache: KVCache, blocks: Sequence[int], staged: tuple[int, KVCache]
    ) -> KVCache:
        """`cache` (donated) with the i-th staged block written into blocks[i]."""
        count, copies = staged
        if len(blocks) != count:
            raise AssertionError(f"kv_restore of {count} staged blocks into {len(blocks)}")
        return self._scatter(cache, self._indices(count, blocks), copies)


def size_pool(
    cfg: EngineConfig,
    tp: TensorParallel,
    model_config: ModelConfig,
    dtype: jnp.dtype,
    adapter_pages: int | None = None,
) -> EngineConfig:
    """`cfg` with the device pool's size resolved into KV blocks (kv_cache_tokens set,
    pool_bytes and pool_fraction cleared), as everyone reads it: `num_blocks`.

    A KV block is its keys and values in every layer, in the serving dtype, on the whole
    mesh (`kv_block_bytes`). pool_bytes holds pool_bytes // kv_block_bytes blocks;
    pool_fraction, that fraction of the memory free now (bytes_limit - bytes_in_use;
    the engine asks once its weights and adapter slots are placed) on the mesh's device
    with least, in blocks of what each device holds of one; neither: kv_cache_tokens'
    blocks, and with adapters (max_loras) the pages of max_loras adapters at
    max_lora_rank on all lora_targets, so a configuration sized before the pool was
    shared keeps its KV room (`adapter_pages` each where given: the pages an adapter at
    max_lora_rank takes where they live in the pool). ConfigError, naming the field, for fewer than
    blocks_per_seq blocks, or pool_fraction on a device that does not report its memory.
    """
    block = (model_config.num_layers, 1, cfg.block_size, tp.kv_heads, model_config.head_dim)
    pair = 2 * dtype.itemsize  # a key and a value
    if not (cfg.pool_bytes or cfg.pool_fraction):
        if not cfg.max_loras:
            return cfg
        # The default pool: kv_cache_tokens for KV, and room for max_loras adapters at
        # max_lora_rank on every target, which they share.
        shapes = target_shapes(tp.placed)  # k/v as wide as the replicated KV heads
        row = rank_row_bytes(shapes, cfg.lora_targets, model_config.num_layers, dtype.itemsize)
        per_adapter = adapter_pages or math.ceil(
            row * cfg.max_lora_rank / (math.prod(block) * pair)
        )
        blocks = cfg.num_blocks + cfg.max_loras * per_adapter
        return dataclasses.replace(cfg, kv_cache_tokens=blocks * cfg.block_size)
    field = "pool_bytes" if cfg.pool_bytes else "pool_fraction"
    if cfg.pool_bytes:
        blocks = cfg.pool_bytes // (math.prod(block) * pair)
    else:
        free = []
        for device in tp.mesh.devices.flat:
            stats = device.memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ConfigError(
                    f"EngineConfig.pool_fraction={cfg.pool_fraction} needs a device that "
                    f"reports its memory, and {device.platform} does not: give pool_bytes"
                )
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        shard = NamedSharding(tp.mesh, tp.kv_spec).shard_shape(block)  # one device's part
        blocks = int(cfg.pool_fraction * min(free)) // (math.prod(shard) * pair)
    if blocks < cfg.blocks_per_seq:
        raise ConfigError(
            f"EngineConfig.{field}={getattr(cfg, field)} holds {blocks} KV blocks; one "
            f"sequence of max_seq_len={cfg.max_seq_len} needs {cfg.blocks_per_seq}"
        )
    return dataclasses.replace(
        cfg, kv_cache_tokens=blocks * cfg.block_size, pool_bytes=0, pool_fraction=0.0
    )
