"""Rank-exact adapter transfers (jlora/device/lora_slots.py): only an adapter's own
targets and rank rows cross the host-to-device link; the slot's padding is written on
the device. Checked through the engine's own load and install, in every backend."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from configs import EngineConfig
from configs.engine import LORA_BACKENDS
from jlora.adapters.peft import load_peft_adapter, make_demo_adapters
from jlora.device.llama_engine import LlamaEngine
from jlora.model.lora.base import exact_rows, padded_rows, rank_bucket

MAX_RANK = 64
QV = ("q_proj", "v_proj")
GROUPS = 2  # cpu-tiny's 3 layers land as groups of 2 and 1: two install variants


def _besides(engine: LlamaEngine, bucket: int, targets) -> int:
    """The bytes a transfer sends besides the factors: per layer group and target, the
    reference and BGMV the rank (one i32), MBGMV the page of each rank row (`bucket`
    i32). Where the adapters live in the KV cache's pages (one device): the reference
    the rank and the pages its rows fill, MBGMV the rank and the cache's row of each
    rank row (an i32 each)."""
    backend, shapes = engine.lora.backend, engine.lora.shapes
    if backend.pooled and backend.name == "reference":
        return GROUPS * sum(4 + 4 * backend.pages_for(bucket, shapes[t]) for t in targets)
    per_target = {"reference": 4, "bgmv": 4, "mbgmv": 4 * bucket + 4 * backend.pooled}
    return per_target[backend.name] * len(targets) * GROUPS


def _engine(loaded, backend: str, **overrides) -> LlamaEngine:
    config = {
        "max_slots": 2, "max_seq_len": 64, "min_bucket": 16, "max_loras": 2,
        "max_lora_rank": MAX_RANK, "lora_backend": backend, "host_store_mib": 16,
        "lora_layer_groups": GROUPS, **overrides,
    }  # fmt: skip
    return LlamaEngine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=None,
        engine_config=EngineConfig(**config),
    )


def _stage(engine, tmp_path, name: str, rank: int, targets, seed: int = 0):
    """Stage a demo adapter; its (A [L, in, r], B·scaling [L, r, out]) per target."""
    [path] = make_demo_adapters(
        engine.model_config, tmp_path / name, n=1, ranks=[rank], targets=targets, seed=seed
    )
    engine.stage_adapter(name, str(path))
    return load_peft_adapter(path, engine.model_config).weights


def _load(engine, name: str, slot: int):
    transfer = engine.load_adapter(name, slot)
    engine.install_adapter(name, slot, transfer)
    return transfer


def _assert_slot_holds(engine, slot: int, weights) -> None:
    """Every target of the slots, every layer: the backend's factors of `slot` are the
    adapter's A and B (in the serving dtype) padded with zeros to the slots' rank, and
    zeros for the targets it does not adapt."""
    lora = engine.lora
    held = lora.backend.with_pool(lora.weights, engine.cache)  # pooled: the cache holds them
    for target in lora.shapes:
        for layer in range(engine.model_config.num_layers):
            a, b = lora.backend.factors(held, target, jnp.int32(layer), jnp.array([slot]))
            expected_a, expected_b = np.zeros(a.shape[1:]), np.zeros(b.shape[1:])
            if target in weights:
                lora_a, lora_b = weights[target]
                rank = lora_a.shape[-1]
                expected_a[:, :rank] = lora_a[layer]
                expected_b[:rank] = lora_b[layer]
            np.testing.assert_array_equal(np.asarray(a[0]), expected_a, err_msg=target)
            np.testing.assert_array_equal(np.asarray(b[0]), expected_b, err_msg=target)


def test_rank_buckets_are_powers_of_two_up_to_the_rows():
    assert [rank_bucket(r, 64) for r in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert [rank_bucket(r, 48) for r in (17, 33, 48)] == [32, 48, 48]  # never past the slot


def test_exact_rows_by_hand_and_back():
    # A factor of rank 3 (rows 1, 2, 3 of width 1) for slots of 8 rows: its bucket, 4
    # rows, cross; the device pads them to 8.
    factor = np.array([[[1.0], [2.0], [3.0]]])
    exact = exact_rows(factor, rows=8, shards=1, dtype=np.float32)
    np.testing.assert_array_equal(exact[0, :, 0], [1, 2, 3, 0])
    np.testing.assert_array_equal(padded_rows(exact, 8)[0, :, 0], [1, 2, 3, 0, 0, 0, 0, 0])
    # Split over four devices, rank 1 (bucket 1) crosses as 4 rows, one per device.
    exact = exact_rows(factor[:, :1], rows=8, shards=4, dtype=np.float32)
    np.testing.assert_array_equal(exact[0, :, 0], [1, 0, 0, 0])


@pytest.mark.serial
@pytest.mark.parametrize("backend", LORA_BACKENDS)
def test_a_rank_8_qv_adapter_sends_its_a_and_b_alone(tiny, tmp_path, backend):
    """Slots of rank 64 on all seven targets; a rank-8 adapter of q/v (rank 8 is its own
    bucket). Sent: A [in, 8] and B [8, out] of q and v in every layer, 4 bytes each
    (float32), and the few bytes `_besides` counts. The emulated link takes those
    bytes' time, not a padded slot's."""
    engine = _engine(tiny, backend, emulated_link_gbps=2e-3)  # 2 MB/s
    try:
        weights = _stage(engine, tmp_path, "small", 8, QV)
        start = time.perf_counter()
        transfer = _load(engine, "small", 0)
        seconds = time.perf_counter() - start
        factors = 4 * sum(a.size + b.size for a, b in weights.values())
        assert transfer.nbytes == factors + _besides(engine, 8, QV)
        link_s = transfer.nbytes / 2e6
        padded_s = engine.memory().lora_slot_bytes / 2e6  # what a padded slot would take
        assert padded_s > 20 * link_s
        assert link_s <= seconds < padded_s / 2
        _assert_slot_holds(engine, 0, weights)
        assert engine.lora.layer_bytes(8, QV) * tiny.config.num_layers == factors
    finally:
        engine.close()


@pytest.mark.parametrize("backend", LORA_BACKENDS)
def test_a_small_adapter_over_a_full_one_leaves_only_its_own_rows(tiny, tmp_path, backend):
    """A full adapter (rank 64, every target) in slot 1, then a rank-5 q/v adapter over
    it: the slot holds the small one padded with zeros (the device wrote the padding,
    the full one's rows and targets are gone); slot 0 is untouched throughout."""
    engine = _engine(tiny, backend)
    try:
        other = _stage(engine, tmp_path, "other", 12, ("k_proj", "down_proj"), seed=3)
        full = _stage(engine, tmp_path, "full", MAX_RANK, engine.lora.shapes, seed=1)
        small = _stage(engine, tmp_path, "small", 5, QV, seed=2)
        _load(engine, "other", 0)
        _load(engine, "full", 1)
        _assert_slot_holds(engine, 1, full)
        transfer = _load(engine, "small", 1)
        _assert_slot_holds(engine, 1, small)
        _assert_slot_holds(engine, 0, other)
        # Rank 5 crosses as its bucket, 8 rank rows.
        factors = 4 * sum(a.size + b.size for a, b in small.values())
        assert transfer.nbytes == factors * 8 // 5 + _besides(engine, 8, QV)
    finally:
        engine.close()


def test_installs_compile_when_staged_one_per_group_size_and_shape(tiny, tmp_path):
    """Staging compiles the installs of an adapter's shape (rank bucket, targets), one
    per layer-group size; ranks in one bucket share them, and a load compiles nothing."""
    engine = _engine(tiny, "reference")
    try:
        lora = engine.lora
        _stage(engine, tmp_path, "r5", 5, QV)
        assert lora.install_variants == 2  # groups of 2 layers and of 1
        _stage(engine, tmp_path, "r7", 7, QV)
        _stage(engine, tmp_path, "r8", 8, QV)
        assert lora.install_variants == 2  # the same bucket, 8
        _stage(engine, tmp_path, "r9", 9, QV)
        _stage(engine, tmp_path, "r8-q", 8, ("q_proj",))
        assert lora.install_variants == 6
        for slot, name in enumerate(("r5", "r9")):
            _load(engine, name, slot)
        assert lora.install_variants == 6
    finally:
        engine.close()
