"""MockEngine's KV records: a wrong prefix reuse is caught, swaps carry the records, the
link's time is taken, and the pool's sizes are reported.

Every test uses blocks of 4 tokens, so position p of a table lives in its block p // 4.
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest

from configs import ConfigError
from jlora.engine.device_api import DecodeRow, PrefillJob, SamplingRow
from jlora.engine.mock import MockEngine, mock_adapter_dir

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)
SIZE = 4  # tokens per block


def _engine(**options) -> MockEngine:
    """Adapter "a" installed in device slot 0, "b" in slot 1."""
    engine = MockEngine(max_seq_len=32, block_size=SIZE, num_blocks=16, **options)
    for slot, name in enumerate("ab"):
        engine.stage_adapter(name, str(mock_adapter_dir(8)))
        engine.install_adapter(name, slot, engine.load_adapter(name, slot))
    return engine


def _table(engine: MockEngine, blocks: list[int]) -> np.ndarray:
    table = np.full(engine.config.blocks_per_seq, engine.config.num_blocks, np.int32)
    table[: len(blocks)] = blocks
    return table


def _prefill(engine, tokens, blocks, *, slot=0, cached=0) -> int:
    job = PrefillJob(tokens, _table(engine, blocks), GREEDY, adapter_slot=slot, cached=cached)
    return engine.prefill(job).token


PROMPT = list(range(100, 110))  # 10 tokens: blocks 0 and 1 full, 2 holds two


def test_a_right_prefix_is_reused_and_gives_the_full_prefills_token():
    engine = _engine()
    _prefill(engine, PROMPT, [0, 1, 2])
    extended = PROMPT + [7, 8, 9]
    reused = _prefill(engine, extended, [0, 1, 5, 6], cached=8)
    assert reused == _prefill(engine, extended, [9, 10, 11, 12])
    _prefill(engine, extended[:12] + [1, 2], [0, 1, 5, 6], cached=12)  # block 5 is written


@pytest.mark.parametrize(
    "tokens, slot, held",
    [
        (PROMPT[:5] + [0] + PROMPT[6:], 0, "('a', 105)"),  # another token at position 5
        (PROMPT, 1, "('a', 100)"),  # the same tokens, another adapter's KV
        (PROMPT, -1, "('a', 100)"),  # the base model's
    ],
    ids=["other-tokens", "other-adapter", "base-model"],
)
def test_a_wrong_prefix_reuse_is_an_assertion(tokens, slot, held):
    engine = _engine()
    _prefill(engine, PROMPT, [0, 1, 2])
    with pytest.raises(AssertionError, match=rf"wrong prefix reuse: .* holds .*{re.escape(held)}"):
        _prefill(engine, tokens + [1], [0, 1, 3], slot=slot, cached=8)


def test_unwritten_blocks_and_bad_cached_counts_are_assertions():
    engine = _engine()
    with pytest.raises(AssertionError, match=r"holds \(adapter, token\) None"):
        _prefill(engine, PROMPT, [0, 1, 2], cached=4)
    for cached in (3, 10, 12):  # not a multiple of 4; not below the 10 tokens
        with pytest.raises(AssertionError, match=f"cached={cached} must be a multiple"):
            _prefill(engine, PROMPT, [0, 1, 2], cached=cached)


def test_generated_tokens_are_recorded_at_their_positions():
    """Prefill 6 tokens; the row's first two generated tokens land at positions 6 and 7,
    completing block 1, which a longer prompt holding them may then reuse."""
    engine = _engine()
    prompt = PROMPT[:6]
    first = _prefill(engine, prompt, [0, 1, 2])
    sampling = dataclasses.replace(GREEDY, step=1)
    engine.insert(0, DecodeRow(first, 6, _table(engine, [0, 1, 2]), sampling, adapter_slot=0))
    second = int(engine.generate()[0])
    engine.generate()
    engine.free(0)
    engine.generate()  # a freed row writes nothing
    _prefill(engine, prompt + [first, second, 5], [0, 1, 3], cached=8)
    with pytest.raises(AssertionError, match="position 7"):
        _prefill(engine, prompt + [first, second + 1, 5], [0, 1, 3], cached=8)


def test_swapped_out_and_restored_records_serve_a_cached_prefill():
    """Snapshot blocks 0-1, overwrite them at once (allowed), then host, device, and
    restore into blocks 5-6: those hold the prompt's first 8 tokens, 0-1 no longer."""
    engine = _engine(kv_block_bytes=1000)
    assert engine.can_swap_kv
    _prefill(engine, PROMPT, [0, 1, 2])
    snapshot = engine.kv_snapshot([0, 1])
    _prefill(engine, [1] * 10, [0, 1, 2])
    host = engine.kv_to_host(snapshot)
    assert (host.count, host.nbytes) == (2, 2000)
    engine.kv_restore([5, 6], engine.kv_to_device(host))
    _prefill(engine, PROMPT, [5, 6, 7], cached=8)
    with pytest.raises(AssertionError, match="wrong prefix reuse"):
        _prefill(engine, PROMPT, [0, 1, 7], cached=8)
    with pytest.raises(AssertionError, match="2 staged blocks into 3"):
        engine.kv_restore([5, 6, 7], engine.kv_to_device(host))


def test_swaps_take_the_emulated_links_time():
    gbps = 1e-3  # 1 MB/s: two blocks of 100 kB take 0.2 s each way
    engine = _engine(kv_block_bytes=100_000, emulated_link_gbps=gbps)
    start = time.perf_counter()
    host = engine.kv_to_host(engine.kv_snapshot([0, 1]))
    middle = time.perf_counter()
    engine.kv_to_device(host)
    end = time.perf_counter()
    assert middle - start >= 0.2 and end - middle >= 0.2


def test_sizes_and_the_cache_settings_reach_the_config():
    engine = _engine(
        kv_block_bytes=3000,
        rank_row_bytes=100,
        pool_bytes=40 * 3000 + 10,
        cache_policy="lru",
        host_pool_mib=7,
    )
    cfg = engine.config
    assert (cfg.num_blocks, cfg.pool_bytes) == (40, 0)  # pool_bytes // kv_block_bytes
    assert (cfg.cache_policy, cfg.host_pool_mib) == ("lru", 7)
    assert engine.memory().kv_block_bytes == 3000
    staged = engine.stage_adapter("r16", str(mock_adapter_dir(16)))
    assert staged.device_bytes == 16 * 100
    with pytest.raises(ConfigError, match=r"EngineConfig\.pool_bytes=21000 holds 7 KV blocks"):
        MockEngine(max_seq_len=32, block_size=SIZE, kv_block_bytes=3000, pool_bytes=21000)
