"""The scheduler: the requests' host state, and each step's plan (vLLM's scheduler output).

The scheduler decides; the orchestrator (orchestrator.py) carries the decisions out on
the device engine. It owns the queue, the decode rows and the paused requests, and the
bookkeeping that goes with them (KV leases from the memory manager, adapter slots from
the slot manager); it calls the device engine only to ask (what is merged, what a
CPU-assisted prefill would cost). Each step asks it twice:

1. `admit()`, before the prefills: which queued requests start (first-come first-served
   while a decode row is free and the KV blocks for their prompt and first token can be
   had, leaving a watermark of 1% of the pool, vLLM's, for the running requests to grow
   into; with `kv_allocation="upfront"`, the blocks of their whole sequence), each
   prefill's end this step (chunks of whole blocks within `prefill_token_budget`, so
   running requests keep decoding: vLLM's chunked prefill, `_chunk_end`), and whether it
   is CPU-assisted (always in `cpu-assist` mode, in `auto` when the cost model says it
   shortens the time to first token; a request for an adapter not on the device otherwise
   waits for it, and later requests may go first). With merging on, the dLoRA batcher
   picks the iteration's requests instead (merging.py): the plan then also pauses the
   running requests left out (their KV and slot kept), names the adapter to merge, and
   inserts again the paused ones picked.
2. `grow()`, before the decode step: each decoding row whose next token starts a new
   block gets it, oldest first; where the pool has none the newest admitted request is
   preempted (vLLM's recompute preemption): it gives back its KV (cached like that of a
   request that leaves), its row and its slot, and is queued again ahead of later
   arrivals, keeping its tokens, seed and text.

A `Plan` is what the device must do, in order: free rows, switch the merged adapter,
run the prefills, insert rows. Everything else the decisions change (who holds which
row, lease and slot) has happened when the plan is returned.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

from configs import SPLIT_TOKENS, bucket
from jlora.contract.errors import RequestError, ResourceExhausted
from jlora.engine import cost_model
from jlora.engine.adapters import AdapterManager
from jlora.engine.api import Logprobs, Request
from jlora.engine.detokenizer import Detokenizer
from jlora.engine.device_api import DeviceEngine, LogprobArrays, SamplingRow
from jlora.engine.grammar import Matcher
from jlora.engine.memory.manager import FULL, SWAPPING, MemoryManager
from jlora.engine.memory.tree import Lease
from jlora.engine.merging import Batch, DynamicBatcher

log = logging.getLogger(__name__)

# With merging on, adapters are requested (loads started) for this many queued requests
# per decode row at most, in FCFS order, so a long queue does not churn the slots.
LOOKAHEAD_PER_ROW = 2
KEEP = "keep"  # Plan.switch: the merged adapter stays as it is


@dataclasses.dataclass(eq=False)
class Sequence:
    """Host state of one request, queued or running (hashed by identity)."""

    request: Request
    seed: int
    limit: int  # the sequence may grow to this many tokens (prompt + generated)
    detokenizer: Detokenizer | None
    stops: frozenset[int] = frozenset()  # the tokens that end it (EOS, stop_token_ids)
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
    # Its prompt is scored (prompt logprobs) until its first token: each prefill's
    # scores by the position it starts at.
    score_prompt: bool = False
    grammar: Matcher | None = None  # its structured output's place (engine/grammar.py)
    prompt_scores: dict[int, LogprobArrays] = dataclasses.field(default_factory=dict)

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
            params.temperature,
            params.top_k,
            params.top_p,
            self.seed,
            len(self.generated),
            logprobs=params.logprobs is not None,
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
            min_p=params.min_p,
            min_tokens=params.min_tokens,
            banned=tuple(sorted(self.stops)) if params.min_tokens else (),
            logit_bias=params.logit_bias,
            allowed=None if self.grammar is None else self.grammar.mask(),
        )

    def take_prompt_logprobs(self) -> tuple[Logprobs, ...] | None:
        """The prompt's log-probabilities (every token after the first), from its prefills'
        scores, once: a later prefill of the request (after a preemption) scores none."""
        if not self.score_prompt:
            return None
        self.score_prompt = False
        count = self.request.sampling.prompt_logprobs
        assert count is not None
        prompt = self.request.prompt_ids
        scores = LogprobArrays.concatenate(
            [self.prompt_scores[s] for s in sorted(self.prompt_scores)]
        )
        self.prompt_scores.clear()
        return tuple(scores.at(i - 1, prompt[i], count) for i in range(1, len(prompt)))

    def stopped_by(self, token: int) -> bool:
        """Whether `token`, just generated, ends the sequence: a stop token, once more
        than min_tokens are out."""
        return token in self.stops and len(self.generated) > self.request.sampling.min_tokens


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One prefill this step: `seq`'s tokens up to `end` into its `lease` (a chunk if `end`
    is short of its length), CPU-assisted or not."""

    seq: Sequence
    lease: Lease
    assist: bool
    end: int

    @property
    def score_next(self) -> int | None:
        """Its job's `score_next`: the prompt token after this chunk (-1 after the
        prompt's last), where the request's prompt is scored."""
        if not self.seq.score_prompt:
            return None
        prompt = self.seq.request.prompt_ids
        return prompt[self.end] if self.end < len(prompt) else -1


@dataclasses.dataclass
class Plan:
    """What the device does this step, in this order (see the module docstring)."""

    free: list[int] = dataclasses.field(default_factory=list)  # rows that stop decoding
    switch: str | None = KEEP  # the adapter to have merged (None: unmerged); KEEP: as is
    prefills: list[Prefill] = dataclasses.field(default_factory=list)
    # rows to (re)insert: those still holding a row when the plan is carried out
    insert: list[Sequence] = dataclasses.field(default_factory=list)
    # requests that fail, already taken out (their rows are in `free`)
    failed: list[tuple[Sequence, RequestError]] = dataclasses.field(default_factory=list)


class Scheduler:
    """See the module docstring."""

    def __init__(
        self,
        device: DeviceEngine,
        memory: MemoryManager,
        adapters: AdapterManager | None,
        batcher: DynamicBatcher | None,
    ) -> None:
        self.device = device
        self.config = cfg = device.config
        self.memory = memory
        self.adapters = adapters
        self.batcher = batcher
        self.counters: collections.Counter[str] = collections.Counter()
        self.adapter_wait_s = 0.0  # queued requests' seconds waiting for their adapter
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.paused: list[Sequence] = []
        self.rows: list[Sequence | None] = [None] * cfg.max_slots
        self._arrivals = 0
        self._lazy = cfg.kv_allocation == "lazy"
        self._watermark = max(1, cfg.num_blocks // 100) if self._lazy else 0

    # -- the requests ------------------------------------------------------------------

    def queue(self, seq: Sequence) -> None:
        seq.order = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def sequences(self) -> list[Sequence]:
        return [*self.waiting, *self.paused, *(seq for seq in self.rows if seq is not None)]

    def running(self) -> list[Sequence]:
        return [seq for seq in self.rows if seq is not None]

    def decoding(self) -> list[Sequence]:
        """The rows the next decode step advances (not those still prefilling in chunks)."""
        return [seq for seq in self.rows if seq is not None and seq.prefilled and not seq.parked]

    def chunking(self) -> list[Sequence]:
        """Admitted requests whose prefill is under way in chunks, oldest first."""
        rows = (seq for seq in self.rows if seq is not None and not seq.prefilled)
        return sorted(rows, key=lambda seq: seq.order)

    def admitted(self) -> list[Sequence]:
        """Requests holding KV: in a decode row (parked or not) or paused."""
        return [*self.running(), *self.paused]

    def remove(self, seq: Sequence) -> int | None:
        """Take `seq` out, queued or admitted, giving back what it holds; the row to free
        on the device, if it had one."""
        if seq.row < 0 and not seq.paused:
            self.waiting.remove(seq)
            self.memory.forget(seq.request.request_id)
            return None
        return self.release(seq)

    def release(self, seq: Sequence) -> int | None:
        """An admitted request gives back its row (or leaves the paused), its KV and its
        adapter slot; the row to free on the device, if it had one."""
        row = None
        if seq.paused:
            self.paused.remove(seq)
            seq.paused = False
        else:
            row, seq.row = seq.row, -1
            self.rows[row] = None
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
        return row

    # -- 1. admission -------------------------------------------------------------------

    def admit(self) -> Plan:
        """This step's prefills (and, merging, its pauses and merge switch)."""
        plan = Plan()
        if self.batcher is None:
            plan.prefills = self._first_come_first_served()
        else:
            self._merging_batch(self.batcher, plan)
        return plan

    def _first_come_first_served(self) -> list[Prefill]:
        """This step's `prefill_token_budget` prompt tokens: first the next chunks of the
        requests prefilled in chunks, then queued requests as they are admitted; the last
        of them may get only a chunk."""
        budget, bs, prefilled = self.config.prefill_token_budget, self.config.block_size, 0
        prefills: list[Prefill] = []
        for seq in self.chunking():
            assert seq.lease is not None
            end = self._chunk_end(seq, seq.chunked, budget - prefilled)
            if end == seq.chunked:
                break
            prefills.append(Prefill(seq, seq.lease, False, end))
            prefilled += end - seq.chunked
        for seq in list(self.waiting):
            if None not in self.rows or budget - prefilled < bs:
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
            prefills.append(Prefill(seq, lease, assist, end))
            prefilled += end - start
        return prefills

    def _chunk_end(self, seq: Sequence, start: int, room: int) -> int:
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

    def _assists(self, seq: Sequence) -> bool:
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

    def _lease(self, seq: Sequence, *, reuse: bool) -> Lease | str:
        """The KV blocks for `seq` (a cached prefix first, if `reuse` and its prompt is
        not scored: a scored prompt computes every position)."""
        reuse = reuse and not seq.score_prompt
        return self.memory.admit(
            seq.request.request_id, seq.request.adapter, seq.tokens, self._blocks(seq), reuse
        )

    def _blocks(self, seq: Sequence) -> int:
        """The blocks `seq` is admitted with: its prompt (and generated tokens) and the
        next token, lazily; its whole sequence, up front."""
        tokens = seq.length + 1 if self._lazy else seq.limit
        return math.ceil(min(tokens, seq.limit) / self.config.block_size)

    def _room_for(self, seq: Sequence) -> bool:
        """Whether admitting `seq` leaves the watermark for the running requests to grow
        into (lazily; at worst, its prefix is not cached)."""
        if not self._watermark or not any(self.admitted()):
            return True
        return self.memory.available() >= self._blocks(seq) + self._watermark

    def _start(self, seq: Sequence, lease: Lease) -> None:
        """An admitted request takes its lease, its adapter's slot and a decode row."""
        self.waiting.remove(seq)
        adapter = seq.request.adapter
        if adapter is not None:
            assert self.adapters is not None
            seq.adapter_slot = self.adapters.slots.acquire(adapter)
        seq.lease = lease
        seq.row = self.rows.index(None)
        self.rows[seq.row] = seq

    # -- 1'. admission with merging on (dLoRA) -------------------------------------------

    def _merging_batch(self, batcher: DynamicBatcher, plan: Plan) -> None:
        """The batcher picks this iteration's requests among the runnable ones
        (merging.py): running requests left out are paused (their KV and adapter slot
        kept), the engine is to merge or unmerge as the batch needs, paused requests
        picked are inserted again and queued ones picked are prefilled (decode rows, KV
        blocks and the prefill token budget permitting)."""
        runnable = self._runnable()
        if not runnable:
            return
        batch = batcher.plan([(seq, seq.request.adapter) for seq in runnable])
        chosen = set(batch.items)
        for seq in self.rows:
            if seq is not None and not seq.parked and seq not in chosen:
                plan.free.append(self._pause(seq))
        if self.device.merged != batch.merged:
            plan.switch = batch.merged
        self._run_batch(batch, plan)
        if batch.merged is not None and not any(self.rows):
            # Nothing of the merged batch could start (no KV blocks while paused requests
            # hold them): unmerge and let the FCFS batch go on, so the engine never stalls.
            batcher.merged = None
            plan.switch = None if self.device.merged is not None else KEEP
            fcfs = self._runnable()[: self.config.max_slots]
            self._run_batch(Batch(tuple(fcfs), None, "fcfs"), plan)

    def _runnable(self) -> list[Sequence]:
        """Requests that can run this iteration, in FCFS order: running and paused ones,
        and queued ones whose adapter is on the device (for the first few queued, an
        adapter that is not gets its load started)."""
        runnable = [seq for seq in self.rows if seq is not None and not seq.parked]
        runnable += self.paused
        lookahead = LOOKAHEAD_PER_ROW * self.config.max_slots
        for seq in list(self.waiting)[:lookahead]:
            adapter = seq.request.adapter
            if adapter is None:
                runnable.append(seq)
            else:
                assert self.adapters is not None
                if self.adapters.slots.request(adapter) is not None:
                    runnable.append(seq)
        return sorted(runnable, key=lambda seq: seq.order)

    def _run_batch(self, batch: Batch, plan: Plan) -> None:
        budget, prefilled = self.config.prefill_token_budget, 0
        for seq in batch.items:
            assert isinstance(seq, Sequence)
            if None not in self.rows:
                break
            if seq.paused:
                self._unpause(seq)
                plan.insert.append(seq)
            elif seq.row < 0:
                if prefilled and prefilled + seq.length > budget:
                    continue
                if not self._room_for(seq):
                    continue
                lease = self._lease(seq, reuse=True)
                if not isinstance(lease, Lease):
                    continue
                self._start(seq, lease)
                plan.prefills.append(Prefill(seq, lease, False, seq.length))  # whole: no chunks
                prefilled += seq.length - lease.cached_tokens

    def _pause(self, seq: Sequence) -> int:
        row, seq.row = seq.row, -1
        self.rows[row] = None
        seq.paused = True
        self.paused.append(seq)
        return row

    def _unpause(self, seq: Sequence) -> None:
        self.paused.remove(seq)
        seq.paused = False
        seq.row = self.rows.index(None)
        self.rows[seq.row] = seq

    # -- 2. lazy KV and preemption ---------------------------------------------------------

    def grow(self) -> Plan:
        """Give each decoding row, oldest first, the block its next token's KV goes to;
        where none can be had, preempt the newest request until one can. A request the
        pool cannot hold even alone fails."""
        plan = Plan()
        bs = self.config.block_size
        for seq in sorted(self.decoding(), key=lambda seq: seq.order):
            while seq.lease is not None and len(seq.lease.table) * bs < seq.length:
                if self.memory.grow(seq.lease, 1):
                    plan.insert.append(seq)  # the row's longer block table
                    continue
                admitted = self.admitted()
                if admitted == [seq]:  # the pool cannot hold this one sequence
                    pages = self.memory.pool.num_pages
                    plan.failed.append((seq, ResourceExhausted(
                        f"the device pool ({pages} pages of {bs} tokens, adapters included) "
                        f"cannot hold this request's {seq.length} tokens; lower "
                        "sampling.max_tokens or give the server a larger --pool-size",
                        field="sampling.max_tokens",
                    )))  # fmt: skip
                    plan.free.append(self._row_of(self.remove(seq)))
                    break
                row = self._preempt(max(admitted, key=lambda seq: seq.order))
                if row is not None:
                    plan.free.append(row)
        return plan

    @staticmethod
    def _row_of(row: int | None) -> int:
        assert row is not None, "a decoding request holds a row"
        return row

    def _preempt(self, seq: Sequence) -> int | None:
        """Queue an admitted request again, after those that came before it, giving back
        what it holds (the row to free, if it had one); it keeps its tokens, seed and
        text."""
        row = self.release(seq)
        seq.preemptions += 1
        seq.parked = False
        self.counters["preemptions"] += 1
        position = sum(1 for queued in self.waiting if queued.order < seq.order)
        self.waiting.insert(position, seq)
        log.info(
            "request %s preempted after %d tokens (%d waiting)",
            seq.request.request_id,
            len(seq.generated),
            len(self.waiting),
        )
        return row
