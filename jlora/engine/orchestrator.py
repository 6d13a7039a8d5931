"""The orchestrator: continuous batching at the iteration level (Orca) over a device engine.

It owns everything about requests, in plain host state, and drives any `DeviceEngine`
(device_api.py): the JAX `LlamaEngine` or the `MockEngine` of the server and router
tests. What to run each step is the scheduler's decision (scheduler.py); the
orchestrator carries it out and turns the device's tokens into events.

A request's life:

1. `add_request` validates it (a unique id, a registered adapter, a prompt that is not
   empty, fits the context and the vocabulary, stop strings only with a tokenizer) and
   queues it. Nothing else changes; a bad request raises `RequestError` naming the field.
2. Each `step()` first installs the adapter loads that have landed. A load that failed
   fails the requests that waited for that adapter (and those prefilled while it was
   in flight); the worker goes on. A request parked until its adapter landed is
   inserted into its decode row.
3. The scheduler's admission plan is carried out: rows freed, the merged adapter
   switched (dLoRA), the admitted requests prefilled (`device.prefill_many`, which
   packs short plain prompts several to a compiled call; a chunk continues the KV of
   the chunks before it, and only the last samples a first token), paused requests
   inserted again. A prefilled request is inserted into its decode row, or parked if
   its adapter has not fully landed (a CPU-assisted prefill). A fault of one request
   alone (`RequestError` from the device engine) fails it and nothing else.
4. The scheduler's growth plan is carried out (rows given their next block, requests
   preempted to make room, scheduler.py), then `device.generate` advances every
   inserted row by one token; rows of different adapters (and the base model) share
   the step.
5. Each token is checked on the host against EOS, stop strings, max_tokens and
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

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from configs import ConfigError
from jlora.contract.adapters import Adapter
from jlora.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    RequestError,
)
from jlora.engine.adapters import AdapterManager
from jlora.engine.api import (
    ERROR,
    LENGTH,
    STOP,
    AdapterInfo,
    EngineStats,
    Logprobs,
    Request,
    SequenceState,
    TokenEvent,
    check_request,
)
from jlora.engine.detokenizer import Detokenizer
from jlora.engine.device_api import DecodeRow, DeviceEngine, LogprobArrays, PrefillJob
from jlora.engine.grammar import Grammars
from jlora.engine.memory.manager import MemoryManager
from jlora.engine.merging import DynamicBatcher
from jlora.engine.scheduler import KEEP, Plan, Prefill, Scheduler, Sequence
from jlora.engine.stats import engine_stats

log = logging.getLogger(__name__)

LOAD_WAIT_S = 1.0  # an idle step waits this long at most for an adapter to land


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
        self.batcher: DynamicBatcher | None = None
        if cfg.merge != "never":
            if not device.can_merge:
                raise ConfigError(
                    f"EngineConfig.merge={cfg.merge!r} needs an engine that can merge "
                    "adapters (max_loras > 0)"
                )
            self.batcher = DynamicBatcher(cfg.merge, cfg.max_slots)
        self.scheduler = Scheduler(device, self.memory, self.adapters, self.batcher)
        self.counters = self.scheduler.counters
        self._ids: set[str] = set()
        self._seeds = np.random.default_rng()
        self._eos = set(self.tokenizer.eos_ids) if self.tokenizer is not None else set()
        self._grammar_cache: Grammars | None = None

    # -- capacity and state ----------------------------------------------------------

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def has_unfinished(self) -> bool:
        return any(self.scheduler.sequences())

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
        """One iteration (steps 2-5 of the module docstring); returns its events."""
        events: list[TokenEvent] = []
        self.memory.tick(self.num_running)
        if self.adapters is not None:
            self._install_landed(events)
        self._carry_out(self.scheduler.admit(), events)
        self._carry_out(self.scheduler.grow(), events)
        decoding = self.scheduler.decoding()
        if decoding:
            grammars = [(seq.row, seq.grammar) for seq in decoding if seq.grammar is not None]
            if grammars:
                masks = self._grammars().masks([grammar for _, grammar in grammars])
                for (row, _), mask in zip(grammars, masks, strict=True):
                    self.device.constrain(row, mask)
            start = time.perf_counter()
            tokens = self.device.generate()
            if self.batcher is not None:
                merged = self.device.merged is not None
                self.batcher.observe(merged, len(decoding), time.perf_counter() - start)
            logprobs = self.device.decode_logprobs()
            for seq in decoding:
                own = None
                if logprobs is not None and seq.request.sampling.logprobs is not None:
                    own = logprobs.take([seq.row])
                self._append(seq, int(tokens[seq.row]), events, logprobs=own)
        elif self.scheduler.chunking():
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
        users = sum(seq.request.adapter == name for seq in self.scheduler.sequences())
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
        """The running batch, the queue, the slots and memory, now (stats.py)."""
        return engine_stats(self)

    # -- admission ---------------------------------------------------------------------

    def _checked(self, request: Request, *, generated: tuple[int, ...]) -> Sequence:
        """The sequence of a valid request (with `generated` tokens already), or a
        RequestError naming the field (`api.check_request`)."""
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
        check_request(
            request,
            generated,
            max_seq_len=self.max_seq_len,
            vocab_size=self.device.vocab_size,
            has_tokenizer=self.tokenizer is not None,
        )
        sampling = request.sampling
        limit = min(len(request.prompt_ids) + sampling.max_tokens, self.max_seq_len)
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(2**32))
        stops = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(self._eos)
        )
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = Detokenizer(
                self.tokenizer,
                sampling.stop,
                include_stop=sampling.include_stop_str_in_output,
                min_tokens=sampling.min_tokens,
                skip_special=sampling.skip_special_tokens,
            )
            for token in generated:  # its text went out already: rebuild the state only
                detokenizer.add(token)
        seq = Sequence(request, seed, limit, detokenizer, stops, generated=list(generated))
        if sampling.structured is not None:
            seq.grammar = self._grammars().matcher(sampling.structured)
            for token in generated:
                seq.grammar.consume(token)
        # A resumed request's prompt was scored where it started.
        seq.score_prompt = sampling.prompt_logprobs is not None and not generated
        return seq

    # -- carrying out a plan ----------------------------------------------------------

    def _carry_out(self, plan: Plan, events: list[TokenEvent]) -> None:
        """The device's part of a scheduler plan, in its order (scheduler.py)."""
        for row in plan.free:
            self.device.free(row)
        for seq, error in plan.failed:
            self._failed(seq, error, events)
        if plan.switch != KEEP:
            self._switch(plan.switch)
        self._prefill(plan.prefills, events)
        for seq in dict.fromkeys(plan.insert):
            if seq.row >= 0:
                self._insert(seq)

    def _prefill(self, prefills: list[Prefill], events: list[TokenEvent]) -> None:
        """Run this step's prefills in one `prefill_many` (the engine packs the plain ones
        several to a compiled call), and sample the first tokens of those whose prompt is
        now written. A chunk continues the KV its earlier chunks (or a cached prefix)
        wrote, as a cached-prefix prefill; its sampled token is not used. A request whose
        prefill failed alone fails; the others go on."""
        if not prefills:
            return
        jobs = [
            PrefillJob(
                tokens=p.seq.tokens[: p.end],
                block_table=self._block_table(p.seq),
                sampling=p.seq.sampling_row(),
                adapter_slot=p.seq.adapter_slot,
                assist=p.seq.request.adapter if p.assist else None,
                cached=max(p.lease.cached_tokens, p.seq.chunked),
                score_next=p.score_next,
            )
            for p in prefills
        ]
        start = time.perf_counter()
        results = self.device.prefill_many(jobs)
        if not any(p.assist for p in prefills):
            computed = sum(len(job.tokens) - job.cached for job in jobs)
            self.memory.observe_prefill(computed, time.perf_counter() - start)
        for p, job, prefilled in zip(prefills, jobs, results, strict=True):
            seq = p.seq
            if prefilled.error is not None:
                self._fail(seq, prefilled.error, events)
                continue
            if prefilled.prompt is not None:
                seq.prompt_scores[job.cached] = prefilled.prompt
            if p.end < seq.length:  # a chunk: the rest in the next steps
                seq.chunked = p.end
                self.counters["prefill_chunks"] += 1
                continue
            seq.prefilled = True
            self.memory.prefilled(p.lease, job.tokens)
            if p.assist:
                self._assisted(seq, prefilled.routes)
            # A re-prefill after a preemption is the engine's own: no prompt token served.
            cached = 0 if seq.preemptions else p.lease.cached_tokens
            running = self._append(
                seq,
                prefilled.token,
                events,
                cached=cached,
                logprobs=prefilled.logprobs,
                prompt_logprobs=seq.take_prompt_logprobs(),
            )
            if running and not seq.parked:
                self._insert(seq)

    def _assisted(self, seq: Sequence, routes: str) -> None:
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
            for seq in self.scheduler.sequences():
                if seq.request.adapter == name and (seq.row < 0 or seq.parked):
                    self._fail(seq, error, events)
        for parked in self.scheduler.running():
            if parked.parked and adapters.slots.is_ready(parked.request.adapter or ""):
                parked.parked = False
                self._insert(parked)

    def _grammars(self) -> Grammars:
        """The tokenizer's compiled grammars, made on the first structured request."""
        if self._grammar_cache is None:
            vocab = self.device.vocab_size
            self._grammar_cache = Grammars.of(self.tokenizer, vocab, sorted(self._eos))
        return self._grammar_cache

    # -- rows -------------------------------------------------------------------------------

    def _block_table(self, seq: Sequence) -> np.ndarray:
        assert seq.lease is not None
        blocks = seq.lease.table
        table = np.full(self.config.blocks_per_seq, self.config.num_blocks, np.int32)
        table[: len(blocks)] = blocks
        return table

    def _insert(self, seq: Sequence) -> None:
        sampling = seq.sampling_row()
        row = DecodeRow(
            token=seq.generated[-1],
            position=seq.length - 1,
            block_table=self._block_table(seq),
            sampling=sampling,
            adapter_slot=seq.adapter_slot,
            history=seq.tokens if sampling.penalized else (),
        )
        self.device.insert(seq.row, row)

    def _append(
        self,
        seq: Sequence,
        token: int,
        events: list[TokenEvent],
        *,
        cached: int = 0,
        logprobs: LogprobArrays | None = None,
        prompt_logprobs: tuple[Logprobs, ...] | None = None,
    ) -> bool:
        """Record a sampled token, emit its event (`cached`: the prefix-cache hit of the
        prefill that sampled it; `logprobs`: its own, one position; `prompt_logprobs`:
        the prompt's, on a first event); False if that finished the request."""
        seq.generated.append(token)
        seq.served_at = time.monotonic()
        if seq.grammar is not None:
            try:
                seq.grammar.consume(token)
            except RequestError as error:
                self._fail(seq, error, events)
                return False
        # A stop token's own text is left out, as vLLM's, unless include_stop_str_in_output.
        stop_token = seq.stopped_by(token)
        text, hit_stop = "", False
        if seq.detokenizer is not None and (
            not stop_token or seq.request.sampling.include_stop_str_in_output
        ):
            text, hit_stop = seq.detokenizer.add(token)
        finish = None
        if hit_stop or stop_token or (seq.grammar is not None and seq.grammar.stopped):
            finish = STOP
        elif seq.length >= seq.limit:
            finish = LENGTH
        if finish is not None and not hit_stop and seq.detokenizer is not None:
            text += seq.detokenizer.flush()
        count = seq.request.sampling.logprobs
        own = None if logprobs is None or count is None else logprobs.at(0, token, count)
        events.append(
            TokenEvent(
                seq.request.request_id,
                token,
                text,
                finish,
                cached_tokens=cached,
                logprobs=own,
                prompt_logprobs=prompt_logprobs,
            )
        )
        if finish is not None:
            self._remove(seq)
        return finish is None

    def _fail(self, seq: Sequence, error: RequestError, events: list[TokenEvent]) -> None:
        self._remove(seq)
        self._failed(seq, error, events)

    def _failed(self, seq: Sequence, error: RequestError, events: list[TokenEvent]) -> None:
        """The failure event of a request already taken out."""
        log.warning("request %s failed: %s", seq.request.request_id, error.message)
        events.append(TokenEvent(seq.request.request_id, -1, "", ERROR, error))
        self._ids.discard(seq.request.request_id)

    def _remove(self, seq: Sequence) -> None:
        """Take `seq` out, queued or running, and give back what it holds."""
        row = self.scheduler.remove(seq)
        if row is not None:
            self.device.free(row)
        self._ids.discard(seq.request.request_id)

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.queue(seq)
        self._ids.add(seq.request.request_id)

    def _find(self, request_id: str) -> Sequence | None:
        seqs = self.scheduler.sequences()
        return next((s for s in seqs if s.request.request_id == request_id), None)

    def _adapter_manager(self) -> AdapterManager:
        if self.adapters is None:
            raise FailedPrecondition(
                "this engine serves the base model only (max_loras=0)", reason="NO_ADAPTERS"
            )
        return self.adapters
