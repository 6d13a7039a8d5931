"""Plain prefill jobs packed several to a compiled call: the host side (numpy).

A packed prefill (`Llama.prefill_packed`, compiled per bucket by `CompiledSteps`) holds
up to `prompts` prompts back to back in `bucket` tokens. Two steps make its inputs:

1. `packs` groups the jobs into calls that fill their compiled sizes: padding is
   computed like real tokens, and a CPU has no idle lanes to hide it in.
2. `layout` writes one call's arrays. Its prompts are sorted by adapter slot, so that
   the prompts of one adapter are one SGMV segment (Punica's form), cut every `window`
   rows where the backend asks for it (`LoraBackend.segment_rows`: the reference
   backend computes each segment over a window of that many rows, not over the whole
   call, so its LoRA costs about the call's rows, not its rows times its adapters);
   then the call is padded to its fixed shapes: tokens with zeros (written nowhere),
   prompt rows with empty prompts (all-sentinel block tables, greedy), and segments
   with empty ones of no adapter (slot -1), `segment_count` of them.

`PackedPrefill` holds an engine's packed shapes (`EngineConfig.packed_prefill_tokens`,
`packed_prefill_prompts` and `packed_prefill_prompt_tokens`), compiles them and runs
the calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from configs import SPLIT_TOKENS, EngineConfig, bucket
from jlora.device.sampling import SamplingArrays, host_logprobs, set_sampling
from jlora.device.steps import CompiledSteps
from jlora.engine.device_api import Prefilled, PrefillJob
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Params
from jlora.model.lora.base import LoraWeights, Segments
from jlora.model.sharding import to_host


@dataclasses.dataclass(frozen=True)
class PackedCall:
    """One packed prefill's inputs, and where each job's first token comes out."""

    tokens: np.ndarray  # i32[size]: the prompts back to back, then zeros
    starts: np.ndarray  # i32[prompts + 1]: prompt r is tokens[starts[r]:starts[r + 1]]
    block_tables: np.ndarray  # i32[prompts, blocks_per_seq]; an empty row is all sentinel
    sampling: SamplingArrays  # [prompts]; an empty row is greedy
    segments: Segments  # [prompts]: runs of prompts of one adapter slot, then empty ones
    rows: list[int]  # rows[j]: the prompt row of the call's j-th job


def packs(lengths: Sequence[int], sizes: Sequence[int], prompts: int) -> list[list[int]]:
    """Indices into `lengths` (each at most the largest of `sizes`, the calls' compiled
    token counts, ascending) grouped into calls of at most `prompts` prompts, so that
    the tokens computed, padding included, stay few. The calls run in one engine step,
    so their order, and their prompts', is free.

    Each call is filled to the largest size while the prompts left hold more; the last
    ones to the size holding them all, or to the size below it and the rest to the
    next call where that computes `SPLIT_TOKENS` fewer tokens (300 tokens: about 256
    and 64, not 512). 64 prompts of 16-64 tokens (2589 tokens, 16 to a call): 2624
    computed, against 2816 filling the calls in order.
    """
    left = sorted(range(len(lengths)), key=lambda index: -lengths[index])  # stable

    def computed(call: list[int], total: int) -> int:  # by `call` and one call of the rest
        held = sum(lengths[index] for index in call)
        return bucket(sizes, held) + (bucket(sizes, total - held) if held < total else 0)

    calls: list[list[int]] = []
    while left:
        total = sum(lengths[index] for index in left)
        call = _fill(left, lengths, min(total, sizes[-1]), prompts)
        smaller = [size for size in sizes if size < total]
        if total <= sizes[-1] and smaller:
            part = _fill(left, lengths, smaller[-1], prompts)
            if computed(call, total) - computed(part, total) >= SPLIT_TOKENS:
                call = part
        calls.append(call)
        taken = set(call)
        left = [index for index in left if index not in taken]
    return calls


def _fill(left: list[int], lengths: Sequence[int], room: int, prompts: int) -> list[int]:
    """One call's prompts among `left` (longest first): taken by turns from the long and
    the short end, so that the call's mix is the mix of what is left (taking the long
    ones first leaves a tail of short ones that the prompt limit keeps from filling
    their calls), then the last two longest prompts' worth of room filled as exactly as
    the prompts left can (`_top_off`). A prompt longer than `room` alone, if nothing
    fits."""
    call: list[int] = []
    held, longest_first = 0, True
    order = list(left)
    while order and len(call) < prompts and room - held > 2 * lengths[left[0]]:
        fits = [index for index in order if held + lengths[index] <= room]
        if not fits:
            break
        pick = fits[0] if longest_first else fits[-1]
        longest_first = not longest_first
        call.append(pick)
        held += lengths[pick]
        order.remove(pick)
    call += _top_off(order, lengths, room - held, prompts - len(call))
    return call or left[:1]


def _top_off(order: list[int], lengths: Sequence[int], gap: int, slots: int) -> list[int]:
    """At most `slots` of `order` whose tokens come closest to `gap` from below, the
    fewest prompts for that sum (a 0/1 knapsack over the sums 0..gap)."""
    if slots <= 0 or gap <= 0:
        return []
    fewest = np.full(gap + 1, slots + 1)  # fewest prompts making each sum so far
    fewest[0] = 0
    took = np.zeros((len(order), gap + 1), bool)  # took[k, s]: order[k] improved sum s
    for k, index in enumerate(order):
        n = lengths[index]
        if n <= gap:
            better = fewest[: gap + 1 - n] + 1 < fewest[n:]
            took[k, n:] = better
            fewest[n:] = np.where(better, fewest[: gap + 1 - n] + 1, fewest[n:])
    total = int(np.flatnonzero(fewest <= slots)[-1])
    picks = []
    for k in reversed(range(len(order))):
        if took[k, total]:
            picks.append(order[k])
            total -= lengths[order[k]]
    return picks


def segment_count(prompts: int, size: int, window: int | None) -> int:
    """The segments a call of `prompts` prompts in `size` tokens has room for: a run per
    prompt, and with segments of at most `window` rows, one more per `window` tokens."""
    return prompts if window is None else prompts + size // window


def empty_segments(count: int, window: int | None) -> Segments:
    """`count` empty segments of no adapter."""
    return Segments(np.full(count, -1, np.int32), np.zeros(count + 1, np.int32), window)


def layout(
    jobs: Sequence[PrefillJob],
    size: int,
    prompts: int,
    num_blocks: int,
    window: int | None = None,
    *,
    sampling: SamplingArrays,
) -> PackedCall:
    """The arrays of one packed call of `jobs` (plain: nothing cached, at most `prompts`
    of them, their tokens together at most `size`); `num_blocks` is the sentinel;
    `window`: the most rows of one LoRA segment (None: any); `sampling`: greedy host
    sampling arrays of `prompts` rows (the steps' `sampling_rows`), filled in here."""
    order = sorted(range(len(jobs)), key=lambda j: jobs[j].adapter_slot)  # stable
    lengths = [len(jobs[j].tokens) for j in order]
    starts = np.full(prompts + 1, sum(lengths), np.int32)
    starts[: len(jobs) + 1] = np.cumsum([0, *lengths])
    tokens = np.zeros(size, np.int32)
    tables = np.full((prompts, len(jobs[0].block_table)), num_blocks, np.int32)
    slots = np.full(prompts, -1, np.int32)
    for row, j in enumerate(order):
        tokens[starts[row] : starts[row + 1]] = jobs[j].tokens
        tables[row] = jobs[j].block_table
        set_sampling(sampling, row, jobs[j].sampling, jobs[j].tokens)
        slots[row] = jobs[j].adapter_slot
    # A segment per run of one slot's prompts, cut every `window` rows; the rest empty,
    # at the end.
    segments = empty_segments(segment_count(prompts, size, window), window)
    segments.start[:] = starts[-1]
    runs = [row for row in range(len(jobs)) if row == 0 or slots[row] != slots[row - 1]]
    bounds, count = [*runs, len(jobs)], 0
    for first, end in zip(bounds, bounds[1:], strict=False):
        low, high = int(starts[first]), int(starts[end])
        for start in range(low, high, window or high - low):
            segments.slot[count], segments.start[count] = slots[first], start
            count += 1
    rows = [0] * len(jobs)
    for row, j in enumerate(order):
        rows[j] = row
    return PackedCall(tokens, starts, tables, sampling, segments, rows)


class PackedPrefill:
    """An engine's packed prefill: `prompts` prompt rows; `sizes`, the prefill buckets up
    to packed_prefill_tokens (none where packing is off); and `longest`, the most tokens
    of one prompt in a call (packed_prefill_prompt_tokens, at most the largest size),
    which bounds the keys each token's attention reads (`packed_causal_attention`)."""

    def __init__(self, cfg: EngineConfig, window: int | None = None) -> None:
        """window: the most rows of one LoRA segment (`LoraBackend.segment_rows`)."""
        self.config = cfg
        self.prompts = min(cfg.packed_prefill_prompts, cfg.max_slots)
        on = self.prompts > 1 and cfg.packed_prefill_prompt_tokens > 0
        self.sizes = tuple(
            size for size in cfg.prefill_buckets if on and size <= cfg.packed_prefill_tokens
        )
        self.longest = min(cfg.packed_prefill_prompt_tokens, self.tokens)
        self.window = window

    def segments(self, size: int, weights: LoraWeights | None) -> Segments | None:
        """The LoRA segments' shape of a call of `size` tokens (None: no LoRA)."""
        if weights is None:
            return None
        return empty_segments(segment_count(self.prompts, size, self.window), self.window)

    @property
    def tokens(self) -> int:
        """The most tokens one call holds (0: no packing)."""
        return self.sizes[-1] if self.sizes else 0

    def takes(self, tokens: int) -> bool:
        """Whether a plain job of `tokens` tokens may join a packed call."""
        return tokens <= self.longest

    def compile(
        self,
        steps: CompiledSteps,
        params: Params,
        cache: KVCache,
        weights: LoraWeights | None,
        smallest: int = 0,
    ) -> None:
        """Every packed shape of at least `smallest` tokens."""
        for size in self.sizes:
            if size >= smallest:
                steps.compile_prefill_packed(
                    params,
                    cache,
                    size,
                    self.prompts,
                    self.config.blocks_per_seq,
                    weights,
                    self.segments(size, weights),
                )

    def calls(self, plain: Mapping[int, int]) -> list[list[int]]:
        """The packed calls of two or more among plain jobs (job index -> its tokens;
        those `takes` refuses stay out): lists of job indices."""
        packable = [index for index, tokens in plain.items() if self.takes(tokens)]
        grouped = packs([plain[index] for index in packable], self.sizes, self.prompts)
        return [[packable[k] for k in call] for call in grouped if len(call) > 1]

    def run(
        self,
        steps: CompiledSteps,
        params: Params,
        cache: KVCache,
        weights: LoraWeights | None,
        jobs: Sequence[PrefillJob],
    ) -> tuple[list[Prefilled], KVCache]:
        """One packed call of plain `jobs`, padded to the bucket holding their tokens:
        each job's first token (with its log-probabilities where its sampling asked),
        and the cache (donated)."""
        cfg = self.config
        size = bucket(cfg.prefill_buckets, sum(len(job.tokens) for job in jobs))
        call = layout(
            jobs, size, self.prompts, cfg.num_blocks, self.window,
            sampling=steps.sampling_rows(self.prompts),
        )  # fmt: skip
        steps.compile_prefill_packed(
            params,
            cache,
            size,
            self.prompts,
            cfg.blocks_per_seq,
            weights,
            None if weights is None else call.segments,
        )
        sampled, logprobs, cache = steps.prefill_packed(
            params,
            cache,
            call.tokens,
            call.starts,
            call.block_tables,
            call.sampling,
            weights,
            None if weights is None else call.segments,
        )
        first = to_host(sampled)
        scored = host_logprobs(logprobs) if any(job.sampling.logprobs for job in jobs) else None
        results = []
        for job, row in zip(jobs, call.rows, strict=True):
            own = scored.take([row]) if scored is not None and job.sampling.logprobs else None
            results.append(Prefilled(int(first[row]), logprobs=own))
        return results, cache
