"""CpuLoraPool: worker processes that compute x @ A @ B on CPU cores, with a watchdog.

The coordinator (the engine's host thread) owns one pool. A request's LoRA product
for one layer is a `submit` (x plus one `LoraJob` per target sharing that input),
later matched by a `collect`; in between, the device computes the base projection.
The wire protocol is in `cpu_offload.protocol`; this module is its two ends:

- `_worker_main`: one spawned process per core, pinned with `os.sched_setaffinity`,
  waiting on its slot's REQUEST (spin, then sleep) and writing its rows of every
  job in place, in one compiled call (`kernels.lora_task`).
- `CpuLoraPool`: profiles the kernel at start-up (tokens per core per millisecond
  on a reference shape, CaraServe's profiling-guided parallelization), decides how
  many threads a submit gets (`threads_for`), splits the rows (a share of rows needs
  A and B whole but only its rows of x; splitting the output columns instead would
  repeat x·A on every thread), and collects: into a buffer the caller gives, each job
  in the columns the submit named and zeros in the columns no job covers, so a host
  callback copies the products once, into its own output.

Threads instead of processes (`local_threads`): where the device is the CPU itself,
the products have nothing to overlap (the device's base projections run on the same
cores), and the processes' copies and hand-offs are pure cost. A pool made with
`local_threads` has no worker processes: `collect` computes every submit in the calling
process, on up to that many of its threads (the calling thread and the helpers of its
`team.Team`, which stay awake between products), straight into the caller's buffer;
`run`, for a caller with nothing to overlap, computes at once from x where it lies,
without copying it. Measured on this project's 2-core EPYC against PyTorch's
`x @ A @ B` on the same threads, everything the engine pays included
(bench/results/2026-11-29-cpu-team.md): on two threads 0.98-4.57x over three runs,
where worker processes reached 0.30-1.33x. Beside an accelerator the processes stay:
their products run while the device computes the base projections. A product under
about `target_ms` on one core stays on one thread (`threads_for`): 1 ms for
processes, 0.05 ms for the team.

Faults lose nothing (DESIGN.md, Reliability). A watchdog thread polls every worker:
one whose process is gone, or which holds a task longer than `hang_after` seconds,
is killed, counted in `respawns` and replaced; its unserved task is marked lost and
`collect` recomputes those rows in the calling process with the same kernel
(counted in `fallbacks`). A slot whose worker dies `max_start_failures` times in a
row before it is ready is disabled and logged; submits then use the others, or the
calling process when no worker is ready. Lateness is not a fault: a worker that has
not taken its share `steal_after` seconds after the submit (on a busy host the
scheduler may not run it for milliseconds) has its rows computed by `collect` in the
calling process (counted in `steals`; protocol step 5), so a CPU-routed layer waits
for a product, not for the scheduler. `close()` (or the finalizer, for a pool
that is never closed) stops the workers and unlinks the control segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import mmap
import multiprocessing
import os
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from cpu_offload.kernels.blas import lora_rows, lora_task, one_blas_thread
from cpu_offload.kernels.team import Team
from cpu_offload.protocol import (
    CLAIMED,
    DONE,
    MAX_JOBS,
    READY,
    REQUEST,
    STOP,
    Backoff,
    ControlBlock,
    Layout,
    LoraJob,
    Task,
    attach,
)

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "jlora_cpu_"  # control segments: /dev/shm/jlora_cpu_<pid>_<random>
LOCAL = -1  # Share.worker for rows computed in the calling process
REFERENCE_SHAPE = (128, 576, 16, 576)  # rows, in, rank, out: SmolLM2's q_proj at rank 16
# A worker spins this long after its last task before it starts sleeping: a prefill
# hands off every few hundred microseconds, and a sleeping worker wakes late.
WORKER_SPIN_S = 2e-3
# `collect` spins this long before it sleeps: its caller (the device's host callback)
# has nothing else to do, and a sleep overshoots by the timer slack (~50-100 µs), which
# the old 50 µs spin paid on every product longer than that.
COLLECT_SPIN_S = 5e-3
# A running worker takes its task within microseconds of the submit; one that has not
# after this long is descheduled or asleep, and `collect` computes its rows itself.
STEAL_AFTER_S = 5e-5
# `target_ms`'s defaults: a product splits over worker processes past 1 ms of work on
# one core, over the team's threads past 0.05 ms (bench/results/2026-11-29-cpu-team.md:
# at 25 µs a split did not pay, at 62 µs two threads took 37 µs).
PROCESSES_TARGET_MS, THREADS_TARGET_MS = 1.0, 0.05
# The most checked submits `_jobs` keeps: a prefill's layers and input groups for many
# adapters (30 layers x 3 groups each for SmolLM2).
CHECKED_JOBS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class Profile:
    """Start-up measurement of the kernel on one core (REFERENCE_SHAPE)."""

    tokens_per_ms: float
    flops_per_token: int  # 2 · rank · (in + out) at the reference shape


@dataclasses.dataclass(frozen=True)
class CheckedJobs:
    """A submit's jobs checked against the arena and its output (`CpuLoraPool._jobs`),
    with what each call of them needs worked out once: a prefill makes the same calls,
    one per layer and input group, for every prompt of an adapter."""

    whole: Task  # every row of a submit: rows [0, its rows), set per call
    gaps: tuple[tuple[int, int], ...]  # the output's column ranges no job writes
    flops_per_token: int
    job_rows: np.ndarray  # whole.job_rows(), the kernels' descriptor


@dataclasses.dataclass(frozen=True)
class Share:
    worker: int  # slot index, or LOCAL
    seq: int
    task: Task


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A submit in flight; pass it to `collect`.

    gaps: the column ranges [start, stop) of the output that no job writes.
    threads: the calling process's threads for a share of its own (`LOCAL`: every row,
      under `local_threads` or where no worker could take any), computed at `collect`
      straight into the output.
    """

    rows: int
    out_total: int
    shares: tuple[Share, ...]
    gaps: tuple[tuple[int, int], ...] = ()
    submitted: float = 0.0  # time.monotonic() of the submit
    threads: int = 1

    @property
    def local(self) -> bool:
        return self.shares[0].worker == LOCAL


def _output(out: np.ndarray | None, rows: int, out_total: int) -> np.ndarray:
    """out[:rows], checked (f32[>= rows, out_total]), or a new f32[rows, out_total]."""
    if out is None:
        return np.empty((rows, out_total), np.float32)
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[0] < rows or out.shape[1] != out_total:
        raise ValueError(
            f"out: {out.dtype}{list(out.shape)} must be float32 [>= {rows}, {out_total}]"
        )
    return out[:rows]


def _arena_floats(arena: mmap.mmap) -> np.ndarray:
    """The arena as f32[bytes / 4], the view `lora_task` reads A and B from."""
    return np.frombuffer(arena, np.float32, count=len(arena) // 4)


def _worker_main(
    control_name: str,
    arena_name: str,
    index: int,
    generation: int,
    start_seq: int,
    core: int,
    lock: Any,
) -> None:
    """A worker process: steps 1, 3 and 4 of the protocol until STOP or its parent dies."""
    os.sched_setaffinity(0, {core})
    parent = os.getppid()
    control = attach(control_name, "control_name")
    arena = _arena_floats(attach(arena_name, "arena_name"))
    block = ControlBlock.from_header(control)
    slot = block.slots[index]
    warm = np.zeros((1, 1), np.float32)
    lora_rows(warm, warm, warm, warm)
    slot[READY] = generation
    served = start_seq
    while True:
        backoff = Backoff(spin_s=WORKER_SPIN_S)
        while (request := int(slot[REQUEST])) == served:
            backoff.pause()
            if backoff.sleep_s >= backoff.max_sleep_s and os.getppid() != parent:
                return  # orphaned: nobody will ever collect or close
        if request == STOP:
            return
        with lock:
            taken = int(slot[CLAIMED]) < request  # else the coordinator took it (step 5)
            if taken:
                slot[CLAIMED] = request
        if taken:
            lora_task(arena, *block.task_views(index))
        slot[DONE] = request
        served = request


@dataclasses.dataclass
class _Worker:
    """The coordinator's record of one slot (host state; never in shared memory)."""

    process: BaseProcess
    generation: int
    started: float
    lock: Any  # the slot's process-shared lock for this generation (CLAIMED)
    start_failures: int = 0
    disabled: bool = False
    task_since: float | None = None  # when the slot's unserved task was submitted
    lost_seq: int = -1  # latest sequence number the slot's dead worker never served


@dataclasses.dataclass
class _Resources:
    """What must be released even if the pool object is forgotten (the finalizer's view)."""

    control: shared_memory.SharedMemory
    block: ControlBlock
    arena: Any
    workers: list[_Worker]
    stop: threading.Event
    team: Team  # the calling process's threads (one, unless `local_threads`)
    watchdog: threading.Thread | None = None


def _release(resources: _Resources) -> None:
    resources.stop.set()
    resources.team.close()
    watchdog = resources.watchdog
    if watchdog is not None and watchdog is not threading.current_thread():
        watchdog.join()
    resources.block.slots[:, REQUEST] = STOP
    for worker in resources.workers:
        worker.process.join(timeout=2.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
    with contextlib.suppress(BufferError):  # numpy views still alive: unmapped with them
        resources.control.close()
    with contextlib.suppress(FileNotFoundError):
        resources.control.unlink()
    with contextlib.suppress(BufferError):
        resources.arena.close()


class CpuLoraPool:
    """Worker processes computing LoRA products x @ A @ B over a shared-memory arena.

    arena_name: `SharedArena.name` of the host store (A and B are read in place).
    workers:    number of worker processes, pinned round-robin to the cores this
                process may run on.
    max_rows:   most rows (tokens) one submit carries.
    max_in:     largest in_features of a submit.
    max_out:    most output columns one submit produces (the sum over its jobs).
    target_ms:  how long one share should take; `threads_for` gives a submit as many
                threads as that takes, by the start-up profile. Default: 1 ms for
                worker processes (a hand-off costs tens of microseconds), 0.05 ms for
                local threads (a helper that is awake takes its share in microseconds).
    local_threads: no worker processes (`workers` must be 0): the calling process
                computes every submit itself, on up to this many of its threads (see
                the module docstring); 0: the workers do.
    hang_after: seconds a worker may hold a task before the watchdog replaces it.
    steal_after: seconds after a submit from which `collect` computes the rows of a
                worker that has not taken its share yet (None: always wait for it).
    """

    def __init__(
        self,
        arena_name: str,
        *,
        workers: int,
        max_rows: int,
        max_in: int,
        max_out: int,
        target_ms: float | None = None,
        hang_after: float = 5.0,
        steal_after: float | None = STEAL_AFTER_S,
        local_threads: int = 0,
        start_timeout: float = 120.0,
        max_start_failures: int = 3,
    ) -> None:
        for field, value in [
            ("max_rows", max_rows),
            ("max_in", max_in),
            ("max_out", max_out),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive int")
        if not isinstance(local_threads, int) or local_threads < 0:
            raise ValueError(f"local_threads={local_threads!r} must be an int >= 0")
        if not isinstance(workers, int) or workers < (0 if local_threads else 1):
            raise ValueError(f"workers={workers!r} must be a positive int")
        if local_threads and workers:
            raise ValueError(
                f"workers={workers} with local_threads={local_threads}: a pool computes "
                "in worker processes or on the caller's threads, not both (workers=0)"
            )
        if target_ms is None:
            target_ms = THREADS_TARGET_MS if local_threads else PROCESSES_TARGET_MS
        for field, seconds in [
            ("target_ms", target_ms),
            ("hang_after", hang_after),
            ("start_timeout", start_timeout),
        ]:
            if not seconds > 0:
                raise ValueError(f"{field}={seconds!r} must be positive")
        arena = attach(arena_name, "arena_name")
        self.arena_name = arena_name
        self.arena_nbytes = len(arena)
        self.layout = Layout(workers, max_rows, max_in, max_out)
        self.target_ms = target_ms
        self.hang_after = hang_after
        if steal_after is not None and not steal_after >= 0:
            raise ValueError(f"steal_after={steal_after!r} must be None or >= 0")
        self.steal_after = steal_after
        self.local_threads = local_threads
        self.start_timeout = start_timeout
        self.max_start_failures = max_start_failures
        one_blas_thread()  # this process computes shares too: see its docstring
        self.profile = _profile()
        self.fallbacks = 0  # shares recomputed in the calling process (no worker could)
        self.steals = 0  # shares a late worker had not taken, computed in the calling process
        self.respawns = 0  # workers replaced after dying or hanging
        self._context = multiprocessing.get_context("spawn")
        self._cores = sorted(os.sched_getaffinity(0))
        self._lock = threading.Lock()
        self._seq = 0
        self._inflight: Ticket | None = None
        self._checked_jobs: dict[tuple, CheckedJobs] = {}  # see _jobs

        control = shared_memory.SharedMemory(
            name=f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}",
            create=True,
            size=self.layout.nbytes,
        )
        assert control.buf is not None
        self._block = ControlBlock(control.buf, self.layout)
        self._block.write_header()
        self._block.slots[:] = 0
        self._floats = _arena_floats(arena)
        self._team = Team(max(local_threads, 1))
        self._resources = _Resources(control, self._block, arena, [], threading.Event(), self._team)
        self._finalizer = weakref.finalize(self, _release, self._resources)
        self._workers = self._resources.workers
        self._workers += [self._spawn(index, generation=1) for index in range(workers)]
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        if not workers:
            return  # nothing to watch
        watchdog = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._resources.stop), daemon=True
        )
        self._resources.watchdog = watchdog
        watchdog.start()

    # -- public API ----------------------------------------------------------

    @property
    def control_name(self) -> str:
        return self._resources.control.name

    @property
    def num_workers(self) -> int:
        return self.layout.workers

    def ready_workers(self) -> list[int]:
        """Slots whose worker is warm and idle enough to take a task."""
        return [
            index
            for index, worker in enumerate(self._workers)
            if not worker.disabled and int(self._block.slots[index, READY]) == worker.generation
        ]

    @property
    def max_threads(self) -> int:
        """The most threads a submit can have: the caller's, or the workers."""
        return self.local_threads or self.num_workers

    @property
    def arena(self) -> np.ndarray:
        """The arena as float32 words, where the jobs' offsets point."""
        return self._floats

    @property
    def team(self) -> Team:
        """The calling process's threads (`local_threads`; one, the caller, without)."""
        return self._team

    def check(
        self,
        jobs: Sequence[LoraJob],
        in_features: int,
        *,
        columns: Sequence[int] | None = None,
        out_total: int | None = None,
    ) -> CheckedJobs:
        """A submit's jobs checked as `submit` checks them (ValueError naming the field),
        with what its calls need: the kernel's job rows, the columns no job writes, the
        work a token takes."""
        return self._jobs(tuple(jobs), in_features, columns, out_total)

    def threads_for(self, rows: int, in_features: int, rank: int, out_features: int) -> int:
        """How many threads a product of this shape needs to finish in ~target_ms."""
        return self.threads_for_flops(rows, 2 * rank * (in_features + out_features))

    @property
    def flops_per_thread(self) -> float:
        """The work one thread does in ~target_ms, by the start-up profile."""
        return self.profile.tokens_per_ms * self.profile.flops_per_token * self.target_ms

    def threads_for_flops(self, rows: int, flops_per_token: int) -> int:
        """How many threads `rows` tokens of `flops_per_token` need for ~target_ms (the
        FFI path's handler computes the same from `flops_per_thread`)."""
        wanted = math.ceil(rows * flops_per_token / max(self.flops_per_thread, 1e-9))
        return max(1, min(wanted, self.max_threads))

    def submit(
        self,
        x: np.ndarray,
        jobs: Sequence[LoraJob],
        *,
        columns: Sequence[int] | None = None,
        out_total: int | None = None,
        threads: int | None = None,
    ) -> Ticket:
        """Hand x @ A_j @ B_j for every job to the workers; returns a Ticket for `collect`.

        x:         f32[rows, in_features], 1 <= rows <= max_rows, in_features <= max_in
                   (the real rows only: padding rows cost a copy and a product each).
        jobs:      1 to MAX_JOBS LoraJobs sharing x.
        columns:   where job j's out_features columns start in the output; default:
                   side by side in job order. Ranges may not overlap.
        out_total: the output's width (default: the end of the last job's columns),
                   <= max_out; columns no job covers come back as zeros.
        threads:   how many threads to split the rows across: the caller's under
                   `local_threads`, else workers (default: `threads_for`); fewer where
                   fewer workers are ready. With none ready the caller computes all.
        """
        checked, rows, wanted = self._checked("submit", x, jobs, columns, out_total, threads)
        whole = dataclasses.replace(checked.whole, row_end=rows)
        self._block.x(rows, whole.in_features)[...] = x
        shares = []
        with self._lock:
            ready = [LOCAL] if self.local_threads else self.ready_workers()[:wanted]
            if not ready:  # no worker can take it: the caller computes it all
                ready = [LOCAL]
                self.fallbacks += 1
            now = time.monotonic()
            for i, index in enumerate(ready):  # contiguous row ranges, sizes differing by <= 1
                start, end = rows * i // len(ready), rows * (i + 1) // len(ready)
                task = dataclasses.replace(whole, row_start=start, row_end=end)
                self._seq += 1
                if index != LOCAL:
                    self._workers[index].task_since = now
                    self._block.write_task(index, task, self._seq)
                shares.append(Share(index, self._seq, task))
        threads = min(wanted, self.local_threads) if self.local_threads else 1
        self._inflight = Ticket(rows, whole.out_total, tuple(shares), checked.gaps, now, threads)
        return self._inflight

    def collect(
        self, ticket: Ticket, timeout: float | None = None, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Wait for the ticket's rows; returns f32[rows, out_total].

        Each job's product is in its columns, zeros in the columns no job covers. With
        `out` (f32[>= rows, out_total], row-major rows, writable: e.g. a host callback's
        output buffer) the result is written into out[:rows] and that view returned;
        otherwise it is a new array. Rows of a worker that died or hung are recomputed
        here, and so are those of a worker that has not taken its share `steal_after`
        seconds after the submit. Raises TimeoutError after `timeout` seconds (the ticket
        stays in flight and can be collected again).
        """
        if ticket is not self._inflight:
            raise ValueError("ticket is not the one in flight (collected already?)")
        result = _output(out, ticket.rows, ticket.out_total)
        self._settle(ticket, timeout, result)
        # The caller's own share is in `result` already; the workers' are in the region.
        own = ticket.rows if ticket.local else 0
        products = self._block.y(ticket.rows, ticket.out_total)
        if not ticket.gaps:
            np.copyto(result[own:], products[own:])
            return result
        cursor = 0
        for start, stop in (*ticket.gaps, (ticket.out_total, ticket.out_total)):
            np.copyto(result[own:, cursor:start], products[own:, cursor:start])
            result[:, start:stop] = 0.0
            cursor = stop
        return result

    def run(
        self,
        x: np.ndarray,
        jobs: Sequence[LoraJob],
        *,
        columns: Sequence[int] | None = None,
        out_total: int | None = None,
        threads: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """`submit` then `collect`, at once: for a caller with nothing to overlap the
        products with. A pool of threads computes them straight from x, which is still
        there, into `out`: no copy into shared memory, no ticket. Arguments as theirs."""
        if not self.local_threads:
            ticket = self.submit(x, jobs, columns=columns, out_total=out_total, threads=threads)
            return self.collect(ticket, out=out)
        checked, rows, wanted = self._checked("run", x, jobs, columns, out_total, threads)
        result = _output(out, rows, checked.whole.out_total)
        # The kernel takes writable C-ordered rows, as a callback's buffer is (an
        # io_callback's read-only argument is copied).
        if not (x.flags.c_contiguous and x.flags.writeable):
            x = np.array(x)
        self._team.run(self._floats, x, result, checked.job_rows, wanted)
        for start, stop in checked.gaps:
            result[:, start:stop] = 0.0
        return result

    def discard(self, ticket: Ticket, timeout: float | None = None) -> None:
        """Let a ticket go without its result (its caller failed): wait, as `collect`
        does, until no worker writes for it any more, so the next `submit` may reuse the
        buffers. A ticket no longer in flight is a no-op."""
        if ticket is self._inflight:
            self._settle(ticket, timeout)

    def _settle(self, ticket: Ticket, timeout: float | None, out: np.ndarray | None = None) -> None:
        """Wait until every share of the ticket in flight is served (the caller's own
        into `out` first, if given: else it is not computed); it leaves flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = [share for share in ticket.shares if share.worker != LOCAL]
        for share in ticket.shares:
            if share.worker == LOCAL and out is not None:
                self._compute_share(share.task, out, ticket.threads)
        backoff = Backoff(spin_s=COLLECT_SPIN_S)
        while pending:
            pending = [share for share in pending if not self._served(share, ticket.submitted)]
            if pending and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collect: {len(pending)} worker shares still running")
            if pending:
                backoff.pause()
        self._inflight = None

    def close(self) -> None:
        """Stop the workers and unlink the control segment (idempotent)."""
        self._finalizer()

    def __enter__(self) -> CpuLoraPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _checked(
        self,
        call: str,
        x: object,
        jobs: Sequence[LoraJob],
        columns: Sequence[int] | None,
        out_total: int | None,
        threads: int | None,
    ) -> tuple[CheckedJobs, int, int]:
        """A submit's (or run's) arguments, checked: (its jobs, its rows, the threads it
        gets, at most one per row)."""
        rows, in_features = self._check_input(x)
        checked = self._jobs(tuple(jobs), in_features, columns, out_total)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r} must be a positive int")
        if not self._finalizer.alive:
            raise RuntimeError(f"{call}: the pool is closed")
        if self._inflight is not None:
            raise RuntimeError(f"{call}: the previous ticket has not been collected")
        if threads is None:
            threads = self.threads_for_flops(rows, checked.flops_per_token)
        return checked, rows, min(threads, rows)

    def _jobs(
        self,
        jobs: tuple[LoraJob, ...],
        in_features: int,
        columns: Sequence[int] | None,
        out_total: int | None,
    ) -> CheckedJobs:
        """The jobs of a submit, checked, or found among those checked before (about
        15 µs of Python a call less, a fifth of a small product on this project's CPU)."""
        key: tuple | None = (
            in_features,
            jobs,
            None if columns is None else tuple(columns),
            out_total,
        )
        try:
            found = self._checked_jobs.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable, so not valid: the checks below say why
            key, found = None, None
        if found is not None:
            return found
        self._check_jobs(jobs, in_features)
        columns, out_total, gaps = self._check_columns(jobs, columns, out_total)
        whole = Task(0, 0, in_features, out_total, jobs, columns)
        checked = CheckedJobs(
            whole,
            gaps,
            sum(2 * job.rank * (in_features + job.out_features) for job in jobs),
            whole.job_rows(),
        )
        if key is not None:
            if len(self._checked_jobs) >= CHECKED_JOBS_KEPT:
                self._checked_jobs.clear()
            self._checked_jobs[key] = checked
        return checked

    def _check_input(self, x: object) -> tuple[int, int]:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise ValueError(f"x.dtype={getattr(x, 'dtype', type(x))} must be float32 ndarray")
        if x.ndim != 2:
            raise ValueError(f"x.shape={x.shape} must be [rows, in_features]")
        rows, in_features = x.shape
        if not 1 <= rows <= self.layout.max_rows:
            raise ValueError(f"rows={rows} must be in 1..max_rows={self.layout.max_rows}")
        if not 1 <= in_features <= self.layout.max_in:
            raise ValueError(f"in_features={in_features} must be in 1..max_in={self.layout.max_in}")
        return rows, in_features

    def _check_jobs(self, jobs: tuple[LoraJob, ...], in_features: int) -> None:
        if not 1 <= len(jobs) <= MAX_JOBS:
            raise ValueError(f"len(jobs)={len(jobs)} must be in 1..{MAX_JOBS}")
        for job in jobs:
            if not isinstance(job, LoraJob):
                raise ValueError(f"jobs: {job!r} is not a LoraJob")
            if job.rank < 1 or job.out_features < 1:
                raise ValueError(f"{job.rank=} and {job.out_features=} must be positive")
            for field, offset, count in [
                ("a_offset", job.a_offset, in_features * job.rank),
                ("b_offset", job.b_offset, job.rank * job.out_features),
            ]:
                if offset < 0 or offset % 4 or offset + 4 * count > self.arena_nbytes:
                    raise ValueError(
                        f"{field}={offset} ({4 * count} bytes) must be a multiple of 4 "
                        f"inside the arena ({self.arena_nbytes} bytes)"
                    )

    def _check_columns(
        self, jobs: tuple[LoraJob, ...], columns: Sequence[int] | None, out_total: int | None
    ) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
        """(columns, out_total, gaps) of a submit: every job's columns inside the output,
        none overlapping; gaps are the column ranges no job covers."""
        if columns is None:
            widths = (job.out_features for job in jobs[:-1])
            columns = tuple(itertools.accumulate(widths, initial=0))
        columns = tuple(int(column) for column in columns)
        if len(columns) != len(jobs):
            raise ValueError(f"len(columns)={len(columns)} must equal len(jobs)={len(jobs)}")
        spans = sorted(
            (column, column + job.out_features) for column, job in zip(columns, jobs, strict=True)
        )
        if out_total is None:
            out_total = spans[-1][1]
        if not 1 <= out_total <= self.layout.max_out:
            raise ValueError(
                f"out_total={out_total} (by default the jobs' out_features side by side) "
                f"must be in 1..max_out={self.layout.max_out}"
            )
        gaps, cursor = [], 0
        for start, stop in spans:
            if start < cursor or stop > out_total:
                raise ValueError(
                    f"columns={columns}: job columns [{start}, {stop}) overlap another job's "
                    f"or leave the output (out_total={out_total})"
                )
            if start > cursor:
                gaps.append((cursor, start))
            cursor = stop
        if cursor < out_total:
            gaps.append((cursor, out_total))
        return columns, out_total, tuple(gaps)

    def _compute_share(self, task: Task, into: np.ndarray | None = None, threads: int = 1) -> None:
        """A share of the submit in flight, here: from the input region into the output
        region, or into `into` (the caller's output)."""
        x = self._block.x(task.row_end, task.in_features)
        y = self._block.y(task.row_end, task.out_total) if into is None else into
        rows = slice(task.row_start, task.row_end)
        self._team.run(self._floats, x[rows], y[rows], task.job_rows(), threads)

    def _served(self, share: Share, submitted: float) -> bool:
        """True once a worker's share is in the output region (computing here those of a
        lost task, or of a late worker's: step 5 and 6 of the protocol)."""
        worker = self._workers[share.worker]
        if worker.lost_seq < share.seq:  # set before the replacement is visible
            if int(self._block.slots[share.worker, DONE]) >= share.seq:
                return True
            if not self._steal(share, worker, submitted):
                return False
            self._compute_share(share.task)
            self.steals += 1
            return True
        self._compute_share(share.task)
        self.fallbacks += 1
        return True

    def _steal(self, share: Share, worker: _Worker, submitted: float) -> bool:
        """Take a share its worker has not taken `steal_after` seconds after the submit."""
        if self.steal_after is None or time.monotonic() - submitted < self.steal_after:
            return False
        slot = self._block.slots[share.worker]
        if int(slot[CLAIMED]) >= share.seq:  # taken: no lock, so as never to delay a claim
            return False
        if not worker.lock.acquire(block=False):  # the worker is taking it right now
            return False
        try:
            if int(slot[CLAIMED]) >= share.seq:
                return False
            slot[CLAIMED] = share.seq
            return True
        finally:
            worker.lock.release()

    def _spawn(self, index: int, generation: int, start_failures: int = 0) -> _Worker:
        start_seq = int(self._block.slots[index, REQUEST])
        lock = self._context.Lock()  # a new one: a killed worker may hold its predecessor's
        process = self._context.Process(
            target=_worker_main,
            args=(
                self.control_name,
                self.arena_name,
                index,
                generation,
                start_seq,
                self._cores[index % len(self._cores)],
                lock,
            ),
            name=f"cpu-lora-{index}",
            daemon=True,
        )
        with _one_blas_thread():
            process.start()
        return _Worker(process, generation, time.monotonic(), lock, start_failures)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while len(self.ready_workers()) < self.num_workers:
            for index, worker in enumerate(self._workers):
                if not worker.process.is_alive():
                    raise RuntimeError(
                        f"cpu_offload worker {index} exited with code "
                        f"{worker.process.exitcode} during start-up"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"cpu_offload workers not ready after start_timeout={self.start_timeout}s"
                )
            time.sleep(0.01)

    def _check_workers(self) -> None:
        """One watchdog pass: replace every worker that died or hangs."""
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            if worker.disabled:
                continue
            ready = int(self._block.slots[index, READY]) == worker.generation
            served = int(self._block.slots[index, DONE]) >= int(self._block.slots[index, REQUEST])
            if not worker.process.is_alive():
                self._replace(index, f"died (exit code {worker.process.exitcode})", ready)
            elif not ready and now - worker.started > self.start_timeout:
                self._replace(index, f"not ready after {self.start_timeout}s", ready)
            elif (
                not served
                and worker.task_since is not None
                and now - worker.task_since > self.hang_after
            ):
                self._replace(index, f"hung (no result after {self.hang_after}s)", ready)

    def _replace(self, index: int, reason: str, was_ready: bool) -> None:
        """Step 6 of the protocol: kill, mark the unserved task lost, start a new worker."""
        with self._lock:
            worker = self._workers[index]
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join()
            worker.disabled = True  # its READY still reads as ready: never hand it a task
            request = int(self._block.slots[index, REQUEST])
            lost_seq = request if int(self._block.slots[index, DONE]) < request else -1
            lost_seq = max(lost_seq, worker.lost_seq)
            failures = 0 if was_ready else worker.start_failures + 1
            if failures >= self.max_start_failures:
                worker.lost_seq = lost_seq
                log.error("cpu_offload worker %d %s; disabled after %d failed starts",
                          index, reason, failures)  # fmt: skip
                return
            log.warning("cpu_offload worker %d %s; respawning", index, reason)
            replacement = self._spawn(index, worker.generation + 1, failures)
            replacement.lost_seq = lost_seq
            self.respawns += 1
            self._workers[index] = replacement  # collect sees lost_seq from here on


def _watch(pool_ref: weakref.ref[CpuLoraPool], stop: threading.Event) -> None:
    """The watchdog thread: holds the pool only weakly, so a forgotten pool is finalized."""
    while not stop.wait(0.01):
        pool = pool_ref()
        if pool is None:
            return
        try:
            pool._check_workers()
        except Exception:  # a failing watchdog would hide every later fault: say so, go on
            log.exception("cpu_offload watchdog pass failed")
        del pool


def _profile() -> Profile:
    """Tokens per core per millisecond of `lora_rows` at REFERENCE_SHAPE (median of 7)."""
    rows, in_features, rank, out_features = REFERENCE_SHAPE
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, in_features), np.float32)
    a = rng.standard_normal((in_features, rank), np.float32)
    b = rng.standard_normal((rank, out_features), np.float32)
    out = np.empty((rows, out_features), np.float32)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        lora_rows(x, a, b, out)
        times.append(time.perf_counter() - start)
    return Profile(rows / (1e3 * float(np.median(times))), 2 * rank * (in_features + out_features))


@contextlib.contextmanager
def _one_blas_thread():
    """Spawned workers inherit this environment: one BLAS thread each, since the pool
    already runs one worker per core."""
    names = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
