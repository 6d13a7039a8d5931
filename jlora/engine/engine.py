"""The LLM engine: continuous batching at the iteration level (Orca) over paged KV.

A request's life:

1. `add_request` validates it (prompt length, vocabulary, sampling) and queues it.
   Nothing on the device changes; an invalid request raises `InvalidRequest`.
2. At the start of a `step()`, queued requests are admitted first-come first-served
   while a decode slot is free and the KV blocks for their whole sequence (prompt +
   max_tokens, capped at max_seq_len) can be reserved; prompt tokens prefilled per
   step are bounded by `prefill_token_budget` so running requests keep decoding.
   A request for an adapter that is not on the device waits while its adapter is
   transferred in the background (later requests may go ahead of it), and the
   running batch keeps decoding meanwhile; in `cpu-assist` mode (or in `auto`,
   when the cost model says it shortens the time to first token) it is admitted
   at once instead, its adapter still loading.
3. Each admitted prompt is padded to its prefill bucket and prefilled in one
   compiled call that also samples the first token; the request takes a slot, and
   its adapter's device slot is held (never evicted) until the request leaves.
   A CPU-assisted prefill runs layer group by layer group instead: before each
   segment the landed groups of the adapter are installed, and the layers of the
   groups still in flight compute their LoRA on the CPU workers (`cpu_assist.py`).
   If the adapter has not fully landed when the prefill ends, the request is
   parked (it skips decode steps) until it has.
4. One compiled decode call advances every occupied slot by a token, attending
   over the smallest decode bucket that holds the longest running sequence; each
   row adds its own adapter's LoRA delta (or none), so adapters mix in one batch.
5. Each new token is checked on the host against EOS, stop strings, max_tokens
   and max_seq_len; a finished request leaves its slot and returns its blocks at
   once, so a queued request can join in the next step.

Everything runs on the caller's thread; `step()` blocks until the device is done.
All host state lives in plain dataclasses and numpy arrays; what enters the
compiled steps are fixed-shape arrays, so no step ever compiles after warm-up.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs import ConfigError, EngineConfig, ModelConfig
from jlora.adapters.backends import LoraWeights, Segments, make_backend
from jlora.adapters.manager import AdapterManager
from jlora.adapters.peft import AdapterError
from jlora.adapters.store import StoredAdapter
from jlora.engine import cost_model
from jlora.engine.api import (
    DEVICE,
    HOST,
    LOADING,
    AdapterInfo,
    Engine,
    EngineStats,
    InvalidRequest,
    Request,
    RunningInfo,
    TokenEvent,
    UnknownAdapter,
)
from jlora.engine.assisted import AssistedPrefill
from jlora.engine.blocks import BlockAllocator
from jlora.engine.cpu_assist import CpuAssist, default_workers
from jlora.engine.detokenizer import Detokenizer
from jlora.engine.steps import CompiledSteps, host_sampling
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama, Params
from jlora.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sequence:
    """Host state of one admitted request."""

    request: Request
    seed: int
    limit: int  # the sequence may grow to this many tokens (prompt + generated)
    detokenizer: Detokenizer | None
    blocks: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    generated: list[int] = dataclasses.field(default_factory=list)
    assist: bool | None = None  # the cost model's decision (auto mode), once made
    parked: bool = False  # prefilled with CPU assistance; decodes once its adapter lands

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)


class LLMEngine(Engine):
    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Params,
        tokenizer: Tokenizer | None,
        engine_config: EngineConfig,
    ) -> None:
        cfg = engine_config
        if cfg.max_seq_len > model_config.max_context:
            raise ConfigError(
                f"EngineConfig.max_seq_len={cfg.max_seq_len} exceeds the model's context "
                f"length {model_config.max_context}"
            )
        self.model_config = model_config
        self.config = cfg
        self.tokenizer = tokenizer
        self.params = params
        backend = make_backend(cfg.lora_backend) if cfg.max_loras else None
        self.model = Llama(model_config, jnp.dtype(cfg.dtype), backend)
        self.cache = KVCache.zeros(
            num_layers=model_config.num_layers,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.model.dtype,
        )
        self.steps = CompiledSteps(self.model)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * cfg.max_slots
        self._ids: set[str] = set()
        self._seeds = np.random.default_rng()
        self._eos = set(tokenizer.eos_ids) if tokenizer else set()
        # Decode inputs, one row per slot; an idle row has an all-sentinel block table.
        self._sentinel = cfg.num_blocks
        self._tokens = np.zeros(cfg.max_slots, np.int32)
        self._positions = np.zeros(cfg.max_slots, np.int32)
        self._tables = np.full((cfg.max_slots, cfg.blocks_per_seq), self._sentinel, np.int32)
        self._sampling = host_sampling(cfg.max_slots)
        self._lora_idx = np.full(cfg.max_slots, -1, np.int32)  # each row's adapter slot
        self.lora: AdapterManager | None = None
        if backend is not None:
            self.lora = AdapterManager(
                model_config,
                backend=backend,
                num_slots=cfg.max_loras,
                max_rank=cfg.max_lora_rank,
                targets=cfg.lora_targets,
                mode=cfg.lora_mode,
                dtype=self.model.dtype,
                host_store_bytes=cfg.host_store_mib * 2**20,
                layer_groups_per_load=cfg.lora_layer_groups,
                emulated_link_gbps=cfg.emulated_link_gbps,
            )
        self.cpu: CpuAssist | None = None
        if self.lora is not None and cfg.lora_mode in ("cpu-assist", "auto"):
            self.cpu = CpuAssist(
                self.lora.store.arena.name,
                self.lora.shapes,
                workers=cfg.cpu_workers or default_workers(),
                max_rows=max(cfg.prefill_buckets),
            )
            self.model.cpu_lora = self.cpu
        self.counters: collections.Counter[str] = collections.Counter()
        self.assisted: AssistedPrefill | None = None
        if self.cpu is not None:
            assert self.lora is not None
            self.assisted = AssistedPrefill(self.steps, self.lora, self.cpu, cfg)
        log.info(
            "engine: %d slots, %d KV blocks of %d tokens (%.1f MiB), max_seq_len %d",
            cfg.max_slots,
            cfg.num_blocks,
            cfg.block_size,
            self.cache.nbytes() / 2**20,
            cfg.max_seq_len,
        )

    # -- Engine interface ----------------------------------------------------------

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
        if self.lora is not None:
            self.lora.close()

    # -- adapters -----------------------------------------------------------------

    def register_adapter(self, name: str, path: str | Path) -> StoredAdapter:
        """Validate the PEFT adapter at `path` and serve it as `name` (AdapterError and
        no change if it cannot be served)."""
        if self.lora is None:
            raise AdapterError("this engine serves the base model only (max_loras=0)")
        return self.lora.register(name, path)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter that no queued or running request names."""
        if self.lora is None or name not in self.lora.store:
            raise AdapterError(f"adapter name={name!r} is not registered")
        users = sum(seq.request.adapter == name for seq in self._waiting)
        users += sum(seq is not None and seq.request.adapter == name for seq in self._slots)
        if users:
            raise AdapterError(f"adapter {name!r} is named by {users} queued or running requests")
        self.lora.unregister(name)

    def adapters(self) -> list[StoredAdapter]:
        return (
            [] if self.lora is None else [self.lora.store.get(n) for n in self.lora.store.names()]
        )

    def _registered(self, name: str) -> AdapterManager:
        if self.lora is None or name not in self.lora.store:
            raise AdapterError(f"adapter name={name!r} is not registered")
        return self.lora

    def load_adapter(self, name: str, *, pin: bool = False) -> None:
        """Start copying a registered adapter into a device slot and return at once (a
        no-op if it is there or on its way); `pin` keeps it there until unloaded."""
        slots = self._registered(name).slots
        if pin:
            try:
                slots.pin(name)
            except ValueError as err:
                raise AdapterError(f"adapter {name!r}: {err}") from None
        elif slots.request(name) is None and not slots.is_loading(name):
            raise AdapterError(
                f"adapter {name!r}: no device slot can be had; all max_loras="
                f"{slots.num_slots} slots are held by running requests or pinned"
            )

    def unload_adapter(self, name: str) -> None:
        """Unpin an adapter and free its device slot; it stays registered."""
        slots = self._registered(name).slots
        if slots.in_use(name):
            raise AdapterError(f"adapter {name!r} is used by {slots.in_use(name)} running requests")
        slots.discard(name)

    def adapter_infos(self) -> list[AdapterInfo]:
        """Every registered adapter and where it is, in registration order (loads that
        have landed are installed first, so an idle engine reports them ready)."""
        if self.lora is not None:
            self.lora.slots.poll()
        infos = []
        for stored in self.adapters():
            assert self.lora is not None
            slots, name = self.lora.slots, stored.name
            state, slot = HOST, -1
            if slots.is_ready(name):
                state, slot = DEVICE, slots.slot_of(name) or 0
            elif name in slots.loading():
                state, slot = LOADING, slots.loading()[name]
            infos.append(
                AdapterInfo(
                    name=name,
                    path=str(stored.path),
                    rank=stored.spec.rank,
                    alpha=stored.spec.alpha,
                    target_modules=stored.spec.targets,
                    sha256=stored.sha256,
                    size_bytes=stored.file_bytes,
                    state=state,
                    slot=slot,
                    pinned=name in slots.pinned,
                    running_requests=slots.in_use(name),
                )
            )
        return infos

    def stats(self) -> EngineStats:
        """The running batch, the queue, the slots and memory, now."""
        if self.lora is not None:
            self.lora.slots.poll()  # an idle engine installs landed loads here
        running = tuple(
            RunningInfo(
                request_id=seq.request.request_id,
                adapter=seq.request.adapter,
                rank=self.lora.store.get(seq.request.adapter).spec.rank
                if self.lora is not None and seq.request.adapter
                else 0,
                slot=seq.slot,
                prompt_tokens=len(seq.request.prompt_ids),
                generated_tokens=len(seq.generated),
            )
            for seq in self._slots
            if seq is not None
        )
        lora, cfg = self.lora, self.config
        counts = lora.slots.stats() if lora is not None else {}
        memory = jax.devices()[0].memory_stats() or {}
        return EngineStats(
            running=running,
            waiting=len(self._waiting),
            max_slots=cfg.max_slots,
            max_seq_len=cfg.max_seq_len,
            kv_blocks_total=cfg.num_blocks,
            kv_blocks_free=self.allocator.num_free,
            kv_block_size=cfg.block_size,
            adapter_slots_total=cfg.max_loras,
            adapter_slots_free=lora.slots.num_free if lora is not None else 0,
            adapter_slots_loading=len(lora.slots.loading()) if lora is not None else 0,
            adapter_loads=counts.get("loads", 0),
            adapter_evictions=counts.get("evictions", 0),
            host_store_bytes_used=lora.store.arena.bytes_used if lora is not None else 0,
            host_store_bytes_capacity=lora.store.arena.capacity if lora is not None else 0,
            device_bytes_in_use=memory.get("bytes_in_use", -1),
            device_bytes_limit=memory.get("bytes_limit", -1),
        )

    @property
    def _lora_weights(self) -> LoraWeights | None:
        return None if self.lora is None else self.lora.weights

    # -- requests -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        prompt = request.prompt_ids
        if request.request_id in self._ids:
            raise InvalidRequest(f"request_id={request.request_id!r} is already in use")
        if request.adapter is not None and (
            self.lora is None or request.adapter not in self.lora.store
        ):
            raise UnknownAdapter(f"adapter={request.adapter!r} is not registered")
        if not prompt:
            raise InvalidRequest("prompt is empty")
        if len(prompt) >= self.max_seq_len:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens; the context limit is {self.max_seq_len} "
                f"tokens (max_seq_len), which leaves no room to generate"
            )
        vocab = self.model_config.vocab_size
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_ids[{bad}]={prompt[bad]} is outside the vocabulary [0, {vocab})"
            )
        sampling = request.sampling
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none")
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(2**32))
        detok = Detokenizer(self.tokenizer, sampling.stop) if self.tokenizer else None
        limit = min(len(prompt) + sampling.max_tokens, self.max_seq_len)
        self._waiting.append(_Sequence(request, seed, limit, detok))
        self._ids.add(request.request_id)

    def abort(self, request_id: str) -> bool:
        for queued in self._waiting:
            if queued.request.request_id == request_id:
                self._waiting.remove(queued)
                self._ids.discard(request_id)
                return True
        for running in self._slots:
            if running is not None and running.request.request_id == request_id:
                self._release(running)
                return True
        return False

    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self._admit(events)
        if self._decoding():
            self._decode(events)
        elif self.has_unfinished and self.lora is not None and self.lora.slots.loading():
            self.lora.slots.wait(timeout=1.0)  # nothing to run until an adapter lands
        return events

    # -- warm-up -----------------------------------------------------------------

    def warmup(
        self, prompt_lengths: list[int] | None = None, max_length: int | None = None
    ) -> None:
        """Compile each prefill bucket (those `prompt_lengths` need, or all) and each decode
        bucket up to the one holding `max_length` tokens (or all)."""
        cfg = self.config
        prefill = (
            cfg.prefill_buckets
            if prompt_lengths is None
            else sorted({self._bucket(cfg.prefill_buckets, n) for n in prompt_lengths})
        )
        longest = self._bucket(
            cfg.decode_buckets, min(max_length or cfg.max_seq_len, cfg.max_seq_len)
        )
        for bucket in prefill:
            self.steps.compile_prefill(
                self.params, self.cache, bucket, cfg.blocks_per_seq, self._lora_weights
            )
        if self.cpu is not None:
            assert self._lora_weights is not None and self.lora is not None
            sizes = sorted({stop - start for start, stop in self.lora.groups})
            for bucket in prefill:
                self.steps.compile_segmented(
                    self.params,
                    self.cache,
                    bucket,
                    cfg.blocks_per_seq,
                    self._lora_weights,
                    sizes,
                )
        if self.assisted is not None and cfg.lora_mode == "auto":
            self.cache = self.assisted.measure(self.params, self.cache, prefill)
        for bucket in cfg.decode_buckets[: cfg.decode_buckets.index(longest) + 1]:
            self.steps.compile_decode(
                self.params,
                self.cache,
                cfg.max_slots,
                bucket // cfg.block_size,
                self._lora_weights,
            )
        self.steps.warmed_up = True

    # -- the iteration ----------------------------------------------------------------

    @staticmethod
    def _bucket(buckets: tuple[int, ...] | list[int], length: int) -> int:
        return buckets[bisect.bisect_left(buckets, length)]

    def _decoding(self) -> list[_Sequence]:
        """The running requests that take part in decode steps (none parked)."""
        return [s for s in self._slots if s is not None and not s.parked]

    def _admit(self, events: list[TokenEvent]) -> None:
        if self.lora is not None:
            self.lora.slots.poll()  # install the adapters that finished loading
            for seq in self._slots:
                if seq is not None and seq.parked:
                    seq.parked = not self.lora.slots.is_ready(seq.request.adapter or "")
        budget = self.config.prefill_token_budget
        prefilled = 0
        for seq in list(self._waiting):
            if None not in self._slots:
                break
            adapter = seq.request.adapter
            assisted = False
            if adapter is not None:
                assert self.lora is not None
                if self.lora.slots.request(adapter) is None:
                    if not self._assists(seq):
                        continue  # its adapter is on its way; later requests may go first
                    assisted = True
            prompt_len = len(seq.request.prompt_ids)
            blocks_needed = math.ceil(seq.limit / self.config.block_size)
            if blocks_needed > self.allocator.num_free:
                break
            if prefilled and prefilled + prompt_len > budget:
                break
            self._waiting.remove(seq)
            adapter_slot = -1
            if adapter is not None:
                assert self.lora is not None
                adapter_slot = self.lora.slots.acquire(adapter)
            seq.blocks = self.allocator.allocate(blocks_needed)
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq
            self._tables[seq.slot, : len(seq.blocks)] = seq.blocks
            self._lora_idx[seq.slot] = adapter_slot
            self._set_sampling_row(seq)
            self._prefill(seq, events, assisted)
            prefilled += prompt_len

    def _assists(self, seq: _Sequence) -> bool:
        """Whether to prefill `seq` now with CPU assistance, its adapter still loading."""
        adapter = seq.request.adapter
        assert self.lora is not None and adapter is not None
        if self.cpu is None or not self.lora.slots.is_loading(adapter):
            return False
        if self.config.lora_mode == "cpu-assist":
            return True
        if seq.assist is None:
            assert self.assisted is not None
            prompt = len(seq.request.prompt_ids)
            bucket = self._bucket(self.config.prefill_buckets, prompt)
            decision = cost_model.decide(self.assisted.cold_start(adapter, prompt, bucket))
            seq.assist = decision.assist
            self.counters["auto_assist" if decision.assist else "auto_wait"] += 1
            log.info(
                "request %s, adapter %s, %d prompt tokens: %s",
                seq.request.request_id,
                adapter,
                len(seq.request.prompt_ids),
                decision.describe(),
            )
        return seq.assist

    def _set_sampling_row(self, seq: _Sequence) -> None:
        params, row, arrays = seq.request.sampling, seq.slot, self._sampling
        arrays.temperature[row] = params.temperature
        arrays.top_k[row] = params.top_k
        arrays.top_p[row] = params.top_p
        arrays.seed[row] = seq.seed
        arrays.step[row] = 0

    def _prefill(self, seq: _Sequence, events: list[TokenEvent], assisted: bool) -> None:
        prompt = seq.request.prompt_ids
        bucket = self._bucket(self.config.prefill_buckets, len(prompt))
        tokens = np.zeros(bucket, np.int32)
        tokens[: len(prompt)] = prompt
        sampling = jax.tree.map(lambda a: a[seq.slot : seq.slot + 1], self._sampling)
        if assisted:
            assert self.assisted and self.lora and seq.request.adapter
            first, self.cache, routes = self.assisted.run(
                self.params,
                self.cache,
                tokens,
                len(prompt),
                self._tables[seq.slot],
                self._lora_idx[seq.slot],
                seq.request.adapter,
                sampling,
            )
            seq.parked = not self.lora.slots.is_ready(seq.request.adapter)
            self.counters["assisted_prefills"] += 1
            self.counters["assisted_mixed_prefills"] += "C" in routes and "D" in routes
            self.counters["cpu_layer_groups"] += routes.count("C")
            self.counters["device_layer_groups"] += routes.count("D")
            log.info(
                "request %s prefilled with CPU assistance, layer groups %s (C: CPU, D: device)%s",
                seq.request.request_id,
                routes,
                ", parked until its adapter lands" if seq.parked else "",
            )
            self._append(seq, first, events)
            return
        weights = self._lora_weights
        segments = None if weights is None else Segments.single(self._lora_idx[seq.slot], bucket)
        self.steps.compile_prefill(
            self.params, self.cache, bucket, self.config.blocks_per_seq, weights
        )
        start = time.perf_counter()
        token, self.cache = self.steps.prefill(
            self.params,
            self.cache,
            tokens,
            len(prompt),
            self._tables[seq.slot],
            sampling,
            weights,
            segments,
        )
        self._append(seq, int(token), events)
        if self.assisted is not None:  # keep the cost model's estimate current
            self.assisted.observe_prefill(bucket, time.perf_counter() - start)

    def _decode(self, events: list[TokenEvent]) -> None:
        running = self._decoding()
        longest = max(s.length for s in running)
        blocks = self._bucket(self.config.decode_buckets, longest) // self.config.block_size
        weights = self._lora_weights
        self.steps.compile_decode(self.params, self.cache, self.max_slots, blocks, weights)
        tables = self._tables[:, :blocks]
        parked = [s.slot for s in self._slots if s is not None and s.parked]
        if parked:  # a parked row runs like an idle one: its write is dropped
            tables = tables.copy()
            tables[parked] = self._sentinel
        sampled, self.cache = self.steps.decode(
            self.params,
            self.cache,
            self._tokens,
            self._positions,
            tables,
            self._sampling,
            weights,
            None if weights is None else self._lora_idx,
        )
        tokens = np.asarray(sampled)
        for seq in running:
            self._append(seq, int(tokens[seq.slot]), events)

    def _append(self, seq: _Sequence, token: int, events: list[TokenEvent]) -> None:
        """Record a sampled token, decide whether the request is done, emit its event."""
        seq.generated.append(token)
        text, hit_stop = seq.detokenizer.add(token) if seq.detokenizer else ("", False)
        finish = None
        if hit_stop or (token in self._eos and not seq.request.sampling.ignore_eos):
            finish = "stop"
        elif seq.length >= seq.limit:
            finish = "length"
        if finish is not None and not hit_stop and seq.detokenizer is not None:
            text += seq.detokenizer.flush()
        events.append(TokenEvent(seq.request.request_id, token, text, finish))
        if finish is not None:
            self._release(seq)
            return
        self._tokens[seq.slot] = token
        self._positions[seq.slot] = seq.length - 1
        self._sampling.step[seq.slot] = len(seq.generated)

    def _release(self, seq: _Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []
        self._tables[seq.slot] = self._sentinel
        self._positions[seq.slot] = 0
        self._sampling.temperature[seq.slot] = 0.0
        if seq.request.adapter is not None:
            assert self.lora is not None
            self.lora.slots.release(seq.request.adapter)
        self._lora_idx[seq.slot] = -1
        self._slots[seq.slot] = None
        self._ids.discard(seq.request.request_id)
