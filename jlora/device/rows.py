"""The decode rows: the state of each decode slot, host arrays that enter the compiled
decode step each iteration (JetStream's decode state).

A row holds its last token (not yet in the KV cache), that token's position, its block
table, its sampling parameters, its tokens so far where a penalty reads them, and its
device adapter slot. A free row has an all-sentinel block table, so its KV writes are
dropped, and is greedy with no adjustment (such a batch skips the sampler's sort and
adjustments). A decode step takes the live rows, in order, padded
with idle rows to the row bucket (`batch`), and each live row then continues from its
new token (`advance`), and the step's log-probabilities are kept, by slot, where a live
row asked for them (`logprobs`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from jlora.device.sampling import (
    PAD,
    SamplingArrays,
    TokenLogprobs,
    constrain,
    host_logprobs,
    host_sampling,
    set_sampling,
)
from jlora.engine.device_api import DecodeRow, LogprobArrays, SamplingRow
from jlora.model.kv_cache import KVCache
from jlora.model.lora.base import LoraWeights

IDLE = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)


@struct.dataclass
class DecodeState:
    """The decode rows, as the compiled decode step takes them (host arrays)."""

    tokens: np.ndarray  # i32[S], each row's last token (not yet in the cache)
    positions: np.ndarray  # i32[S], that token's position
    block_tables: np.ndarray  # i32[S, blocks_per_seq]; a free row is all sentinel (num_blocks)
    sampling: SamplingArrays  # [S]; a free row is greedy (its history is `history`'s)
    history: np.ndarray  # i32[S, max_seq_len]: a penalized row's tokens so far, then PAD
    lora_idx: np.ndarray  # i32[S], each row's device adapter slot (-1: the base model)
    live: np.ndarray  # bool[S], inserted rows


class DecodeRows:
    """`slots` rows of tables of `blocks_per_seq` blocks of `block_size` tokens;
    `sentinel` is the block id no write reaches (the pool's size); `vocab` tokens."""

    def __init__(
        self, slots: int, blocks_per_seq: int, block_size: int, sentinel: int, vocab: int
    ) -> None:
        self.sentinel = sentinel
        self.block_size = block_size
        self.state = DecodeState(
            tokens=np.zeros(slots, np.int32),
            positions=np.zeros(slots, np.int32),
            block_tables=np.full((slots, blocks_per_seq), sentinel, np.int32),
            sampling=host_sampling(slots, 0, vocab),
            history=np.full((slots, blocks_per_seq * block_size), PAD, np.int32),
            lora_idx=np.full(slots, -1, np.int32),
            live=np.zeros(slots, bool),
        )
        self._logprobs: tuple[np.ndarray, TokenLogprobs] | None = None  # (batch, the step's)

    def insert(self, slot: int, row: DecodeRow) -> None:
        state = self.state
        state.tokens[slot] = row.token
        state.positions[slot] = row.position
        state.block_tables[slot] = row.block_table
        set_sampling(state.sampling, slot, row.sampling)
        state.history[slot] = PAD
        if row.sampling.penalized:
            assert len(row.history) == row.position + 1, "a penalized row needs its tokens"
            state.history[slot, : len(row.history)] = row.history
        state.lora_idx[slot] = row.adapter_slot
        state.live[slot] = True

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        constrain(self.state.sampling, slot, allowed)

    def free(self, slot: int) -> None:
        state = self.state
        state.live[slot] = False
        state.block_tables[slot] = self.sentinel
        state.positions[slot] = 0
        set_sampling(state.sampling, slot, IDLE)
        state.lora_idx[slot] = -1

    def count(self) -> int:
        return int(self.state.live.sum())

    def longest(self) -> int:
        """The tokens the longest live row attends to (its keys, the new one included)."""
        state = self.state
        return int(state.positions[state.live].max(initial=0)) + 1

    def live_slots(self) -> np.ndarray:
        """The live rows' device adapter slots."""
        return self.state.lora_idx[self.state.live]

    def batch(self, count: int) -> np.ndarray:
        """`count` row indices for a decode step: every live row, in order, then idle rows
        (all-sentinel block tables: their writes are dropped) to fill the bucket."""
        live = self.state.live
        return np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])[:count]

    def step_inputs(
        self, batch: np.ndarray, blocks: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, SamplingArrays]:
        """The decode step's row inputs for `batch`: tokens, positions, the first `blocks`
        of their block tables, sampling (with the history of those blocks' tokens)."""
        state = self.state
        sampling = jax.tree.map(lambda field: field[batch], state.sampling)
        history = state.history[batch, : blocks * self.block_size]
        return (
            state.tokens[batch],
            state.positions[batch],
            state.block_tables[batch, :blocks],
            sampling.replace(history=history),
        )

    def advance(
        self, batch: np.ndarray, sampled: np.ndarray, logprobs: TokenLogprobs | None = None
    ) -> np.ndarray:
        """i32[slots]: the token `sampled` gave each row of `batch` (other rows hold
        zeros); each live row continues from its new token. `logprobs`: the step's, kept
        (on the device until asked for) where a live row wants them."""
        state = self.state
        tokens = np.zeros_like(state.tokens)
        tokens[batch] = sampled
        live = state.live
        self._logprobs = None
        if logprobs is not None and (state.sampling.logprobs & live).any():
            self._logprobs = (batch, logprobs)
        state.tokens[live] = tokens[live]
        state.positions[live] += 1
        state.sampling.step[live] += 1
        rows = np.flatnonzero(live & (state.positions < state.history.shape[1]))
        state.history[rows, state.positions[rows]] = state.tokens[rows]
        return tokens

    def logprobs(self) -> LogprobArrays | None:
        """The last step's log-probabilities by slot (valid for the live rows that asked);
        None if none asked."""
        if self._logprobs is None:
            return None
        batch, logprobs = self._logprobs
        step = host_logprobs(logprobs)
        slots = len(self.state.tokens)
        chosen = np.zeros(slots, np.float32)
        top_ids = np.zeros((slots, step.top_ids.shape[1]), np.int32)
        top = np.zeros((slots, step.top.shape[1]), np.float32)
        chosen[batch], top_ids[batch], top[batch] = step.chosen, step.top_ids, step.top
        return LogprobArrays(chosen, top_ids, top)


def idle_rows(
    slots: int, blocks: int, cache: KVCache, lora_weights: LoraWeights | None, vocab: int
):
    """A decode step's inputs after the cache, for `slots` idle rows: block tables all
    the sentinel `cache.num_blocks` (nothing written), base-model rows where there are
    adapter slots."""
    zeros = np.zeros(slots, np.int32)
    tables = np.full((slots, blocks), cache.num_blocks, np.int32)
    lora_idx = None if lora_weights is None else np.full(slots, -1, np.int32)
    sampling = host_sampling(slots, blocks * cache.block_size, vocab)
    return zeros, zeros, tables, sampling, lora_weights, lora_idx
