"""The jitted step functions, compiled ahead of time per bucket.

`prefill` runs one prompt padded to a bucket length; `decode` runs every slot for
one token, attending over a bucketed prefix of the block tables. With LoRA, both
also take the device adapter slots and the rows' slot indices (fixed shapes, so the
adapter mix never causes a compilation). Both sample inside
the step, so only token ids cross back to the host, and both donate the KV cache
so XLA updates it in place. Executables are compiled ahead of time, once per
bucket, and then called directly, so nothing is ever traced or compiled twice. The
engine compiles at warm-up every shape it will use; a shape first met after warm-up
is compiled then and logged as a warning.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np

from jlora.adapters.backends import LoraWeights, Segments
from jlora.engine.sampling import SamplingArrays, sample
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama, Params

log = logging.getLogger(__name__)


class CompiledSteps:
    def __init__(self, model: Llama) -> None:
        self.model = model
        self._prefill_jit = jax.jit(self._prefill, donate_argnums=(1,))
        self._decode_jit = jax.jit(self._decode, donate_argnums=(1,))
        self._prefill_exe: dict[int, Any] = {}
        self._decode_exe: dict[tuple[int, int], Any] = {}
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
