"""Per-layer views of the stacked parameters (jlora/model/host/layer_views.py), which the
decode step reads its kernels from on CPU: they alias the stack, are forgotten with it,
and decode gives what the scan slicing the stack gives."""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlora.device.steps as steps_module
from jlora.engine.api import SamplingParams
from jlora.model.host.layer_views import COPY_LIMIT, LayerViews, WithLayerViews, split_layers
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama
from jlora.model.lora.backends import make_backend
from jlora.model.lora.targets import target_shapes
from tests.engine_helpers import make_engine, run_to_completion


def test_views_share_the_stacked_memory():
    stacked = jnp.arange(4 * 8 * 16, dtype=jnp.float32).reshape(4, 8, 16) + 0  # 512 B a layer
    views = split_layers(stacked)
    assert views is not None and len(views) == 4
    for layer, view in enumerate(views):
        assert view.unsafe_buffer_pointer() == stacked.unsafe_buffer_pointer() + layer * 512
        np.testing.assert_array_equal(view, stacked[layer])


def test_misaligned_layers_are_copied_only_when_small():
    small = jnp.arange(4 * 15, dtype=jnp.float32).reshape(4, 5, 3) + 0  # 60 B a layer
    views = split_layers(small)
    assert views is not None
    np.testing.assert_array_equal(np.stack(views), small)
    # Layer 1 starts 349,532 bytes in (not a multiple of 64), and the whole is too big to
    # copy: no views, so the caller keeps the scan.
    large = jnp.zeros((3, 87_383), jnp.float32) + 0
    assert large.nbytes > COPY_LIMIT
    assert split_layers(large) is None


def test_views_are_made_once_and_forgotten_with_their_stack():
    views = LayerViews()
    layers = {"norm": {"scale": jnp.ones((3, 16)) + 0}, "proj": {"kernel": jnp.ones((3, 16, 16))}}
    first = views(layers)
    assert first is not None and len(first) == 3 and views(layers) is first
    assert views(dict(layers)) is first  # the same arrays, another dict
    stack = weakref.ref(layers["proj"]["kernel"])
    del layers
    gc.collect()
    assert stack() is None  # the views hold its buffer, not the array
    assert not views._split and views._last is None  # ... and are forgotten with it


def _decode_both_ways(model: Llama, params, lora_weights=None, lora_idx=None):
    """Logits and cache of one decode step, with and without layer views."""
    cfg = model.config
    slots, blocks, block_size = 3, 4, 8
    cache = KVCache.zeros(
        num_layers=cfg.num_layers,
        num_blocks=slots * blocks,
        block_size=block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=jnp.float32,
    )
    rng = np.random.default_rng(0)
    cache = KVCache(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32), v=cache.v + 1)
    tokens = jnp.asarray([5, 77, 300], jnp.int32)
    positions = jnp.asarray([0, 9, 30], jnp.int32)
    tables = jnp.arange(slots * blocks, dtype=jnp.int32).reshape(slots, blocks)
    tables = tables.at[2, 3].set(slots * blocks)  # an unallocated block: the sentinel
    views = LayerViews()(params["layers"])
    assert views is not None
    decode = jax.jit(model.decode)
    args = (params, cache, tokens, positions, tables, lora_weights, lora_idx)
    return decode(*args), decode(*args, views)


def test_decode_with_views_equals_the_scan(tiny):
    model = Llama(tiny.config)
    params = jax.device_put(tiny.params)
    (logits, cache), (with_views, views_cache) = _decode_both_ways(model, params)
    assert with_views.dtype == logits.dtype == jnp.float32
    np.testing.assert_array_equal(with_views, logits)
    np.testing.assert_array_equal(views_cache.k, cache.k)
    np.testing.assert_array_equal(views_cache.v, cache.v)


def test_decode_with_views_and_lora_equals_the_scan(tiny):
    backend = make_backend("reference")
    model = Llama(tiny.config, lora=backend)
    params = jax.device_put(tiny.params)
    shapes = target_shapes(tiny.config)
    weights = backend.allocate(
        num_layers=tiny.config.num_layers,
        num_slots=2,
        max_rank=4,
        shapes=shapes,
        dtype=jnp.float32,
    )
    rng = np.random.default_rng(1)
    weights = jax.tree.map(lambda w: jnp.asarray(rng.normal(size=w.shape) * 0.1, w.dtype), weights)
    idx = jnp.asarray([1, -1, 0], jnp.int32)  # one row on the base model
    (logits, _), (with_views, _) = _decode_both_ways(model, params, weights, idx)
    np.testing.assert_array_equal(with_views, logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_tokens_do_not_depend_on_views(tiny, monkeypatch, temperature):
    prompts = [[1, 2, 3], list(range(40, 75)), [9] * 17]
    sampling = SamplingParams(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True)
    config = {"max_slots": 3, "max_seq_len": 128, "min_bucket": 16}
    engine = make_engine(tiny, **config)
    with_views = run_to_completion(engine, prompts, sampling)
    executables = list(engine.device.steps._decode_exe.values())
    assert executables and all(isinstance(e, WithLayerViews) for e in executables)
    init = functools.partialmethod(steps_module.CompiledSteps.__init__, layer_views=False)
    monkeypatch.setattr(steps_module.CompiledSteps, "__init__", init)
    engine = make_engine(tiny, **config)
    assert run_to_completion(engine, prompts, sampling) == with_views
    executables = list(engine.device.steps._decode_exe.values())
    assert executables and not any(isinstance(e, WithLayerViews) for e in executables)


def test_decode_with_the_layer_loop_unrolled_equals_the_scan(tiny):
    """`Llama(..., unroll_layers=True)`, a GPU's default (EngineConfig.layer_loop): the
    same logits and cache, from the stack and from the layers' views, with LoRA rows and
    a base row."""
    backend = make_backend("reference")
    model = Llama(tiny.config, lora=backend)
    params = jax.device_put(tiny.params)
    weights = backend.allocate(
        num_layers=tiny.config.num_layers,
        num_slots=2,
        max_rank=4,
        shapes=target_shapes(tiny.config),
        dtype=jnp.float32,
    )
    rng = np.random.default_rng(2)
    weights = jax.tree.map(lambda w: jnp.asarray(rng.normal(size=w.shape) * 0.1, w.dtype), weights)
    idx = jnp.asarray([1, -1, 0], jnp.int32)
    (logits, cache), _ = _decode_both_ways(model, params, weights, idx)
    model = Llama(tiny.config, lora=backend, unroll_layers=True)
    for unrolled, unrolled_cache in _decode_both_ways(model, params, weights, idx):
        np.testing.assert_allclose(unrolled, logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(unrolled_cache.k, cache.k, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(unrolled_cache.v, cache.v, rtol=1e-6, atol=1e-6)
