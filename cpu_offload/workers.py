"""The pool's worker processes: their loop, and the coordinator's side of their lives.

- `worker_main`: one spawned process per core, pinned with `os.sched_setaffinity`,
  waiting on its slot's REQUEST (spin, then sleep) and writing its rows of every job
  in place, in one compiled call (`kernels.blas.lora_task`): steps 1, 3 and 4 of the
  protocol (protocol.py).
- `Workers`: the coordinator's record of each slot's process (`Worker`), started with
  `spawn` and one BLAS thread each, waited for at start-up, and watched: `check` (the
  watchdog's pass) replaces a worker whose process is gone, that is not ready in time,
  or that holds a task longer than `hang_after` seconds, marking its unserved task lost
  (step 6); a slot whose worker dies `max_start_failures` times in a row before it is
  ready is disabled.
- `profile_kernel`: the kernel's tokens per core per millisecond at start-up (CaraServe's
  profiling-guided parallelization).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from cpu_offload.kernels.blas import lora_rows, lora_task
from cpu_offload.protocol import (
    CLAIMED,
    DONE,
    READY,
    REQUEST,
    STOP,
    Backoff,
    ControlBlock,
    arena_floats,
    attach,
)

log = logging.getLogger(__name__)

REFERENCE_SHAPE = (128, 576, 16, 576)  # rows, in, rank, out: SmolLM2's q_proj at rank 16
# A worker spins this long after its last task before it starts sleeping: a prefill
# hands off every few hundred microseconds, and a sleeping worker wakes late.
WORKER_SPIN_S = 2e-3


@dataclasses.dataclass(frozen=True)
class Profile:
    """Start-up measurement of the kernel on one core (REFERENCE_SHAPE)."""

    tokens_per_ms: float
    flops_per_token: int  # 2 · rank · (in + out) at the reference shape


def worker_main(
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
    arena = arena_floats(attach(arena_name, "arena_name"))
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
class Worker:
    """The coordinator's record of one slot (host state; never in shared memory)."""

    process: BaseProcess
    generation: int
    started: float
    lock: Any  # the slot's process-shared lock for this generation (CLAIMED)
    start_failures: int = 0
    disabled: bool = False
    task_since: float | None = None  # when the slot's unserved task was submitted
    lost_seq: int = -1  # latest sequence number the slot's dead worker never served


class Workers:
    """See the module docstring: `records[i]` is slot i's process. `lock` is the pool's
    (a replacement becomes visible to `collect` under it)."""

    def __init__(
        self,
        block: ControlBlock,
        *,
        control_name: str,
        arena_name: str,
        count: int,
        start_timeout: float,
        hang_after: float,
        max_start_failures: int,
        lock: threading.Lock,
        context: SpawnContext,
    ) -> None:
        self.block = block
        self.control_name = control_name
        self.arena_name = arena_name
        self.start_timeout = start_timeout
        self.hang_after = hang_after
        self.max_start_failures = max_start_failures
        self.respawns = 0  # workers replaced after dying or hanging
        self._lock = lock
        self._context = context
        self._cores = sorted(os.sched_getaffinity(0))
        self.records: list[Worker] = [self._spawn(index, generation=1) for index in range(count)]

    def ready(self) -> list[int]:
        """Slots whose worker is warm and idle enough to take a task."""
        return [
            index
            for index, worker in enumerate(self.records)
            if not worker.disabled and int(self.block.slots[index, READY]) == worker.generation
        ]

    def _spawn(self, index: int, generation: int, start_failures: int = 0) -> Worker:
        start_seq = int(self.block.slots[index, REQUEST])
        lock = self._context.Lock()  # a new one: a killed worker may hold its predecessor's
        process = self._context.Process(
            target=worker_main,
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
        with one_blas_thread_env():
            process.start()
        return Worker(process, generation, time.monotonic(), lock, start_failures)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while len(self.ready()) < len(self.records):
            for index, worker in enumerate(self.records):
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

    def check(self) -> None:
        """One watchdog pass: replace every worker that died or hangs."""
        now = time.monotonic()
        for index, worker in enumerate(self.records):
            if worker.disabled:
                continue
            ready = int(self.block.slots[index, READY]) == worker.generation
            served = int(self.block.slots[index, DONE]) >= int(self.block.slots[index, REQUEST])
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
            worker = self.records[index]
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join()
            worker.disabled = True  # its READY still reads as ready: never hand it a task
            request = int(self.block.slots[index, REQUEST])
            lost_seq = request if int(self.block.slots[index, DONE]) < request else -1
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
            self.records[index] = replacement  # collect sees lost_seq from here on


def profile_kernel() -> Profile:
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
def one_blas_thread_env():
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
