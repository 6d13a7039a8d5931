"""The orchestrator: continuous batching at the iteration level (Orca) over a device engine.

It owns everything about requests, in plain host state, and drives any `DeviceEngine`
(device_api.py): the JAX `LlamaEngine` or the `MockEngine` of the server and router tests.

A request's life:

1. `add_request` validates it (a unique id, a registered adapter, a prompt that is not
   empty, fits the context and the vocabulary, stop strings only with a tokenizer) and
   queues it. Nothing else changes; a bad request raises `RequestError` naming the field.
2. Each `step()` first installs the adapter loads that have landed. A load that failed
   fails the requests that waited for that adapter (and those prefilled while it was
   in flight); the worker goes on. A request parked until its adapter landed is
   inserted into its decode row.
3. Then queued requests are admitted first-come first-served while a decode row is
   free and the KV blocks for their prompt and first token can be had, leaving a
   watermark of 1% of the pool (vLLM's) for the running requests to grow into (with
   `kv_allocation="upfront"`, the blocks of their whole sequence, prompt + max_tokens
   capped at max_seq_len). Prompt tokens prefilled per step are bounded by
   `prefill_token_budget`, so running requests keep decoding (vLLM's chunked prefill):
   the request admitted last, or one whose prompt alone exceeds the budget, gets a
   chunk of whole blocks, and its prefill goes on in the next steps, ahead of new
   admissions, each chunk continuing the KV of the ones before (as after a cached
   prefix); the last chunk samples its first token. A prefill whose padding to its
   prefill bucket would cost more than a call of its own ends early on a smaller
   bucket, the rest continuing in the next step (`_chunk_end`). CPU-assisted prefills and those
   that merging schedules run whole. A request for an adapter that is not on the
   device waits while its adapter is copied in the background (later requests may go
   ahead of it), unless CPU assistance starts it at once: always
   in `cpu-assist` mode, in `auto` when the cost model says it shortens the time to
   first token (cost_model.py). An admitted request holds its adapter's device slot
   (never evicted) until it leaves.
4. `device.prefill` runs its prompt and samples its first token; the request is
   inserted into its decode row, or parked if its adapter has not fully landed (a
   CPU-assisted prefill). A fault of this request alone (`RequestError` from the
   device engine) fails it and nothing else.
5. Before `device.generate`, a row whose next token starts a new block gets it; where
   the pool has none, the newest request is preempted (vLLM's recompute preemption): its
   KV is released, its full blocks cached like those of any request that leaves (kept
   on the device, swapped to the host or dropped, as the cache policy and the swap cost
   model decide, jlora/engine/memory), and it is queued again ahead of later arrivals; when
   admitted again, its prompt and generated tokens are prefilled (a cache hit where its
   blocks survived) and it goes on with the token it would have had next. Then
   `device.generate` advances every inserted row by one token; rows of different
   adapters (and the base model) share the step.
6. Each token is checked on the host against EOS, stop strings, max_tokens and
   max_seq_len; a finished request frees its row and its blocks at once, so a queued
   request can join in the next step.

KV blocks and device memory are the memory manager's (jlora/engine/memory): a request's
blocks come as a lease whose first blocks may be a cached prefix of the same adapter's
earlier prompts (the prefill then computes only the rest, `PrefillJob.cached`); its
full blocks stay cached after it leaves, under the cache policy (EngineConfig.
cache_policy). A request whose cached prefix is being swapped in from the host pool
waits for it, as for its adapter, and later requests may go first.

Everything runs on the caller's thread (the server's scheduler thread), except
`stage_adapter`, which any thread may call (registration validates and copies off
the scheduler thread). Any exception other than a `RequestError` comes from the device
and is the caller's: the device is broken.

A request's host state is a plain value: `export` takes a request out as a
`SequenceState`, `resume` continues it here or in another orchestrator with the same
tokens (its seed and step travel with it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np

from configs import SPLIT_TOKENS, ConfigError, bucket
from jlora.contract.adapters import Adapter
from jlora.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    RequestError,
    ResourceExhausted,
)
from jlora.engine import cost_model
from jlora.engine.adapters import AdapterManager
from jlora.engine.api import (
    ERROR,
    LENGTH,
    STOP,
    AdapterInfo,
    EngineStats,
    MergeStats,
    Request,
    RunningInfo,
    SequenceState,
    TokenEvent,
)
from jlora.engine.detokenizer import Detokenizer
from jlora.engine.device_api import DecodeRow, DeviceEngine, PrefillJob, SamplingRow
from jlora.engine.memory.manager import FULL, SWAPPING, Lease, MemoryManager
from jlora.engine.merging import Batch, DynamicBatcher

log = logging.getLogger(__name__)

LOAD_WAIT_S = 1.0  # an idle step waits this long at most for an adapter to land
# With merging on, adapters are requested (loads started) for this many queued requests
# per decode row at most, in FCFS order, so a long queue does not churn the slots.
LOOKAHEAD_PER_ROW = 2


@dataclasses.dataclass(eq=False)
class _Sequence:
    """Host state of one request, queued or running (hashed by identity)."""

    request: Request
    seed: int
    limit: int  # the sequence may grow to this many tokens (prompt + generated)
    detokenizer: Detokenizer | None
    order: int = 0  # first-come first-served rank
    generated: list[int] = dataclasses.field(default_factory=list)
    lease: Lease | None = None  # its KV blocks, once admitted
    prefilled: bool = False  # its KV is written (up to its last token)
    chunked: int = 0  # admitted, prefilled in chunks: the tokens whose KV is written so far
    row: int = -1  # its decode row, once admitted
    adapter_slot: int = -1
    assist: bool | None = None  # the cost model's decision (auto mode), once made
    parked: bool = False  # prefilled, not inserted: its adapter is still landing
    paused: bool = False  # prefilled, out of the batch (merging): keeps blocks and slot
    served_at: float = dataclasses.field(default_factory=time.monotonic)  # its last token
    adapter_wait: float | None = None  # since when it waits, queued, for its adapter
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """Its prompt and what it has generated."""
        return [*self.request.prompt_ids, *self.generated]

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)

    def sampling_row(self) -> SamplingRow:
        params = self.request.sampling
        return SamplingRow(
            params.temperature, params.top_k, params.top_p, self.seed, len(self.generated)
        )


class Orchestrator:
    """See the module docstring."""

    def __init__(self, device: DeviceEngine) -> None:
        self.device = device
        self.config = cfg = device.config
        self.tokenizer = device.tokenizer
        sizes = device.memory()
        self.memory = MemoryManager(
            policy=cfg.cache_policy,
            device=device,
            num_pages=cfg.num_blocks,
            page_bytes=sizes.kv_block_bytes or 1,
            block_size=cfg.block_size,
            host_bytes=cfg.host_pool_mib * 2**20 if device.can_swap_kv else 0,
            lora_slots=cfg.max_loras,
            lora_slot_bytes=sizes.lora_slot_bytes,
            min_kv_pages=cfg.blocks_per_seq,
            link_bytes_per_s=cfg.emulated_link_gbps * 1e9,
        )
        self.adapters: AdapterManager | None = None
        if cfg.max_loras:
            self.adapters = AdapterManager(
                device, num_slots=device.adapter_slots, mode=cfg.lora_mode, memory=self.memory
            )
            self.memory.attach(self.adapters.slots)
        self.counters: collections.Counter[str] = collections.Counter()
        self.adapter_wait_s = 0.0  # queued requests' seconds waiting for their adapter
        self.batcher: DynamicBatcher | None = None
        if cfg.merge != "never":
            if not device.can_merge:
                raise ConfigError(
                    f"EngineConfig.merge={cfg.merge!r} needs an engine that can merge "
                    "adapters (max_loras > 0)"
                )
            self.batcher = DynamicBatcher(cfg.merge, cfg.max_slots)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._paused: list[_Sequence] = []
        self._arrivals = 0
        self._rows: list[_Sequence | None] = [None] * cfg.max_slots
        self._ids: set[str] = set()
        self._seeds = np.random.default_rng()
        self._lazy = cfg.kv_allocation == "lazy"
        self._watermark = max(1, cfg.num_blocks // 100) if self._lazy else 0
        self._eos = set(self.tokenizer.eos_ids) if self.tokenizer is not None else set()

    # -- capacity and state ----------------------------------------------------------

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def num_running(self) -> int:
        return sum(seq is not None for seq in self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting) or bool(self._paused) or self.num_running > 0

    def warmup(
        self,
        prompt_lengths: list[int] | None = None,
        max_length: int | None = None,
        *,
        on_demand: bool = False,
    ) -> None:
        """Compile the device engine's steps, or with `on_demand` only what they need
        when they first need it (see `DeviceEngine.warmup`); in cached mode, wait until
        every adapter is on the device."""
        self.device.warmup(prompt_lengths, max_length, on_demand=on_demand)
        if self.adapters is not None and self.adapters.mode == "cached":
            self.adapters.wait_pinned()

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
        self.memory.close()
        self.device.close()

    # -- requests ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue `request`; RequestError (and no change) if it cannot run here."""
        self._queue(self._checked(request, generated=()))

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request, freeing its row and blocks; False if unknown."""
        seq = self._find(request_id)
        if seq is not None:
            self._remove(seq)
        return seq is not None

    def admitted(self, request_id: str) -> bool:
        """Whether the request has been prefilled (running, paused or parked), not queued."""
        seq = self._find(request_id)
        return seq is not None and (seq.row >= 0 or seq.paused)

    def export(self, request_id: str) -> SequenceState:
        """Take a queued or running request out, as the value `resume` continues."""
        seq = self._find(request_id)
        if seq is None:
            raise NotFound(
                f"request_id={request_id!r} is not queued or running", field="request_id"
            )
        self._remove(seq)
        request = seq.request
        return SequenceState(
            request_id=request.request_id,
            prompt_ids=tuple(request.prompt_ids),
            generated=tuple(seq.generated),
            sampling=request.sampling,
            seed=seq.seed,
            adapter=request.adapter,
            arrival_time=request.arrival_time,
        )

    def resume(self, state: SequenceState) -> None:
        """Queue an exported request; its next token is the one it would have had next."""
        request = Request(
            state.request_id,
            list(state.prompt_ids),
            dataclasses.replace(state.sampling, seed=state.seed),
            adapter=state.adapter,
            arrival_time=state.arrival_time,
        )
        self._queue(self._checked(request, generated=state.generated))

    def step(self) -> list[TokenEvent]:
        """One iteration (steps 2-6 of the module docstring); returns its events."""
        events: list[TokenEvent] = []
        self.memory.tick(self.num_running)
        if self.adapters is not None:
            self._install_landed(events)
        if self.batcher is None:
            self._admit(events)
        else:
            self._schedule(self.batcher, events)
        self._grow(events)
        decoding = self._decoding()
        if decoding:
            start = time.perf_counter()
            tokens = self.device.generate()
            if self.batcher is not None:
                merged = self.device.merged is not None
                self.batcher.observe(merged, len(decoding), time.perf_counter() - start)
            for seq in decoding:
                self._append(seq, int(tokens[seq.row]), events)
        elif self._chunking():
            pass  # the next step prefills the next chunk
        elif self.has_unfinished and self.adapters is not None and self.adapters.slots.loading():
            self.adapters.slots.wait(timeout=LOAD_WAIT_S)  # nothing runs until one lands
        elif self.has_unfinished and self.memory.swapping:
            self.memory.wait(timeout=LOAD_WAIT_S)  # nothing runs until a swap-in lands
        return events

    # -- adapters ---------------------------------------------------------------------

    def stage_adapter(
        self, name: str, path: str | Path, *, expect_sha256: str | None = None
    ) -> Adapter:
        """Any thread: validate the adapter at `path` and copy it into host memory as
        `name` (registration's slow half; `commit_adapter` finishes it)."""
        return self._adapter_manager().stage(name, path, expect_sha256=expect_sha256)

    def commit_adapter(
        self, staged: Adapter, *, load: bool = False, pin: bool = False
    ) -> AdapterInfo:
        adapters = self._adapter_manager()
        adapters.commit(staged, load=load, pin=pin)
        return adapters.info(staged.name)

    def discard_adapter(self, staged: Adapter) -> None:
        """Forget an adapter staged but not committed."""
        self._adapter_manager().discard(staged)

    def register_adapter(
        self,
        name: str,
        path: str | Path,
        *,
        expect_sha256: str | None = None,
        load: bool = False,
        pin: bool = False,
    ) -> AdapterInfo:
        """Stage and commit in one call (on the scheduler thread: the CLI's way)."""
        staged = self.stage_adapter(name, path, expect_sha256=expect_sha256)
        return self.commit_adapter(staged, load=load, pin=pin)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter that no queued or running request names."""
        users = sum(seq.request.adapter == name for seq in self._sequences())
        self._adapter_manager().unregister(name, users=users)
        if self.device.merged == name:  # idle, merged: its weights leave with it
            self._switch(None)

    def load_adapter(self, name: str, *, pin: bool = False) -> AdapterInfo:
        adapters = self._adapter_manager()
        adapters.load(name, pin=pin)
        return adapters.info(name)

    def unload_adapter(self, name: str) -> AdapterInfo:
        adapters = self._adapter_manager()
        adapters.unload(name)
        return adapters.info(name)

    def adapter_infos(self) -> list[AdapterInfo]:
        """Every registered adapter and where it is, in registration order (loads that
        have landed are installed first, so an idle engine reports them ready)."""
        if self.adapters is None:
            return []
        self.adapters.poll()
        return self.adapters.infos()

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The running batch, the queue, the slots and memory, now."""
        adapters, cfg = self.adapters, self.config
        if adapters is not None:
            adapters.poll()  # an idle engine installs landed loads here

        def info(seq: _Sequence) -> RunningInfo:
            adapter = seq.request.adapter
            return RunningInfo(
                request_id=seq.request.request_id,
                adapter=adapter,
                rank=adapters.get(adapter).rank if adapters is not None and adapter else 0,
                slot=seq.row,
                prompt_tokens=len(seq.request.prompt_ids),
                generated_tokens=len(seq.generated),
                max_tokens=seq.request.sampling.max_tokens,
            )

        running = tuple(info(seq) for seq in (*self._rows, *self._paused) if seq is not None)
        slots = adapters.slots if adapters is not None else None
        counts = slots.stats() if slots is not None else {}
        memory, cache = self.device.memory(), self.memory.stats()
        return EngineStats(
            running=running,
            waiting=len(self._waiting),
            max_slots=cfg.max_slots,
            max_seq_len=cfg.max_seq_len,
            kv_blocks_total=cfg.num_blocks,
            kv_blocks_free=cache.pages_total
            - cache.pages_lora
            - cache.pages_kv
            + cache.pages_kv_cached,
            kv_block_size=cfg.block_size,
            adapter_slots_total=self.device.adapter_slots,
            adapter_slots_free=slots.num_free if slots is not None else 0,
            adapter_slots_loading=len(slots.loading()) if slots is not None else 0,
            adapter_loads=counts.get("loads", 0),
            adapter_evictions=counts.get("evictions", 0),
            host_store_bytes_used=memory.host_store_used,
            host_store_bytes_capacity=memory.host_store_capacity,
            device_bytes_in_use=memory.device_in_use,
            device_bytes_limit=memory.device_limit,
            merging=self._merge_stats(),
            queued=tuple(info(seq) for seq in self._waiting),
            kv_block_bytes=memory.kv_block_bytes,
            cache=cache,
            preemptions=self.counters["preemptions"],
            prefill_chunks=self.counters["prefill_chunks"],
            adapter_wait_s=self.adapter_wait_s,
        )

    def _merge_stats(self) -> MergeStats | None:
        batcher = self.batcher
        if batcher is None:
            return None
        now, waits = time.monotonic(), dict.fromkeys(batcher.credits, 0.0)
        for seq in self._sequences():
            if seq.row < 0 or seq.parked:  # queued or paused: not served this iteration
                adapter = seq.request.adapter
                waits[adapter] = max(waits.get(adapter, 0.0), now - seq.served_at)
        counters = batcher.counters
        return MergeStats(
            merged=self.device.merged,
            alpha=batcher.alpha,
            beta=batcher.beta,
            merged_iterations=counters["merged_iterations"],
            unmerged_iterations=counters["unmerged_iterations"],
            switches=counters["switches"],
            credits=tuple((name or "", credit) for name, credit in batcher.credits.items()),
            waits=tuple((name or "", wait) for name, wait in waits.items()),
        )

    # -- admission ----------------------------------------------------------------------

    def _checked(self, request: Request, *, generated: tuple[int, ...]) -> _Sequence:
        """The sequence of a valid request (with `generated` tokens already), or a
        RequestError naming the field."""
        prompt = request.prompt_ids
        if request.request_id in self._ids:
            raise AlreadyExists(
                f"request_id={request.request_id!r} is already in use", field="request_id"
            )
        if request.adapter is not None and (
            self.adapters is None or request.adapter not in self.adapters
        ):
            raise NotFound(
                f"adapter={request.adapter!r} is not registered",
                field="adapter",
                reason="ADAPTER_NOT_FOUND",
            )
        if not prompt:
            raise InvalidRequest("prompt is empty", field="prompt")
        if len(prompt) >= self.max_seq_len:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens; the context limit is {self.max_seq_len} "
                f"tokens (max_seq_len), which leaves no room to generate",
                field="prompt",
            )
        vocab = self.device.vocab_size
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_ids[{bad}]={prompt[bad]} is outside the vocabulary [0, {vocab})",
                field="prompt",
            )
        sampling = request.sampling
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequest(
                "stop strings need a tokenizer; this model has none", field="sampling.stop"
            )
        self._check_generated(prompt, generated, sampling.max_tokens)
        limit = min(len(prompt) + sampling.max_tokens, self.max_seq_len)
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(2**32))
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = Detokenizer(self.tokenizer, sampling.stop)
            for token in generated:  # its text went out already: rebuild the state only
                detokenizer.add(token)
        return _Sequence(request, seed, limit, detokenizer, generated=list(generated))

    def _check_generated(
        self, prompt: list[int], generated: tuple[int, ...], max_tokens: int
    ) -> None:
        """A resumed request's tokens so far must be tokens and leave one to generate
        (named as the API's `resume.generated_ids`, where they come from)."""
        vocab = self.device.vocab_size
        bad = next((i for i, t in enumerate(generated) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"resume.generated_ids[{bad}]={generated[bad]} is outside the vocabulary "
                f"[0, {vocab})",
                field="resume.generated_ids",
            )
        if len(generated) >= max_tokens:
            raise InvalidRequest(
                f"resume.generated_ids has {len(generated)} tokens: sampling.max_tokens="
                f"{max_tokens} leaves none to generate",
                field="resume.generated_ids",
            )
        if len(prompt) + len(generated) >= self.max_seq_len:
            raise InvalidRequest(
                f"the prompt ({len(prompt)} tokens) and resume.generated_ids "
                f"({len(generated)}) fill the context limit of {self.max_seq_len} tokens "
                "(max_seq_len)",
                field="resume.generated_ids",
            )

    def _queue(self, seq: _Sequence) -> None:
        seq.order = self._arrivals
        self._arrivals += 1
        self._waiting.append(seq)
        self._ids.add(seq.request.request_id)

    def _admit(self, events: list[TokenEvent]) -> None:
        """Prefill this step's `prefill_token_budget` prompt tokens: first the next chunks
        of the requests prefilled in chunks, then queued requests as they are admitted
        (step 3); the last of them may get only a chunk."""
        budget, bs, prefilled = self.config.prefill_token_budget, self.config.block_size, 0
        admitted: list[tuple[_Sequence, Lease, bool, int]] = []
        for seq in self._chunking():
            assert seq.lease is not None
            end = self._chunk_end(seq, seq.chunked, budget - prefilled)
            if end == seq.chunked:
                break
            admitted.append((seq, seq.lease, False, end))
            prefilled += end - seq.chunked
        for seq in list(self._waiting):
            if None not in self._rows or budget - prefilled < bs:
                break
            adapter, assist = seq.request.adapter, False
            if adapter is not None:
                assert self.adapters is not None
                if self.adapters.slots.request(adapter) is None:
                    if not self._assists(seq):
                        if seq.adapter_wait is None:
                            seq.adapter_wait = time.monotonic()
                        continue  # its adapter is on its way; later requests may go first
                    assist = True
            if assist and prefilled and prefilled + seq.length > budget:
                break  # a CPU-assisted prefill runs whole, in a step of its own if need be
            if not self._room_for(seq):
                break
            lease = self._lease(seq, reuse=not assist)
            if lease == SWAPPING:
                continue  # its cached prefix is on its way; later requests may go first
            if lease == FULL:
                break
            assert isinstance(lease, Lease)
            if seq.adapter_wait is not None:
                self.adapter_wait_s += time.monotonic() - seq.adapter_wait
                seq.adapter_wait = None
            self._start(seq, lease)
            start = lease.cached_tokens
            end = seq.length if assist else self._chunk_end(seq, start, budget - prefilled)
            admitted.append((seq, lease, assist, end))
            prefilled += end - start
        self._prefill(admitted, events)

    def _chunking(self) -> list[_Sequence]:
        """Admitted requests whose prefill is under way in chunks, oldest first."""
        rows = (seq for seq in self._rows if seq is not None and not seq.prefilled)
        return sorted(rows, key=lambda seq: seq.order)

    def _chunk_end(self, seq: _Sequence, start: int, room: int) -> int:
        """Where this step's prefill of `seq` ends, its KV written up to `start`: at its
        last token if the rest fits in `room` tokens, else after the most whole blocks
        that do (vLLM's chunked prefill), so the next chunk continues a cached prefix of
        whole blocks; `start` if not one block fits. Where padding that prefill to its
        prefill bucket would compute `SPLIT_TOKENS` or more tokens than ending it on a
        smaller bucket (and, for the last chunk, padding the rest), it ends there: a
        384-token prompt runs as 256 + 128 tokens, not 512. Not under the "none" cache
        policy (S-LoRA's baseline: a prompt's chunks as long as the budget allows)."""
        cfg = self.config
        rest, bs = seq.length - start, cfg.block_size
        whole = rest if rest <= room else room // bs * bs
        buckets = cfg.prefill_buckets
        smaller = [b for b in buckets if b % bs == 0 and b <= min(whole, rest - 1)]
        if cfg.cache_policy == "none" or not smaller:
            return start + whole
        split = smaller[-1]
        padding = bucket(buckets, whole) - whole
        after = 0 if whole < rest else bucket(buckets, rest - split) - (rest - split)
        return start + (split if padding - after >= SPLIT_TOKENS else whole)

    def _assists(self, seq: _Sequence) -> bool:
        """Whether to prefill `seq` now with CPU assistance, its adapter still loading."""
        adapter, mode = seq.request.adapter, self.config.lora_mode
        assert self.adapters is not None and adapter is not None
        slots = self.adapters.slots
        if mode not in ("cpu-assist", "auto") or not self.device.can_assist:
            return False
        if not slots.will_land(adapter):
            return False
        if mode == "cpu-assist":
            return True
        if seq.assist is None:
            estimate = self.device.cold_start(adapter, slots.loading()[adapter], seq.length)
            if estimate is None:
                return False
            decision = cost_model.decide(estimate)
            seq.assist = decision.assist
            self.counters["auto_assist" if decision.assist else "auto_wait"] += 1
            log.info(
                "request %s, adapter %s, %d prompt tokens: %s",
                seq.request.request_id,
                adapter,
                seq.length,
                decision.describe(),
            )
        return seq.assist

    def _lease(self, seq: _Sequence, *, reuse: bool) -> Lease | str:
        """The KV blocks for `seq` (a cached prefix first, if `reuse`)."""
        return self.memory.admit(
            seq.request.request_id, seq.request.adapter, seq.tokens, self._blocks(seq), reuse
        )

    def _blocks(self, seq: _Sequence) -> int:
        """The blocks `seq` is admitted with: its prompt (and generated tokens) and the
        next token, lazily; its whole sequence, up front."""
        tokens = seq.length + 1 if self._lazy else seq.limit
        return math.ceil(min(tokens, seq.limit) / self.config.block_size)

    def _room_for(self, seq: _Sequence) -> bool:
        """Whether admitting `seq` leaves the watermark for the running requests to grow
        into (lazily; at worst, its prefix is not cached)."""
        if not self._watermark or not any(self._admitted()):
            return True
        return self.memory.available() >= self._blocks(seq) + self._watermark

    def _start(self, seq: _Sequence, lease: Lease) -> None:
        """An admitted request takes its lease, its adapter's slot and a decode row."""
        self._waiting.remove(seq)
        adapter = seq.request.adapter
        if adapter is not None:
            assert self.adapters is not None
            seq.adapter_slot = self.adapters.slots.acquire(adapter)
        seq.lease = lease
        seq.row = self._rows.index(None)
        self._rows[seq.row] = seq

    def _prefill(
        self, admitted: list[tuple[_Sequence, Lease, bool, int]], events: list[TokenEvent]
    ) -> None:
        """Prefill the requests admitted this step (seq, lease, CPU-assisted, the token
        its prefill ends at this step) in one `prefill_many` (the engine packs the plain
        ones several to a compiled call), and sample the first tokens of those whose
        prompt is now written. A chunk continues the KV its earlier chunks (or a cached
        prefix) wrote, as a cached-prefix prefill; its sampled token is not used. A
        request whose prefill failed alone fails; the others go on."""
        if not admitted:
            return
        jobs = [
            PrefillJob(
                tokens=seq.tokens[:end],
                block_table=self._block_table(seq),
                sampling=seq.sampling_row(),
                adapter_slot=seq.adapter_slot,
                assist=seq.request.adapter if assist else None,
                cached=max(lease.cached_tokens, seq.chunked),
            )
            for seq, lease, assist, end in admitted
        ]
        start = time.perf_counter()
        results = self.device.prefill_many(jobs)
        if not any(assist for _, _, assist, _ in admitted):
            computed = sum(len(job.tokens) - job.cached for job in jobs)
            self.memory.observe_prefill(computed, time.perf_counter() - start)
        for (seq, lease, assist, end), job, prefilled in zip(admitted, jobs, results, strict=True):
            if prefilled.error is not None:
                self._fail(seq, prefilled.error, events)
                continue
            if end < seq.length:  # a chunk: the rest in the next steps
                seq.chunked = end
                self.counters["prefill_chunks"] += 1
                continue
            seq.prefilled = True
            self.memory.prefilled(lease, job.tokens)
            if assist:
                self._assisted(seq, prefilled.routes)
            # A re-prefill after a preemption is the engine's own: no prompt token served.
            cached = 0 if seq.preemptions else lease.cached_tokens
            running = self._append(seq, prefilled.token, events, cached=cached)
            if running and not seq.parked:
                self._insert(seq)

    def _assisted(self, seq: _Sequence, routes: str) -> None:
        """A CPU-assisted prefill: park the request if its adapter has not landed yet."""
        adapter = seq.request.adapter
        assert self.adapters is not None and adapter is not None
        seq.parked = not self.adapters.slots.is_ready(adapter)
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

    # -- merging (dLoRA) ------------------------------------------------------------------

    def _schedule(self, batcher: DynamicBatcher, events: list[TokenEvent]) -> None:
        """Admission with merging on: the batcher picks this iteration's requests among the
        runnable ones (merging.py); running requests left out are paused (their KV and
        adapter slot kept), the engine merges or unmerges as the batch needs, paused
        requests picked are inserted again and queued ones picked are prefilled (decode
        rows, KV blocks and the prefill token budget permitting)."""
        runnable = self._runnable()
        if not runnable:
            return
        batch = batcher.plan([(seq, seq.request.adapter) for seq in runnable])
        chosen = set(batch.items)
        for seq in self._rows:
            if seq is not None and not seq.parked and seq not in chosen:
                self._pause(seq)
        if self.device.merged != batch.merged:
            self._switch(batch.merged)
        self._run_batch(batch, events)
        if batch.merged is not None and self.num_running == 0:
            # Nothing of the merged batch could start (no KV blocks while paused requests
            # hold them): unmerge and let the FCFS batch go on, so the engine never stalls.
            batcher.merged = None
            self._switch(None)
            fcfs = self._runnable()[: self.max_slots]
            self._run_batch(Batch(tuple(fcfs), None, "fcfs"), events)

    def _runnable(self) -> list[_Sequence]:
        """Requests that can run this iteration, in FCFS order: running and paused ones,
        and queued ones whose adapter is on the device (for the first few queued, an
        adapter that is not gets its load started)."""
        runnable = [seq for seq in self._rows if seq is not None and not seq.parked]
        runnable += self._paused
        lookahead = LOOKAHEAD_PER_ROW * self.max_slots
        for seq in list(self._waiting)[:lookahead]:
            adapter = seq.request.adapter
            if adapter is None:
                runnable.append(seq)
            else:
                assert self.adapters is not None
                if self.adapters.slots.request(adapter) is not None:
                    runnable.append(seq)
        return sorted(runnable, key=lambda seq: seq.order)

    def _run_batch(self, batch: Batch, events: list[TokenEvent]) -> None:
        budget, prefilled = self.config.prefill_token_budget, 0
        admitted: list[tuple[_Sequence, Lease, bool, int]] = []
        for seq in batch.items:
            assert isinstance(seq, _Sequence)
            if None not in self._rows:
                break
            if seq.paused:
                self._unpause(seq)
            elif seq.row < 0:
                if prefilled and prefilled + seq.length > budget:
                    continue
                if not self._room_for(seq):
                    continue
                lease = self._lease(seq, reuse=True)
                if not isinstance(lease, Lease):
                    continue
                self._start(seq, lease)
                admitted.append((seq, lease, False, seq.length))  # whole: no chunks here
                prefilled += seq.length - lease.cached_tokens
        self._prefill(admitted, events)

    def _pause(self, seq: _Sequence) -> None:
        self.device.free(seq.row)
        self._rows[seq.row] = None
        seq.row = -1
        seq.paused = True
        self._paused.append(seq)

    def _unpause(self, seq: _Sequence) -> None:
        self._paused.remove(seq)
        seq.paused = False
        seq.row = self._rows.index(None)
        self._rows[seq.row] = seq
        self._insert(seq)

    def _switch(self, adapter: str | None) -> None:
        """Unmerge, then merge `adapter` (None: stay unmerged); the batcher learns the
        switch's cost."""
        start = time.perf_counter()
        before = self.device.merged
        if before is not None:
            self.device.unmerge()
        if adapter is not None:
            self.device.merge(adapter)
        seconds = time.perf_counter() - start
        self.counters["merge_switches"] += 1
        if self.batcher is not None:
            self.batcher.switched(seconds)
        log.info("merged %s -> %s in %.1f ms", before, adapter, seconds * 1e3)

    def _install_landed(self, events: list[TokenEvent]) -> None:
        adapters = self.adapters
        assert adapters is not None
        adapters.poll()
        for name, error in adapters.take_failures():
            for seq in self._sequences():
                if seq.request.adapter == name and (seq.row < 0 or seq.parked):
                    self._fail(seq, error, events)
        for parked in self._rows:
            if (
                parked is not None
                and parked.parked
                and adapters.slots.is_ready(parked.request.adapter or "")
            ):
                parked.parked = False
                self._insert(parked)

    # -- lazy KV and preemption -------------------------------------------------------------

    def _grow(self, events: list[TokenEvent]) -> None:
        """Give each decoding row, oldest first, the block its next token's KV goes to;
        where none can be had, preempt the newest request until one can (step 5)."""
        bs = self.config.block_size
        for seq in sorted(self._decoding(), key=lambda seq: seq.order):
            while seq.lease is not None and len(seq.lease.table) * bs < seq.length:
                if self.memory.grow(seq.lease, 1):
                    self._insert(seq)  # the row's longer block table
                    continue
                admitted = list(self._admitted())
                if admitted == [seq]:  # the pool cannot hold this one sequence
                    pages = self.memory.pool.num_pages
                    self._fail(seq, ResourceExhausted(
                        f"the device pool ({pages} pages of {bs} tokens, adapters included) "
                        f"cannot hold this request's {seq.length} tokens; lower "
                        "sampling.max_tokens or give the server a larger --pool-size",
                        field="sampling.max_tokens",
                    ), events)  # fmt: skip
                    break
                self._preempt(max(admitted, key=lambda seq: seq.order))

    def _preempt(self, seq: _Sequence) -> None:
        """Queue an admitted request again, after those that came before it, giving back
        what it holds; it keeps its tokens, seed and text."""
        self._release(seq)
        seq.preemptions += 1
        seq.parked = False
        self.counters["preemptions"] += 1
        position = sum(1 for queued in self._waiting if queued.order < seq.order)
        self._waiting.insert(position, seq)
        log.info(
            "request %s preempted after %d tokens (%d waiting)",
            seq.request.request_id,
            len(seq.generated),
            len(self._waiting),
        )

    def _decoding(self) -> list[_Sequence]:
        """The rows the next decode step advances (not those still prefilling in chunks)."""
        return [seq for seq in self._rows if seq is not None and seq.prefilled and not seq.parked]

    def _admitted(self) -> list[_Sequence]:
        """Requests holding KV: in a decode row (parked or not) or paused."""
        return [*(seq for seq in self._rows if seq is not None), *self._paused]

    # -- rows -------------------------------------------------------------------------------

    def _block_table(self, seq: _Sequence) -> np.ndarray:
        assert seq.lease is not None
        blocks = seq.lease.table
        table = np.full(self.config.blocks_per_seq, self.config.num_blocks, np.int32)
        table[: len(blocks)] = blocks
        return table

    def _insert(self, seq: _Sequence) -> None:
        row = DecodeRow(
            token=seq.generated[-1],
            position=seq.length - 1,
            block_table=self._block_table(seq),
            sampling=seq.sampling_row(),
            adapter_slot=seq.adapter_slot,
        )
        self.device.insert(seq.row, row)

    def _append(
        self, seq: _Sequence, token: int, events: list[TokenEvent], *, cached: int = 0
    ) -> bool:
        """Record a sampled token, emit its event (`cached`: the prefix-cache hit of the
        prefill that sampled it); False if that finished the request."""
        seq.generated.append(token)
        seq.served_at = time.monotonic()
        text, hit_stop = seq.detokenizer.add(token) if seq.detokenizer else ("", False)
        finish = None
        if hit_stop or (token in self._eos and not seq.request.sampling.ignore_eos):
            finish = STOP
        elif seq.length >= seq.limit:
            finish = LENGTH
        if finish is not None and not hit_stop and seq.detokenizer is not None:
            text += seq.detokenizer.flush()
        events.append(TokenEvent(seq.request.request_id, token, text, finish, cached_tokens=cached))
        if finish is not None:
            self._remove(seq)
        return finish is None

    def _fail(self, seq: _Sequence, error: RequestError, events: list[TokenEvent]) -> None:
        log.warning("request %s failed: %s", seq.request.request_id, error.message)
        events.append(TokenEvent(seq.request.request_id, -1, "", ERROR, error))
        self._remove(seq)

    def _remove(self, seq: _Sequence) -> None:
        """Take `seq` out, queued or running, and give back what it holds."""
        if seq.row < 0 and not seq.paused:
            self._waiting.remove(seq)
            self.memory.forget(seq.request.request_id)
        else:
            self._release(seq)
        self._ids.discard(seq.request.request_id)

    def _release(self, seq: _Sequence) -> None:
        """An admitted request gives back its row (or leaves the paused), its KV and its
        adapter slot."""
        if seq.paused:
            self._paused.remove(seq)
            seq.paused = False
        else:
            self.device.free(seq.row)
            self._rows[seq.row] = None
            seq.row = -1
        assert seq.lease is not None
        # The newest token's KV is written by the step that would have fed it; a prefill
        # that failed may have written nothing.
        written = seq.length - 1 if seq.prefilled else 0
        self.memory.release(seq.lease, seq.tokens, written=written)
        seq.lease, seq.prefilled, seq.chunked = None, False, 0
        if seq.request.adapter is not None:
            assert self.adapters is not None
            self.adapters.slots.release(seq.request.adapter)
            seq.adapter_slot = -1

    # -- helpers ----------------------------------------------------------------------------

    def _sequences(self) -> list[_Sequence]:
        return [*self._waiting, *self._paused, *(seq for seq in self._rows if seq is not None)]

    def _find(self, request_id: str) -> _Sequence | None:
        return next((s for s in self._sequences() if s.request.request_id == request_id), None)

    def _adapter_manager(self) -> AdapterManager:
        if self.adapters is None:
            raise FailedPrecondition(
                "this engine serves the base model only (max_loras=0)", reason="NO_ADAPTERS"
            )
        return self.adapters
