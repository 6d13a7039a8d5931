"""CPU-assisted prefill on the tiny model: the callbacks' products against numpy, the same
tokens and logits as the device path, routing that switches mid-prefill, a worker killed
mid-prefill, the cost model, clean-up.

The adapters are cold and the link is throttled (`emulated_link_gbps`), so each layer
group lands while prefills run; every test builds its engines with real CPU workers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.adapters.peft import make_demo_adapters
from jlora.adapters.store import HostStore
from jlora.device.cpu_assist.callbacks import CpuAssist
from jlora.engine import cost_model
from jlora.engine.api import Request, SamplingParams
from jlora.model.lora.base import Segments
from jlora.model.lora.targets import INPUT_GROUPS, target_shapes
from tests.engine_helpers import kv_blocks, make_engine, run_to_completion
from tests.tolerances import assert_close

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# Three cold adapters: different ranks and target sets (one leaves the MLP alone, one
# the attention; rank 12 is not a power of two).
ADAPTERS = {
    "qv-r4": (4, ("q_proj", "v_proj")),
    "all-r12": (12, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "mlp-r32": (32, ("o_proj", "gate_proj", "up_proj", "down_proj")),
}
# cpu-tiny's adapters weigh ~20-90 KB per layer group as packed; at 0.2 MB/s a group
# takes about a tenth to half a second to land.
SLOW_LINK_GBPS = 2e-4


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cold")
    paths = {}
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        (path,) = make_demo_adapters(
            tiny.config, out / name, n=1, ranks=[rank], targets=targets, seed=10 + i
        )
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def device_only(tiny, adapters):
    """device_only(prompts, rows) -> the tokens of the ondemand (device-only) engine."""
    engine = _engine(tiny, adapters, "ondemand")
    yield lambda prompts, rows: run_to_completion(engine, prompts, GREEDY, rows)
    engine.close()


def _engine(tiny, adapters, mode, warm=True, **overrides):
    config = {
        "max_slots": 4,
        "max_seq_len": 128,
        "min_bucket": 16,
        "max_loras": 3,
        "max_lora_rank": 32,
        "lora_mode": mode,
        "lora_layer_groups": 3,  # one layer per group
        "cpu_workers": 2,
        **overrides,
    }
    engine = make_engine(tiny, **config)
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    if warm:  # so no compilation lets an adapter land before its prefill
        engine.warmup(prompt_lengths=[16, 32], max_length=32 + GREEDY.max_tokens)
    return engine


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


def _segments(engine) -> list[Path]:
    """The engine's shared-memory segments: the host store's arena, the control block."""
    names = [engine.device.store.arena.name, engine.device.cpu.pool.control_name]
    return [Path("/dev/shm") / name.lstrip("/") for name in names]


def _route_switch(engine):
    """Make every CPU-assisted prefill run its first layer group on the CPU and its last on
    the device: the last segment waits until the adapter has landed (as a slow device
    would), so the routing switches in the middle of the prefill whatever the timing."""
    install_landed, groups = engine.device.lora.install_landed, len(engine.device.lora.groups)
    calls = []

    def patched(name, slot, cache):
        calls.append(name)
        if len(calls) % groups == 0:  # the last segment of this prefill
            deadline = time.monotonic() + 30
            landed, cache = install_landed(name, slot, cache)  # the cache is given back
            while landed < groups:
                assert time.monotonic() < deadline, "the adapter never landed"
                time.sleep(0.005)
                landed, cache = install_landed(name, slot, cache)
        return install_landed(name, slot, cache)

    engine.device.lora.install_landed = patched


@pytest.mark.parametrize("threads", [False, True], ids=["submit-collect", "apply"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "io-callback"])
def test_callbacks_give_x_a_b_in_the_projections_columns(tiny, adapters, in_place, threads):
    """The jitted ops alone, for every adapter, input group and a first and a last
    layer: the real rows' x·A·B in the columns of the projections the adapter adapts,
    zeros in the others' columns and in the padding rows; a group the adapter leaves
    alone makes no hand-off (the collect is skipped on the device) and adds zeros. Both
    kinds of callback: in place (the CPU's: buffer_callbacks, and for `apply` an FFI
    handler, jlora/device/cpu_assist/apply.py) and with host copies (an accelerator's);
    both paths: a submit and a collect around the base projections (worker
    processes), and one `apply` (threads of this process, where nothing overlaps)."""
    shapes = target_shapes(tiny.config)
    store = HostStore(tiny.config, 8 << 20)
    cpu = None
    try:
        for name, path in adapters.items():
            store.register(name, path)
        cpu = CpuAssist(store.arena.name, shapes, workers=1, threads=threads, max_rows=32)
        cpu.in_place = in_place
        assert cpu.overlapped is not threads

        @functools.partial(jax.jit, static_argnums=0)
        def callbacks(group, layer, x, length):
            shape = (x.shape[0], cpu.widths[group])
            if threads:
                return cpu.apply(group, jnp.int32(0), layer, x, length, shape)
            ticket = cpu.submit(group, jnp.int32(0), layer, x, length)
            return cpu.collect(group, jnp.int32(0), ticket, shape)

        rng = np.random.default_rng(3)
        for name in ADAPTERS:
            weights = store.tensors(name)
            cpu.begin(store.get(name))
            try:
                for group, names in enumerate(INPUT_GROUPS):
                    fan_in = shapes[names[0]][0]
                    for layer, length in ((0, 21), (tiny.config.num_layers - 1, 32)):
                        x = rng.standard_normal((32, fan_in), np.float32)
                        handoffs = cpu.handoffs
                        got = callbacks(group, np.int32(layer), x, np.int32(length))
                        expected = np.zeros((32, cpu.widths[group]), np.float64)
                        column = 0
                        for target in names:
                            width = shapes[target][1]
                            if target in weights:
                                a, b = (w[layer].astype(np.float64) for w in weights[target])
                                expected[:length, column : column + width] = x[:length] @ a @ b
                            column += width
                        assert_close(got, expected, "float32", "float32", scope="op")
                        adapted = any(target in weights for target in names)
                        assert cpu.handoffs == handoffs + adapted, (name, names)
            finally:
                cpu.end()
        assert cpu.failure is None and cpu.pool.fallbacks == 0
    finally:
        if cpu is not None:
            cpu.close()
        store.close()


def test_a_plan_whose_last_layer_leaves_the_arena_fails_its_prefill_and_adds_zeros(tiny, adapters):
    """On one CPU device `begin` checks the prefill's jobs at the first and the last layer
    (jlora/device/cpu_assist/apply.py): an adapter whose layers would run past the arena is
    refused before any product, the error names the field, and the FFI handler then
    writes zeros; the next prefill, of a sound adapter, gets its products."""
    shapes = target_shapes(tiny.config)
    store = HostStore(tiny.config, 8 << 20)
    cpu = CpuAssist(store.arena.name, shapes, workers=1, threads=True, max_rows=32)
    try:
        store.register("all-r12", adapters["all-r12"])
        stored = store.get("all-r12")
        apply = jax.jit(
            lambda x: cpu.apply(
                0, jnp.int32(0), jnp.int32(1), x, jnp.int32(32), (32, cpu.widths[0])
            )
        )
        x = np.random.default_rng(4).standard_normal((32, shapes["q_proj"][0]), np.float32)
        cpu.begin(dataclasses.replace(stored, layer_stride=store.arena.capacity))
        assert "a_offset" in str(cpu.failure) and "inside the arena" in str(cpu.failure)
        assert (np.asarray(apply(x)) == 0).all()
        cpu.end()
        cpu.begin(stored)
        assert cpu.failure is None
        a, b = (w[1].astype(np.float64) for w in store.tensors("all-r12")["q_proj"])
        got = np.asarray(apply(x))[:, : shapes["q_proj"][1]]
        assert_close(got, x @ a @ b, "float32", "float32", scope="op")
        cpu.end()
    finally:
        cpu.close()
        store.close()


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_cpu_assisted_tokens_equal_device_only_with_routing_switching_mid_prefill(
    tiny, adapters, device_only, layer_loop
):
    """A mixed batch of cold adapters (and base rows): CPU-assisted prefills give the
    tokens of the device-only (ondemand, scanned) engine, and some of them ran CPU then
    device. With the layers unrolled (a GPU's default), each segment is compiled for its
    own first layer."""
    names = list(ADAPTERS)
    prompts = _prompts([5, 17, 9, 30, 12, 3])
    rows = [names[0], names[1], None, names[2], names[1], names[0]]
    expected = device_only(prompts, rows)
    engine = _engine(
        tiny, adapters, "cpu-assist", emulated_link_gbps=SLOW_LINK_GBPS, layer_loop=layer_loop
    )
    starts = {start for _, _, start in engine.device.steps._segment_exe}
    assert starts == ({0, 1, 2} if layer_loop == "unrolled" else {0})
    segments = _segments(engine)
    assert all(path.exists() for path in segments)
    try:
        _route_switch(engine)
        got = run_to_completion(engine, prompts, GREEDY, rows)
        counters = dict(engine.counters)
    finally:
        engine.close()
    assert got == expected
    assert counters["assisted_prefills"] >= 3  # one per cold adapter at least
    assert counters["assisted_mixed_prefills"] >= 3
    assert counters["cpu_layer_groups"] >= 3 and counters["device_layer_groups"] >= 3
    assert not any(path.exists() for path in segments)  # unlinked at close


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_routed_layers_give_the_device_logits(tiny, adapters, dtype):
    """Model level: the segmented prefill with any routing (all CPU, mixed, all device)
    gives the logits of the one-call device prefill, within the tolerance policy."""
    engine = _engine(tiny, adapters, "cpu-assist", warm=False, dtype=dtype)
    try:
        name = "all-r12"
        engine.adapters.slots.load_all([name])
        slot = engine.adapters.slots.slot_of(name)
        model, params, weights = (
            engine.device.model,
            engine.device.params,
            engine.device.lora.weights,
        )
        tokens = np.zeros(32, np.int32)
        tokens[:21] = _prompts([21], seed=4)[0]
        table = jnp.asarray(kv_blocks(engine, 8))  # the engine's cache holds its adapters
        seg = Segments.single(slot, 32)

        def cache():
            return engine.device.cache  # not donated: left as it was

        device = jax.jit(model.prefill)(params, cache(), tokens, 21, table, weights, seg)[0]

        @jax.jit
        def routed(route):
            x = model.embed(params, tokens)
            x, _ = model.prefill_layers(
                params, cache(), x, np.int32(21), table, 0, 3, weights, seg, route
            )
            return model.last_logits(params, x, np.int32(21))

        engine.device.cpu.begin(engine.device.store.get(name))
        try:
            for route in ([1, 1, 1], [1, 0, 1], [0, 0, 0]):
                logits = routed(np.array(route, np.int32))
                assert_close(logits, device, dtype, "float32", scope="model")
            handoffs = engine.device.cpu.handoffs
        finally:
            engine.device.cpu.end()
        assert handoffs == 4 * 3 + 4 * 2  # 4 input groups in each CPU-routed layer
    finally:
        engine.close()


def test_a_worker_killed_mid_prefill_loses_nothing_and_is_respawned(tiny, adapters, device_only):
    """SIGKILL a CPU worker from inside a prefill's callbacks: the request still gets the
    device-only tokens (its rows are recomputed in the engine's process), the watchdog
    respawns the worker, and nothing is left in /dev/shm after close. The products run
    in worker processes, as beside an accelerator."""
    prompts = _prompts([25])
    expected = device_only(prompts, ["all-r12"])
    engine = _engine(
        tiny, adapters, "cpu-assist", emulated_link_gbps=SLOW_LINK_GBPS, cpu_lora="processes"
    )
    segments = _segments(engine)
    try:
        pool, submit = engine.device.cpu.pool, engine.device.cpu.pool.submit
        killed = []

        def submit_then_kill(x, jobs, **kwargs):
            ticket = submit(x, jobs, **kwargs)
            if not killed:
                assert ticket.shares[0].worker >= 0
                victim = pool._workers[ticket.shares[0].worker].process
                os.kill(victim.pid, signal.SIGKILL)
                killed.append(victim.pid)
            return ticket

        pool.submit = submit_then_kill
        got = run_to_completion(engine, prompts, GREEDY, ["all-r12"])
        deadline = time.monotonic() + 30
        while pool.respawns < 1 or len(pool.ready_workers()) < pool.num_workers:
            assert time.monotonic() < deadline, "the killed worker was not respawned"
            time.sleep(0.05)
        assert killed and engine.counters["assisted_prefills"] == 1
        assert pool.respawns >= 1
    finally:
        engine.close()
    assert got == expected
    assert not any(path.exists() for path in segments)


def test_a_cpu_path_that_cannot_recover_fails_only_its_request(tiny, adapters, device_only):
    """The pool itself breaks inside a prefill (beyond a dead worker, which it recovers):
    that request ends with an error, its KV blocks freed; the engine's device
    state is intact, so the other requests and the next one get the device-only tokens."""
    prompts = _prompts([25, 9, 14])
    rows = ["all-r12", None, "qv-r4"]
    expected = device_only(prompts, rows)
    engine = _engine(tiny, adapters, "cpu-assist", emulated_link_gbps=SLOW_LINK_GBPS)
    try:
        pool, broken = engine.device.cpu.pool, []

        def once_broken(method):  # the first product the prefill asks for fails
            def call(*args, **kwargs):
                if not broken:
                    broken.append(method.__name__)
                    raise OSError("the shared-memory control block is gone")
                return method(*args, **kwargs)

            return call

        pool.collect, pool.check = once_broken(pool.collect), once_broken(pool.check)
        for i, (ids, adapter) in enumerate(zip(prompts, rows, strict=True)):
            engine.add_request(Request(f"r{i}", ids, GREEDY, adapter=adapter))
        events: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished:
            for event in engine.step():
                events[event.request_id].append(event)
        # On a CPU the products run on the engine's threads, from a plan the pool checks
        # once a prefill (jlora/device/cpu_assist/apply.py).
        assert broken == ["check"]
        [failed] = events["r0"]  # the first assisted prefill met the broken pool
        assert failed.finish_reason == "error" and failed.error.reason == "CPU_ASSIST_FAILED"
        assert "control block is gone" in failed.error.message
        for i in (1, 2):
            assert [e.token_id for e in events[f"r{i}"]] == expected[i]["token_ids"]
        assert engine.memory.held_pages() == 0
        assert run_to_completion(engine, prompts[:1], GREEDY, rows[:1]) == expected[:1]
    finally:
        engine.close()


def test_an_untrusted_cpu_pool_makes_cold_requests_wait(tiny, adapters, device_only):
    """Once the pool cannot be trusted (a failed ticket could not even be let go), cold
    requests fall back to the device path: they wait for their adapter."""
    prompts = _prompts([12, 7])
    rows = ["mlp-r32", "qv-r4"]
    expected = device_only(prompts, rows)
    engine = _engine(tiny, adapters, "cpu-assist", emulated_link_gbps=SLOW_LINK_GBPS)
    try:
        engine.device.cpu.usable = False
        assert not engine.device.can_assist
        assert run_to_completion(engine, prompts, GREEDY, rows) == expected
        assert engine.counters["assisted_prefills"] == 0
    finally:
        engine.close()


def test_auto_waits_on_a_fast_link_and_assists_on_a_slow_one(tiny, adapters, device_only, caplog):
    """The cost model's choice follows the link: each decision is logged with both
    estimates, and the tokens are the device-only ones either way."""
    prompts = _prompts([20, 20])
    rows = ["mlp-r32", "qv-r4"]
    expected = device_only(prompts, rows)
    for gbps, chosen in ((100.0, "auto_wait"), (SLOW_LINK_GBPS, "auto_assist")):
        engine = _engine(tiny, adapters, "auto", emulated_link_gbps=gbps)
        try:
            with caplog.at_level("INFO", logger="jlora.engine.scheduler"):
                got = run_to_completion(engine, prompts, GREEDY, rows)
            counters = dict(engine.counters)
        finally:
            engine.close()
        assert got == expected
        assert counters.get(chosen, 0) >= 1, (gbps, counters)
        assert "estimated TTFT: wait" in caplog.text


def test_cost_model_walks_the_segments():
    """Hand-made cases: load 4 s over 4 one-layer groups, prefill 1 s (0.25 s a layer)."""
    slow_cpu = cost_model.ColdStart(4.0, 1.0, 2.0, 0.0, (1, 1, 1, 1))
    # CPU layers take 2 s each: t = 2 (group 0, lands at 1: CPU), t = 2.25 (group 1 landed
    # at 2: device), group 2 lands at 3 > 2.25: CPU, t = 4.25; group 3 landed at 4: 4.5.
    assert cost_model.assist_seconds(slow_cpu) == pytest.approx(4.5)
    assert cost_model.wait_seconds(slow_cpu) == 5.0
    assert cost_model.decide(slow_cpu).assist
    fast_link = cost_model.ColdStart(0.01, 1.0, 2.0, 0.0, (1, 1, 1, 1))
    assert cost_model.assist_seconds(fast_link) == pytest.approx(2.75)
    assert not cost_model.decide(fast_link).assist
    # A CPU layer never beats the device's base projections it overlaps.
    fast_cpu = cost_model.ColdStart(100.0, 1.0, 0.0, 0.0, (2, 2))
    assert cost_model.assist_seconds(fast_cpu) == pytest.approx(1.0)
    # Where nothing overlaps it (the device is the CPU), a CPU layer costs the device
    # layer plus its products: 0.25 + 0.05 + 0.01, so a 1 ms load is worth waiting for.
    same_cores = cost_model.ColdStart(0.001, 1.0, 0.05, 0.01, (1, 1, 1, 1), overlapped=False)
    assert cost_model.assist_seconds(same_cores) == pytest.approx(1.0 + 0.06)
    assert not cost_model.decide(same_cores).assist
    assert cost_model.decide(dataclasses.replace(same_cores, overlapped=True)).assist
    with pytest.raises(ValueError, match="ColdStart.prefill_s=-1"):
        cost_model.ColdStart(1.0, -1, 0.0, 0.0, (1,))
    with pytest.raises(ValueError, match="ColdStart.group_layers"):
        cost_model.ColdStart(1.0, 1.0, 0.0, 0.0, ())
