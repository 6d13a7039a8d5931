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
    output  float32[max_rows*(max_out+16)]  y of the current submit, [rows, out_total],
                                        rows `out_stride(out_total)` floats apart

A slot, in int64 words; each counter sits on its own 64-byte line and has exactly
one writer:

    word 0   REQUEST  written by the coordinator only: the sequence number of the
                      latest task put in this slot (STOP = -1 asks the worker to exit)
    word 8   DONE     written by the worker only: the latest sequence number served
    word 16  READY    written by the worker only: its generation once it is warm
    word 96  CLAIMED  written under the slot's lock only (by its worker or by the
                      coordinator): the latest sequence number whose task someone
                      took; whoever raises it to a task's number computes that task
    word 24  task descriptor, written by the coordinator only, before REQUEST:
             row_start, row_end, in_features, out_total, n_jobs, then from word 32
             per job: a_offset, b_offset, rank, out_features, out_column, and the
             rows per sgemm call of its two products (the `kernels.lora_task` job
             row, which the worker passes in place)

a_offset and b_offset are byte offsets into the arena of A [in, rank] and
B [rank, out] (float32, row-major, scaling folded into B: the host store's layout).
Job j writes columns [out_column, out_column + out_features) of the output, so the
q, k and v products of one layer (which share one input) come back in the columns
the device lays them out in; columns no job writes (a projection the adapter leaves
alone) are zeroed by `collect`, never by the workers.

The protocol, step by step:

1. The coordinator creates the segment, writes the header, and starts the workers
   (multiprocessing `spawn`; each gets its slot index, a generation number and the
   sequence number to start from). A worker pins itself to a core, attaches the
   control block and the arena by name, runs its kernel once, and writes its
   generation into READY.
2. `submit` copies x (the real rows only) into the input region, splits the rows
   into one contiguous range per chosen worker, writes each worker's task descriptor
   (one slice assignment) and then bumps its REQUEST. The descriptor is complete
   before REQUEST changes, and a worker reads it only after it has seen the new
   REQUEST.
3. A worker waits for REQUEST > the last sequence number it served: it spins (with
   `sched_yield`) for a couple of milliseconds after its last task, since a prefill
   hands off every few hundred microseconds, then sleeps in growing steps up to a
   millisecond (so an idle pool does not eat the cores the device's host thread
   needs).
4. It takes the task (raises CLAIMED, under the slot's lock), computes x[rows] @ A @ B
   for each job straight into the output region (one compiled call,
   `kernels.lora_task`), then writes the sequence number into DONE. A task the
   coordinator took first (step 5) it does not compute; it only writes DONE.
5. `collect` waits (spin for up to a few milliseconds, then sleep) until DONE has
   caught up with every REQUEST the ticket bumped, and copies the output out, into
   a buffer the caller gives (the host callback's own output buffer) or a new array
   (the regions are reused by the next submit, so one ticket is in flight at a
   time). A share that its worker has not taken `steal_after` seconds after the
   submit belongs to a worker that is not running (descheduled on a busy host, or
   asleep after an idle spell): the coordinator takes it, if the lock is free, and
   computes those rows itself, rather than wait for the scheduler. The lock is a
   process-shared semaphore per worker generation, which the coordinator only ever
   tries (it never blocks on it): a worker killed while holding it takes it along,
   and its replacement gets a new one.
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

from cpu_offload.kernels.blas import rows_per_call

MAGIC = 0x4A4C4F5241435055  # "JLORACPU"
VERSION = 3  # 2: out_column, CLAIMED, padded output rows; 3: rows per sgemm call
HEADER_WORDS = 8
SLOT_WORDS = 128
MAX_JOBS = 8
STOP = -1

# Slot word indices.
REQUEST = 0
DONE = 8
READY = 16
CLAIMED = 96
ROW_START, ROW_END, IN_FEATURES, OUT_TOTAL, N_JOBS = 24, 25, 26, 27, 28
JOBS = 32
JOB_WORDS = 7  # `kernels.lora_task`'s job row
assert JOBS + JOB_WORDS * MAX_JOBS <= CLAIMED, "a slot's job rows reach CLAIMED"

SHM_DIR = Path("/dev/shm")
ALIAS_PAD = 16  # floats (one cache line) added to an output row whose bytes are 2 KiB multiples


def out_stride(out_total: int) -> int:
    """Floats between two rows of an out_total-wide output in the output region.

    OpenBLAS's sgemm writes rows 4 KiB apart (SmolLM2's gate/up: 2 x 1536 floats) about
    half as fast as rows a cache line further apart at ranks 1-4, where the product is
    all stores (the rows alias in the cache; no difference from rank 16 on). PyTorch's
    output is contiguous, the host callback's buffer too: only this region is padded,
    and `collect` copies row by row.
    """
    return out_total + ALIAS_PAD if (4 * out_total) % 2048 == 0 else out_total


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
    """What one worker computes: rows [row_start, row_end) of every job, job j into
    columns [columns[j], columns[j] + jobs[j].out_features) of an out_total-wide output."""

    row_start: int
    row_end: int
    in_features: int
    out_total: int
    jobs: tuple[LoraJob, ...]
    columns: tuple[int, ...]

    def job_rows(self) -> np.ndarray:
        """i64[n_jobs, JOB_WORDS]: the descriptor's job rows (`kernels.lora_task`'s jobs),
        with this process's OpenBLAS's rows per call of each product."""
        return np.array(
            [
                [
                    job.a_offset,
                    job.b_offset,
                    job.rank,
                    job.out_features,
                    column,
                    rows_per_call(job.rank, self.in_features),
                    rows_per_call(job.out_features, job.rank),
                ]
                for job, column in zip(self.jobs, self.columns, strict=True)
            ],  # fmt: skip
            np.int64,
        ).reshape(len(self.jobs), JOB_WORDS)


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
        return self.output_offset + 4 * self.max_rows * (self.max_out + ALIAS_PAD)


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
            (layout.max_rows * (layout.max_out + ALIAS_PAD),),
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
        stride = out_stride(out_total)
        return self.output[: rows * stride].reshape(rows, stride)[:, :out_total]

    def write_task(self, worker: int, task: Task, seq: int) -> None:
        """Step 2: the descriptor, then REQUEST (the coordinator's fields only)."""
        n_jobs = len(task.jobs)
        words = np.zeros(JOBS - ROW_START + JOB_WORDS * n_jobs, np.int64)
        words[: N_JOBS - ROW_START + 1] = (
            task.row_start,
            task.row_end,
            task.in_features,
            task.out_total,
            n_jobs,
        )
        words[JOBS - ROW_START :] = task.job_rows().ravel()
        slot = self.slots[worker]
        slot[ROW_START : ROW_START + words.size] = words
        slot[REQUEST] = seq

    def task_views(self, worker: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A worker's side of step 4: (x, y, job rows) of the task in its slot, as views
        of the input region, the output region and the descriptor."""
        slot = self.slots[worker]
        row_start, row_end, in_features, out_total, n_jobs = slot[ROW_START : N_JOBS + 1].tolist()
        x = self.x(row_end, in_features)[row_start:]
        y = self.y(row_end, out_total)[row_start:]
        return x, y, slot[JOBS : JOBS + JOB_WORDS * n_jobs].reshape(n_jobs, JOB_WORDS)


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


def arena_floats(arena: mmap.mmap) -> np.ndarray:
    """The arena as f32[bytes / 4], the view `lora_task` reads A and B from."""
    return np.frombuffer(arena, np.float32, count=len(arena) // 4)
