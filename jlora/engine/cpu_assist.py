"""The host side of CPU-assisted prefill: the callbacks the jitted prefill makes.

A request whose adapter is still on its way to the device is prefilled at once
(CaraServe §4, Toppings §4). The engine runs its prefill as layer-group segments
(`Llama.prefill_layers`); in a layer whose group has not landed yet, each input
group (q/k/v, o, gate/up, down; `INPUT_GROUPS`) makes two ordered host callbacks:

1. `submit(group, layer, x, length)`, before the device computes x·W: the prompt's
   `length` real rows of x go to the `CpuLoraPool` workers with one `LoraJob` per
   projection of the group that the adapter adapts. A and B are read in place from
   the host store's arena, at `offset + layer · layer_stride + target offset`.
2. The device computes the base projections meanwhile.
3. `collect(group, ticket)`, after them: waits for the workers and returns x·A·B
   side by side in the columns of the projections the device slots hold (zeros for
   those the adapter does not adapt and for padding rows), which the model adds.

A worker that dies or hangs loses nothing: `CpuLoraPool.collect` recomputes its rows
here, and the watchdog respawns it. A failure beyond that never escapes a callback (an
exception inside the compiled prefill would take the donated KV cache with it): the
callback returns zeros, the error is kept in `failure`, and the engine fails that one
request after the prefill. The failed ticket is let go (`CpuLoraPool.discard`); if even
that fails, the pool is not trusted again (`usable` turns false) and cold requests
wait for their adapter on the device instead. `begin(adapter)` / `end()` bracket one
prefill; callbacks run on the engine's thread, one ticket in flight at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
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
    """Where one adapted projection's product goes: the pool job, minus the layer."""

    a_offset: int  # bytes into the arena at layer 0
    b_offset: int
    rank: int
    out_features: int
    column: int  # first column of the projection in the group's collect output


def default_workers() -> int:
    """One worker per core this process may use, less one for the engine's thread."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class CpuAssist:
    """Implements `jlora.model.llama.CpuLora` over a `CpuLoraPool`.

    arena_name: the host store's shared-memory arena; shapes: (in, out) of each
    projection the device slots hold; max_rows: the longest prefill (in tokens).
    """

    def __init__(
        self,
        arena_name: str,
        shapes: dict[str, tuple[int, int]],
        *,
        workers: int,
        max_rows: int,
        hang_after: float = 5.0,
    ) -> None:
        self.shapes = shapes
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
        self._ticket: Ticket | None = None
        self._rows = 0
        self._probe: Ticket | None = None  # measure_handoff_s's ticket
        self.failure: Exception | None = None  # of the current prefill, if its CPU path broke
        self.usable = True  # false once a failed ticket could not even be let go

    # -- one prefill -----------------------------------------------------------

    def begin(self, adapter: StoredAdapter) -> None:
        """Serve the callbacks of one prefill for `adapter`."""
        self._adapter = adapter
        self.failure = None
        self._plan = []
        for names in INPUT_GROUPS:
            column, placements = 0, []
            for name in names:
                if name not in self.shapes:
                    continue
                if name in adapter.target_offsets:
                    a_off, b_off = adapter.target_offsets[name]
                    placements.append(
                        _Placement(
                            adapter.offset + a_off,
                            adapter.offset + b_off,
                            adapter.spec.rank,
                            self.shapes[name][1],
                            column,
                        )
                    )
                column += self.shapes[name][1]
            self._plan.append(placements)

    def end(self) -> None:
        self._adapter, self._plan, self._ticket = None, [], None

    # -- the callbacks (CpuLora) -------------------------------------------------

    def submit(self, group: int, layer: np.ndarray, x: np.ndarray, length: np.ndarray) -> Any:
        """Step 1: hand the real rows of x to the workers; returns the ticket flag."""
        assert self._adapter is not None, "submit outside begin()/end()"
        self._rows = x.shape[0]
        placements = self._plan[group]
        if not placements or self.failure is not None:
            return np.int32(NO_TICKET)
        try:
            return self._submit(placements, layer, x, length)
        except Exception as err:  # never into the compiled step: see the module docstring
            self._failed("submit", err)
            return np.int32(NO_TICKET)

    def _submit(
        self, placements: list[_Placement], layer: np.ndarray, x: np.ndarray, length: np.ndarray
    ) -> Any:
        assert self._adapter is not None
        shift = int(layer) * self._adapter.layer_stride
        jobs = [
            LoraJob(p.a_offset + shift, p.b_offset + shift, p.rank, p.out_features)
            for p in placements
        ]
        self._ticket = self.pool.submit(np.ascontiguousarray(x[: int(length)]), jobs)
        self.handoffs += 1
        return np.int32(1)

    def collect(self, group: int, ticket: np.ndarray) -> np.ndarray:
        """Step 3: the group's products, placed in the columns the model expects."""
        out = np.zeros((self._rows, self.widths[group]), np.float32)
        if int(ticket) == NO_TICKET:
            return out
        assert self._ticket is not None
        start = time.perf_counter()
        try:
            products = self.pool.collect(self._ticket)
        except Exception as err:  # never into the compiled step: see the module docstring
            self._failed("collect", err)
            return out
        finally:
            self._ticket = None
        self.collect_wait_s.append(time.perf_counter() - start)
        rows, cursor = products.shape[0], 0
        for p in self._plan[group]:
            out[:rows, p.column : p.column + p.out_features] = products[
                :, cursor : cursor + p.out_features
            ]
            cursor += p.out_features
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
