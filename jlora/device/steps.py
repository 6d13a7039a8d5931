"""The jitted step functions, compiled ahead of time per bucket.

`prefill` runs one prompt padded to a bucket length; `decode` runs a bucketed number of
decode rows for one token each, attending over a bucketed prefix of the block tables.
Variants of the prefill: after a cached prefix (`cached` > 0: a prefix-cache hit, its
new tokens attending over the whole block table); packed (`prefill_packed`: several
prompts back to back in one bucket, a fixed number of prompt rows); scored (prompt
logprobs: every position's log-probabilities too, the prompt's next token chosen at
each; compiled on first use); and CPU-assisted, in three kinds of call so the host can
route each layer group: `embed`, one `prefill_segment` per layer group (its per-layer
route to the CPU or the device) and `prefill_head` (logits, sample). With LoRA, the
steps also take the device adapter slots and the rows' slot indices (fixed shapes: the
adapter mix never compiles). They sample inside the step, so only token ids (and, for
rows that ask, log-probabilities at a fixed width) cross back to the host, and donate
the KV cache so XLA updates it in place. On a CPU mesh, decode takes the layers'
parameters as arrays of their own (jlora/model/host/layer_views.py), so each matmul
reads its kernel in place, and (one CPU device, fp32) its attention, like a packed
prefill's, is a host kernel reading the cache's pages in place
(jlora/model/host/attention.py).

Executables are compiled ahead of time, once per bucket, and then called directly, so
nothing is ever traced or compiled twice. The engine compiles at warm-up every shape it
will use; a shape first met after warm-up is compiled then and logged as a warning (the
cached-prefix variants, which warm-up compiles unless the cache policy keeps no
history, are only logged: a prefix hit under "none" cannot happen).

Every step runs in `shard_map` over the engine's mesh (`StepSpecs` says how the
parameters, the KV cache and the adapter slots are split; everything else is
replicated): the model computes one shard and its collectives are explicit
(llama.py). On a one-device mesh this is the plain computation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jlora.device.rows import idle_rows
from jlora.device.sampling import (
    SamplingArrays,
    TokenLogprobs,
    block_scores,
    host_sampling,
    sample,
)
from jlora.model.host import attention as host_kernel
from jlora.model.host.layer_views import LayerViews, WithLayerViews
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama, Params
from jlora.model.lora.base import LoraWeights, Segments

log = logging.getLogger(__name__)


REPLICATED = PartitionSpec()


@dataclasses.dataclass(frozen=True)
class StepSpecs:
    """How the steps' sharded inputs are split over `mesh`: PartitionSpec pytrees of the
    parameters, the KV cache and the adapter slots (None: no LoRA)."""

    mesh: Mesh
    params: Any
    cache: KVCache
    lora: Any = None


class CompiledSteps:
    def __init__(
        self,
        model: Llama,
        specs: StepSpecs,
        history: int,
        vocab: int,
        packed_longest: int | None = None,
        layer_views: bool | None = None,
        host_attention: bool = False,
    ) -> None:
        """history: the tokens of a prefill's sampling history (a sequence's most; the
        penalties read it, sampling.py); a decode step's is its bucket's tokens. vocab:
        the model's whole vocabulary (a grammar's bitmask covers it).
        packed_longest: the most tokens of one prompt in a packed prefill (None: any).
        layer_views: decode reading each layer's kernels from arrays of their own where
        the parameters can be split without a copy (host/layer_views.py); None: on a CPU mesh
        (a GPU's scan reads them from the stack).
        host_attention: decode and packed prefill attention by the host kernels
        (jlora/model/host/attention.py); the engine passes `host_attention.usable`."""
        self.model = model
        self.history = history
        self.vocab = vocab
        self.packed_longest = packed_longest
        params, cache, lora, rep = specs.params, specs.cache, specs.lora, REPLICATED
        lora = rep if lora is None else lora

        def sharded(fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
            return jax.shard_map(
                fn, mesh=specs.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )

        prefill_specs = (params, cache, rep, rep, rep, rep, lora, rep)
        self._prefill_jit = jax.jit(
            sharded(self._prefill, prefill_specs, (rep, rep, cache)), donate_argnums=(1,)
        )
        self._prefill_cached_jit = jax.jit(  # its last argument `cached`
            sharded(self._prefill, (*prefill_specs, rep), (rep, rep, cache)),
            donate_argnums=(1,),
        )
        self._prefill_scored_jit = jax.jit(  # its last arguments `cached` and `targets`
            sharded(self._prefill, (*prefill_specs, rep, rep), (rep, rep, rep, cache)),
            donate_argnums=(1,),
        )
        self._prefill_packed_jit = jax.jit(
            sharded(self._prefill_packed, prefill_specs, (rep, rep, cache)),
            donate_argnums=(1,),
        )
        decode_specs = (params, cache, rep, rep, rep, rep, lora, rep)
        self._decode_jit = jax.jit(
            sharded(self._decode, decode_specs, (rep, rep, cache)), donate_argnums=(1,)
        )
        if layer_views is None:
            layer_views = specs.mesh.devices.flat[0].platform == "cpu"
        self._views = LayerViews() if layer_views else None
        self.host_attention = host_attention
        one_layer = jax.tree.map(
            lambda spec: PartitionSpec(*spec[1:]),
            params["layers"],
            is_leaf=lambda spec: isinstance(spec, PartitionSpec),
        )
        self._decode_views_jit = jax.jit(  # the layers' views its last argument
            sharded(
                self._decode,
                (*decode_specs, [one_layer] * model.config.num_layers),
                (rep, rep, cache),
            ),
            donate_argnums=(1,),
        )
        self._embed_jit = jax.jit(sharded(model.embed, (params, rep), rep))
        # A CPU-assisted prefill's layer-group segment, its first layer an argument: traced
        # under a scan (one executable per segment size), static where the model unrolls
        # its layers (one per segment), so that each layer's index is a constant there too.
        segment_specs = (params, cache, rep, rep, rep, rep, lora, rep)

        def segment(layer_start, *args):
            body = functools.partial(self._prefill_segment, layer_start)
            return sharded(body, segment_specs, (rep, cache))(*args)

        self._segment_jit = jax.jit(
            segment,
            static_argnums=(0,) if model.unroll_layers else (),
            donate_argnums=(2,),
        )
        self._head_jit = jax.jit(sharded(self._prefill_head, (params, rep, rep, rep), (rep, rep)))
        self._head_scored_jit = jax.jit(  # its last argument `targets`
            sharded(self._prefill_head, (params, rep, rep, rep, rep), (rep, rep, rep))
        )
        self._prefill_exe: dict[int, Any] = {}
        self._prefill_cached_exe: dict[int, Any] = {}  # compiled on first use
        self._prefill_scored_exe: dict[int, Any] = {}  # compiled on first use
        self._head_scored_exe: dict[int, Any] = {}  # compiled on first use
        self._prefill_packed_exe: dict[tuple[int, int], Any] = {}  # (bucket, prompts)
        self._decode_exe: dict[tuple[int, int], Any] = {}
        self._embed_exe: dict[int, Any] = {}
        self._segment_exe: dict[tuple[int, int, int], Any] = {}  # _segment_key
        self._head_exe: dict[int, Any] = {}
        self.num_compiles = 0
        self.warmed_up = False  # set by the engine once warm-up is done

    def _prefill(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None,
        segments: Segments | None,
        cached: jax.Array | None = None,
        targets: jax.Array | None = None,
    ) -> tuple:
        """A prompt's prefill and its first token, with its log-probabilities; `cached`
        (the cached-prefix variant): its first tokens' keys and values are in the cache
        already; `targets` (the scored variant, i32[T]): also every position's
        log-probabilities, targets[i] chosen at position i. Returns (token, its
        log-probabilities (one position), [scores,] cache)."""
        x, cache = self.model.prefill_hidden(
            params, cache, tokens, length, block_table, lora_weights, segments, cached
        )
        first, logprobs = sample(self.model.last_logits(params, x, length)[None], sampling)
        if targets is None:
            return first[0], logprobs, cache
        scores = block_scores(functools.partial(self.model.logits, params), x, targets)
        return first[0], logprobs, scores, cache

    def _prefill_packed(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        starts: jax.Array,
        block_tables: jax.Array,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None,
        segments: Segments | None,
    ) -> tuple[jax.Array, TokenLogprobs, KVCache]:
        """Several prompts' prefill and each one's first token (its own sampling row)."""
        logits, cache = self.model.prefill_packed(
            params,
            cache,
            tokens,
            starts,
            block_tables,
            lora_weights,
            segments,
            self.packed_longest,
            host_attention=self.host_attention,
        )
        return *sample(logits, sampling), cache

    def _prefill_segment(
        self,
        layer_start: jax.Array | int,
        params: Params,
        cache: KVCache,
        x: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        route: jax.Array,
        lora_weights: LoraWeights,
        segments: Segments,
    ) -> tuple[jax.Array, KVCache]:
        return self.model.prefill_layers(
            params,
            cache,
            x,
            length,
            block_table,
            layer_start,
            route.shape[0],
            lora_weights,
            segments,
            route,
        )

    def _prefill_head(
        self,
        params: Params,
        x: jax.Array,
        length: jax.Array,
        sampling: SamplingArrays,
        targets: jax.Array | None = None,
    ) -> tuple:
        """A CPU-assisted prefill's first token and its log-probabilities (and, with
        `targets`, every position's, as `_prefill`'s scored variant)."""
        first, logprobs = sample(self.model.last_logits(params, x, length)[None], sampling)
        if targets is None:
            return first[0], logprobs
        scores = block_scores(functools.partial(self.model.logits, params), x, targets)
        return first[0], logprobs, scores

    def _decode(
        self,
        params: Params,
        cache: KVCache,
        tokens: jax.Array,
        positions: jax.Array,
        block_tables: jax.Array,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None,
        lora_idx: jax.Array | None,
        layers: list[Params] | None = None,
    ) -> tuple[jax.Array, TokenLogprobs, KVCache]:
        logits, cache = self.model.decode(
            params,
            cache,
            tokens,
            positions,
            block_tables,
            lora_weights,
            lora_idx,
            layers,
            host_attention=self.host_attention,
        )
        return *sample(logits, sampling), cache

    def sampling_rows(self, rows: int) -> SamplingArrays:
        """Greedy host sampling arrays for `rows` prefill rows (their history wide)."""
        return host_sampling(rows, self.history, self.vocab)

    # -- compilation -------------------------------------------------------------

    def _compile(self, jitted, what: str, *args, on_first_use: bool = False):
        start = time.perf_counter()
        executable = jitted.lower(*args).compile()
        self.num_compiles += 1
        late = self.warmed_up and not on_first_use
        log.log(
            logging.WARNING if late else logging.INFO,
            "compiled %s in %.1f s%s",
            what,
            time.perf_counter() - start,
            " after warm-up" if late else " on first use" if on_first_use else "",
        )
        return executable

    def compile_prefill(
        self,
        params: Params,
        cache: KVCache,
        bucket: int,
        blocks_per_seq: int,
        lora_weights: LoraWeights | None,
        *,
        cached: bool = False,
        scored: bool = False,
    ) -> None:
        """The prefill of `bucket` tokens; with `cached`, its cached-prefix variant; with
        `scored`, the variant that scores every position (after a cached prefix or not)."""
        executables = self._prefill_exe
        if scored or cached:
            executables = self._prefill_scored_exe if scored else self._prefill_cached_exe
        if bucket in executables:
            return
        args = [
            params,
            cache,
            np.zeros(bucket, np.int32),
            np.int32(1),
            np.zeros(blocks_per_seq, np.int32),
            self.sampling_rows(1),
            lora_weights,
            None if lora_weights is None else Segments.single(-1, bucket),
        ]
        if scored:
            executables[bucket] = self._compile(
                self._prefill_scored_jit,
                f"scored prefill[{bucket}]",
                *args,
                np.int32(0),
                np.zeros(bucket, np.int32),
                on_first_use=True,
            )
        elif cached:
            executables[bucket] = self._compile(
                self._prefill_cached_jit,
                f"prefill after a cached prefix[{bucket}]",
                *args,
                np.int32(0),
                on_first_use=True,
            )
        else:
            executables[bucket] = self._compile(self._prefill_jit, f"prefill[{bucket}]", *args)

    def compile_prefill_packed(
        self,
        params: Params,
        cache: KVCache,
        bucket: int,
        prompts: int,
        blocks_per_seq: int,
        lora_weights: LoraWeights | None,
        segments: Segments | None,
    ) -> None:
        """The packed prefill of `bucket` tokens in up to `prompts` prompts, with LoRA
        segments shaped as `segments` (packing.py lays them out; None: no LoRA)."""
        if (bucket, prompts) in self._prefill_packed_exe:
            return
        self._prefill_packed_exe[(bucket, prompts)] = self._compile(
            self._prefill_packed_jit,
            f"packed prefill[{bucket} tokens x {prompts} prompts]",
            params,
            cache,
            np.zeros(bucket, np.int32),
            np.zeros(prompts + 1, np.int32),
            np.zeros((prompts, blocks_per_seq), np.int32),
            self.sampling_rows(prompts),
            lora_weights,
            segments,
        )

    def compile_segmented(
        self,
        params: Params,
        cache: KVCache,
        bucket: int,
        blocks_per_seq: int,
        lora_weights: LoraWeights,
        groups: Sequence[tuple[int, int]],
    ) -> None:
        """The calls of a CPU-assisted prefill of `bucket` tokens, for the layer groups
        [start, stop) of `groups`."""
        tokens = np.zeros(bucket, np.int32)
        if bucket not in self._embed_exe:
            self._embed_exe[bucket] = self._compile(
                self._embed_jit, f"embed[{bucket}]", params, tokens
            )
        x = jax.eval_shape(self._embed_jit, params, tokens)
        for start, stop in groups:
            key = self._segment_key(bucket, start, stop - start)
            if key not in self._segment_exe:
                self._segment_exe[key] = self._compile(
                    self._segment_jit,
                    f"prefill segment[{bucket} tokens x {stop - start} layers]",
                    start if self.model.unroll_layers else np.int32(start),  # static, or not
                    params,
                    cache,
                    x,
                    np.int32(1),
                    np.zeros(blocks_per_seq, np.int32),
                    np.zeros(stop - start, np.int32),
                    lora_weights,
                    Segments.single(-1, bucket),
                )
        if bucket not in self._head_exe:
            self._head_exe[bucket] = self._compile(
                self._head_jit,
                f"prefill head[{bucket}]",
                params,
                x,
                np.int32(1),
                self.sampling_rows(1),
            )

    def compile_scored_head(self, params: Params, x: jax.Array) -> None:
        """A CPU-assisted prefill's head that scores every position, for x's bucket."""
        if x.shape[0] not in self._head_scored_exe:
            self._head_scored_exe[x.shape[0]] = self._compile(
                self._head_scored_jit,
                f"scored prefill head[{x.shape[0]}]",
                params,
                x,
                np.int32(1),
                self.sampling_rows(1),
                np.zeros(x.shape[0], np.int32),
                on_first_use=True,
            )

    def compile_decode(
        self,
        params: Params,
        cache: KVCache,
        slots: int,
        blocks: int,
        lora_weights: LoraWeights | None,
    ) -> None:
        if (slots, blocks) in self._decode_exe:
            return
        if self.host_attention:
            host_kernel.warm()  # its FFI target registered before a step calls it
        args = (params, cache, *idle_rows(slots, blocks, cache, lora_weights, self.vocab))
        what = f"decode[{slots} slots x {blocks} blocks]"
        views = None if self._views is None else self._views(params["layers"])
        if self._views is None or views is None:
            self._decode_exe[(slots, blocks)] = self._compile(self._decode_jit, what, *args)
        else:
            executable = self._compile(self._decode_views_jit, what + ", layer views", *args, views)
            self._decode_exe[(slots, blocks)] = WithLayerViews(executable, self._views)

    def prime_decode(
        self,
        params: Params,
        cache: KVCache,
        slots: int,
        blocks: int,
        lora_weights: LoraWeights | None,
    ) -> KVCache:
        """Run a compiled decode variant once on idle rows (all-sentinel block tables, so
        nothing is written): XLA:CPU sets up each matmul's kernel on an executable's first
        run, about 160 ms for SmolLM2's layer views (a `lax.switch` of 30 branches), which
        would otherwise stall running streams the first time their length reaches the
        variant's bucket. Warm-up calls it after `compile_decode`. Not on a mesh that spans
        processes: there every launch must be the leader's, mirrored (multiprocess.py),
        and each process warms up on its own."""
        if jax.process_count() > 1:
            return cache
        idle = idle_rows(slots, blocks, cache, lora_weights, self.vocab)
        sampled, _, cache = self.decode(params, cache, *idle)
        jax.block_until_ready(sampled)
        return cache

    # -- calls -------------------------------------------------------------------

    def prefill(
        self,
        params: Params,
        cache: KVCache,
        tokens: np.ndarray,
        length: int,
        block_table: np.ndarray,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
        cached: int = 0,
        targets: np.ndarray | None = None,
    ) -> tuple:
        """`tokens` (padded; `length` real) into `block_table`'s blocks, after the first
        `cached` tokens already there (0: none, the plain prefill): (the first token, its
        log-probabilities, [with `targets`, i32[T]: every position's,] the cache)."""
        args = (params, cache, tokens, np.int32(length), block_table, sampling, lora_weights)
        if targets is not None:
            executable = self._prefill_scored_exe[tokens.shape[0]]
            return executable(*args, segments, np.int32(cached), targets)
        if cached:
            return self._prefill_cached_exe[tokens.shape[0]](*args, segments, np.int32(cached))
        return self._prefill_exe[tokens.shape[0]](*args, segments)

    def prefill_packed(
        self,
        params: Params,
        cache: KVCache,
        tokens: np.ndarray,
        starts: np.ndarray,
        block_tables: np.ndarray,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None = None,
        segments: Segments | None = None,
    ) -> tuple[jax.Array, TokenLogprobs, KVCache]:
        """Prompt p, tokens[starts[p]:starts[p + 1]], into block_tables[p]'s blocks
        (Llama.prefill_packed): i32[P], each prompt's first token, their log-probabilities."""
        executable = self._prefill_packed_exe[(tokens.shape[0], block_tables.shape[0])]
        return executable(
            params, cache, tokens, starts, block_tables, sampling, lora_weights, segments
        )

    def embed(self, params: Params, tokens: np.ndarray) -> jax.Array:
        return self._embed_exe[tokens.shape[0]](params, tokens)

    def prefill_segment(
        self,
        params: Params,
        cache: KVCache,
        x: jax.Array,
        length: int,
        block_table: np.ndarray,
        layer_start: int,
        route: np.ndarray,
        lora_weights: LoraWeights,
        segments: Segments,
    ) -> tuple[jax.Array, KVCache]:
        """Layers [layer_start, layer_start + len(route)); route[i] = 1 puts layer
        layer_start + i's LoRA on the CPU workers, 0 on the device slots."""
        executable = self._segment_exe[self._segment_key(x.shape[0], layer_start, route.shape[0])]
        return executable(
            *(() if self.model.unroll_layers else (np.int32(layer_start),)),  # compiled in
            params,
            cache,
            x,
            np.int32(length),
            block_table,
            route,
            lora_weights,
            segments,
        )

    def _segment_key(self, bucket: int, start: int, layers: int) -> tuple[int, int, int]:
        """A segment's executable: one per (bucket, layers) under a scan, one per (bucket,
        layers, first layer) where the layers are unrolled."""
        return bucket, layers, start if self.model.unroll_layers else 0

    def prefill_head(
        self,
        params: Params,
        x: jax.Array,
        length: int,
        sampling: SamplingArrays,
        targets: np.ndarray | None = None,
    ) -> tuple:
        """(the first token, its log-probabilities[, with `targets`: every position's])."""
        if targets is not None:
            return self._head_scored_exe[x.shape[0]](params, x, np.int32(length), sampling, targets)
        return self._head_exe[x.shape[0]](params, x, np.int32(length), sampling)

    def decode(
        self,
        params: Params,
        cache: KVCache,
        tokens: np.ndarray,
        positions: np.ndarray,
        block_tables: np.ndarray,
        sampling: SamplingArrays,
        lora_weights: LoraWeights | None = None,
        lora_idx: np.ndarray | None = None,
    ) -> tuple[jax.Array, TokenLogprobs, KVCache]:
        executable = self._decode_exe[block_tables.shape]
        return executable(
            params, cache, tokens, positions, block_tables, sampling, lora_weights, lora_idx
        )
