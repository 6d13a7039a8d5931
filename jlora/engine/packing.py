"""Plain prefill jobs packed several to a compiled call: the host side (numpy).

A packed prefill (`Llama.prefill_packed`, compiled per bucket by `CompiledSteps`) holds
up to `prompts` prompts back to back in `bucket` tokens. Two steps make its inputs:

1. `packs` groups the jobs into calls: greedily, in order, a job joins the current call
   while the call's tokens and prompts allow, else it starts the next call.
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

from configs import EngineConfig, bucket
from jlora.adapters.backends import LoraWeights, Segments
from jlora.engine.device import PrefillJob
from jlora.engine.sampling import SamplingArrays
from jlora.engine.steps import CompiledSteps, host_sampling, set_sampling
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Params
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


def packs(lengths: Sequence[int], tokens: int, prompts: int) -> list[list[int]]:
    """Indices into `lengths` (each at most `tokens`), in order, grouped into calls of at
    most `tokens` tokens and `prompts` prompts."""
    calls: list[list[int]] = []
    held = 0
    for index, length in enumerate(lengths):
        if not calls or len(calls[-1]) == prompts or held + length > tokens:
            calls.append([])
            held = 0
        calls[-1].append(index)
        held += length
    return calls


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
) -> PackedCall:
    """The arrays of one packed call of `jobs` (plain: nothing cached, at most `prompts`
    of them, their tokens together at most `size`); `num_blocks` is the sentinel;
    `window`: the most rows of one LoRA segment (None: any)."""
    order = sorted(range(len(jobs)), key=lambda j: jobs[j].adapter_slot)  # stable
    lengths = [len(jobs[j].tokens) for j in order]
    starts = np.full(prompts + 1, sum(lengths), np.int32)
    starts[: len(jobs) + 1] = np.cumsum([0, *lengths])
    tokens = np.zeros(size, np.int32)
    tables = np.full((prompts, len(jobs[0].block_table)), num_blocks, np.int32)
    sampling = host_sampling(prompts)
    slots = np.full(prompts, -1, np.int32)
    for row, j in enumerate(order):
        tokens[starts[row] : starts[row + 1]] = jobs[j].tokens
        tables[row] = jobs[j].block_table
        set_sampling(sampling, row, jobs[j].sampling)
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
        """The packed calls of two or more among plain jobs (job index -> its tokens, in
        order; those `takes` refuses stay out): lists of job indices."""
        packable = [index for index, tokens in plain.items() if self.takes(tokens)]
        grouped = packs([plain[index] for index in packable], self.tokens, self.prompts)
        return [[packable[k] for k in call] for call in grouped if len(call) > 1]

    def run(
        self,
        steps: CompiledSteps,
        params: Params,
        cache: KVCache,
        weights: LoraWeights | None,
        jobs: Sequence[PrefillJob],
    ) -> tuple[list[int], KVCache]:
        """One packed call of plain `jobs`, padded to the bucket holding their tokens:
        each job's first token, and the cache (donated)."""
        cfg = self.config
        size = bucket(cfg.prefill_buckets, sum(len(job.tokens) for job in jobs))
        call = layout(jobs, size, self.prompts, cfg.num_blocks, self.window)
        steps.compile_prefill_packed(
            params,
            cache,
            size,
            self.prompts,
            cfg.blocks_per_seq,
            weights,
            None if weights is None else call.segments,
        )
        sampled, cache = steps.prefill_packed(
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
        return [int(first[row]) for row in call.rows], cache
