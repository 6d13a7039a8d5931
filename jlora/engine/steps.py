"""The jitted step functions, compiled ahead of time per bucket.

`prefill` runs one prompt padded to a bucket length; `decode` runs every slot for
one token, attending over a bucketed prefix of the block tables. A CPU-assisted
prefill runs the same prompt in three kinds of call instead, so the host can route
each layer group between them: `embed`, one `prefill_segment` per layer group (with
its per-layer route to the CPU or the device), and `prefill_head` (logits, sample). With LoRA, both
also take the device adapter slots and the rows' slot indices (fixed shapes, so the
adapter mix never causes a compilation). Both sample inside
the step, so only token ids cross back to the host, and both donate the KV cache
so XLA updates it in place. Executables are compiled ahead of time, once per
bucket, and then called directly, so nothing is ever traced or compiled twice. The
engine compiles at warm-up every shape it will use; a shape first met after warm-up
is compiled then and logged as a warning.

Every step runs in `shard_map` over the engine's mesh (`StepSpecs` says how the
parameters, the KV cache and the adapter slots are split; everything else is
replicated): the model computes one shard and its collectives are explicit
(llama.py). On a one-device mesh this is the plain computation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jlora.adapters.backends import LoraWeights, Segments
from jlora.engine.sampling import SamplingArrays, sample
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama, Params

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
    def __init__(self, model: Llama, specs: StepSpecs) -> None:
        self.model = model
        params, cache, lora, rep = specs.params, specs.cache, specs.lora, REPLICATED
        lora = rep if lora is None else lora

        def sharded(fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
            return jax.shard_map(
                fn, mesh=specs.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )

        self._prefill_jit = jax.jit(
            sharded(
                self._prefill,
                (params, cache, rep, rep, rep, rep, lora, rep),
                (rep, cache),
            ),
            donate_argnums=(1,),
        )
        self._decode_jit = jax.jit(
            sharded(self._decode, (params, cache, rep, rep, rep, rep, lora, rep), (rep, cache)),
            donate_argnums=(1,),
        )
        self._embed_jit = jax.jit(sharded(model.embed, (params, rep), rep))
        self._segment_jit = jax.jit(
            sharded(
                self._prefill_segment,
                (params, cache, rep, rep, rep, rep, rep, lora, rep),
                (rep, cache),
            ),
            donate_argnums=(1,),
        )
        self._head_jit = jax.jit(sharded(self._prefill_head, (params, rep, rep, rep), rep))
        self._prefill_exe: dict[int, Any] = {}
        self._decode_exe: dict[tuple[int, int], Any] = {}
        self._embed_exe: dict[int, Any] = {}
        self._segment_exe: dict[tuple[int, int], Any] = {}  # (bucket, layers)
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
    ) -> tuple[jax.Array, KVCache]:
        logits, cache = self.model.prefill(
            params, cache, tokens, length, block_table, lora_weights, segments
        )
        return sample(logits[None], sampling)[0], cache

    def _prefill_segment(
        self,
        params: Params,
        cache: KVCache,
        x: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
        layer_start: jax.Array,
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
        self, params: Params, x: jax.Array, length: jax.Array, sampling: SamplingArrays
    ) -> jax.Array:
        return sample(self.model.last_logits(params, x, length)[None], sampling)[0]

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
    ) -> tuple[jax.Array, KVCache]:
        logits, cache = self.model.decode(
            params, cache, tokens, positions, block_tables, lora_weights, lora_idx
        )
        return sample(logits, sampling), cache

    # -- compilation -------------------------------------------------------------

    def _compile(self, jitted, what: str, *args):
        start = time.perf_counter()
        executable = jitted.lower(*args).compile()
        self.num_compiles += 1
        log.log(
            logging.WARNING if self.warmed_up else logging.INFO,
            "compiled %s in %.1f s%s",
            what,
            time.perf_counter() - start,
            " after warm-up" if self.warmed_up else "",
        )
        return executable

    def compile_prefill(
        self,
        params: Params,
        cache: KVCache,
        bucket: int,
        blocks_per_seq: int,
        lora_weights: LoraWeights | None,
    ) -> None:
        if bucket not in self._prefill_exe:
            self._prefill_exe[bucket] = self._compile(
                self._prefill_jit,
                f"prefill[{bucket}]",
                params,
                cache,
                np.zeros(bucket, np.int32),
                np.int32(1),
                np.zeros(blocks_per_seq, np.int32),
                host_sampling(1),
                lora_weights,
                None if lora_weights is None else Segments.single(-1, bucket),
            )

    def compile_segmented(
        self,
        params: Params,
        cache: KVCache,
        bucket: int,
        blocks_per_seq: int,
        lora_weights: LoraWeights,
        group_sizes: list[int],
    ) -> None:
        """The calls of a CPU-assisted prefill of `bucket` tokens, for layer groups of
        `group_sizes` layers."""
        tokens = np.zeros(bucket, np.int32)
        if bucket not in self._embed_exe:
            self._embed_exe[bucket] = self._compile(
                self._embed_jit, f"embed[{bucket}]", params, tokens
            )
        x = jax.eval_shape(self._embed_jit, params, tokens)
        for size in group_sizes:
            if (bucket, size) not in self._segment_exe:
                self._segment_exe[(bucket, size)] = self._compile(
                    self._segment_jit,
                    f"prefill segment[{bucket} tokens x {size} layers]",
                    params,
                    cache,
                    x,
                    np.int32(1),
                    np.zeros(blocks_per_seq, np.int32),
                    np.int32(0),
                    np.zeros(size, np.int32),
                    lora_weights,
                    Segments.single(-1, bucket),
                )
        if bucket not in self._head_exe:
            self._head_exe[bucket] = self._compile(
                self._head_jit, f"prefill head[{bucket}]", params, x, np.int32(1), host_sampling(1)
            )

    def compile_decode(
        self,
        params: Params,
        cache: KVCache,
        slots: int,
        blocks: int,
        lora_weights: LoraWeights | None,
    ) -> None:
        if (slots, blocks) not in self._decode_exe:
            self._decode_exe[(slots, blocks)] = self._compile(
                self._decode_jit,
                f"decode[{slots} slots x {blocks} blocks]",
                params,
                cache,
                np.zeros(slots, np.int32),
                np.zeros(slots, np.int32),
                np.zeros((slots, blocks), np.int32),
                host_sampling(slots),
                lora_weights,
                None if lora_weights is None else np.zeros(slots, np.int32),
            )

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
    ) -> tuple[jax.Array, KVCache]:
        executable = self._prefill_exe[tokens.shape[0]]
        return executable(
            params, cache, tokens, np.int32(length), block_table, sampling, lora_weights, segments
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
        executable = self._segment_exe[(x.shape[0], route.shape[0])]
        return executable(
            params,
            cache,
            x,
            np.int32(length),
            block_table,
            np.int32(layer_start),
            route,
            lora_weights,
            segments,
        )

    def prefill_head(
        self, params: Params, x: jax.Array, length: int, sampling: SamplingArrays
    ) -> jax.Array:
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
    ) -> tuple[jax.Array, KVCache]:
        executable = self._decode_exe[block_tables.shape]
        return executable(
            params, cache, tokens, positions, block_tables, sampling, lora_weights, lora_idx
        )


def host_sampling(rows: int) -> SamplingArrays:
    """Greedy sampling arrays on the host (numpy), to be filled in per row."""
    return SamplingArrays(
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        seed=np.zeros(rows, np.uint32),
        step=np.zeros(rows, np.int32),
    )
