"""A Llama-family decoder over stacked layers, run as a `lax.scan` or unrolled.

Parameters are an explicit pytree (`Params`) passed into jitted step functions:

    {"embed": {"embedding": [V, D]},
     "layers": {<DecoderLayer params, each with a leading [num_layers] axis>},
     "final_norm": {"scale": [D]},
     "lm_head": {"kernel": [D, V]}}          # absent when embeddings are tied

Dense kernels are stored `[in, out]` (Flax), i.e. transposed w.r.t. PyTorch. Stacking
the layers keeps compile time independent of depth, and a layer-group segment of a
CPU-assisted prefill (`prefill_layers`) is a scan over a slice of the stack, with the
per-layer routing of LoRA to the device or the CPU as an i32 array.

A scan's read of layer i's kernels out of the stack is a copy (a dynamic-slice before
each matmul) on XLA:CPU and XLA:GPU alike. On a CPU, `decode` may take `layers`: every
layer's parameters as arrays of their own (views of the stack, host/layer_views.py);
the scan then picks layer i's projections with a `lax.switch` over the layers
(`_switch_dense`), and each matmul reads its kernel in place (the branches call one
jitted function, so JAX traces and lowers it once). On a GPU, where a conditional costs
a host round trip, the engine unrolls the layer loop instead (`unroll_layers`,
EngineConfig.layer_loop): every layer's index is a constant and its kernels static
slices of the stack, for a compile that grows with depth.

The layer itself is layers.py's; the caller attends over the paged KV cache
(attention.py, or the host kernels of host/attention.py on one CPU device). A packed
prefill (`prefill_packed`) runs the prefill's layers over several prompts back to back,
each token at its own position, writing to its own prompt's blocks and attending to it
alone.

On a mesh (`sharding.TensorParallel`) the same code runs per shard inside `shard_map`
(the engine's steps): the config is the shard's (`tp.local`: its heads, its slice of
the MLP and of the vocabulary), o_proj's and down_proj's partial sums (LoRA deltas
included) are all-reduced over `attn_reduce` / `mlp_reduce`, and a split vocabulary
is looked up with a mask and an all-reduce and its logits all-gathered.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp

from configs import ModelConfig
from jlora.model.attention import (
    causal_attention,
    packed_causal_attention,
    paged_decode_attention,
    paged_decode_attention_kernel,
    paged_prefix_attention,
    write_kv,
)
from jlora.model.dots import einsum_f32
from jlora.model.host.attention import (
    packed_causal_attention_host,
    paged_decode_attention_host,
)
from jlora.model.kv_cache import KVCache
from jlora.model.layers import DecoderLayer, DenseFn, LoraFn, Projections, RMSNorm
from jlora.model.lora.base import CpuLora, LoraBackend, LoraWeights, Segments
from jlora.model.lora.targets import INPUT_GROUPS, target_shapes
from jlora.model.sharding import TensorParallel

Params = dict[str, Any]  # the model's parameter pytree (layout in the module docstring)


class Llama:
    """The model: parameter initialisation and the step bodies (prefill, several prompts
    packed in one prefill, decode): pure functions meant to be wrapped in `jax.jit` by
    the engine.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: Any = jnp.float32,
        lora: LoraBackend | None = None,
        cpu_lora: CpuLora | None = None,
        tp: TensorParallel | None = None,
        unroll_layers: bool = False,
        decode_attention: str = "xla",
        interpret_kernels: bool | None = None,
    ) -> None:
        self.vocab_size = config.vocab_size  # the real one: logits past it are padding
        self.config = config if tp is None else tp.local  # the shapes a shard computes
        self.dtype = jnp.dtype(dtype)
        self.lora = lora  # the batched-LoRA backend; None serves the base model only
        self.cpu_lora = cpu_lora  # the host side of CPU-assisted prefill, if any
        self.tp = tp
        self.vocab_axis = None if tp is None else tp.vocab_axis
        # The layer loop as a Python loop instead of a `lax.scan` (the module docstring):
        # each layer's index a constant, its kernels static slices of the stack, or its
        # own arrays picked without a `lax.switch`. A segment whose first layer is traced
        # (`prefill_layers` with an array `layer_start`) is scanned all the same.
        self.unroll_layers = unroll_layers
        self.decode_attention = decode_attention  # EngineConfig.decode_attention
        self.interpret_kernels = interpret_kernels  # its kernel's; None: off a GPU
        self.layer = DecoderLayer(
            self.config,
            self.dtype,
            attn_reduce=None if tp is None else tp.attn_reduce,
            mlp_reduce=None if tp is None else tp.mlp_reduce,
        )
        self.final_norm = RMSNorm(config.rms_norm_eps, self.dtype)

    # -- parameters ------------------------------------------------------------

    def init_params(self, seed: int) -> Params:
        """Seeded random weights (normal(0.02) kernels, unit norms), for benchmarks."""
        cfg = self.config
        k_embed, k_layers, k_head = jax.random.split(jax.random.PRNGKey(seed), 3)
        dummy = jnp.zeros((1, cfg.hidden_size), self.dtype)
        pos = jnp.zeros((1,), jnp.int32)

        def init_layer(key: jax.Array) -> Params:
            return self.layer.init(key, dummy, pos)["params"]

        params: Params = {
            "embed": {
                "embedding": (
                    0.02 * jax.random.normal(k_embed, (cfg.vocab_size, cfg.hidden_size))
                ).astype(self.dtype)
            },
            "layers": jax.jit(jax.vmap(init_layer))(jax.random.split(k_layers, cfg.num_layers)),
            "final_norm": {"scale": jnp.ones((cfg.hidden_size,), self.dtype)},
        }
        if not cfg.tie_embeddings:
            params["lm_head"] = {
                "kernel": (
                    0.02 * jax.random.normal(k_head, (cfg.hidden_size, cfg.vocab_size))
                ).astype(self.dtype)
            }
        return params

    def param_shapes(self) -> Params:
        """The parameter pytree as `jax.ShapeDtypeStruct`s (no allocation)."""
        return jax.eval_shape(lambda: self.init_params(0))

    # -- step bodies -------------------------------------------------------------

    def _logits(self, params: Params, x: jax.Array) -> jax.Array:
        """x: [..., D] -> fp32 logits [..., V].

        Tied embeddings: the table [V, D] is the dot's left operand, as stored, and the
        [V, N] product is transposed after an optimization barrier (else XLA folds the
        transpose back into the dot). As the right operand, XLA:CPU's matmul would repack
        the whole table (the vocabulary's rows) on every call with more than one row.
        """
        h = cast(jax.Array, self.final_norm.apply({"params": params["final_norm"]}, x))
        if self.config.tie_embeddings:
            rows = h.reshape(-1, h.shape[-1])
            columns = einsum_f32("vd,nd->vn", params["embed"]["embedding"], rows)
            logits = jax.lax.optimization_barrier(columns).T.reshape(*h.shape[:-1], -1)
        else:
            logits = einsum_f32("...d,dv->...v", h, params["lm_head"]["kernel"])
        if self.vocab_axis is not None:  # each shard has a slice of the vocabulary
            logits = jax.lax.all_gather(logits, self.vocab_axis, axis=logits.ndim - 1, tiled=True)
        return logits[..., : self.vocab_size]

    def _lora_fn(self, weights: LoraWeights | None, apply) -> LoraFn | None:
        """A layer's LoRA hook over the slots' targets: `apply(weights, target, h, y)`.

        The slots are indexed by layer inside the backend rather than scanned over, so
        a step reads only the rows' adapters, not every slot of every layer.
        """
        if weights is None:
            return None
        if self.lora is None:
            raise ValueError("LoRA weights were passed to a model built without a backend")

        def lora(names, h, base) -> Projections:
            rows = h.reshape(-1, h.shape[-1])  # decode passes [S, 1, in] or [S, in]

            def add(name: str, y: jax.Array) -> jax.Array:
                if name not in weights:
                    return y
                return apply(weights, name, rows, y.reshape(rows.shape[0], -1)).reshape(y.shape)

            return tuple(add(name, y) for name, y in zip(names, base(h), strict=True))

        return lora

    def _with_pool(self, weights: LoraWeights | None, cache: KVCache) -> LoraWeights | None:
        """The LoRA weights a layer reads, with the KV cache as it is at that point of the
        layer where the backend keeps its adapters in the cache's pages (a pooled
        backend): read before the layer's keys are written, and again after, never an
        older cache than the one the layer writes (which would copy it)."""
        if weights is None or self.lora is None:
            return weights
        return self.lora.with_pool(weights, cache)

    def _read_before_write(self, qkv: Projections) -> Projections:
        """q, k and v, the keys and values to write made to depend on all three: where
        the adapters live in the cache (a pooled backend), each projection's LoRA reads
        the cache as it was, and XLA copies the whole cache (every layer) unless every
        such read is an operand, however remote, of both writes. The tie is a scalar
        zero (each projection's first element times zero: an exact +0.0 where they are
        finite; XLA never folds a float times zero), added to what is written."""
        if self.lora is None or not self.lora.pooled:
            return qkv
        q, k, v = qkv
        tie = sum((p.reshape(-1)[0].astype(jnp.float32) * 0.0 for p in qkv), jnp.float32(0))
        return q, k + tie.astype(k.dtype), v + tie.astype(v.dtype)

    def _lora_apply(self, layer: jax.Array, rows: jax.Array | Segments | None):
        """`apply(weights, target, x, y)` for `_lora_fn`: the backend's fused BGMV (rows:
        i32[S] slots) or SGMV (rows: Segments), or the split product when the adapters
        are fully sharded across the mesh."""
        backend = self.lora
        if backend is None or rows is None:  # the base model only: `_lora_fn` gives None
            return None
        if self.tp is not None and self.tp.lora_axis is not None:
            return lambda w, t, x, y: self._split_lora(w, t, layer, x, y, rows)
        if isinstance(rows, Segments):
            return lambda w, t, x, y: backend.sgmv(w, t, layer, x, y, rows)
        return lambda w, t, x, y: backend.bgmv(w, t, layer, x, y, rows)

    def _split_lora(self, weights, target, layer, x, y, rows) -> jax.Array:
        """A fully-sharded adapter's delta (configs.sharding.LORA_SHARDINGS): x·A on each
        device, then its collective (an all-gather over the rank where A is split on it,
        an all-reduce where x is split, i.e. row-parallel), then ·B, each half the
        backend's (its kernels' halves in the Pallas backends). A row-parallel target's B
        is split on its output: each device adds its columns into its partial sum, and
        the base all-reduce completes it."""
        backend, tp = self.lora, self.tp
        assert backend is not None and tp is not None and tp.lora_axis is not None
        axis = tp.lora_axis
        gather, reduce = tp.lora_split(target, backend.layout)
        slots = rows.slot if isinstance(rows, Segments) else rows
        part = jax.lax.axis_index(axis)

        def compute() -> jax.Array:
            xa = backend.shrink(weights, target, layer, x, rows, part if gather else None)
            if gather:
                xa = jax.lax.all_gather(xa, axis, axis=1, tiled=True)
            if reduce:
                xa = jax.lax.psum(xa, axis)
            xa = xa.astype(x.dtype)
            if not reduce:
                return backend.expand(weights, target, layer, xa, y, rows)
            width = y.shape[1] // tp.size  # this device's columns of the partial sum
            columns = jax.lax.dynamic_slice_in_dim(y, part * width, width, axis=1)
            columns = backend.expand(weights, target, layer, xa, columns, rows)
            return jax.lax.dynamic_update_slice_in_dim(y, columns, part * width, axis=1)

        return jax.lax.cond(jnp.any(slots >= 0), compute, lambda: y)

    def _cpu_lora_fn(self, weights: LoraWeights, layer: jax.Array, length: jax.Array) -> LoraFn:
        """The LoRA hook of a CPU-routed prefill layer: hand h to the CPU workers, run the
        base projections on the device meanwhile, then add what the workers computed.

        The two optimization barriers order the three: the base projections take h only
        after the hand-off, and the collect waits for their outputs (CaraServe §4.2,
        the sync-free operator: the device never waits on the CPU before it must).
        Where nothing could overlap them (not `cpu_lora.overlapped`), the products are
        one callback, `apply`.
        """
        cpu, shapes = self.cpu_lora, target_shapes(self.config)
        assert cpu is not None
        shard, row_reduce = jnp.int32(0), {}
        if self.tp is not None and self.tp.size > 1:
            shard = jax.lax.axis_index(self.tp.sharding.tensor_axis)
            row_reduce = {"o_proj": self.tp.attn_reduce, "down_proj": self.tp.mlp_reduce}

        def lora(names, h, base) -> Projections:
            held = [name for name in names if name in weights]
            if not held:
                return base(h)
            group = INPUT_GROUPS.index(names)
            width = sum(shapes[name][1] for name in held)
            whole = h
            if (reduce := row_reduce.get(names[0])) is not None:
                # Row-parallel: h is split across the shards; the workers take it whole.
                whole = jax.lax.all_gather(h, reduce, axis=h.ndim - 1, tiled=True)
            whole, shape = whole.astype(jnp.float32), (h.shape[0], width)
            if cpu.overlapped:
                ticket = cpu.submit(group, shard, layer, whole, length)
                h, ticket = jax.lax.optimization_barrier((h, ticket))
                ys, ticket = jax.lax.optimization_barrier((base(h), ticket))
                deltas = cpu.collect(group, shard, ticket, shape)
            else:
                ys, deltas = base(h), cpu.apply(group, shard, layer, whole, length, shape)
            out, column = [], 0
            for name, y in zip(names, ys, strict=True):
                if name in weights:
                    delta = deltas[:, column : column + y.shape[-1]]
                    column += y.shape[-1]
                    y = (y.astype(jnp.float32) + delta).astype(y.dtype)
                out.append(y)
            return tuple(out)

        return lora

    def _scan_layers(
        self, params: Params, x: jax.Array, cache: KVCache, layer_fn, start=0, count=None
    ):
        """Run `layer_fn(layer_params, layer_index, step, x, cache) -> (x, cache)` over the
        layers [start, start + count) of the stack (all by default); step counts from 0."""
        count = self.config.num_layers if count is None else count

        def body(carry, step):
            x, cache = carry
            index = start + step
            layer_params = jax.tree.map(lambda p: p[index], params["layers"])
            return layer_fn(layer_params, index, step, x, cache), None

        if self.unroll_layers and isinstance(start, int):
            for step in range(count):
                (x, cache), _ = body((x, cache), step)
            return x, cache
        steps = jnp.arange(count, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), steps)
        return x, cache

    def _switch_dense(self, layers: list[Params] | None, index: jax.Array | int) -> DenseFn | None:
        """The base projections of layer `index` (traced, or an unrolled loop's int), from
        per-layer arrays: a `lax.switch` on the index whose branch j multiplies by layer
        j's own kernels (or, for an int, that branch alone), so no kernel is sliced out of
        a stack (the scan's other reads, the norms' scales, still are: a few hundred
        bytes). None without `layers`: the layer's own kernels."""
        if layers is None:
            return None

        def dense(names: tuple[str, ...], h: jax.Array) -> Projections:
            def project(layer_params: Params, h: jax.Array) -> Projections:
                layer = self.layer.bind({"params": layer_params})
                return tuple(getattr(layer, name)(h) for name in names)

            if isinstance(index, int):  # an unrolled loop's layer: no switch
                return project(layers[index], h)
            # One jitted function for every branch: traced and lowered once, not once
            # per layer (XLA inlines the calls, so the compiled switch is the same).
            shared = jax.jit(project)
            return jax.lax.switch(index, [functools.partial(shared, p) for p in layers], h)

        return dense

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """tokens: i32[T] -> x [T, D]."""
        table = params["embed"]["embedding"]
        if self.vocab_axis is None:
            return jnp.take(table, tokens, axis=0)
        rows = table.shape[0]  # this shard's slice of the vocabulary
        local = tokens - jax.lax.axis_index(self.vocab_axis) * rows
        inside = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
        return jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros_like(x)), self.vocab_axis)

    def last_logits(self, params: Params, x: jax.Array, length: jax.Array) -> jax.Array:
        """fp32 logits [V] of a prefilled prompt's last real position."""
        return self._logits(params, x[length - 1])

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        """fp32 logits [..., V] of hidden states x [..., D] (the final norm, the head)."""
        return self._logits(params, x)

    def prefill(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
        cached: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run one prompt, write its keys/values into its blocks, return the last logits.

        tokens: i32[T] (padded to a bucket length T); length: i32[] real tokens (1..T);
        block_table: i32[max_blocks] (entries past the prompt may be the sentinel);
        lora_weights, segments: the device adapter slots and which rows use which slot
        (both None, or both given when the model has a LoRA backend).
        cached: None, or i32[] (a multiple of the block size): a prefix-cache hit, the
        prompt's first `cached` tokens already in its first blocks; `tokens` are then
        the ones after them (positions cached..), and attend to the cached ones too.
        Returns fp32 logits [V] at the last real token, and the updated cache.
        """
        x, cache = self.prefill_hidden(
            params, cache, tokens, length, block_table, lora_weights, segments, cached
        )
        return self.last_logits(params, x, length), cache

    def prefill_hidden(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
        cached: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """`prefill`, returning every position's last hidden state [T, D] instead (the
        logits of each are `logits(params, x)`)."""
        x = self.embed(params, tokens)
        return self.prefill_layers(
            params,
            cache,
            x,
            length,
            block_table,
            0,
            self.config.num_layers,
            lora_weights,
            segments,
            cached=cached,
        )

    def prefill_layers(
        self,
        params: Params,
        cache: KVCache,
        x: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        layer_start: jax.Array | int,
        num_layers: int,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
        route: jax.Array | None = None,
        cached: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """The prefill of layers [layer_start, layer_start + num_layers): one segment.

        x: [T, D], the hidden states entering the segment; num_layers is static.
        route: i32[num_layers] or None: 1 computes that layer's LoRA on the CPU workers
        (`cpu_lora`), 0 with the device backend and `segments`. cached: as in `prefill`
        (None: the prompt starts at position 0 and attends to itself alone; otherwise
        each layer writes its keys first and attends over the table's blocks, which
        hold the cached prefix). Returns (x, cache).
        """
        positions = jnp.arange(x.shape[0], dtype=jnp.int32)
        end = length
        if cached is not None:
            positions, end = positions + cached, length + cached
        blocks = jnp.where(
            positions < end, block_table[positions // cache.block_size], cache.num_blocks
        )

        def attend(q, k, v, cache, index):
            if cached is None:
                return causal_attention(q, k, v, length)
            return paged_prefix_attention(q, cache.k, cache.v, index, block_table, positions)

        def lora_for(index, step, cache):
            weights = self._with_pool(lora_weights, cache)
            device = self._lora_fn(weights, self._lora_apply(index, segments))
            if route is None:
                return device
            assert lora_weights is not None and device is not None
            on_cpu = self._cpu_lora_fn(lora_weights, index, length)

            def lora(names, h, base):
                return jax.lax.cond(
                    route[step] > 0,
                    lambda h: on_cpu(names, h, base),
                    lambda h: device(names, h, base),
                    h,
                )

            return lora

        return self._prefill_scan(
            params, cache, x, positions, blocks, attend, lora_for, layer_start, num_layers
        )

    def prefill_packed(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        starts: jax.Array,
        block_tables: jax.Array,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
        longest: int | None = None,
        host_attention: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """Several prompts in one pass, back to back: each is what `prefill` makes of it
        alone (its tokens attend causally to its own, never to another prompt's), writes
        its keys and values into its own blocks and gives its last logits.

        tokens: i32[T]; prompt p is tokens[starts[p]:starts[p + 1]] (possibly empty), at
        positions 0, 1, ... of its sequence. starts: i32[P + 1], non-decreasing from 0;
        tokens from starts[P] on are padding (nothing is written). block_tables:
        i32[P, max_blocks], each prompt's. lora_weights, segments: as in `prefill`, the
        segments over the packed rows (each prompt inside its adapter's segment).
        longest: None, or (static) the most tokens a prompt has, which bounds the keys
        a token's attention reads (`packed_causal_attention`).
        host_attention: attention by the host kernel (jlora/model/host/attention.py; a one-device
        CPU mesh in fp32 only), each prompt by itself.
        Returns fp32 logits [P, V] at each prompt's last token (an empty prompt's are
        meaningless), and the updated cache.
        """
        index = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        prompt = jnp.sum(index[:, None] >= starts[None, 1:], axis=1)  # padding: P
        real = index < starts[-1]
        row = jnp.minimum(prompt, block_tables.shape[0] - 1)
        positions = jnp.where(real, index - starts[row], 0)
        blocks = jnp.where(real, block_tables[row, positions // cache.block_size], cache.num_blocks)

        def attend(q, k, v, cache, index):
            if host_attention:
                return packed_causal_attention_host(q, k, v, starts)
            return packed_causal_attention(q, k, v, prompt, longest)

        def lora_for(index, step, cache):
            weights = self._with_pool(lora_weights, cache)
            return self._lora_fn(weights, self._lora_apply(index, segments))

        x = self.embed(params, tokens)
        x, cache = self._prefill_scan(params, cache, x, positions, blocks, attend, lora_for)
        return self._logits(params, x[jnp.maximum(starts[1:] - 1, 0)]), cache

    def _prefill_scan(
        self, params, cache, x, positions, blocks, attend, lora_for, start=0, count=None
    ) -> tuple[jax.Array, KVCache]:
        """The prefill's layers [start, start + count) over tokens at `positions`
        (i32[T]): each layer writes token t's keys and values at offset positions[t] %
        block_size of blocks[t] (the sentinel drops them), then attends with
        `attend(q, k, v, cache, layer)` (the cache holding the layer's new keys);
        `lora_for(layer, step, cache)` gives the layer's LoRA hook, reading the cache as
        it is (a pooled backend's adapters live in it: `_with_pool`)."""
        offsets = positions % cache.block_size

        def layer_fn(layer_params, index, step, x, cache):
            layer = self.layer.bind({"params": layer_params})
            q, k, v = self._read_before_write(layer.qkv(x, positions, lora_for(index, step, cache)))
            cache = KVCache(
                k=write_kv(cache.k, index, blocks, offsets, k),
                v=write_kv(cache.v, index, blocks, offsets, v),
            )
            attn = attend(q, k, v, cache, index)
            return layer.finish(x, attn, lora_for(index, step, cache)), cache

        return self._scan_layers(params, x, cache, layer_fn, start, count)

    def decode(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        positions: jax.Array,
        block_tables: jax.Array,
        lora_weights: LoraWeights | None = None,
        lora_idx: jax.Array | None = None,
        layers: list[Params] | None = None,
        host_attention: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """One token for each of S slots.

        tokens, positions: i32[S]; block_tables: i32[S, max_blocks]. An idle slot has an
        all-sentinel block table: its write is dropped and its logits are meaningless.
        lora_weights, lora_idx: the device adapter slots and each row's slot, i32[S]
        (-1: the base model), both given when the model has a LoRA backend.
        layers: None, or the layers' parameters as arrays of their own (host/layer_views.py,
        on CPU): the same result, without copying each layer's kernels out of the stack.
        host_attention: attention by the host kernel (jlora/model/host/attention.py; a one-device
        CPU mesh in fp32 only), reading each row's own keys in place.
        Returns fp32 logits [S, V] and the updated cache.
        """
        rows = jnp.arange(tokens.shape[0])
        blocks = block_tables[rows, positions // cache.block_size]
        offsets = positions % cache.block_size
        x = self.embed(params, tokens)  # [S, D]

        def lora_for(index, cache):
            weights = self._with_pool(lora_weights, cache)
            return self._lora_fn(weights, self._lora_apply(index, lora_idx))

        def layer_fn(layer_params, index, step, x, cache):
            layer = self.layer.bind({"params": layer_params})
            dense = self._switch_dense(layers, index)
            lora = lora_for(index, cache)
            q, k, v = layer.qkv(x[:, None], positions[:, None], lora, dense)  # [S, 1, ...]
            q, k, v = self._read_before_write((q, k, v))
            cache = KVCache(
                k=write_kv(cache.k, index, blocks, offsets, k[:, 0]),
                v=write_kv(cache.v, index, blocks, offsets, v[:, 0]),
            )
            if self.decode_attention == "pallas":
                attn = paged_decode_attention_kernel(
                    q[:, 0], cache.k[index], cache.v[index], block_tables, positions,
                    self.interpret_kernels,
                )  # fmt: skip
            elif host_attention:
                attn = paged_decode_attention_host(q[:, 0], cache, index, block_tables, positions)
            else:
                attn = paged_decode_attention(
                    q[:, 0], cache.k[index], cache.v[index], block_tables, positions
                )
            return layer.finish(x, attn, lora_for(index, cache), dense), cache

        x, cache = self._scan_layers(params, x, cache, layer_fn)
        return self._logits(params, x), cache
