"""CpuLoraPool: worker processes that compute x @ A @ B on CPU cores, with a watchdog.

The coordinator (the engine's host thread) owns one pool. A request's LoRA product
for one layer is a `submit` (x plus one `LoraJob` per target sharing that input),
later matched by a `collect`; in between, the device computes the base projection.
The wire protocol is `cpu_offload.protocol`; the worker processes' end of it is
`cpu_offload.workers`, this module the coordinator's: it profiles the kernel at
start-up (tokens per core per millisecond on a reference shape, CaraServe's
profiling-guided parallelization), decides how many threads a submit gets
(`threads_for`), splits the rows (a share of rows needs A and B whole but only its rows
of x; splitting the output columns instead would repeat x·A on every thread), and
collects: into a buffer the caller gives, each job in the columns the submit named and
zeros in the columns no job covers, so a host callback copies the products once.

Threads instead of processes (`local_threads`): where the device is the CPU itself,
the products have nothing to overlap (the device's base projections run on the same
cores), and the processes' copies and hand-offs are pure cost. Such a pool has no
worker processes: `collect` computes every submit in the calling process, on up to that
many of its threads (the calling thread and the helpers of its `Team`, which stay awake
between products), straight into the caller's buffer; `run`, for a caller with nothing
to overlap, computes at once from x where it lies. Beside an accelerator the processes
stay: their products run while the device computes the base projections. A product
under about `target_ms` on one core stays on one thread (`threads_for`).

Faults lose nothing (DESIGN.md, Reliability). The watchdog replaces a worker that died
or hangs (`cpu_offload.workers`); its unserved task is marked lost and `collect`
recomputes those rows in the calling process with the same kernel (counted in
`fallbacks`); with no worker ready, submits run in the calling process. Lateness is not
a fault: a worker that has not taken its share `steal_after` seconds after the submit
(on a busy host the scheduler may not run it for milliseconds) has its rows computed by
`collect` in the calling process (counted in `steals`; protocol step 5), so a
CPU-routed layer waits for a product, not for the scheduler. `close()` (or the
finalizer, for a pool that is never closed) stops the workers and unlinks the control
segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from cpu_offload.jobs import CheckedJobs, JobChecker
from cpu_offload.kernels.blas import one_blas_thread
from cpu_offload.kernels.team import Team
from cpu_offload.protocol import (
    CLAIMED,
    DONE,
    REQUEST,
    STOP,
    Backoff,
    ControlBlock,
    Layout,
    LoraJob,
    Task,
    arena_floats,
    attach,
)
from cpu_offload.workers import Worker, Workers, profile_kernel

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "jlora_cpu_"  # control segments: /dev/shm/jlora_cpu_<pid>_<random>
LOCAL = -1  # Share.worker for rows computed in the calling process
# `collect` spins this long before it sleeps: its caller (the device's host callback)
# has nothing else to do, and a sleep overshoots by the timer slack (~50-100 µs), which
# a spin of tens of microseconds would pay on every product longer than it.
COLLECT_SPIN_S = 5e-3
# A running worker takes its task within microseconds of the submit; one that has not
# after this long is descheduled or asleep, and `collect` computes its rows itself.
STEAL_AFTER_S = 5e-5
# `target_ms`'s defaults: a product splits over worker processes past 1 ms of work on
# one core (a hand-off costs tens of microseconds), over the team's threads past 0.05 ms
# (an awake helper takes its share in microseconds; at 25 µs of work a split did not pay).
PROCESSES_TARGET_MS, THREADS_TARGET_MS = 1.0, 0.05


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


@dataclasses.dataclass
class _Resources:
    """What must be released even if the pool object is forgotten (the finalizer's view)."""

    control: shared_memory.SharedMemory
    block: ControlBlock
    arena: Any
    workers: list[Worker]
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
        self._checker = JobChecker(self.layout, len(arena))
        self.target_ms = target_ms
        self.hang_after = hang_after
        if steal_after is not None and not steal_after >= 0:
            raise ValueError(f"steal_after={steal_after!r} must be None or >= 0")
        self.steal_after = steal_after
        self.local_threads = local_threads
        self.start_timeout = start_timeout
        self.max_start_failures = max_start_failures
        one_blas_thread()  # this process computes shares too: see its docstring
        self.profile = profile_kernel()
        self.fallbacks = 0  # shares recomputed in the calling process (no worker could)
        self.steals = 0  # shares a late worker had not taken, computed in the calling process
        self._lock = threading.Lock()
        self._seq = 0
        self._inflight: Ticket | None = None

        control = shared_memory.SharedMemory(
            name=f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}",
            create=True,
            size=self.layout.nbytes,
        )
        assert control.buf is not None
        self._block = ControlBlock(control.buf, self.layout)
        self._block.write_header()
        self._block.slots[:] = 0
        self._floats = arena_floats(arena)
        self._team = Team(max(local_threads, 1))
        self._resources = _Resources(control, self._block, arena, [], threading.Event(), self._team)
        self._finalizer = weakref.finalize(self, _release, self._resources)
        try:
            self._processes = Workers(
                self._block,
                control_name=control.name,
                arena_name=arena_name,
                count=workers,
                start_timeout=start_timeout,
                hang_after=hang_after,
                max_start_failures=max_start_failures,
                lock=self._lock,
                context=multiprocessing.get_context("spawn"),
            )
            self._workers = self._resources.workers = self._processes.records
            self._processes.wait_ready()
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

    @property
    def respawns(self) -> int:
        """Workers replaced after dying or hanging."""
        return self._processes.respawns

    def ready_workers(self) -> list[int]:
        """Slots whose worker is warm and idle enough to take a task."""
        return self._processes.ready()

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
        return self._checker.jobs(tuple(jobs), in_features, columns, out_total)

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
        rows, in_features = self._checker.input(x)
        checked = self._checker.jobs(tuple(jobs), in_features, columns, out_total)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r} must be a positive int")
        if not self._finalizer.alive:
            raise RuntimeError(f"{call}: the pool is closed")
        if self._inflight is not None:
            raise RuntimeError(f"{call}: the previous ticket has not been collected")
        if threads is None:
            threads = self.threads_for_flops(rows, checked.flops_per_token)
        return checked, rows, min(threads, rows)

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

    def _steal(self, share: Share, worker: Worker, submitted: float) -> bool:
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


def _watch(pool_ref: weakref.ref[CpuLoraPool], stop: threading.Event) -> None:
    """The watchdog thread: holds the pool only weakly, so a forgotten pool is finalized."""
    while not stop.wait(0.01):
        pool = pool_ref()
        if pool is None:
            return
        try:
            pool._processes.check()
        except Exception:  # a failing watchdog would hide every later fault: say so, go on
            log.exception("cpu_offload watchdog pass failed")
        del pool
