"""The host attention kernels (jlora/model/host/attention.py). Decode: each row's softmax
over its own keys, read in place through its block table from the layer the scan is
at; the engine's tokens do not depend on which attention decoded them. Packed prefill:
each prompt's causal softmax over its own tokens, whatever else shares the call."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from cpu_offload.kernels.team import Team
from jlora.engine.api import SamplingParams
from jlora.model.attention import packed_causal_attention, paged_decode_attention
from jlora.model.host import attention as host_attention
from jlora.model.host.attention import (
    packed_causal_attention_host,
    paged_decode_attention_host,
    usable,
)
from jlora.model.kv_cache import KVCache
from tests.engine_helpers import make_engine, run_to_completion
from tests.test_attention import naive, random
from tests.tolerances import assert_close


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (9, 3)])
def test_each_row_attends_to_its_own_keys_in_the_scanned_layer(heads, kv_heads):
    """Four rows over shuffled blocks of 4 tokens in 3 layers: a one-token row, one ending
    on a block boundary, one whose table ends in the sentinel (past its position), and an
    idle row (all sentinel: read clipped, finite, meaningless)."""
    layers, blocks, block_size, head_dim = 3, 12, 4, 16
    cache = KVCache(
        k=jnp.asarray(random((layers, blocks, block_size, kv_heads, head_dim), 1)),
        v=jnp.asarray(random((layers, blocks, block_size, kv_heads, head_dim), 2)),
    )
    tables = np.array(
        [[7, 12, 12], [3, 0, 11], [5, 9, 12], [12, 12, 12]], np.int32
    )  # 12: the sentinel
    positions = np.array([0, 11, 6, 0], np.int32)
    q = random((layers, 4, heads, head_dim), 3)

    @jax.jit
    def every_layer(q, cache, tables, positions):
        def body(_, layer):
            args = (cache, layer, tables, positions)
            host = paged_decode_attention_host(q[layer], *args)
            xla = paged_decode_attention(
                q[layer], cache.k[layer], cache.v[layer], tables, positions
            )
            return None, (host, xla)

        return jax.lax.scan(body, None, jnp.arange(layers))[1]

    host, xla = every_layer(jnp.asarray(q), cache, jnp.asarray(tables), jnp.asarray(positions))
    assert host.shape == (layers, 4, heads * head_dim) and host.dtype == jnp.float32
    keys, values = np.asarray(cache.k), np.asarray(cache.v)
    for layer in range(layers):
        for row in range(3):
            seen = tables[row][: positions[row] // block_size + 1]
            k = keys[layer, seen].reshape(-1, kv_heads, head_dim)
            v = values[layer, seen].reshape(-1, kv_heads, head_dim)
            expected = naive(q[layer, row], k, v, positions[row] + 1)
            assert_close(host[layer, row], expected, np.float32, np.float32, scope="op")
        assert np.isfinite(np.asarray(host[layer, 3])).all()
    assert_close(host, xla, np.float32, np.float32, scope="op")


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_calling_thread_and_numbas_threads_give_the_same_rows(parts):
    """The two drivers of the kernel (`_attend` below PARALLEL_KEYS keys, `_attend_parallel`
    from there, each row's 3 KV heads split into `parts` jobs, unevenly at 2) compute each
    (row, KV head) pair alike."""
    k, v = random((2, 16, 4, 3, 16), 7), random((2, 16, 4, 3, 16), 8)
    q = random((5, 9, 16), 9)
    tables = np.arange(5 * 4, dtype=np.int32).reshape(5, 4) % 16
    positions = np.array([0, 3, 9, 15, 12], np.int32)
    serial, parallel = np.zeros_like(q), np.full_like(q, np.nan)
    host_attention._attend(q, k, v, 1, tables, positions, serial)
    host_attention._attend_parallel(q, k, v, 1, tables, positions, parallel, parts)
    np.testing.assert_array_equal(parallel, serial)
    assert np.isfinite(serial).all()


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (9, 3)])
def test_each_packed_prompt_attends_causally_to_its_own_tokens(heads, kv_heads):
    """Six prompts of 5, 0, 17, 1, 33 and 12 tokens packed into 80 rows (12 of padding):
    each token's softmax over its own prompt's tokens up to it (the naive form, and XLA's
    `packed_causal_attention`); the padding rows are zeros."""
    lengths = [5, 0, 17, 1, 33, 12]
    seq, head_dim = 80, 16
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    prompt = np.searchsorted(starts[1:], np.arange(seq), side="right").astype(np.int32)
    widths = (heads, kv_heads, kv_heads)
    q, k, v = (random((seq, h, head_dim), seed) for seed, h in enumerate(widths))
    out = np.asarray(jax.jit(packed_causal_attention_host)(q, k, v, starts))
    assert out.shape == (seq, heads * head_dim) and out.dtype == np.float32
    for first, end in zip(starts[:-1], starts[1:], strict=True):
        for t in range(first, end):
            expected = naive(q[t], k[first:end], v[first:end], t - first + 1)
            assert_close(out[t], expected, np.float32, np.float32, scope="op")
    np.testing.assert_array_equal(out[starts[-1] :], 0.0)
    xla = jax.jit(packed_causal_attention)(q, k, v, prompt)
    assert_close(out[: starts[-1]], xla[: starts[-1]], np.float32, np.float32, scope="op")


def test_a_packed_prompts_attention_does_not_depend_on_its_neighbours():
    """Batch invariance: a 21-token prompt gives the same bits alone as packed after 30
    other tokens and before 9 more."""
    q, k, v = random((60, 9, 64), 11), random((60, 3, 64), 12), random((60, 3, 64), 13)
    attend = jax.jit(packed_causal_attention_host)
    packed = attend(q, k, v, np.array([0, 30, 51, 60], np.int32))
    alone = attend(q[30:51], k[30:51], v[30:51], np.array([0, 21], np.int32))
    np.testing.assert_array_equal(np.asarray(packed)[30:51], np.asarray(alone))


def test_it_serves_only_where_it_reads_the_cache_in_place():
    one = Mesh(np.array(jax.devices("cpu")[:1]), ("tp",))
    assert usable(one, jnp.float32)
    assert not usable(one, jnp.bfloat16)  # Numba has no bfloat16


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_tokens_do_not_depend_on_the_attention_that_decoded_them(
    tiny, monkeypatch, temperature
):
    prompts = [[1, 2, 3], list(range(40, 75)), [9] * 17]
    sampling = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    config = {"max_slots": 4, "max_seq_len": 128, "min_bucket": 16}
    engine = make_engine(tiny, **config)
    assert engine.device.steps.host_attention  # one CPU device, fp32
    on_host = run_to_completion(engine, prompts, sampling)
    monkeypatch.setattr(host_attention, "usable", lambda mesh, dtype: False)
    engine = make_engine(tiny, **config)
    assert not engine.device.steps.host_attention
    assert run_to_completion(engine, prompts, sampling) == on_host


def test_two_threads_may_decode_at_once():
    """Two engines in one process decode on their own threads; Numba's workqueue aborts
    the process if two launches overlap, so the kernel's launches take turns (rows that
    read PARALLEL_KEYS keys in all run on Numba's threads)."""
    cache = KVCache(
        k=jnp.asarray(random((2, 64, 16, 3, 64), 4)), v=jnp.asarray(random((2, 64, 16, 3, 64), 5))
    )
    tables = jnp.asarray(np.arange(32 * 8, dtype=np.int32).reshape(32, 8) % 64)
    positions = jnp.full(32, 127, jnp.int32)
    assert host_attention.PARALLEL_KEYS <= 32 * 128
    q = jnp.asarray(random((32, 9, 64), 6))
    attend = jax.jit(paged_decode_attention_host)
    expected = np.asarray(attend(q, cache, jnp.int32(1), tables, positions))
    results: list[np.ndarray] = []

    def decode() -> None:
        for _ in range(50):
            results.append(np.asarray(attend(q, cache, jnp.int32(1), tables, positions)))

    threads = [threading.Thread(target=decode) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 150
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_two_decodes_launch_in_turn_beside_a_pool_of_threads():
    """Two decodes (each on an XLA thread) and a pool of threads' CPU LoRA (on a Python
    thread and its team's helper) in one process: the decodes launch parallel Numba
    kernels, which Numba's workqueue would abort the process for if two launches
    overlapped, so they take turns (the launch lock, cpu_offload.kernels.threads); the team
    launches none. Each computes what it computes alone."""
    cache = KVCache(
        k=jnp.asarray(random((2, 64, 16, 3, 64), 4)), v=jnp.asarray(random((2, 64, 16, 3, 64), 5))
    )
    tables = jnp.asarray(np.arange(32 * 8, dtype=np.int32).reshape(32, 8) % 64)
    positions = jnp.full(32, 127, jnp.int32)
    q = jnp.asarray(random((32, 9, 64), 6))
    attend = jax.jit(paged_decode_attention_host)
    attended = np.asarray(attend(q, cache, jnp.int32(1), tables, positions))
    # One LoRA job: A [64, 8] then B [8, 48] in the arena, into columns 0-47 of y.
    a, b = random((64, 8), 7), random((8, 48), 8)
    arena = np.concatenate([a.ravel(), b.ravel()]).astype(np.float32)
    jobs = np.array([[0, a.size * 4, 8, 48, 0]], np.int64)
    x = random((40, 64), 9)
    team = Team(2)
    lora = np.zeros((40, 48), np.float32)
    team.run(arena, x, lora, jobs, 2)
    np.testing.assert_allclose(lora, x @ a @ b, rtol=1e-4, atol=1e-4)
    outputs: dict[str, list[np.ndarray]] = {"attention": [], "lora": []}

    def decode() -> None:
        for _ in range(60):
            attention = attend(q, cache, jnp.int32(1), tables, positions)
            outputs["attention"].append(np.asarray(attention))

    def offload() -> None:
        for _ in range(600):
            y = np.zeros((40, 48), np.float32)
            team.run(arena, x, y, jobs, 2)
            outputs["lora"].append(y)

    threads = [threading.Thread(target=f) for f in (decode, decode, offload)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    team.close()
    assert len(outputs["attention"]) == 120 and len(outputs["lora"]) == 600
    for result in outputs["attention"]:
        np.testing.assert_array_equal(result, attended)
    for y in outputs["lora"]:
        np.testing.assert_array_equal(y, lora)


def test_engine_tokens_with_the_layer_loop_unrolled_equal_the_scans(tiny):
    """EngineConfig.layer_loop "unrolled" (a GPU's default) passes the host kernel an int
    layer; the tokens are the scan's."""
    prompts = [[1, 2, 3], list(range(40, 75)), [9] * 17]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    config = {"max_slots": 4, "max_seq_len": 128, "min_bucket": 16}
    scanned = run_to_completion(make_engine(tiny, **config, layer_loop="scan"), prompts, sampling)
    engine = make_engine(tiny, **config, layer_loop="unrolled")
    assert engine.device.model.unroll_layers
    assert engine.device.steps.host_attention
    assert run_to_completion(engine, prompts, sampling) == scanned
