"""CPU-assisted LoRA on one CPU device as an XLA FFI handler: `CpuAssist.apply` with no
Python in the step.

Where the device is the CPU, a CPU-routed input group makes one callback, `apply`, which
computes the adapter's products on the engine's own threads (the pool's `team.Team`)
from x where it lies into the callback's output (jlora/device/cpu_assist/callbacks.py).
That callback is a Numba `cfunc` that XLA calls itself (jlora/model/host/ffi.py), as the
host decode attention is, not a `buffer_callback`: one of those takes the GIL and wraps
its buffers, and the pool's Python checks the jobs and picks the threads, at every call
(tens of microseconds a group before any work). As a `cfunc` the overhead of a
CPU-routed SmolLM2 layer at 128 tokens, beyond its products, is about half that of the
`buffer_callback` at rank 1 and a quarter at rank 16.

What Python decided per call is decided once a prefill, in `begin`: the plan, an
int64 array at a fixed address (one a `CpuApply`), holds the arena's and the team's
addresses and, for each input group, its jobs at layer 0 (checked against the arena
at the first and the last layer, so that no layer's can leave it), the output columns
no job writes, and the work a token takes. The handler reads x, the prompt's length,
the layer and (a constant of the call) the plan's address and the group; it shifts
the jobs to the layer, picks the threads as `CpuLoraPool.threads_for_flops` does,
computes through `team.run_team` (the compiled code `Team.run` runs), zeroes the
columns no job writes and the padding rows, and counts the call. With no plan (no
prefill under way, or a plan that failed its checks: `CpuAssist.failure` says why)
it writes zeros.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numba import carray, cfunc, njit, types

from cpu_offload import CpuLoraPool, LoraJob
from cpu_offload.kernels.native import pointer
from cpu_offload.kernels.team import BOX, TEAM_WORDS, run_team
from cpu_offload.protocol import JOB_WORDS
from jlora.model.host import ffi
from jlora.model.lora.targets import INPUT_GROUPS

# The plan's header words; a group's words follow, GROUP_WORDS each.
(ACTIVE, ARENA, ARENA_FLOATS, LAYER_STRIDE, MAIL, HELPERS, TEAM, MAX_THREADS) = range(8)
(FLOPS_PER_THREAD, CALLS) = range(8, 10)  # a float64 word; calls made with a plan
HEADER = 10
MAX_JOBS, MAX_GAPS = 3, 4  # an input group's projections (q, k, v), and the gaps around them
(N_JOBS, FLOPS_PER_TOKEN, JOBS) = range(3)
N_GAPS = JOBS + JOB_WORDS * MAX_JOBS
GAPS = N_GAPS + 1
GROUP_WORDS = GAPS + 2 * MAX_GAPS
PLAN_WORDS = HEADER + len(INPUT_GROUPS) * GROUP_WORDS
_TARGET = "jlora_cpu_lora_apply"


@njit(inline="always")
def _apply(plan, group, x, rows, layer, out):  # pragma: no cover - compiled
    """out = the plan's products of x's first `rows` rows for `group` at `layer`."""
    words = plan[HEADER + group * GROUP_WORDS :]
    if plan[ACTIVE] == 0 or words[N_JOBS] == 0:
        out[:] = 0.0
        return
    jobs = np.empty((words[N_JOBS], JOB_WORDS), np.int64)
    shift = layer * plan[LAYER_STRIDE]
    for j in range(words[N_JOBS]):
        for w in range(JOB_WORDS):
            jobs[j, w] = words[JOBS + JOB_WORDS * j + w]
        jobs[j, 0] += shift
        jobs[j, 1] += shift
    arena = carray(pointer(plan[ARENA]), (plan[ARENA_FLOATS],), dtype=np.float32)
    per_thread = plan.view(np.float64)[FLOPS_PER_THREAD]  # as CpuLoraPool.threads_for_flops
    wanted = int(math.ceil(rows * words[FLOPS_PER_TOKEN] / max(per_thread, 1e-9)))
    threads = max(1, min(wanted, plan[MAX_THREADS]))
    mail = carray(pointer(plan[MAIL]), (plan[HELPERS], BOX), dtype=np.int64)
    team = carray(pointer(plan[TEAM]), TEAM_WORDS, dtype=np.int64)
    run_team(arena, x[:rows], out[:rows], jobs, mail, team, threads)
    for g in range(words[N_GAPS]):
        out[:rows, words[GAPS + 2 * g] : words[GAPS + 2 * g + 1]] = 0.0
    out[rows:] = 0.0
    plan[CALLS] += 1


@functools.cache
def _handler() -> Any:
    """The FFI target, compiled on first use in each process: args x f32[T, in], length
    i32[], layer i32[], where u32[3] (the plan's address, low and high words, and the
    group); result f32[T, width]."""

    @cfunc(types.int64(types.voidptr))
    def handle(frame):  # pragma: no cover - compiled
        if ffi.answered_metadata(frame):
            return 0
        a = ffi.ARGS
        x = ffi.array_2d(frame, a, 0, np.float32)
        rows, layer = ffi.scalar(frame, a, 1, np.int32), ffi.scalar(frame, a, 2, np.int32)
        where = ffi.array_1d(frame, a, 3, np.uint32)
        address = np.int64(where[0]) | (np.int64(where[1]) << 32)
        plan = carray(pointer(address), (PLAN_WORDS,), dtype=np.int64)
        out = ffi.array_2d(frame, ffi.RETS, 0, np.float32)
        _apply(plan, where[2], x, rows, layer, out)
        return 0

    return handle


class CpuApply:
    """The plan and the FFI call of one `CpuAssist` (one device, the engine's threads).

    set(groups, layers, layer_stride): a prefill's plan, checked; each group is
    (jobs at layer 0, their columns, the group's output width, its fan-in), or None.
    clear(): no plan (the handler writes zeros). call(group, layer, x, length, shape):
    the traced op. calls: the calls that found a plan and a job.
    """

    def __init__(self, pool: CpuLoraPool) -> None:
        self.pool = pool
        self.plan = np.zeros(PLAN_WORDS, np.int64)
        arena, team = pool.arena, pool.team
        self.plan[ARENA], self.plan[ARENA_FLOATS] = arena.ctypes.data, arena.shape[0]
        self.plan[MAIL], self.plan[HELPERS] = team.mail.ctypes.data, team.mail.shape[0]
        self.plan[TEAM], self.plan[MAX_THREADS] = team.words.ctypes.data, pool.max_threads
        self.plan.view(np.float64)[FLOPS_PER_THREAD] = pool.flops_per_thread
        address = self.plan.ctypes.data
        self._address = (address & 0xFFFFFFFF, address >> 32)

    @property
    def calls(self) -> int:
        return int(self.plan[CALLS])

    def set(
        self,
        groups: Sequence[tuple[list[LoraJob], list[int], int, int] | None],
        layers: int,
        layer_stride: int,
    ) -> None:
        """Check every group's jobs at the first and the last layer (ValueError, naming
        the field, where one leaves the arena or its columns), then make the plan."""
        self.clear()
        words = np.zeros((len(INPUT_GROUPS), GROUP_WORDS), np.int64)
        for group, planned in enumerate(groups):  # groups left out: none planned
            if planned is None:
                continue
            jobs, columns, width, fan_in = planned
            shift = (layers - 1) * layer_stride
            last = [
                LoraJob(j.a_offset + shift, j.b_offset + shift, j.rank, j.out_features)
                for j in jobs
            ]
            self.pool.check(last, fan_in, columns=columns, out_total=width)
            checked = self.pool.check(jobs, fan_in, columns=columns, out_total=width)
            if len(jobs) > MAX_JOBS:  # so at most MAX_GAPS gaps
                raise ValueError(f"jobs={len(jobs)}: an input group has at most {MAX_JOBS}")
            row = words[group]
            row[N_JOBS], row[FLOPS_PER_TOKEN] = len(jobs), checked.flops_per_token
            row[JOBS : JOBS + JOB_WORDS * len(jobs)] = checked.job_rows.ravel()
            row[N_GAPS] = len(checked.gaps)
            row[GAPS : GAPS + 2 * len(checked.gaps)] = np.ravel(checked.gaps)
        self.plan[HEADER:] = words.ravel()
        self.plan[LAYER_STRIDE] = layer_stride
        self.plan[ACTIVE] = 1

    def clear(self, calls: int | None = None) -> None:
        """No plan; `calls` sets the count (a probe's calls are not a prefill's)."""
        self.plan[ACTIVE] = 0
        if calls is not None:
            self.plan[CALLS] = calls

    def call(
        self, group: int, layer: jax.Array, x: jax.Array, length: jax.Array, shape: tuple[int, int]
    ) -> jax.Array:
        where = jnp.asarray(np.array([*self._address, group], np.uint32))
        result = jax.ShapeDtypeStruct(shape, jnp.float32)
        length, layer = jnp.asarray(length, jnp.int32), jnp.asarray(layer, jnp.int32)
        return ffi.call(_TARGET, _handler(), result, x, length, layer, where)
