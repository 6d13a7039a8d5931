"""The CPU-assisted prefill of one request, and the numbers `auto`'s cost model needs.

`AssistedPrefill.run` is Toppings §4.1's pipelined loading seen from the scheduler:

1. The prompt is embedded (`CompiledSteps.embed`).
2. Before each layer-group segment, the host waits for the previous segment to finish
   (so the routing reflects what has landed by the time the segment runs), installs the
   adapter's layer groups that have landed (`DeviceSlots.install_landed`), and
   routes the segment's layers: to the device slot if their group is installed, to the
   CPU workers otherwise (`CpuAssist`, through the model's host callbacks).
3. The last hidden state gives the logits and the first token (`prefill_head`).

If the CPU path failed beyond what the worker pool recovers, the callbacks returned
zeros and `CpuAssist.failure` says why: the engine fails that request (its KV blocks
are garbage and are freed with it) and keeps the cache this returns, intact otherwise.

The route of each group is returned as a string ("CCDD": CPU, CPU, device, device).
`measure` (at warm-up) and `observe_prefill` (per device prefill) keep the device
prefill time per bucket; `cold_start` assembles the cost model's inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from configs import EngineConfig
from jlora.adapters.store import HostStore
from jlora.device.cpu_assist.callbacks import CpuAssist, ShardPlan, default_workers
from jlora.device.lora_slots import DeviceSlots
from jlora.device.sampling import SamplingArrays
from jlora.device.steps import CompiledSteps
from jlora.engine import cost_model
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Params
from jlora.model.lora.base import Segments
from jlora.model.lora.targets import INPUT_GROUPS, target_shapes

if TYPE_CHECKING:
    from jlora.device.llama_engine import LlamaEngine

log = logging.getLogger(__name__)


class AssistedPrefill:
    """See the module docstring."""

    @classmethod
    def for_engine(cls, engine: LlamaEngine) -> AssistedPrefill:
        """The CPU-assisted prefill of `engine` (whose adapters live in a host store), over
        a `CpuAssist` of its own: worker processes beside an accelerator, threads of this
        process where the device is the CPU (EngineConfig.cpu_lora "auto")."""
        cfg, lora, store = engine.config, engine.lora, engine.store
        assert lora is not None and store is not None
        stored = target_shapes(engine.model_config)  # as the adapters hold them (k/v whole)
        cpu = CpuAssist(
            store.arena.name,
            {target: stored[target] for target in lora.shapes},
            workers=cfg.cpu_workers or default_workers(),
            threads=cfg.cpu_lora == "threads"
            or (cfg.cpu_lora == "auto" and jax.default_backend() == "cpu"),
            max_rows=max(cfg.prefill_buckets),
            shards=ShardPlan.for_mesh(engine.tp),
        )
        return cls(engine.steps, lora, store, cpu, cfg)

    def __init__(
        self,
        steps: CompiledSteps,
        lora: DeviceSlots,
        store: HostStore,
        cpu: CpuAssist,
        config: EngineConfig,
    ) -> None:
        self.steps, self.lora, self.store, self.cpu, self.config = steps, lora, store, cpu, config
        self.prefill_s: dict[int, float] = {}  # device prefill seconds per bucket
        self.handoff_s = 0.0  # one CPU-routed input group's callback round trip

    def compile(self, params: Params, cache: KVCache, bucket: int) -> None:
        """The calls of a CPU-assisted prefill of `bucket` tokens."""
        self.steps.compile_segmented(
            params, cache, bucket, self.config.blocks_per_seq, self.lora.weights, self.lora.groups
        )

    def run(
        self,
        params: Params,
        cache: KVCache,
        tokens: np.ndarray,
        length: int,
        block_table: np.ndarray,
        slot: int,
        adapter: str,
        sampling: SamplingArrays,
        targets: np.ndarray | None = None,
    ) -> tuple[tuple, KVCache, str]:
        """Prefill `tokens` (a bucket, `length` real) for `adapter`, still landing in
        device slot `slot`: the head's outputs (the first token, its log-probabilities,
        with `targets` every position's: `CompiledSteps.prefill_head`), the cache and the
        routes."""
        lora, bucket = self.lora, tokens.shape[0]
        segments = Segments.single(slot, bucket)
        self.compile(params, cache, bucket)
        routes = ""
        x = self.steps.embed(params, tokens)
        self.cpu.begin(self.store.get(adapter))
        try:
            for index, (start, stop) in enumerate(lora.groups):
                jax.block_until_ready(x)  # route by what has landed by now
                landed, cache = lora.install_landed(adapter, slot, cache)
                on_device = index < landed
                routes += "D" if on_device else "C"
                route = np.full(stop - start, 0 if on_device else 1, np.int32)
                x, cache = self.steps.prefill_segment(
                    params, cache, x, length, block_table, start, route, lora.weights, segments
                )
            if targets is not None:
                self.steps.compile_scored_head(params, x)
            head = self.steps.prefill_head(params, x, length, sampling, targets)
            jax.block_until_ready(head)
        finally:
            self.cpu.end()
        return head, cache, routes

    # -- the cost model's inputs ---------------------------------------------------

    def measure(self, params: Params, cache: KVCache, buckets: Sequence[int]) -> KVCache:
        """Time one device prefill per bucket (its KV writes dropped: an all-sentinel
        block table) and one callback round trip; returns the cache."""
        sentinel = np.full(self.config.blocks_per_seq, self.config.num_blocks, np.int32)
        for bucket in buckets:
            tokens = np.zeros(bucket, np.int32)
            segments = Segments.single(-1, bucket)
            for _ in range(2):  # the first call pays one-off costs
                start = time.perf_counter()
                token, _, cache = self.steps.prefill(
                    params, cache, tokens, bucket, sentinel, self.steps.sampling_rows(1),
                    self.lora.weights, segments,
                )  # fmt: skip
                int(token)
            self.prefill_s[bucket] = time.perf_counter() - start
        self.handoff_s = self.cpu.measure_handoff_s()
        log.info(
            "cost model: link %.3f GB/s, device prefill %s ms, callback round trip %.2f ms",
            self.lora.link_bytes_per_s / 1e9,
            {b: round(1e3 * t, 1) for b, t in self.prefill_s.items()},
            1e3 * self.handoff_s,
        )
        return cache

    def observe_prefill(self, bucket: int, seconds: float) -> None:
        """Fold a measured device prefill of `bucket` into the estimate."""
        if bucket in self.prefill_s:
            self.prefill_s[bucket] = 0.8 * self.prefill_s[bucket] + 0.2 * seconds

    def cold_start(
        self, adapter: str, slot: int, prompt_len: int, bucket: int
    ) -> cost_model.ColdStart:
        """The cost model's inputs for a prompt whose adapter is loading into `slot`."""
        lora = self.lora
        layers_left = lora.layers_left(adapter, slot)
        stored = self.store.get(adapter)
        adapted = sum(
            any(name in stored.target_offsets for name in names) for names in INPUT_GROUPS
        )
        return cost_model.ColdStart(
            load_left_s=layers_left
            * lora.layer_bytes(stored.adapter.rank, stored.adapter.targets)
            / lora.link_bytes_per_s,
            prefill_s=self.prefill_s.get(bucket, 0.0),
            cpu_layer_s=self.cpu.layer_seconds(prompt_len, stored),
            callbacks_layer_s=adapted * self.handoff_s,
            group_layers=tuple(stop - start for start, stop in lora.groups),
            overlapped=self.cpu.overlapped,
        )
