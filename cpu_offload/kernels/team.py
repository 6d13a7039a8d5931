"""A team of helper threads that stay awake between products: a split that costs microseconds.

A pool of threads (`CpuLoraPool(local_threads=N)`) splits a product's rows over N
threads of the engine's process. Numba's workqueue costs about 0.1 ms a launch for that
(its threads sleep on a condition variable, and a sleeping vCPU wakes late), more than
half of a mid-sized product: 512 rows at rank 16 ran barely faster on two threads than
on one, where PyTorch's two OpenMP threads, which spin between calls, took about 0.6x
the one-thread time. With a team, two threads take about three quarters of torch's
time on that product, and on two threads the pool is as fast as torch on two at rank
64 and faster at ranks 8 and 16.

A `Team` keeps N - 1 helper threads. A helper that has computed a share stays awake,
in compiled code polling its mailbox (no GIL), while a caller is computing and for
`spin_s` after, so the next product of a prefill, a layer later, finds it awake; then
it sleeps on a POSIX semaphore. Its poll yields the core (`sched_yield`) to any other
thread the scheduler runs there. The caller never waits for a helper that has not
started:

- a helper that is asleep gets no share: the caller wakes it, for the next product,
  and computes without it (one woken now would start late, and the caller would wait
  for the share it claimed). Linux wakes a thread on its waker's core, where it would
  take turns with the caller while the other core idles, so a woken helper first
  moves itself off the caller's core (`sched_setaffinity`, every core but that one);
- to a helper that is awake the caller posts its share, computes its own, then takes
  back a share still unclaimed and computes it too, or waits for the helper's.

Each helper's mailbox is one row of an int64 array: the task's state, which moves
EMPTY -> POSTED (the caller) -> CLAIMED (the helper) -> DONE (the helper) -> EMPTY
(the caller), or POSTED -> EMPTY when the caller takes it back, every move an atomic
compare-exchange or a release store; whether the helper is awake and a caller busy;
and the share's arrays as addresses and shapes, which the helper views in place
(`numba.carray`). One caller at a time: a caller that finds the team busy computes
its product alone. Each row range is computed by the same one-thread kernel whoever
computes it, so a product's bits depend on how many threads it was split for, not on
which took each share.

The caller's side is compiled too (`run_team`: the team's words, the posts, the
wake-ups by `sem_post`), so a step's FFI handler, which runs no Python, uses the team
as `Team.run` does (jlora/device/cpu_assist/apply.py).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import numpy as np
from llvmlite import binding
from numba import carray, float32, int64, njit, types

from cpu_offload.kernels.blas import lora_task
from cpu_offload.kernels.native import load, pointer, store, swap_if
from cpu_offload.protocol import JOB_WORDS

# How long a helper stays awake after the last product: longer than the gap between
# two products of a prefill (a layer's base projections), short beside a request.
TEAM_SPIN_S = 1e-3

# A mailbox: the task's state, whether the helper is awake, whether the team stops,
# whether a caller is computing and on which core it woke the helper, whether a wake-up
# is pending and the address of the helper's semaphore; the share.
(TASK, AWAKE, STOP, CALLER, CALLER_CPU, WAKE) = range(6)
(ARENA, ARENA_LEN, X, ROWS, IN, Y, Y_STRIDE, Y_COLS, JOBS, N_JOBS, SEM) = range(6, 17)
BOX = 24  # int64 words a mailbox takes: 192 bytes, three cache lines (`_mailboxes`)
EMPTY, POSTED, CLAIMED, DONE = range(4)
# The team's own words: whether a caller has it, and the counts `Team` reports.
(BUSY, HELPED, TAKEN_BACK) = range(3)
TEAM_WORDS = 8
_SEM_BYTES = 64  # room for a sem_t (32 bytes on Linux)

_CLOCK_MONOTONIC = 1  # Linux's
_LIBC = ctypes.CDLL(None)
for _name in ("clock_gettime", "sched_yield", "sched_getcpu", "sem_post"):
    binding.add_symbol(f"jlora_{_name}", ctypes.cast(getattr(_LIBC, _name), ctypes.c_void_p).value)
_clock_gettime = types.ExternalFunction(
    "jlora_clock_gettime", types.int32(types.int32, types.voidptr)
)
_sched_yield = types.ExternalFunction("jlora_sched_yield", types.int32())
_sched_getcpu = types.ExternalFunction("jlora_sched_getcpu", types.int32())
_sem_post = types.ExternalFunction("jlora_sem_post", types.int32(types.voidptr))


@njit(inline="always")
def _now_ns(timespec):  # pragma: no cover - compiled
    _clock_gettime(_CLOCK_MONOTONIC, timespec.ctypes)
    return timespec[0] * 1_000_000_000 + timespec[1]


@njit(inline="always")
def _share(box):  # pragma: no cover - compiled
    """The posted share's arrays, viewed where the caller's lie."""
    arena = carray(pointer(box[ARENA]), (box[ARENA_LEN],), dtype=np.float32)
    x = carray(pointer(box[X]), (box[ROWS], box[IN]), dtype=np.float32)
    y = carray(pointer(box[Y]), (box[ROWS], box[Y_STRIDE]), dtype=np.float32)[:, : box[Y_COLS]]
    jobs = carray(pointer(box[JOBS]), (box[N_JOBS], JOB_WORDS), dtype=np.int64)
    return arena, x, y, jobs


@njit(int64(int64[::1], int64), nogil=True, cache=True)
def _serve(box, spin_ns):  # pragma: no cover - compiled
    """A helper awake: compute each share posted in `box` until none has come for
    `spin_ns` or the team stops; how many it computed."""
    timespec = np.zeros(2, np.int64)
    store(box, AWAKE, 1)
    served = 0
    deadline = _now_ns(timespec) + spin_ns
    while load(box, STOP) == 0:
        if load(box, TASK) == POSTED and swap_if(box, TASK, POSTED, CLAIMED):
            arena, x, y, jobs = _share(box)
            lora_task(arena, x, y, jobs)
            store(box, TASK, DONE)
            served += 1
            deadline = _now_ns(timespec) + spin_ns
        elif load(box, CALLER):  # a product is under way: its end starts the spin
            deadline = _now_ns(timespec) + spin_ns
            _sched_yield()
        elif _now_ns(timespec) > deadline:
            break
        else:
            _sched_yield()  # a thread the scheduler put on this core runs first
    store(box, AWAKE, 0)
    return served


@njit(inline="always")
def _rows(rows, parts, i):  # pragma: no cover - compiled
    """Range i of `parts` contiguous row ranges whose sizes differ by <= 1."""
    return rows * i // parts, rows * (i + 1) // parts


@njit(
    types.UniTuple(int64, 2)(
        float32[::1], float32[:, ::1], float32[:, :], int64[:, ::1], int64[:, ::1], int64
    ),
    nogil=True,
    cache=True,
)
def _split(arena, x, y, jobs, mail, helpers):  # pragma: no cover - compiled
    """`lora_task` over helpers + 1 row ranges (`_rows`): range h + 1 posted to helper h
    if it is awake, the others computed here, then each posted range still unclaimed
    taken back and computed here; (ranges the helpers computed, ranges taken back)."""
    rows, fan_in = x.shape
    parts = helpers + 1
    stride = y.strides[0] // 4
    posted = np.zeros(helpers, np.bool_)
    for h in range(helpers):
        box = mail[h]
        if not load(box, AWAKE):
            continue
        start, end = _rows(rows, parts, h + 1)
        box[ARENA], box[ARENA_LEN] = arena.ctypes.data, arena.shape[0]
        box[X], box[ROWS], box[IN] = x.ctypes.data + 4 * start * fan_in, end - start, fan_in
        box[Y], box[Y_STRIDE], box[Y_COLS] = y.ctypes.data + 4 * start * stride, stride, y.shape[1]
        box[JOBS], box[N_JOBS] = jobs.ctypes.data, jobs.shape[0]
        store(box, TASK, POSTED)
        posted[h] = True
    for i in range(parts):
        if i == 0 or not posted[i - 1]:
            start, end = _rows(rows, parts, i)
            lora_task(arena, x[start:end], y[start:end], jobs)
    helped = taken_back = 0
    for h in range(helpers):
        box = mail[h]
        if not posted[h]:
            continue
        if swap_if(box, TASK, POSTED, EMPTY):  # not started: ours
            start, end = _rows(rows, parts, h + 1)
            lora_task(arena, x[start:end], y[start:end], jobs)
            taken_back += 1
        else:
            while load(box, TASK) != DONE:
                _sched_yield()  # the helper, if the scheduler put it on this core
            store(box, TASK, EMPTY)
            helped += 1
    return helped, taken_back


@njit(inline="always")
def _wake(box):  # pragma: no cover - compiled
    """Wake the helper of `box` (asleep) for the next product: once, whoever calls."""
    box[CALLER_CPU] = _sched_getcpu()
    if swap_if(box, WAKE, 0, 1):
        _sem_post(pointer(box[SEM]))


@njit(inline="always")
def _alone(arena, x, y, jobs, helpers):  # pragma: no cover - compiled
    """`_split`'s row ranges for `helpers`, every one computed here: the same bits."""
    if helpers < 1:
        lora_task(arena, x, y, jobs)
    else:
        _split(arena, x, y, jobs, np.zeros((helpers, BOX), np.int64), helpers)


@njit(
    types.void(
        float32[::1], float32[:, ::1], float32[:, :], int64[:, ::1], int64[:, ::1], int64[::1],
        int64,
    ),
    nogil=True,
    cache=True,
)  # fmt: skip
def run_team(arena, x, y, jobs, mail, team, threads):  # pragma: no cover - compiled
    """`lora_task(arena, x, y, jobs)` in min(threads, helpers + 1, rows) row ranges
    (`_rows`), with the helpers of `mail` that are awake (none where another caller has
    the team: `team`'s BUSY word); those asleep are woken for the next product. Compiled,
    so that Python (`Team.run`) and a step's FFI handler (no Python there) call the same
    code."""
    helpers = min(threads, mail.shape[0] + 1, x.shape[0]) - 1
    if helpers < 1 or not swap_if(team, BUSY, 0, 1):
        _alone(arena, x, y, jobs, helpers)
        return
    for h in range(helpers):
        store(mail[h], CALLER, 1)
    for h in range(helpers):
        if not load(mail[h], AWAKE):
            _wake(mail[h])
    helped, taken_back = _split(arena, x, y, jobs, mail, helpers)
    team[HELPED] += helped
    team[TAKEN_BACK] += taken_back
    for h in range(helpers):
        store(mail[h], CALLER, 0)
    store(team, BUSY, 0)


@njit(
    types.void(float32[::1], float32[:, ::1], float32[:, :], int64[:, ::1], int64),
    nogil=True,
    cache=True,
)
def run_alone(arena, x, y, jobs, helpers):  # pragma: no cover - compiled
    """`_alone`, for a closed team's `run`."""
    _alone(arena, x, y, jobs, helpers)


class Team:
    """The calling thread and `threads - 1` helpers, splitting `lora_task`'s rows.

    run:        `lora_task(arena, x, y, jobs)` over up to `threads` threads (`run_team`).
    helped:     row ranges the helpers computed; taken_back: ranges the caller posted
                to a helper, found unclaimed and computed itself.
    mail, words: the helpers' mailboxes and the team's words, for `run_team` (a
                compiled caller holds the team while it uses them).
    close(): stops the helpers (also when the team is collected); a later `run`
    computes every range on the calling thread.
    """

    def __init__(self, threads: int, spin_s: float = TEAM_SPIN_S) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r} must be an int >= 1")
        self.threads = threads
        self.spin_ns = int(spin_s * 1e9)
        self.mail = _mailboxes(threads - 1)
        self.words = np.zeros(TEAM_WORDS, np.int64)
        self._sems = ctypes.create_string_buffer(_SEM_BYTES * max(threads - 1, 1))
        for h in range(threads - 1):
            sem = ctypes.addressof(self._sems) + h * _SEM_BYTES
            if _LIBC.sem_init(ctypes.c_void_p(sem), 0, 0) != 0:
                raise OSError("sem_init failed")
            self.mail[h, SEM] = sem
        helpers = [
            threading.Thread(
                target=_helper,
                args=(self.mail[h], self.spin_ns),
                name=f"jlora-lora-helper-{h + 1}",
                daemon=True,
            )
            for h in range(threads - 1)
        ]
        for helper in helpers:
            helper.start()
        self._finalizer = weakref.finalize(self, _stop, self.mail, self._sems, helpers)

    @property
    def helped(self) -> int:
        return int(self.words[HELPED])

    @property
    def taken_back(self) -> int:
        return int(self.words[TAKEN_BACK])

    def run(
        self, arena: np.ndarray, x: np.ndarray, y: np.ndarray, jobs: np.ndarray, threads: int
    ) -> None:
        """Every row of x (f32[rows, in], C-ordered) through every job (`Task.job_rows`)
        into y (f32[rows, out], unit column stride), in min(threads, rows) row ranges
        (`_rows`), on as many threads as helpers are awake (none where another caller
        has the team, or once it is closed)."""
        if self._finalizer.alive:
            run_team(arena, x, y, jobs, self.mail, self.words, threads)
        else:
            run_alone(arena, x, y, jobs, min(threads, self.threads, x.shape[0]) - 1)

    def close(self) -> None:
        self._finalizer()


def _mailboxes(count: int) -> np.ndarray:
    """int64[count, BOX], zeros, the first on a cache line's start: no two helpers'
    mailboxes share a line."""
    flat = np.zeros(count * BOX + 8, np.int64)
    skip = (-flat.ctypes.data % 64) // 8
    return flat[skip : skip + count * BOX].reshape(count, BOX)


def _helper(box: np.ndarray, spin_ns: int) -> None:
    """A helper thread: sleep on its semaphore until woken (ctypes lets the GIL go
    meanwhile), then serve until idle for spin_ns."""
    cores = os.sched_getaffinity(0)
    sem = ctypes.c_void_p(int(box[SEM]))
    while True:
        while _LIBC.sem_wait(sem) != 0:  # EINTR: a signal, not a wake-up
            pass
        if box[STOP]:
            return
        box[WAKE] = 0  # a caller from now on wakes it again, at worst once too often
        others = cores - {int(box[CALLER_CPU])}
        if others:
            os.sched_setaffinity(0, others)
        _serve(box, spin_ns)


def _stop(mail: np.ndarray, sems: ctypes.Array, helpers: list[threading.Thread]) -> None:
    mail[:, STOP] = 1
    for box in mail:
        _LIBC.sem_post(ctypes.c_void_p(int(box[SEM])))
    for helper in helpers:
        helper.join()
    for box in mail:
        _LIBC.sem_destroy(ctypes.c_void_p(int(box[SEM])))
