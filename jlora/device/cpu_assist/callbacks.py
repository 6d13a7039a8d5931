"""The host side of CPU-assisted prefill: the callbacks the jitted prefill makes.

A request whose adapter is still on its way to the device is prefilled at once
(CaraServe §4, Toppings §4). The engine runs its prefill as layer-group segments
(`Llama.prefill_layers`); in a layer whose group has not landed yet, each input
group (q/k/v, o, gate/up, down; `INPUT_GROUPS`) that the device slots hold makes two
host callbacks, the model's `CpuLora.submit` and `CpuLora.collect`:

1. `submit(group, shard, layer, x, length)`, before the device computes x·W: the
   prompt's `length` real rows of x go to the `CpuLoraPool` workers with one
   `LoraJob` per projection of the group that the adapter adapts. A and B are read in
   place from the host store's arena, at `offset + layer · layer_stride + target
   offset`. It returns a ticket flag, 0 when the adapter adapts nothing in the group.
2. The device computes the base projections meanwhile.
3. `collect(group, shard, ticket, shape)`, after them, only where the flag is not 0
   (a `lax.cond` on the device skips it otherwise, and adds nothing): waits for the
   workers and writes x·A·B into the callback's own output buffer, in the columns of
   the projections the device slots hold, zeros in those of projections the adapter
   leaves alone and in the padding rows; the model adds it.

What crosses the callback boundary is cut to what the product needs (CaraServe §4.2:
invocation overhead, "IPC and data transfer", is what makes CPU LoRA slow). Both
callbacks are `jax.experimental.buffer_callback`s: the callback reads x in place in
the device's own buffer and writes its result in place, where `io_callback` copied
the arguments into new device arrays and copied a freshly allocated result back (on
an accelerator, whose buffers are not host memory, they are `io_callback`s still:
`_host_op`).
Only the real rows of x are copied, once, into the workers' shared memory; the
workers write each product straight into its projection's columns there, and
`collect` copies those rows once into the output buffer. Where the device is the CPU,
the products run on threads of the engine's process instead (`threads`, EngineConfig's
`cpu_lora`): nothing overlaps there, and the processes' copies and hand-offs only
cost. On one device a group then makes one callback, `apply` (the model calls it
when `overlapped` is false), which computes the products from x where it lies in the
device's buffer straight into its output buffer: no copy, half the callbacks. On the
CPU backend `apply` is an XLA FFI handler, no Python in the step (apply.py: the
prefill's plan is made and checked in `begin`); elsewhere a callback that calls
`CpuLoraPool.run`. The callbacks are unordered
(no token threaded through the scan): the data already orders them (the base
projections take h from an optimization barrier with the ticket, the collect takes
the ticket from one with their outputs, and the next group's input depends on this
group's output). Per CPU-routed SmolLM2 layer at 128 tokens, the callback pairs with
their copies cost several times less (3.5-4.7x) than `io_callback` pairs moving the same
data, and the whole path beyond the products, hand-off to the workers included, a
quarter or less of what the `io_callback` path paid. One `apply` a group on the
engine's threads costs less again beyond the products, and as the FFI handler less
still (apply.py).

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
callback writes zeros, the error is kept in `failure`, and the engine fails that one
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
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback

from cpu_offload import CpuLoraPool, LoraJob, Ticket
from jlora.adapters.store import Region
from jlora.device.cpu_assist.apply import CpuApply
from jlora.model.lora.targets import INPUT_GROUPS
from jlora.model.sharding import TensorParallel

log = logging.getLogger(__name__)

NO_TICKET = 0  # submit's answer when the adapter adapts nothing in the group
_PROBE_JOB = LoraJob(0, 0, 1, 1)  # measure_handoff_s's product: 8 floats of the arena


@dataclasses.dataclass(frozen=True)
class _Placement:
    """One adapted projection's pool job, minus the layer."""

    name: str
    a_offset: int  # bytes into the arena at layer 0
    b_offset: int
    rank: int
    out_features: int
    column: int  # where its columns start in the group's output (one device's layout)


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

    @classmethod
    def for_mesh(cls, tp: TensorParallel) -> ShardPlan:
        """How the workers' whole products map onto the shards of `tp`'s mesh."""
        reduce = {"o_proj": tp.attn_reduce, "down_proj": tp.mlp_reduce}
        column = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads"}
        column |= {"gate_proj": "mlp", "up_proj": "mlp"}
        return cls(
            size=tp.size,
            row_groups=frozenset(
                i for i, names in enumerate(INPUT_GROUPS) if reduce.get(names[0]) is not None
            ),
            split=frozenset(name for name, axis in column.items() if tp.spec(axis)[0] is not None),
            widen=lambda name, columns: (
                tp.expand_kv(columns) if name in ("k_proj", "v_proj") else columns
            ),
        )


def default_workers() -> int:
    """One worker per core this process may use, less one for the engine's thread."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class CpuAssist:
    """Implements `jlora.model.lora.base.CpuLora` over a `CpuLoraPool`.

    arena_name: the host store's shared-memory arena; shapes: (in, out) of each
    projection the device slots hold, as the adapters store them (whole, k/v not
    widened); workers: the workers besides the callback's thread; threads: they are
    threads of this process (`CpuLoraPool`'s `local_threads`: workers + 1 threads, the
    callback's among them), not worker processes; max_rows: the longest prefill (in
    tokens); shards: how the devices split the results (one device by default).
    """

    def __init__(
        self,
        arena_name: str,
        shapes: dict[str, tuple[int, int]],
        *,
        workers: int,
        threads: bool = False,
        max_rows: int,
        hang_after: float = 5.0,
        shards: ShardPlan | None = None,
    ) -> None:
        self.shapes = shapes
        self.shards = shards or ShardPlan()
        self.held = [[name for name in names if name in shapes] for names in INPUT_GROUPS]
        self.widths = [sum(shapes[name][1] for name in names) for names in self.held]
        self.pool = CpuLoraPool(
            arena_name,
            workers=0 if threads else workers,
            local_threads=workers + 1 if threads else 0,
            max_rows=max_rows,
            max_in=max(fan_in for fan_in, _ in shapes.values()),
            max_out=max(self.widths),
            hang_after=hang_after,
        )
        self._handoffs = 0  # submits (or Python runs) that reached the pool
        self.in_place = jax.default_backend() == "cpu"  # see _host_op
        # Threads of this process compute the products at the collect anyway, so on one
        # device a group makes one callback (`apply`) instead of a submit and a collect:
        # where it is `in_place`, an FFI handler (jlora/device/cpu_assist/apply.py).
        self.overlapped = not threads or self.shards.size > 1
        self._ffi = None if self.overlapped else CpuApply(self.pool)
        self._region: Region | None = None
        self._plan: list[list[_Placement]] = []
        self._ticket: Ticket | None = None  # in flight (shard 0's last submit)
        self._probe: Ticket | None = None  # measure_handoff_s's ticket
        # The calls of one prefill that carry a ticket, numbered in each shard's order:
        # shard 0's submits post them, every shard's collect takes its share of the one
        # result (a call whose flag is NO_TICKET makes no collect, on every shard).
        self._calls = threading.Condition()
        self._submitted: dict[int, tuple[int, Ticket | None]] = {}  # call -> (rows, ticket)
        self._results: dict[int, tuple[int, np.ndarray | None]] = {}  # call -> products
        self._collected: dict[int, int] = {}  # call -> shards that took their share
        self._next = [0] * self.shards.size  # each shard's next call (collect)
        self._posted = 0  # shard 0's submits with a ticket so far
        self.failure: Exception | None = None  # of the current prefill, if its CPU path broke
        self.usable = True  # false once a failed ticket could not even be let go

    # -- one prefill -----------------------------------------------------------

    def begin(self, region: Region) -> None:
        """Serve the callbacks of one prefill for `adapter`."""
        self._region = region
        self.failure = None
        self._submitted.clear()
        self._results.clear()
        self._collected.clear()
        self._next = [0] * self.shards.size
        self._posted = 0
        self._plan = []
        for names in self.held:
            placements, column = [], 0
            for name in names:
                if name in region.target_offsets:
                    a_off, b_off = region.target_offsets[name]
                    placements.append(
                        _Placement(
                            name,
                            region.offset + a_off,
                            region.offset + b_off,
                            region.adapter.rank,
                            self.shapes[name][1],
                            column,
                        )
                    )
                column += self.shapes[name][1]
            self._plan.append(placements)
        if self._ffi is not None:
            try:
                self._ffi.set(
                    [self._group_at_layer_0(group) for group in range(len(self.held))],
                    region.num_layers,
                    region.layer_stride,
                )
            except Exception as err:  # never into the compiled step: see the module docstring
                self._failed("begin", err)

    def _group_at_layer_0(self, group: int) -> tuple[list[LoraJob], list[int], int, int] | None:
        """(jobs, columns, width, fan-in) of a group the adapter adapts, at layer 0."""
        if not self._plan[group]:
            return None
        jobs, columns = self.layer_jobs(group, 0)
        return jobs, columns, self.widths[group], self.shapes[self.held[group][0]][0]

    def end(self) -> None:
        self._region, self._plan, self._ticket = None, [], None
        if self._ffi is not None:
            self._ffi.clear()

    @property
    def handoffs(self) -> int:
        """Submits, or applies, that reached the pool (or the team)."""
        return self._handoffs + (0 if self._ffi is None else self._ffi.calls)

    # -- the jitted side (CpuLora) -------------------------------------------------

    def submit(
        self, group: int, shard: jax.Array, layer: jax.Array, x: jax.Array, length: jax.Array
    ) -> jax.Array:
        """Step 1, traced: hand the real rows of x (f32[T, in]) to the workers; returns
        the ticket flag, i32[] (NO_TICKET when the adapter adapts nothing in the group)."""
        call = self._host_op(partial(self._submit_host, group), jax.ShapeDtypeStruct((), jnp.int32))
        return call(shard, layer, x, length)

    def collect(
        self, group: int, shard: jax.Array, ticket: jax.Array, shape: tuple[int, int]
    ) -> jax.Array:
        """Step 3, traced: this shard's part of the group's products, f32[shape] =
        [T, the shard's columns of the projections the slots hold]; zeros, with no
        callback, where the flag is NO_TICKET."""
        call = self._host_op(
            partial(self._collect_host, group), jax.ShapeDtypeStruct(shape, jnp.float32)
        )
        return jax.lax.cond(
            ticket != NO_TICKET,
            lambda shard, ticket: call(shard, ticket),
            lambda shard, ticket: jnp.zeros(shape, jnp.float32),
            shard,
            ticket,
        )

    def apply(
        self,
        group: int,
        shard: jax.Array,
        layer: jax.Array,
        x: jax.Array,
        length: jax.Array,
        shape: tuple[int, int],
    ) -> jax.Array:
        """Steps 1 to 3 in one callback, traced, where nothing overlaps the products
        (`overlapped` is false): `collect`'s result from `submit`'s arguments."""
        if self._ffi is not None and self.in_place:
            return self._ffi.call(group, layer, x, length, shape)
        call = self._host_op(
            partial(self._apply_host, group), jax.ShapeDtypeStruct(shape, jnp.float32)
        )
        return call(shard, layer, x, length)

    def _host_op(self, host: Callable[..., None], result: jax.ShapeDtypeStruct) -> Callable:
        """`host(ctx, out, *args)`, which writes its result into `out`, as an op of the
        jitted prefill: a `buffer_callback` where the device's buffers are host memory
        (`in_place`: the CPU backend), so it reads and writes them where they are; else
        an `io_callback`, whose arguments and result are host copies (a GPU's buffers
        are not host memory), `out` a fresh host array."""
        if self.in_place:
            return buffer_callback(host, result, has_side_effect=True)

        def copied(*args: Any) -> np.ndarray:
            out = np.zeros(result.shape, result.dtype)
            host(None, out, *args)
            return out

        return partial(io_callback, copied, result, ordered=False)

    # -- the host callbacks ----------------------------------------------------------

    def _submit_host(
        self, group: int, ctx: Any, flag: Any, shard: Any, layer: Any, x: Any, length: Any
    ) -> None:
        """Shard 0 hands the real rows of x to the workers and posts the call; the other
        shards only answer the flag."""
        del ctx
        assert self._region is not None, "submit outside begin()/end()"
        placements = self._plan[group]
        np.asarray(flag)[...] = 1 if placements else NO_TICKET
        if not placements or int(np.asarray(shard)) != 0:
            return
        x = np.asarray(x)
        ticket = None
        if self.failure is None:
            try:
                ticket = self._submit(group, int(np.asarray(layer)), x, length)
            except Exception as err:  # never into the compiled step: see the module docstring
                self._failed("submit", err)
        with self._calls:
            self._submitted[self._posted] = (x.shape[0], ticket)
            self._posted += 1
            self._calls.notify_all()

    def layer_jobs(self, group: int, layer: int) -> tuple[list[LoraJob], list[int]]:
        """The pool jobs of one input group of one layer for the adapter of the current
        prefill, and the column of the group's output each writes."""
        assert self._region is not None, "layer_jobs outside begin()/end()"
        shift = layer * self._region.layer_stride
        placements = self._plan[group]
        jobs = [
            LoraJob(p.a_offset + shift, p.b_offset + shift, p.rank, p.out_features)
            for p in placements
        ]
        return jobs, [p.column for p in placements]

    def _submit(self, group: int, layer: int, x: np.ndarray, length: Any) -> Ticket:
        jobs, columns = self.layer_jobs(group, layer)
        self._ticket = self.pool.submit(
            x[: int(np.asarray(length))], jobs, columns=columns, out_total=self.widths[group]
        )
        self._handoffs += 1
        return self._ticket

    def _collect_host(self, group: int, ctx: Any, out: Any, shard: Any, ticket: Any) -> None:
        """This shard's columns of the call's products, written into the callback's output
        buffer (waiting for shard 0's submit of the call if need be)."""
        del ctx, ticket
        index, buffer = int(np.asarray(shard)), np.asarray(out)
        with self._calls:
            call = self._next[index]
            self._next[index] += 1
            while call not in self._results and call not in self._submitted:
                self._calls.wait()
            if self.shards.size == 1:  # one device: the products go straight into `out`
                _, posted = self._submitted.pop(call)
                filled = 0 if posted is None else self._products(posted, buffer)
                buffer[filled:] = 0.0
                return
            if call not in self._results:
                rows, posted = self._submitted.pop(call)
                self._results[call] = (rows, None if posted is None else self._products(posted))
            rows, products = self._results[call]
            self._collected[call] = self._collected.get(call, 0) + 1
            if self._collected[call] == self.shards.size:
                del self._results[call], self._collected[call]
        buffer[...] = self._share(group, index, rows, products)

    def _products(self, ticket: Ticket, out: np.ndarray | None = None) -> Any:
        """The workers' x·A·B of a ticket: into out[:rows] (returns rows) or as a new
        array; None (or 0 rows) if the CPU path failed."""
        try:
            products = self.pool.collect(ticket, out=out)
        except Exception as err:  # never into the compiled step: see the module docstring
            self._failed("collect", err)
            return None if out is None else 0
        finally:
            self._ticket = None
        return products if out is None else products.shape[0]

    def _apply_host(
        self, group: int, ctx: Any, out: Any, shard: Any, layer: Any, x: Any, length: Any
    ) -> None:
        """The products of the real rows of x, computed here, straight from the device's
        buffer into the callback's output buffer (one device: all the columns)."""
        del ctx, shard
        assert self._region is not None, "apply outside begin()/end()"
        buffer, filled = np.asarray(out), 0
        if self._plan[group] and self.failure is None:
            rows = int(np.asarray(length))
            jobs, columns = self.layer_jobs(group, int(np.asarray(layer)))
            try:
                self.pool.run(
                    np.asarray(x)[:rows], jobs, columns=columns,
                    out_total=self.widths[group], out=buffer,
                )  # fmt: skip
                filled = rows
                self._handoffs += 1
            except Exception as err:  # never into the compiled step: see the module docstring
                self._failed("run", err)
        buffer[filled:] = 0.0

    def _share(self, group: int, shard: int, rows: int, products: np.ndarray | None) -> np.ndarray:
        """A shard's columns of a group's products ([real rows, the group's columns]),
        zero-padded to `rows`, as the device lays the projections out."""
        plan, placed, cursor = self.shards, [], 0
        whole = np.zeros((rows, self.widths[group]), np.float32)
        if products is not None:
            whole[: products.shape[0]] = products
        for name in self.held[group]:
            width = self.shapes[name][1]
            columns = plan.widen(name, whole[:, cursor : cursor + width])
            cursor += width
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

    def layer_seconds(self, rows: int, region: Region) -> float:
        """Estimated CPU time of one layer's LoRA products for `rows` tokens, split
        across the workers `submit` would give each group (the start-up profile)."""
        profile, total = self.pool.profile, 0.0
        for names in self.held:
            adapted = [n for n in names if n in region.target_offsets]
            if not adapted:
                continue
            fan_in = self.shapes[adapted[0]][0]
            flops = sum(2 * region.adapter.rank * (fan_in + self.shapes[n][1]) for n in adapted)
            per_core_ms = rows * flops / (profile.tokens_per_ms * profile.flops_per_token)
            total += per_core_ms / self.pool.threads_for_flops(rows, flops) / 1e3
        return total

    def measure_handoff_s(self, repeats: int = 20) -> float:
        """Median seconds of the callbacks of one tiny CPU-routed input group made from a
        jitted function (a submit/collect pair, or one apply where not `overlapped`):
        the callback and hand-off overhead a CPU-routed input group pays."""
        assert self.shapes, "no projections"
        assert self._region is None, "measure_handoff_s during a prefill"
        result = jax.ShapeDtypeStruct((1, max(self.widths)), jnp.float32)
        ffi = self._ffi if self.in_place else None

        def group(x):
            if ffi is not None:
                return ffi.call(0, jnp.int32(0), x, jnp.int32(1), result.shape)
            if not self.overlapped:
                return self._host_op(self._probe_run, result)(x)
            ticket = self._host_op(self._probe_submit, jax.ShapeDtypeStruct((), jnp.int32))(x)
            return self._host_op(self._probe_collect, result)(ticket)

        probe = jax.jit(group)
        x = jnp.zeros((1, 8), jnp.float32)
        if ffi is not None:  # the probe's job in group 0's plan, for its calls only
            calls = ffi.calls
            ffi.set([([_PROBE_JOB], [0], result.shape[1], 8)], 1, 0)
        try:
            jax.block_until_ready(probe(x))
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(probe(x))
                samples.append(time.perf_counter() - start)
        finally:
            if ffi is not None:
                ffi.clear(calls)
        return float(np.median(samples))

    def _probe_submit(self, ctx: Any, flag: Any, x: Any) -> None:
        self._probe = self.pool.submit(np.asarray(x), [_PROBE_JOB], threads=1)
        np.asarray(flag)[...] = 1

    def _probe_collect(self, ctx: Any, out: Any, ticket: Any) -> None:
        assert self._probe is not None
        self.pool.collect(self._probe, out=np.asarray(out)[:, :1])
        np.asarray(out)[...] = 0.0

    def _probe_run(self, ctx: Any, out: Any, x: Any) -> None:
        self.pool.run(np.asarray(x), [_PROBE_JOB], threads=1, out=np.asarray(out)[:, :1])
        np.asarray(out)[...] = 0.0

    def close(self) -> None:
        if self._ffi is not None:
            self._ffi.clear()  # a step called after this writes zeros, touching no team
        self.pool.close()
