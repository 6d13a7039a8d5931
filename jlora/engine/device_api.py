"""The device engine: the jitted steps over explicit device state, behind one interface.

JetStream's split: a *device engine* owns the model's parameters, the paged KV cache,
the adapter weights on the device (and in host memory, where they are copied from),
the decode state of its `max_slots` rows, and the mesh they live on; it knows nothing
of requests. The *orchestrator* (orchestrator.py) owns the queue, admission, stop
rules, adapter bookkeeping and stats, and drives any device engine through these
calls, all on one thread (the scheduler's) except where a method says otherwise:

1. `prefill(job)`: run a prompt into the KV blocks of its block table and sample its
   first token (with CPU assistance for the layers whose adapter weights are still in
   flight when `job.assist` is set; scoring every prompt position when
   `job.score_next` is). `prefill_many(jobs)` does the same for several jobs, packing
   plain ones (no assist, nothing cached, no scoring, short) several to a compiled call:
   at most `packed_prefill_prompts` prompts of `packed_prefill_tokens` tokens in all,
   none over `packed_prefill_prompt_tokens`.
2. `insert(slot, row)`: make decode row `slot` continue that sequence.
3. `generate()`: one decode step of every inserted row, one token each
   (`decode_logprobs()`: their log-probabilities, for the rows that asked).
4. `free(slot)`: the row stops decoding.

Adapters: `stage_adapter` validates an adapter and copies it into host memory (any
thread, so registration never stalls the steps); `load_adapter` copies a staged
adapter towards a device slot (the transfer thread); `install_adapter` makes it
usable (the scheduler thread); `drop_adapter` frees its host memory.

Merged inference (dLoRA §4.1): `merge(name)` folds one staged adapter into the base
weights (W' = W + B·A for each of its target projections, computed on the device), and
from then on the prefills and `generate` run the compiled steps without LoRA weights,
the cost of a base-model step. The orchestrator guarantees that while merged only that
adapter's rows are live and only its jobs are prefilled; rows and jobs carry its
device slot as usual, and an engine checks the invariant cheaply (AssertionError: a
scheduler bug). `unmerge()` puts the pristine weights back, bit for bit. Both run on
the scheduler thread, between steps, and block until done, so the caller can time
the switch.

`LlamaEngine` (llama_engine.py) is the JAX implementation; `MockEngine` (mock.py)
replaces it in server and router tests.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from configs import EngineConfig
from jlora.contract.adapters import Adapter
from jlora.contract.errors import RequestError
from jlora.engine.api import Logprobs
from jlora.engine.cost_model import ColdStart
from jlora.engine.detokenizer import Decoder

# What `load_adapter` returns and `install_adapter` consumes: an adapter on its way to a
# device slot (device arrays in LlamaEngine); opaque to the orchestrator.
Payload = object


class TextCodec(Decoder, Protocol):
    """What the orchestrator needs of a tokenizer: decoding (text, stop strings) and the
    end-of-sequence ids."""

    eos_ids: list[int]


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One row's sampling parameters (sampling.py): temperature 0 is greedy; step is the
    number of tokens the request has generated before this one; logprobs: its tokens'
    log-probabilities are wanted. The logit adjustments (SamplingParams' meaning):
    presence, frequency and repetition penalties, min_p; `banned` (EOS and the stop
    token ids) cannot be sampled while step < min_tokens; logit_bias: (token, bias)
    pairs. With a penalty the engine needs the row's tokens so far (the prompt, then
    `step` generated): a prefill job's own, a decode row's `DecodeRow.history`.
    allowed: a grammar's bitmask of the tokens the next may be (i32[ceil(V / 32)], bit
    t % 32 of word t // 32; engine/grammar.py), None: any; a decode row's changes every
    step (`DeviceEngine.constrain`)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    logprobs: bool = False
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    banned: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the row's tokens so far."""
        return bool(self.presence or self.frequency or self.repetition != 1.0)


@dataclasses.dataclass(frozen=True)
class LogprobArrays:
    """The model's log-probabilities at n positions (sampling.py's): of the token chosen
    at each, and of the MAX_LOGPROBS (or vocabulary, if smaller) most likely there."""

    chosen: np.ndarray  # f32[n]
    top_ids: np.ndarray  # i32[n, K], most likely first
    top: np.ndarray  # f32[n, K]

    @staticmethod
    def concatenate(parts: Sequence[LogprobArrays]) -> LogprobArrays:
        """The positions of `parts`, in order."""
        return LogprobArrays(
            np.concatenate([part.chosen for part in parts]),
            np.concatenate([part.top_ids for part in parts]),
            np.concatenate([part.top for part in parts]),
        )

    def take(self, rows: slice | Sequence[int] | np.ndarray) -> LogprobArrays:
        """These positions only."""
        index = rows if isinstance(rows, slice) else np.asarray(rows)
        return LogprobArrays(self.chosen[index], self.top_ids[index], self.top[index])

    def at(self, i: int, token: int, count: int) -> Logprobs:
        """Position i's, `token` the one chosen there, with the `count` most likely."""
        top = tuple(
            (int(t), float(lp))
            for t, lp in zip(self.top_ids[i, :count], self.top[i, :count], strict=True)
        )
        return Logprobs(token, float(self.chosen[i]), top)


@dataclasses.dataclass(frozen=True)
class PrefillJob:
    """A prompt to run into its KV blocks.

    tokens: the real tokens (the engine pads them to a bucket). block_table: i32[
    blocks_per_seq], the sequence's blocks, then the sentinel `num_blocks`.
    adapter_slot: the device adapter slot (-1: the base model). assist: the adapter's
    name when its weights may still be in flight (CPU-assisted prefill), else None.
    cached: the first `cached` tokens already have their keys and values in the table's
    first `cached // block_size` blocks (a prefix-cache hit; a multiple of the block
    size, less than len(tokens)): only tokens[cached:] are computed, attending to the
    cached ones, and the result is that of a prefill of every token. The orchestrator
    sends no job with both `assist` and `cached`: an engine may serve one by computing
    every token again (LlamaEngine does, leaving the cached blocks unwritten).
    score_next: None, or the scoring of the prompt (prompt logprobs): at each computed
    position, the log-probability of the token that follows it, `score_next` after the
    last (the next chunk's first token; -1: none, the prompt ends there).
    """

    tokens: Sequence[int]
    block_table: np.ndarray
    sampling: SamplingRow
    adapter_slot: int = -1
    assist: str | None = None
    cached: int = 0
    score_next: int | None = None

    def targets(self) -> np.ndarray:
        """i32[len(tokens) - cached]: the token after each computed position (-1: none)."""
        assert self.score_next is not None
        return np.array([*self.tokens[self.cached + 1 :], self.score_next], np.int32)


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefill's first token; `routes` says where each layer group's LoRA ran in a
    CPU-assisted prefill ("CCDD": CPU, CPU, device, device), "" otherwise. `error`: the
    fault of this job alone in `prefill_many` (what `prefill` raises), token then -1.
    logprobs: the first token's (one position), where its sampling asked; prompt: the
    job's scoring (`score_next`), one position per computed token."""

    token: int
    routes: str = ""
    error: RequestError | None = None
    logprobs: LogprobArrays | None = None
    prompt: LogprobArrays | None = None


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """What a decode row needs to continue a sequence: its last token (not yet in the
    KV cache) at `position`, its blocks, its sampling (step: tokens generated before
    the next one) and its device adapter slot (-1: the base model). history: where its
    sampling has a penalty, its tokens so far (positions 0 to `position`, the last token
    included); else empty."""

    token: int
    position: int
    block_table: np.ndarray
    sampling: SamplingRow
    adapter_slot: int = -1
    history: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class HostBlocks:
    """The keys and values of `count` KV blocks (every layer) in host memory: a swapped-out
    part of the prefix cache. `data` is the engine's own (numpy arrays in LlamaEngine)."""

    count: int
    nbytes: int
    data: object


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes in use and capacities; -1 where the device does not say."""

    host_store_used: int = 0
    host_store_capacity: int = 0
    device_in_use: int = -1
    device_limit: int = -1
    merged_weights: int = 0  # the merged copies of a merged adapter's targets (all devices)
    kv_block_bytes: int = 0  # one KV block, keys and values of every layer (0: not known)
    lora_slot_bytes: int = 0  # one adapter slot: max_lora_rank on every lora target


class DeviceEngine(abc.ABC):
    """See the module docstring. `config` gives the capacities the orchestrator admits
    against (max_slots, max_seq_len, KV blocks, buckets, adapter slots, lora_mode)."""

    config: EngineConfig
    vocab_size: int
    tokenizer: TextCodec | None  # None: token ids only (no text, no stop strings)

    # -- steps ---------------------------------------------------------------------

    @abc.abstractmethod
    def warmup(
        self,
        prompt_lengths: list[int] | None = None,
        max_length: int | None = None,
        *,
        on_demand: bool = False,
    ) -> None:
        """Compile every step shape (or those these prompts, growing to max_length, need),
        so that none compiles while serving. With `on_demand`, compile nothing ahead: each
        shape compiles when a step first needs it (a one-shot run, which would pay for the
        compiles anyway, gets its first token sooner and never compiles what it does not
        use); the rest of the warm-up (measurements a policy needs) still runs."""

    @abc.abstractmethod
    def prefill(self, job: PrefillJob) -> Prefilled:
        """Run `job` and sample its first token. A fault of this request alone (a CPU
        worker that cannot be recovered) raises RequestError; the device stays usable."""

    def prefill_many(self, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """Run `jobs` (distinct block tables: no block is written by two of them) and
        sample each one's first token: result i is what `prefill(jobs[i])` gives after
        jobs[:i] (a job's cached prefix may be blocks an earlier job writes). Batch
        invariance: a job's first token and keys and values do not depend on the other
        jobs (the same greedy token; the same values up to the summation order).

        An engine may run plain jobs (`assist` None, `cached` 0, `score_next` None, at
        most `packed_prefill_prompt_tokens` tokens) several to a compiled call, and runs the
        others one by one through `prefill`: only those can fail alone, and such a fault
        (RequestError) is returned in that job's `Prefilled.error`, not raised, so the
        other jobs' first tokens are not lost. This default runs every job through
        `prefill`, in order."""
        results = []
        for job in jobs:
            try:
                results.append(self.prefill(job))
            except RequestError as err:
                results.append(Prefilled(-1, error=err))
        return results

    @property
    def packed_prefill_tokens(self) -> int:
        """The most tokens of plain jobs `prefill_many` runs in one compiled call; 0: it
        packs none."""
        return 0

    @property
    def packed_prefill_prompts(self) -> int:
        """The most jobs one packed call of `prefill_many` holds; 0: it packs none."""
        return 0

    @property
    def packed_prefill_prompt_tokens(self) -> int:
        """The most tokens of one job in a packed call (a longer one runs alone)."""
        return 0

    @abc.abstractmethod
    def insert(self, slot: int, row: DecodeRow) -> None:
        """Decode row `slot` continues `row`'s sequence from the next `generate()`."""

    @abc.abstractmethod
    def generate(self) -> np.ndarray:
        """One decode step: i32[max_slots], the next token of every inserted row (other
        rows hold garbage); each inserted row then continues from its new token."""

    @abc.abstractmethod
    def decode_logprobs(self) -> LogprobArrays | None:
        """The log-probabilities of the last `generate()`'s tokens, by slot (max_slots
        positions; valid for the rows whose sampling asked), or None if no row asked."""

    @abc.abstractmethod
    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        """Row `slot`'s next token is one of `allowed` (SamplingRow.allowed), from the
        next `generate()` on; None: any."""

    @abc.abstractmethod
    def free(self, slot: int) -> None:
        """Row `slot` stops decoding (its KV writes are dropped from now on)."""

    # -- adapters --------------------------------------------------------------------

    @abc.abstractmethod
    def stage_adapter(self, name: str, path: str, *, expect_sha256: str | None = None) -> Adapter:
        """Any thread: validate the PEFT adapter at `path` for this engine (rank, targets,
        the base model's shapes; its weights' sha256 against `expect_sha256`) and copy it
        into host memory as `name`: its record, with `host_bytes` and `device_bytes` (in
        the serving dtype at its own rank, what the memory pool charges: layers · rank ·
        Σ over its targets of (in_dim + out_dim) · itemsize). Raises RequestError (and
        keeps nothing) if it cannot be served here. The caller guarantees `name` is not
        staged already."""

    @abc.abstractmethod
    def drop_adapter(self, name: str) -> None:
        """Free a staged adapter's host memory (no load of it may be under way)."""

    @abc.abstractmethod
    def load_adapter(self, name: str, slot: int, pages: Sequence[int] | None = None) -> Payload:
        """The transfer thread: copy a staged adapter towards device slot `slot`, into
        the pool `pages` the memory manager reserved for it (an engine whose adapters
        live in the KV cache writes them there; None: the engine's own choice)."""

    @abc.abstractmethod
    def install_adapter(self, name: str, slot: int, payload: Payload) -> None:
        """The scheduler thread: make a landed adapter usable in `slot`."""

    @property
    def can_assist(self) -> bool:
        """Whether `prefill` can run a job with `assist` (CPU LoRA workers that work)."""
        return False

    def cold_start(self, name: str, slot: int, prompt_len: int) -> ColdStart | None:
        """The cost model's inputs for prefilling `prompt_len` tokens of `name` (loading
        into `slot`) with CPU assistance; None: this engine cannot assist."""
        return None

    @property
    def adapter_slots(self) -> int:
        """The device's adapter slots, which the orchestrator's slot manager hands out:
        config.max_loras unless the engine holds more (adapters that live in the pool's
        pages, whose number the pool sets)."""
        return self.config.max_loras

    # -- KV blocks to and from host memory (the prefix cache's swaps) --------------------

    @property
    def can_swap_kv(self) -> bool:
        """Whether the four calls below are offered (else evicted cached KV is dropped)."""
        return False

    def kv_snapshot(self, blocks: Sequence[int]) -> object:
        """The scheduler thread: capture the keys and values of `blocks` for a swap-out.
        Only dispatches the copy: the blocks may be written again (reused) as soon as this
        returns; `kv_to_host` completes it."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    def kv_to_host(self, snapshot: object) -> HostBlocks:
        """Any thread (the swap thread): bring a snapshot into host memory, taking the
        link's time (`emulated_link_gbps` when set)."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    def kv_to_device(self, host: HostBlocks) -> object:
        """Any thread (the swap thread): copy host blocks to the device, taking the link's
        time; `kv_restore` writes them into blocks."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    def kv_restore(self, blocks: Sequence[int], staged: object) -> None:
        """The scheduler thread: write what `kv_to_device` staged into `blocks`, in order
        (len(blocks) equals the staged count)."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    # -- merged inference (dLoRA §4.1) -------------------------------------------------

    @property
    def can_merge(self) -> bool:
        """Whether `merge` is offered (the policy is `config.merge`)."""
        return False

    @property
    def merged(self) -> str | None:
        """The merged adapter's name; None while unmerged."""
        return None

    def merge(self, name: str) -> None:
        """The scheduler thread, the engine unmerged, `name` staged: fold its LoRA delta
        into the base weights (W' = W + B·A, scaling included, for every target projection
        of every layer it has; its own rank and targets, from host memory), blocking until
        the merged weights are ready. Until `unmerge()`, `prefill` and `generate` run no
        LoRA work at all. Rows and jobs keep carrying the adapter's device slot (the slot
        it was last loaded into, landed or not; the merged steps never read it): a live
        row at `generate`, or a job at `prefill`, whose `adapter_slot` is not that slot
        (another adapter's, or -1, the base model) raises AssertionError, as does a merge
        while merged or of an adapter not staged. A job's `assist` is ignored while
        merged (the merged weights hold the whole adapter). The device holds the pristine
        and the merged copies of the adapter's target weights while merged."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge adapters")

    def unmerge(self) -> None:
        """The scheduler thread, merged: put the pristine base weights back (the very
        arrays, bit for bit; never by subtracting) and free the merged copies; rows of
        any adapter and of the base model may run again. AssertionError if not merged."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge adapters")

    # -- the rest ----------------------------------------------------------------------

    def memory(self) -> Memory:
        return Memory()

    def close(self) -> None:  # noqa: B027 (optional: engines without resources keep it)
        """Release what the engine holds outside Python (shared memory, processes)."""
