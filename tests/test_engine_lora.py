"""The engine with adapters, on the tiny random model: mixing, modes, loading, bad input."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jlora.adapters.peft import make_demo_adapters
from jlora.contract.errors import Code, RequestError
from jlora.engine.api import DEVICE, Request, SamplingParams
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama
from tests.engine_helpers import kv_blocks, make_engine, run_to_completion
from tests.model_helpers import jlora_last_logits
from tests.tolerances import assert_close

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
RANKS = (4, 12, 32)  # 12 is not a power of two


@pytest.fixture(scope="module")
def demo(tiny, tmp_path_factory):
    """Three demo adapters for cpu-tiny: name -> path, ranks 4, 12 and 32."""
    paths = make_demo_adapters(
        tiny.config, tmp_path_factory.mktemp("demo"), n=3, ranks=RANKS, seed=3
    )
    return {path.name: path for path in paths}


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


def _engine(tiny, demo=None, **overrides):
    config = {
        "max_slots": 4,
        "max_seq_len": 128,
        "min_bucket": 16,
        "max_loras": 2,
        "max_lora_rank": 32,
        **overrides,
    }
    engine = make_engine(tiny, **config)
    for name, path in (demo or {}).items():
        engine.register_adapter(name, str(path))
    if engine.adapters is not None:
        engine.adapters.wait_pinned()  # cached mode: on the device before serving
    return engine


def _fresh_cache(config, num_blocks):
    return KVCache.zeros(
        num_layers=config.num_layers,
        num_blocks=num_blocks,
        block_size=16,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=jnp.float32,
    )


def _names(demo):
    return sorted(demo)


def test_mixed_batch_rows_equal_each_alone_and_base_rows_equal_the_base_model(tiny, demo):
    a, b, c = _names(demo)
    prompts = _prompts([5, 9, 17, 3, 20, 11])
    rows = [a, None, b, c, a, None]
    engine = _engine(tiny, demo)
    mixed = run_to_completion(engine, prompts, GREEDY, rows)
    base_engine = make_engine(tiny, max_slots=4, max_seq_len=128, min_bucket=16)
    for ids, name, result in zip(prompts, rows, mixed, strict=True):
        if name is None:
            assert result == run_to_completion(base_engine, [ids], GREEDY)[0]
        else:
            alone = run_to_completion(_engine(tiny, {name: demo[name]}), [ids], GREEDY, [name])
            assert result == alone[0]
            base = run_to_completion(base_engine, [ids], GREEDY)[0]
            assert result["token_ids"] != base["token_ids"], f"{name} changed nothing"
    engine.close()


def test_tokens_do_not_depend_on_the_decode_row_bucket(tiny, demo):
    """As the batch drains, decode runs its live rows gathered into smaller row buckets
    (with their adapter slots and sampling); every request's tokens are those of the
    engine that always decodes every slot."""
    a, b, c = _names(demo)
    prompts = _prompts([5, 9, 17, 3, 20, 11], seed=4)
    rows = [a, None, b, c, a, None]
    sampling = [
        SamplingParams(max_tokens=n, temperature=t, seed=i, ignore_eos=True)
        for i, (n, t) in enumerate([(3, 0.0), (14, 0.8), (6, 0.0), (20, 0.0), (9, 0.9), (1, 0.0)])
    ]
    every_slot = run_to_completion(_engine(tiny, demo), prompts, sampling, rows)
    engine = _engine(tiny, demo, decode_row_buckets=(1, 2, 4))
    assert run_to_completion(engine, prompts, sampling, rows) == every_slot
    assert {rows for rows, _ in engine.device.steps._decode_exe} == {1, 2, 4}
    engine.close()


def test_tokens_do_not_depend_on_the_layer_loop(tiny, demo):
    """EngineConfig.layer_loop "unrolled" (a GPU's default) against "scan" (a CPU's), with
    adapters of three ranks and base rows mixed: packed prefills, one prompt prefilled
    in chunks under a small token budget continuing its cached prefix, a second turn
    hitting the prefix cache, then decode. The same tokens; and "auto" is the scan here.
    (The reference backend: with the Pallas kernels interpreted, an unrolled engine takes
    a minute to compile cold; bench.step_profile runs BGMV unrolled on a GPU.)"""
    a, b, c = _names(demo)
    prompts = _prompts([5, 9, 70, 3, 20, 11], seed=6)
    rows = [a, None, b, c, a, None]
    sampling = [
        SamplingParams(max_tokens=n, temperature=t, seed=i, ignore_eos=True)
        for i, (n, t) in enumerate([(4, 0.0), (9, 0.8), (6, 0.0), (12, 0.0), (7, 0.9), (2, 0.0)])
    ]
    turns = [prompts, [p + [7, 8, 9] for p in prompts]]
    tokens = {}
    for loop in ("scan", "unrolled"):
        engine = _engine(tiny, demo, layer_loop=loop, prefill_token_budget=32)
        assert engine.device.model.unroll_layers == (loop == "unrolled")
        tokens[loop] = [run_to_completion(engine, turn, sampling, rows) for turn in turns]
        assert engine.stats().cache.hit_tokens > 0, "the second turn never hit the cache"
        engine.close()
    assert tokens["unrolled"] == tokens["scan"]
    auto = _engine(tiny, layer_loop="auto")
    assert not auto.device.model.unroll_layers  # a CPU
    auto.close()


@pytest.mark.product_codegen
def test_base_rows_are_bit_identical_in_the_model(tiny, demo):
    """Logits of rows without an adapter, next to adapted rows, equal the base model's."""
    engine = _engine(tiny, demo, max_loras=3, lora_mode="cached")
    slots = [engine.adapters.slots.slot_of(name) for name in _names(demo)]
    base_model = Llama(tiny.config)
    config, slots_count = tiny.config, 6

    def cache():
        return _fresh_cache(config, slots_count * 2)

    prompt = _prompts([7])[0]
    with_lora = jlora_last_logits(tiny, prompt, bucket=32, engine=engine, adapter=None)
    np.testing.assert_array_equal(with_lora, jlora_last_logits(tiny, prompt, bucket=32))

    idx = np.array([slots[0], -1, slots[1], -1, slots[2], -1], np.int32)
    step_tokens = np.array(_prompts([slots_count])[0], np.int32)
    positions = np.arange(slots_count, dtype=np.int32) + 3
    tables = kv_blocks(engine, slots_count * 2).reshape(slots_count, 2)
    mixed, _ = jax.jit(engine.device.model.decode)(
        tiny.params, engine.device.cache, step_tokens, positions, tables,
        engine.device.lora.weights, idx,
    )  # fmt: skip
    tables = np.arange(slots_count * 2, dtype=np.int32).reshape(slots_count, 2)
    plain, _ = jax.jit(base_model.decode)(tiny.params, cache(), step_tokens, positions, tables)
    np.testing.assert_array_equal(np.asarray(mixed)[idx < 0], np.asarray(plain)[idx < 0])
    assert not np.allclose(np.asarray(mixed)[idx >= 0], np.asarray(plain)[idx >= 0])
    engine.close()


def test_cached_and_ondemand_give_identical_tokens(tiny, demo):
    prompts = _prompts([4, 30, 8, 15, 2, 22, 6], seed=1)
    a, b, c = _names(demo)
    rows = [c, a, None, b, c, a, b]
    cached = _engine(tiny, demo, max_loras=3, lora_mode="cached")
    ondemand = _engine(tiny, demo, max_loras=1)  # one device slot: loads and evictions
    assert run_to_completion(cached, prompts, GREEDY, rows) == run_to_completion(
        ondemand, prompts, GREEDY, rows
    )
    assert cached.adapters.slots.stats()["evictions"] == 0
    assert ondemand.adapters.slots.stats()["evictions"] >= 2
    for engine in (cached, ondemand):
        assert not any(engine.adapters.slots.in_use(name) for name in demo)
        assert engine.memory.held_pages() == 0
        engine.close()


@pytest.mark.parametrize("policy", ["fastlibra", "lru"])
def test_the_pool_not_max_loras_sets_the_adapters_resident(tiny, demo, policy):
    """FastLibra §4.3: with the adapters in the KV cache's pages (the default), the pool
    holds as many as their ranks' pages fit, whatever max_loras says: in a pool with room
    to spare, an engine of one max_loras keeps all three demo adapters (ranks 4, 12, 32)
    resident, evicting none, and gives the tokens of an engine with a stacked slot for
    each. Under "lru" (vLLM's static share) max_loras binds: one slot, loads and
    evictions. (In the default pool, KV and one rank-32 adapter's room, the three do not
    fit: fastlibra evicts adapters for pages there.)"""
    a, b, c = _names(demo)
    prompts = _prompts([4, 30, 8, 15, 2, 22], seed=3)
    rows = [c, a, None, b, c, a]
    stacked = _engine(tiny, demo, max_loras=3, lora_pool="slots")
    expected = run_to_completion(stacked, prompts, GREEDY, rows)
    stacked.close()
    engine = _engine(tiny, demo, max_loras=1, cache_policy=policy, kv_cache_tokens=4096)
    assert run_to_completion(engine, prompts, GREEDY, rows) == expected
    slots, stats = engine.adapters.slots, engine.stats()
    if policy == "fastlibra":
        assert stats.adapter_slots_total == engine.config.num_blocks
        assert slots.stats()["evictions"] == 0
        assert all(engine.adapters.info(name).state == DEVICE for name in demo)
    else:
        assert stats.adapter_slots_total == 1
        assert slots.stats()["evictions"] >= 2
    engine.close()


def test_the_running_batch_keeps_decoding_while_an_adapter_loads(tiny, demo):
    name = _names(demo)[-1]  # rank 32
    # ~1.2 MB of slots at 0.005 GB/s: the transfer takes about a quarter of a second.
    engine = _engine(tiny, demo, emulated_link_gbps=0.005)
    engine.add_request(Request("base", _prompts([6])[0], SamplingParams(max_tokens=100)))
    engine.step()
    engine.add_request(Request("lora", _prompts([6], seed=2)[0], GREEDY, adapter=name))
    steps_while_loading, tokens = 0, {"base": [], "lora": []}
    while engine.has_unfinished:
        events = engine.step()
        if engine.adapters.slots.is_loading(name):
            assert [e.request_id for e in events] == ["base"]
            steps_while_loading += 1
        for event in events:
            tokens[event.request_id].append(event.token_id)
    assert steps_while_loading >= 2
    assert len(tokens["lora"]) == GREEDY.max_tokens
    engine.close()


def test_unknown_adapter_is_refused_by_name(tiny, demo):
    engine = _engine(tiny, demo)
    with pytest.raises(RequestError, match="adapter='nope' is not registered") as caught:
        engine.add_request(Request("r", [1, 2, 3], GREEDY, adapter="nope"))
    assert (caught.value.code, caught.value.field) == (Code.NOT_FOUND, "adapter")
    base_only = make_engine(tiny, max_slots=2, max_seq_len=64, min_bucket=16)
    with pytest.raises(RequestError, match="adapter=") as caught:
        base_only.add_request(Request("r", [1, 2, 3], GREEDY, adapter=_names(demo)[0]))
    assert caught.value.code == Code.NOT_FOUND
    with pytest.raises(RequestError, match="max_loras=0") as caught:
        base_only.register_adapter("x", str(demo[_names(demo)[0]]))
    assert caught.value.code == Code.FAILED_PRECONDITION
    assert not engine.has_unfinished
    engine.close()


def _state(engine):
    return (
        engine.device.store.names(),
        engine.device.store.arena.bytes_used,
        engine.adapters.slots.resident(),
        engine.adapters.slots.loading(),
        engine.adapters.slots.pinned,
    )


def _corrupt_copy(path, tmp_path):
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(path, copy)
    weights = copy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return copy


@pytest.mark.parametrize(
    "case, expected, code, field",
    [
        ("missing", "does not exist", Code.INVALID_ARGUMENT, "path"),
        ("corrupt", "adapter_model.safetensors", Code.INVALID_ARGUMENT, "path"),
        ("other-base", "different base model", Code.INVALID_ARGUMENT, "path"),
        ("rank", "max_lora_rank=8", Code.INVALID_ARGUMENT, "path"),
        ("targets", "lora_targets=", Code.INVALID_ARGUMENT, "path"),
        ("duplicate", "already registered", Code.ALREADY_EXISTS, "name"),
        ("bad-name", "name=", Code.INVALID_ARGUMENT, "name"),
        ("cached-full", "max_loras=1", Code.FAILED_PRECONDITION, "pin"),
        ("pool-full", "pinned adapters would take", Code.FAILED_PRECONDITION, "pin"),
    ],
)
def test_bad_adapters_change_nothing(tiny, demo, tmp_path, case, expected, code, field):
    from configs import load_preset

    names = _names(demo)
    overrides = {
        "rank": {"max_lora_rank": 8},
        "targets": {"lora_targets": ("q_proj", "v_proj")},
        # stacked slots: max_loras caps the adapters resident (the pool's pages do not)
        "cached-full": {"max_loras": 1, "lora_mode": "cached", "lora_pool": "slots"},
        # the adapters in the pool's pages, which hold a sequence's KV and one rank-32
        # adapter: the rank-4 one pinned, a rank-32 one would starve the KV
        "pool-full": {"max_loras": 1, "lora_mode": "cached", "kv_cache_tokens": 128},
    }.get(case, {})
    first = demo[names[0]]
    if case == "targets":  # the engine holds q_proj and v_proj only; so does its adapter
        first = make_demo_adapters(
            tiny.config, tmp_path / "qv", n=1, ranks=[4], targets=("q_proj", "v_proj")
        )[0]
    engine = _engine(tiny, {names[0]: first}, **overrides)
    before = _state(engine)
    path = {
        "missing": tmp_path / "no-such-adapter",
        "corrupt": _corrupt_copy(demo[names[1]], tmp_path) if case == "corrupt" else None,
        "other-base": make_demo_adapters(
            load_preset("smollm2-135m").config, tmp_path, n=1, ranks=[4]
        )[0]
        if case == "other-base"
        else None,
    }.get(case, demo[names[-1]])
    name = {"duplicate": names[0], "bad-name": "../escape"}.get(case, "new")
    with pytest.raises(RequestError, match=expected.replace("[", r"\[")) as caught:
        engine.register_adapter(name, str(path))
    assert (caught.value.code, caught.value.field) == (code, field)
    assert _state(engine) == before
    # The engine still serves what it had.
    result = run_to_completion(engine, _prompts([5]), GREEDY, [names[0]])
    assert len(result[0]["token_ids"]) == GREEDY.max_tokens
    engine.close()


def test_unregister_refuses_an_adapter_in_use_then_frees_it(tiny, demo):
    name = _names(demo)[0]
    engine = _engine(tiny, {name: demo[name]})
    engine.add_request(Request("r", _prompts([5])[0], GREEDY, adapter=name))
    with pytest.raises(RequestError, match="named by 1 queued or running") as caught:
        engine.unregister_adapter(name)
    assert caught.value.code == Code.FAILED_PRECONDITION
    while engine.has_unfinished:
        engine.step()
    engine.unregister_adapter(name)
    assert engine.device.store.names() == [] and engine.device.store.arena.bytes_used == 0
    assert engine.adapters.slots.resident() == {}
    with pytest.raises(RequestError) as caught:
        engine.add_request(Request("r2", [1, 2], GREEDY, adapter=name))
    assert caught.value.code == Code.NOT_FOUND
    engine.close()


def test_close_leaves_no_shared_memory_behind(tiny, demo):
    engine = _engine(tiny, demo)
    segment = f"/dev/shm/{engine.device.store.arena.name.lstrip('/')}"
    assert os.path.exists(segment)
    engine.close()
    assert not os.path.exists(segment)


@pytest.fixture(scope="module")
def mode_engines(tiny, demo):
    """One engine per mode, reused across hypothesis examples (each example drains them)."""
    engines = {
        "cached": _engine(tiny, demo, max_loras=3, lora_mode="cached"),
        "ondemand": _engine(tiny, demo, max_loras=2),  # fewer slots than adapters
    }
    yield engines
    for engine in engines.values():
        engine.close()


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.sampled_from([0, 1, 2, None]), st.integers(1, 6)),
        min_size=1,
        max_size=7,
    ),
    seed=st.integers(0, 2**16),
)
def test_cached_and_ondemand_agree_on_any_mix(mode_engines, demo, requests, seed):
    names = _names(demo)
    prompts = _prompts([length for length, _, _ in requests], seed=seed)
    rows = [None if index is None else names[index] for _, index, _ in requests]
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True) for _, _, n in requests]
    results = {
        mode: run_to_completion(engine, prompts, sampling, rows)
        for mode, engine in mode_engines.items()
    }
    assert results["cached"] == results["ondemand"]
    for engine in mode_engines.values():
        assert not any(engine.adapters.slots.in_use(name) for name in names)


@pytest.mark.parametrize("rank", [1, 256])
def test_lora_equals_merged_weights_at_extreme_ranks(tiny, tmp_path, rank):
    """An independent oracle: W + A·B merged into the base weights gives the same logits."""
    from jlora.adapters.peft import load_peft_adapter

    [path] = make_demo_adapters(tiny.config, tmp_path, n=1, ranks=[rank], seed=rank)
    engine = _engine(tiny, {"a": path}, max_loras=1, max_lora_rank=rank, lora_mode="cached")
    adapter = load_peft_adapter(path, tiny.config)
    merged = jax.tree.map(lambda x: x, tiny.params)
    for target, (lora_a, lora_b) in adapter.weights.items():
        kernel = merged["layers"][target]["kernel"]
        merged["layers"][target]["kernel"] = kernel + jnp.einsum("lir,lro->lio", lora_a, lora_b)
    prompt = _prompts([9], seed=5)[0]
    ours = jlora_last_logits(tiny, prompt, bucket=32, engine=engine, adapter="a")
    oracle = jlora_last_logits(tiny, prompt, bucket=32, params=merged)
    base = jlora_last_logits(tiny, prompt, bucket=32)
    assert_close(ours, oracle, jnp.float32, np.float32, scope="model")
    assert not np.allclose(ours, base, atol=1e-2), "the adapter changed nothing"
    engine.close()
