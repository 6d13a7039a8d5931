"""The host side of CPU-assisted prefill: the callbacks the jitted prefill makes.

A request whose adapter is still on its way to the device is prefilled at once
(CaraServe §4, Toppings §4). The engine runs its prefill as layer-group segments
(`Llama.prefill_layers`); in a layer whose group has not landed yet, each input
group (q/k/v, o, gate/up, down; `INPUT_GROUPS`) makes two ordered host callbacks:

1. `submit(group, shard, layer, x, length)`, before the device computes x·W: the
   prompt's `length` real rows of x go to the `CpuLoraPool` workers with one
   `LoraJob` per projection of the group that the adapter adapts. A and B are read in
   place from the host store's arena, at `offset + layer · layer_stride + target
   offset`.
2. The device computes the base projections meanwhile.
3. `collect(group, shard, ticket)`, after them: waits for the workers and returns x·A·B
   side by side in the columns of the projections the device slots hold (zeros for
   those the adapter does not adapt and for padding rows), which the model adds.

On a mesh (tensor parallel) every shard makes both callbacks, in the same order, on
threads of its own. Shard 0's submit hands the whole input to the workers (a
row-parallel group's input is all-gathered first, the CPU path's only extra
collective) and every shard's collect of that call reads the one result
(`ShardPlan`): a column-parallel group's columns of the shard, with k/v widened to
replicated KV heads; a row-parallel group's whole delta on shard 0, zeros elsewhere,
so the base all-reduce adds it once. Nothing is added by a collective.

A worker that dies or hangs loses nothing: `CpuLoraPool.collect` recomputes its rows
here, and the watchdog respawns it. A failure beyond that never escapes a callback (an
exception inside the compiled prefill would take the donated KV cache with it): the
callback returns zeros, the error is kept in `failure`, and the engine fails that one
request after the prefill. The failed ticket is let go (`CpuLoraPool.discard`); if even
that fails, the pool is not trusted again (`usable` turns false) and cold requests
wait for their adapter on the device instead. `begin(adapter)` / `end()` bracket one
prefill; one ticket is in flight at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from cpu_offload import CpuLoraPool, LoraJob, Ticket
from jlora.adapters.store import StoredAdapter
from jlora.adapters.targets import INPUT_GROUPS

log = logging.getLogger(__name__)

NO_TICKET = 0  # submit's answer when the adapter adapts nothing in the group


@dataclasses.dataclass(frozen=True)
class _Placement:
    """One adapted projection's pool job, minus the layer."""

    name: str
    a_offset: int  # bytes into the arena at layer 0
    b_offset: int
    rank: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How the workers' whole x·A·B maps onto the shards of a tensor-parallel mesh.

    size: the shards. row_groups: INPUT_GROUPS indices whose input is split across the
    shards (o, down: row-parallel): their whole delta goes to shard 0. split: the
    projections whose output columns are split evenly across the shards
    (column-parallel). widen(name, columns): a projection's columns as the device lays
    them out (k/v with each KV head replicated where tp exceeds them).
    """

    size: int = 1
    row_groups: frozenset[int] = frozenset()
    split: frozenset[str] = frozenset()
    widen: Callable[[str, np.ndarray], np.ndarray] = lambda name, columns: columns


def default_workers() -> int:
    """One worker per core this process may use, less one for the engine's thread."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class CpuAssist:
    """Implements `jlora.model.llama.CpuLora` over a `CpuLoraPool`.

    arena_name: the host store's shared-memory arena; shapes: (in, out) of each
    projection the device slots hold, as the adapters store them (whole, k/v not
    widened); max_rows: the longest prefill (in tokens); shards: how the devices split
    the results (one device by default).
    """

    def __init__(
        self,
        arena_name: str,
        shapes: dict[str, tuple[int, int]],
        *,
        workers: int,
        max_rows: int,
        hang_after: float = 5.0,
        shards: ShardPlan | None = None,
    ) -> None:
        self.shapes = shapes
        self.shards = shards or ShardPlan()
        groups = [[name for name in names if name in shapes] for names in INPUT_GROUPS]
        self.widths = [sum(shapes[name][1] for name in names) for names in groups]
        self.pool = CpuLoraPool(
            arena_name,
            workers=workers,
            max_rows=max_rows,
            max_in=max(fan_in for fan_in, _ in shapes.values()),
            max_out=max(self.widths),
            hang_after=hang_after,
        )
        self.handoffs = 0  # submits that reached the pool
        self.collect_wait_s: deque[float] = deque(maxlen=4096)  # time blocked in collect
        self._adapter: StoredAdapter | None = None
        self._plan: list[list[_Placement]] = []
        self._ticket: Ticket | None = None  # in flight (shard 0's last submit)
        self._probe: Ticket | None = None  # measure_handoff_s's ticket
        # The calls of one prefill, numbered in each shard's order: shard 0's submits
        # post them, every shard's collect takes its share of the one result.
        self._calls = threading.Condition()
        self._submitted: dict[int, tuple[int, Ticket | None]] = {}  # call -> (rows, ticket)
        self._results: dict[int, tuple[int, np.ndarray | None]] = {}  # call -> products
        self._collected: dict[int, int] = {}  # call -> shards that took their share
        self._next = [0] * self.shards.size  # each shard's next call (submit and collect)
        self._posted = 0  # shard 0's submits so far
        self.failure: Exception | None = None  # of the current prefill, if its CPU path broke
        self.usable = True  # false once a failed ticket could not even be let go

    # -- one prefill -----------------------------------------------------------

    def begin(self, adapter: StoredAdapter) -> None:
        """Serve the callbacks of one prefill for `adapter`."""
        self._adapter = adapter
        self.failure = None
        self._submitted.clear()
        self._results.clear()
        self._collected.clear()
        self._next = [0] * self.shards.size
        self._posted = 0
        self._plan = []
        for names in INPUT_GROUPS:
            placements = []
            for name in names:
                if name in self.shapes and name in adapter.target_offsets:
                    a_off, b_off = adapter.target_offsets[name]
                    placements.append(
                        _Placement(
                            name,
                            adapter.offset + a_off,
                            adapter.offset + b_off,
                            adapter.spec.rank,
                            self.shapes[name][1],
                        )
                    )
            self._plan.append(placements)

    def end(self) -> None:
        self._adapter, self._plan, self._ticket = None, [], None

    # -- the callbacks (CpuLora) -------------------------------------------------

    def submit(
        self, group: int, shard: np.ndarray, layer: np.ndarray, x: np.ndarray, length: np.ndarray
    ) -> Any:
        """Step 1: shard 0 hands the real rows of x to the workers; the others only count
        the call. Returns the ticket flag."""
        assert self._adapter is not None, "submit outside begin()/end()"
        placements = self._plan[group]
        if int(shard) != 0:
            return np.int32(1 if placements else NO_TICKET)
        ticket = None
        if placements and self.failure is None:
            try:
                ticket = self._submit(placements, layer, x, length)
            except Exception as err:  # never into the compiled step: see the module docstring
                self._failed("submit", err)
        with self._calls:
            self._submitted[self._posted] = (x.shape[0], ticket)
            self._posted += 1
            self._calls.notify_all()
        return np.int32(1 if placements else NO_TICKET)

    def _submit(
        self, placements: list[_Placement], layer: np.ndarray, x: np.ndarray, length: np.ndarray
    ) -> Ticket:
        assert self._adapter is not None
        shift = int(layer) * self._adapter.layer_stride
        jobs = [
            LoraJob(p.a_offset + shift, p.b_offset + shift, p.rank, p.out_features)
            for p in placements
        ]
        self._ticket = self.pool.submit(np.ascontiguousarray(x[: int(length)]), jobs)
        self.handoffs += 1
        return self._ticket

    def collect(self, group: int, shard: np.ndarray, ticket: np.ndarray) -> np.ndarray:
        """Step 3: this shard's part of the group's products, in the columns the model
        expects (waiting for shard 0's submit of the call if need be)."""
        index = int(shard)
        with self._calls:
            call = self._next[index]
            self._next[index] += 1
            while call not in self._results and call not in self._submitted:
                self._calls.wait()
            if call not in self._results:
                rows, posted = self._submitted.pop(call)
                self._results[call] = (rows, None if posted is None else self._products(posted))
            rows, products = self._results[call]
            self._collected[call] = self._collected.get(call, 0) + 1
            if self._collected[call] == self.shards.size:
                del self._results[call], self._collected[call]
        return self._share(group, index, rows, products)

    def _products(self, ticket: Ticket) -> np.ndarray | None:
        """The workers' x·A·B of a ticket, None if the CPU path failed."""
        start = time.perf_counter()
        try:
            products = self.pool.collect(ticket)
        except Exception as err:  # never into the compiled step: see the module docstring
            self._failed("collect", err)
            return None
        finally:
            self._ticket = None
        self.collect_wait_s.append(time.perf_counter() - start)
        return products

    def _share(self, group: int, shard: int, rows: int, products: np.ndarray | None) -> np.ndarray:
        """A shard's columns of a group's products ([real rows, their out_features side
        by side]), zero-padded to `rows`, as the device lays the projections out."""
        plan, placed = self.shards, []
        cursor = 0
        for name in (n for n in INPUT_GROUPS[group] if n in self.shapes):
            width = self.shapes[name][1]
            columns = np.zeros((rows, width), np.float32)
            placement = next((p for p in self._plan[group] if p.name == name), None)
            if placement is not None and products is not None:
                columns[: products.shape[0]] = products[:, cursor : cursor + width]
                cursor += width
            columns = plan.widen(name, columns)
            if name in plan.split:
                part = columns.shape[1] // plan.size
                columns = columns[:, shard * part : (shard + 1) * part]
            placed.append(columns)
        out = np.concatenate(placed, axis=1)
        if group in plan.row_groups and shard != 0:
            out = np.zeros_like(out)  # shard 0 carries the whole delta into the sum
        return out

    def _failed(self, step: str, err: Exception) -> None:
        """Record the prefill's failure and let its ticket go (see the module docstring)."""
        log.error("CPU LoRA %s failed: %r", step, err)
        self.failure = err
        if self._ticket is None:
            return
        try:
            self.pool.discard(self._ticket, timeout=self.pool.hang_after)
        except Exception:
            log.exception("the CPU LoRA pool cannot be trusted any more; cold requests will wait")
            self.usable = False

    # -- measurements for the cost model ----------------------------------------

    def layer_seconds(self, rows: int, adapter: StoredAdapter) -> float:
        """Estimated CPU time of one layer's LoRA products for `rows` tokens, split
        across the workers `submit` would give each group (the start-up profile)."""
        profile, total = self.pool.profile, 0.0
        for names in INPUT_GROUPS:
            adapted = [n for n in names if n in self.shapes and n in adapter.target_offsets]
            if not adapted:
                continue
            fan_in = self.shapes[adapted[0]][0]
            flops = sum(2 * adapter.spec.rank * (fan_in + self.shapes[n][1]) for n in adapted)
            per_core_ms = rows * flops / (profile.tokens_per_ms * profile.flops_per_token)
            total += per_core_ms / self.pool.workers_for_flops(rows, flops) / 1e3
        return total

    def measure_handoff_s(self, repeats: int = 20) -> float:
        """Median seconds of one empty submit/collect pair made from a jitted function:
        the callback and hand-off overhead a CPU-routed input group pays."""
        assert self.shapes, "no projections"
        width = self.widths[0] or 1

        def pair(x):
            ticket = io_callback(self._probe_submit, jax.ShapeDtypeStruct((), jnp.int32), x)
            return io_callback(
                self._probe_collect, jax.ShapeDtypeStruct((1, width), jnp.float32), ticket
            )

        probe = jax.jit(pair)
        x = jnp.zeros((1, 8), jnp.float32)
        jax.block_until_ready(probe(x))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(probe(x))
            samples.append(time.perf_counter() - start)
        return float(np.median(samples))

    def _probe_submit(self, x: np.ndarray) -> Any:
        self._probe = self.pool.submit(
            np.zeros((1, 8), np.float32), [LoraJob(0, 0, 1, 1)], workers=1
        )
        return np.int32(1)

    def _probe_collect(self, ticket: np.ndarray) -> np.ndarray:
        assert self._probe is not None
        self.pool.collect(self._probe)
        return np.zeros((1, self.widths[0] or 1), np.float32)

    def close(self) -> None:
        self.pool.close()
