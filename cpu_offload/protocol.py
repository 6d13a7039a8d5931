"""The shared-memory control block between the coordinator and its CPU LoRA workers.

One POSIX shared-memory segment, created by the coordinator (`CpuLoraPool`), holds
everything that crosses a process boundary on the hot path; the adapters' A and B
are read in place from the host store's own segment (the arena). No pipe, socket or
pickle is involved once the workers run (CaraServe §4.2, "shared memory data
transfer").

Memory layout (byte offsets from the start of the segment):

    header  int64[8]                 magic, version, workers, max_rows, max_in, max_out
    slots   int64[workers, 128]      one slot per worker, 1 KiB each (layout below)
    input   float32[max_rows*max_in]    x of the current submit, [rows, in] row-major
    output  float32[max_rows*max_out]   y of the current submit, [rows, out_total]

A slot, in int64 words; each counter sits on its own 64-byte line and has exactly
one writer:

    word 0   REQUEST  written by the coordinator only: the sequence number of the
                      latest task put in this slot (STOP = -1 asks the worker to exit)
    word 8   DONE     written by the worker only: the latest sequence number served
    word 16  READY    written by the worker only: its generation once it is warm
    word 24  task descriptor, written by the coordinator only, before REQUEST:
             row_start, row_end, in_features, out_total, n_jobs, then from word 32
             per job: a_offset, b_offset, rank, out_features, out_column

a_offset and b_offset are byte offsets into the arena of A [in, rank] and
B [rank, out] (float32, row-major, scaling folded into B: the host store's layout).
Job j writes columns [out_column, out_column + out_features) of the output, so the
q, k and v products of one layer (which share one input) come back side by side.

The protocol, step by step:

1. The coordinator creates the segment, writes the header, and starts the workers
   (multiprocessing `spawn`; each gets its slot index, a generation number and the
   sequence number to start from). A worker pins itself to a core, attaches the
   control block and the arena by name, runs its kernel once, and writes its
   generation into READY.
2. `submit` copies x into the input region, splits the rows into one contiguous
   range per chosen worker, writes each worker's task descriptor and then bumps its
   REQUEST. The descriptor is complete before REQUEST changes, and a worker reads
   the descriptor only after it has seen the new REQUEST.
3. A worker waits for REQUEST > the last sequence number it served: it spins for a
   few tens of microseconds, then sleeps in growing steps up to a millisecond (so an
   idle pool does not eat the cores the device's host thread needs).
4. It computes x[rows] @ A @ B for each job of its task straight into the output
   region, then writes the sequence number into DONE.
5. `collect` waits (spin, then sleep) until DONE has caught up with every REQUEST
   the ticket bumped, and copies the output out (the regions are reused by the next
   submit, so one ticket is in flight at a time).
6. A worker that dies or hangs is killed, its DONE read (it can no longer change),
   and, when it had not served its task, the task is marked lost; a new worker is
   started from the current REQUEST (it never serves the lost task) and `collect`
   recomputes the lost rows in the calling process with the same kernel.
7. `close` writes STOP into every REQUEST, joins the workers and unlinks the segment.

Ordering: each counter is one aligned 8-byte store, and the protocol relies on
stores becoming visible in program order (x86-64's total store order): descriptor
before REQUEST, output before DONE.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import time
from pathlib import Path

import numpy as np

MAGIC = 0x4A4C4F5241435055  # "JLORACPU"
VERSION = 1
HEADER_WORDS = 8
SLOT_WORDS = 128
MAX_JOBS = 8
STOP = -1

# Slot word indices.
REQUEST = 0
DONE = 8
READY = 16
ROW_START, ROW_END, IN_FEATURES, OUT_TOTAL, N_JOBS = 24, 25, 26, 27, 28
JOBS = 32
JOB_WORDS = 5

SHM_DIR = Path("/dev/shm")


@dataclasses.dataclass(frozen=True)
class LoraJob:
    """One target's product for one layer: y = x @ A @ B, A and B read from the arena.

    a_offset: byte offset of A [in, rank] (float32, row-major) in the arena.
    b_offset: byte offset of B [rank, out_features] (scaling folded in).
    """

    a_offset: int
    b_offset: int
    rank: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class Task:
    """What one worker computes: rows [row_start, row_end) of every job."""

    row_start: int
    row_end: int
    in_features: int
    out_total: int
    jobs: tuple[LoraJob, ...]

    def out_columns(self) -> list[int]:
        columns, cursor = [], 0
        for job in self.jobs:
            columns.append(cursor)
            cursor += job.out_features
        return columns


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets of the regions of a control block."""

    workers: int
    max_rows: int
    max_in: int
    max_out: int

    @property
    def slots_offset(self) -> int:
        return 8 * HEADER_WORDS

    @property
    def input_offset(self) -> int:
        return self.slots_offset + 8 * SLOT_WORDS * self.workers

    @property
    def output_offset(self) -> int:
        return self.input_offset + 4 * self.max_rows * self.max_in

    @property
    def nbytes(self) -> int:
        return self.output_offset + 4 * self.max_rows * self.max_out


class ControlBlock:
    """Numpy views of a control block's header, slots, input and output regions."""

    def __init__(self, buffer: memoryview | mmap.mmap, layout: Layout) -> None:
        self.layout = layout
        self.header = np.ndarray((HEADER_WORDS,), np.int64, buffer=buffer)
        self.slots = np.ndarray(
            (layout.workers, SLOT_WORDS), np.int64, buffer=buffer, offset=layout.slots_offset
        )
        self.input = np.ndarray(
            (layout.max_rows * layout.max_in,),
            np.float32,
            buffer=buffer,
            offset=layout.input_offset,
        )
        self.output = np.ndarray(
            (layout.max_rows * layout.max_out,),
            np.float32,
            buffer=buffer,
            offset=layout.output_offset,
        )

    def write_header(self) -> None:
        layout = self.layout
        self.header[:6] = [
            MAGIC,
            VERSION,
            layout.workers,
            layout.max_rows,
            layout.max_in,
            layout.max_out,
        ]

    @classmethod
    def from_header(cls, buffer: mmap.mmap) -> ControlBlock:
        """Attach a block another process created, checking its header."""
        header = np.ndarray((HEADER_WORDS,), np.int64, buffer=buffer)
        if int(header[0]) != MAGIC or int(header[1]) != VERSION:
            raise ValueError("not a cpu_offload control block (bad magic or version)")
        block = cls(buffer, Layout(*(int(word) for word in header[2:6])))
        del header
        return block

    def x(self, rows: int, in_features: int) -> np.ndarray:
        return self.input[: rows * in_features].reshape(rows, in_features)

    def y(self, rows: int, out_total: int) -> np.ndarray:
        return self.output[: rows * out_total].reshape(rows, out_total)

    def write_task(self, worker: int, task: Task, seq: int) -> None:
        """Step 2: the descriptor, then REQUEST (the coordinator's fields only)."""
        slot = self.slots[worker]
        slot[ROW_START:JOBS] = [
            task.row_start,
            task.row_end,
            task.in_features,
            task.out_total,
            len(task.jobs),
            0,
            0,
            0,
        ]
        for j, (job, column) in enumerate(zip(task.jobs, task.out_columns(), strict=True)):
            start = JOBS + JOB_WORDS * j
            slot[start : start + JOB_WORDS] = [
                job.a_offset,
                job.b_offset,
                job.rank,
                job.out_features,
                column,
            ]
        slot[REQUEST] = seq

    def read_task(self, worker: int) -> Task:
        slot = self.slots[worker]
        row_start, row_end, in_features, out_total, n_jobs = (
            int(w) for w in slot[ROW_START : N_JOBS + 1]
        )
        jobs = []
        for j in range(n_jobs):
            start = JOBS + JOB_WORDS * j
            a_offset, b_offset, rank, out_features, _ = (int(w) for w in slot[start : start + 5])
            jobs.append(LoraJob(a_offset, b_offset, rank, out_features))
        return Task(row_start, row_end, in_features, out_total, tuple(jobs))


class Backoff:
    """Spin-then-sleep: `pause()` returns at once for `spin_s`, then sleeps longer each call."""

    def __init__(self, spin_s: float = 50e-6, first_sleep_s: float = 20e-6, max_sleep_s=1e-3):
        self.spin_until = time.perf_counter() + spin_s
        self.sleep_s = first_sleep_s
        self.max_sleep_s = max_sleep_s

    def pause(self) -> None:
        if time.perf_counter() < self.spin_until:
            os.sched_yield()  # a runnable coordinator on this core goes first
            return
        time.sleep(self.sleep_s)
        self.sleep_s = min(2 * self.sleep_s, self.max_sleep_s)


def segment_path(name: str, field: str) -> Path:
    """/dev/shm/<name> for a POSIX shared-memory segment name (`SharedMemory.name`)."""
    if not isinstance(name, str) or not name.lstrip("/") or "/" in name.lstrip("/"):
        raise ValueError(f"{field}={name!r} is not a shared-memory segment name")
    if name.lstrip("/") in {".", ".."}:
        raise ValueError(f"{field}={name!r} is not a shared-memory segment name")
    return SHM_DIR / name.lstrip("/")


def attach(name: str, field: str) -> mmap.mmap:
    """Map an existing segment read-write, bypassing multiprocessing's resource tracker.

    (`SharedMemory(name=...)` would register the segment with the tracker, which then
    unlinks it when this process exits; the segment belongs to whoever created it.)
    """
    path = segment_path(name, field)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(f"{field}={name!r}: no shared-memory segment {path}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"{field}={name!r}: the segment {path} is empty")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
