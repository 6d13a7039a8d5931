"""The host store: a shared-memory arena, layer-major regions, readable from another process."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import shared_memory

import numpy as np
import pytest

from configs import load_preset
from jlora.adapters.peft import load_peft_adapter, make_demo_adapters
from jlora.adapters.store import ALIGN, HostStore, SharedArena, store_bytes, store_mib
from jlora.contract.errors import Code, ResourceExhausted


@pytest.fixture(scope="module")
def demo(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return make_demo_adapters(
        tiny.config, root, n=2, ranks=[4, 12], targets=("q_proj", "down_proj", "v_proj")
    )


def test_arena_first_fit_alignment_and_coalescing():
    arena = SharedArena(10 * ALIGN)
    try:
        a = arena.alloc(1)  # rounds up to one aligned unit
        b = arena.alloc(3 * ALIGN)
        c = arena.alloc(ALIGN + 1)  # two units
        assert (a, b, c) == (0, ALIGN, 4 * ALIGN)
        assert arena.bytes_used == 6 * ALIGN
        with pytest.raises(MemoryError, match="no free region of 320 bytes"):
            arena.alloc(5 * ALIGN)  # 4 units free at the end only
        arena.free(b)
        assert arena.alloc(2 * ALIGN) == b  # first fit: the hole left by b
        arena.free(a)
        arena.free(b)
        arena.free(c)  # everything coalesces back into one region
        assert arena.alloc(10 * ALIGN) == 0
    finally:
        arena.close()


def test_regions_are_layer_major_with_scaling_folded_into_b(tiny, demo):
    store = HostStore(tiny.config, 2**22)
    try:
        stored = store.register("a", demo[1])
        adapter = load_peft_adapter(demo[1], tiny.config)
        rank = stored.adapter.rank
        assert stored.adapter.targets == ("q_proj", "v_proj", "down_proj")
        raw = np.frombuffer(store.arena.shm.buf, np.float32)
        for layer in range(tiny.config.num_layers):
            # One layer is one contiguous run: A, B of each target in canonical order.
            start = (stored.offset + layer * stored.layer_stride) // 4
            parts = []
            for target in stored.adapter.targets:
                parts += [
                    adapter.weights[target][0][layer].ravel(),
                    adapter.weights[target][1][layer].ravel(),
                ]
            expected = np.concatenate(parts)
            np.testing.assert_array_equal(raw[start : start + expected.size], expected)
            assert expected.size * 4 == stored.layer_stride
        for target, (a, b) in store.tensors("a").items():
            np.testing.assert_array_equal(a, adapter.weights[target][0])
            np.testing.assert_array_equal(b, adapter.weights[target][1])
            assert a.shape[-1] == rank and not a.flags.owndata  # a view into the arena
        del raw, a, b
    finally:
        store.close()


def _read_layer_sum(shm_name: str, offset: int, count: int, queue) -> None:
    """In a spawned process: attach the arena by name and sum a run of floats in place."""
    shm = shared_memory.SharedMemory(name=shm_name)
    view = np.ndarray((count,), np.float32, buffer=shm.buf, offset=offset)
    queue.put(float(view.astype(np.float64).sum()))
    del view
    shm.close()


def test_another_process_reads_a_layer_in_place(tiny, demo):
    store = HostStore(tiny.config, 2**22)
    try:
        stored = store.register("a", demo[0])
        layer = 2
        offset = stored.offset + layer * stored.layer_stride
        count = stored.layer_stride // 4
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        worker = context.Process(
            target=_read_layer_sum, args=(store.arena.name, offset, count, queue)
        )
        worker.start()
        theirs = queue.get(timeout=60)
        worker.join(timeout=60)
        ours = np.ndarray((count,), np.float32, buffer=store.arena.shm.buf, offset=offset)
        assert theirs == pytest.approx(float(ours.astype(np.float64).sum()), rel=0, abs=0)
        del ours
    finally:
        store.close()


def test_a_full_store_refuses_and_keeps_what_it_has(tiny, demo):
    probe = HostStore(tiny.config, 2**22)
    size = probe.register("probe", demo[1]).nbytes
    probe.close()
    store = HostStore(tiny.config, size + ALIGN)
    try:
        store.register("a", demo[1])
        full = "'b': the host store has no free region"
        with pytest.raises(ResourceExhausted, match=full) as err:
            store.register("b", demo[1])
        assert err.value.code == Code.RESOURCE_EXHAUSTED
        assert store.names() == ["a"]
        store.unregister("a")
        store.register("b", demo[1])  # the freed region is reused
    finally:
        store.close()


def test_store_bytes_is_exactly_what_the_adapters_take(tiny, demo):
    targets = ("q_proj", "v_proj", "down_proj")
    store = HostStore(tiny.config, store_bytes(tiny.config, [4, 12], targets))
    try:
        store.register("r4", demo[0])
        store.register("r12", demo[1])
        with pytest.raises(ResourceExhausted):
            store.register("more", demo[0])
    finally:
        store.close()
    assert store_mib(tiny.config, [4, 12], targets) == 1024  # never below the default
    # a Llama-2-7B adapter of rank 16 on every target: 16 · 78080 · 32 layers · 4 B = 152.5 MiB
    assert store_mib(load_preset("llama2-7b").config, [16] * 32) == 32 * 152.5


def test_close_unlinks_the_segment(tiny, demo):
    store = HostStore(tiny.config, 2**20)
    store.register("a", demo[0])
    path = f"/dev/shm/{store.arena.name.lstrip('/')}"
    assert os.path.exists(path)
    store.close()
    assert not os.path.exists(path)
