"""LlamaEngine's prefix-cache support: a prefill after a cached prefix, KV swaps to host
memory and back, and the device pool's size.

A prefill with `cached` > 0 must give what a prefill of every token gives (device_api.py):
the same first token and greedy continuation, and the same keys and values at the new
positions. Its prefix is an earlier prefill's blocks, or blocks swapped out to host
memory and restored elsewhere. The equality tests run on cpu-tiny (GQA) and on the
real SmolLM2 (slow); the rest on cpu-tiny.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import numpy as np
import pytest

from configs import ConfigError, EngineConfig
from jlora.adapters.peft import load_peft_adapter, make_demo_adapters
from jlora.device.llama_engine import LlamaEngine
from jlora.engine.device_api import DecodeRow, PrefillJob, SamplingRow
from tests.tolerances import assert_close

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)
ADAPTER, SLOT = "demo", 0
EXTRA = 21  # tokens the extended prompt adds after the shared ones
STEPS = 6  # greedy tokens compared (the first one included)
MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)]


def _engine(loaded, **overrides) -> LlamaEngine:
    config = {"max_slots": 2, "max_seq_len": 256, "min_bucket": 16, **overrides}
    return LlamaEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=None,
        engine_config=EngineConfig(**config),
    )


@pytest.fixture(scope="module", params=MODELS)
def lora_engine(request, tmp_path_factory):
    """An engine with one demo adapter (rank 8, every target) installed in SLOT."""
    loaded = request.getfixturevalue(request.param)
    engine = _engine(
        loaded, kv_cache_tokens=64 * 16, max_loras=1, max_lora_rank=8, host_store_mib=64
    )
    [path] = make_demo_adapters(
        loaded.config, tmp_path_factory.mktemp("demo"), n=1, ranks=[8], seed=5
    )
    engine.stage_adapter(ADAPTER, str(path))
    engine.install_adapter(ADAPTER, SLOT, engine.load_adapter(ADAPTER, SLOT))
    yield engine
    engine.close()


class _Blocks:
    """Block tables from consecutive fresh blocks (a test's tables never share blocks
    unless it copies them)."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine, self.next = engine, 0

    def table(self, tokens: int, shared: Sequence[int] = ()) -> np.ndarray:
        """A table for `tokens` tokens (and STEPS more): `shared`, then fresh blocks."""
        cfg = self.engine.config
        count = math.ceil((tokens + STEPS) / cfg.block_size) - len(shared)
        fresh = list(range(self.next, self.next + count))
        self.next += count
        table = np.full(cfg.blocks_per_seq, cfg.num_blocks, np.int32)
        table[: len(shared) + count] = [*shared, *fresh]
        return table


def _greedy(engine, tokens, table, *, slot=-1, cached=0) -> list[int]:
    """The first token of a prefill and the STEPS - 1 greedy tokens after it."""
    job = PrefillJob(tokens, table, GREEDY, adapter_slot=slot, cached=cached)
    out = [engine.prefill(job).token]
    sampling = dataclasses.replace(GREEDY, step=1)
    engine.insert(0, DecodeRow(out[0], len(tokens), table, sampling, slot))
    out += [int(engine.generate()[0]) for _ in range(STEPS - 1)]
    engine.free(0)
    return out


def _kv(engine, table, start, stop) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values of positions [start, stop) of a sequence: [layers, n, kvh, hd]."""
    size = engine.config.block_size
    positions = np.arange(start, stop)
    blocks, offsets = table[positions // size], positions % size
    cache = engine.cache
    return np.asarray(cache.k)[:, blocks, offsets], np.asarray(cache.v)[:, blocks, offsets]


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, length).tolist()


def _check_equal_to_full(engine, blocks, extended, table, cached, slot) -> None:
    """A cached prefill of `extended` on `table` (its first cached // block_size blocks
    holding the prefix) continues exactly as a full prefill on fresh blocks, and writes
    the same keys and values."""
    fresh = blocks.table(len(extended))
    assert _greedy(engine, extended, table, slot=slot, cached=cached) == _greedy(
        engine, extended, fresh, slot=slot
    )
    dtype = engine.model.dtype
    for got, want in zip(
        _kv(engine, table, cached, len(extended)),
        _kv(engine, fresh, cached, len(extended)),
        strict=True,
    ):
        assert_close(got, want, dtype, dtype, scope="model")


@pytest.mark.parametrize("adapter", [None, ADAPTER])
@pytest.mark.parametrize("shared", [32, 40], ids=["at-a-block-boundary", "mid-block"])
def test_cached_prefill_equals_a_full_prefill(lora_engine, shared, adapter):
    """The prompt shares its first `shared` tokens with an earlier one; the full blocks
    among them (32 tokens, two blocks) are reused, the rest computed again."""
    engine, blocks = lora_engine, _Blocks(lora_engine)
    slot = SLOT if adapter else -1
    prompt = _prompt(shared)
    earlier = blocks.table(shared)
    _greedy(engine, prompt, earlier, slot=slot)
    extended = prompt + _prompt(EXTRA, seed=1)
    cached = shared // 16 * 16
    table = blocks.table(len(extended), shared=earlier[: cached // 16].tolist())
    _check_equal_to_full(engine, blocks, extended, table, cached, slot)


def test_cached_prefill_while_merged(lora_engine):
    """The merged steps (no LoRA weights) have their own cached-prefix variant."""
    engine, blocks = lora_engine, _Blocks(lora_engine)
    prompt = _prompt(32, seed=2)
    earlier = blocks.table(32)
    engine.merge(ADAPTER)
    try:
        _greedy(engine, prompt, earlier, slot=SLOT)
        table = blocks.table(32 + EXTRA, shared=earlier[:2].tolist())
        _check_equal_to_full(engine, blocks, prompt + _prompt(EXTRA, seed=3), table, 32, SLOT)
    finally:
        engine.unmerge()


def test_swapped_out_and_restored_blocks_serve_a_cached_prefill(lora_engine):
    """Snapshot, overwrite the blocks at once (allowed), to host, to device, restore into
    other blocks: they hold the original keys and values, and serve as the prefix."""
    engine, blocks = lora_engine, _Blocks(lora_engine)
    assert engine.can_swap_kv
    prompt = _prompt(48, seed=4)
    earlier = blocks.table(48)
    _greedy(engine, prompt, earlier, slot=SLOT)
    original = _kv(engine, earlier, 0, 48)
    snapshot = engine.kv_snapshot(earlier[:3].tolist())
    _greedy(engine, _prompt(48, seed=5), earlier, slot=SLOT)  # the blocks are reused
    host = engine.kv_to_host(snapshot)
    assert (host.count, host.nbytes) == (3, 3 * engine.memory().kv_block_bytes)
    restored = blocks.table(48)[:3].tolist()
    engine.kv_restore(restored, engine.kv_to_device(host))
    table = blocks.table(48 + EXTRA, shared=restored)
    for got, want in zip(_kv(engine, table, 0, 48), original, strict=True):
        np.testing.assert_array_equal(got, want)  # copies: bit for bit
    _check_equal_to_full(engine, blocks, prompt + _prompt(EXTRA, seed=6), table, 48, SLOT)


# -- cpu-tiny only ---------------------------------------------------------------------


def _kv_block_bytes(config, itemsize=4, block_size=16) -> int:
    """Keys and values of one block in every layer: 2 · layers · block_size · kvh · hd."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def test_pool_bytes_sets_the_number_of_kv_blocks(tiny):
    block = _kv_block_bytes(tiny.config)
    engine = _engine(tiny, pool_bytes=40 * block + block // 2)
    assert engine.config.num_blocks == 40
    assert (engine.config.pool_bytes, engine.config.kv_cache_tokens) == (0, 40 * 16)
    assert engine.cache.k.shape[1] == 40 and engine.memory().kv_block_bytes == block


def test_a_pool_below_one_sequence_is_refused(tiny):
    # max_seq_len 256 needs 16 blocks; 15 fit.
    with pytest.raises(ConfigError, match=r"EngineConfig\.pool_bytes=.* holds 15 KV blocks"):
        _engine(tiny, pool_bytes=15 * _kv_block_bytes(tiny.config))


def test_pool_fraction_takes_that_share_of_the_free_device_memory(tiny):
    """A device that reports its memory (a GPU) gives the pool that fraction of what is
    free; one that does not (the CPU) is refused, naming the field."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        with pytest.raises(ConfigError, match=r"EngineConfig\.pool_fraction=0\.5 needs a"):
            _engine(tiny, pool_fraction=0.5)
        return
    fraction, block = 0.01, _kv_block_bytes(tiny.config)
    free = stats["bytes_limit"] - stats["bytes_in_use"]
    engine = _engine(tiny, pool_fraction=fraction)
    assert engine.config.pool_fraction == 0.0
    # The weights are placed before it asks: a little less free, never more.
    assert engine.config.num_blocks <= fraction * free // block
    assert engine.config.num_blocks >= 0.9 * fraction * free // block


@pytest.mark.parametrize("pool", ["slots", "kv"])
def test_device_bytes_is_the_adapters_rank_rows_in_the_serving_dtype(tiny, tmp_path, pool):
    """Every element of A [in, r] and B [r, out], each layer, at 4 bytes (float32); in
    whole KV pages where the adapters live in the KV cache (lora_pool "kv"): each
    target's rank rows (rank 12's bucket, 16) of A fill the key halves of whole pages (a
    block's keys at a layer), those of B the value halves."""
    engine = _engine(tiny, max_loras=1, max_lora_rank=16, host_store_mib=16, lora_pool=pool)
    try:
        [path] = make_demo_adapters(
            tiny.config, tmp_path, n=1, ranks=[12], targets=("q_proj", "down_proj")
        )
        staged = engine.stage_adapter("a", str(path))
        weights = load_peft_adapter(path, tiny.config).weights
        if pool == "slots":
            assert staged.device_bytes == 4 * sum(a.size + b.size for a, b in weights.values())
            return
        block = engine.cache.nbytes() // engine.config.num_blocks
        half = block // (2 * 4 * tiny.config.num_layers)  # a block's keys at a layer
        pages = sum(
            max(math.ceil(16 * a.shape[1] / half), math.ceil(16 * b.shape[2] / half))
            for a, b in weights.values()
        )
        assert staged.device_bytes == pages * block
    finally:
        engine.close()


def test_kv_swaps_take_the_emulated_links_time(tiny):
    gbps = 5e-4  # 500 kB/s: 8 blocks of 12 KiB take 0.2 s each way
    engine = _engine(tiny, kv_cache_tokens=32 * 16, emulated_link_gbps=gbps)
    blocks = list(range(8))
    start = time.perf_counter()
    host = engine.kv_to_host(engine.kv_snapshot(blocks))
    middle = time.perf_counter()
    staged = engine.kv_to_device(host)
    end = time.perf_counter()
    engine.kv_restore(list(range(8, 16)), staged)
    seconds = host.nbytes / (gbps * 1e9)
    assert host.nbytes == 8 * _kv_block_bytes(tiny.config)
    assert middle - start >= seconds and end - middle >= seconds
