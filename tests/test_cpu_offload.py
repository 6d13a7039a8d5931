"""cpu_offload: the Numba kernels against numpy, and the worker pool on a real shared arena.

The arena is laid out as the host store lays it out (jlora/adapters/store.py): per
layer, for each target, A [in, r] then B [r, out], float32. One 2-worker pool is
shared by the module (spawning is slow); the tests that end a pool start their own.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

from cpu_offload import MAX_JOBS, CpuLoraPool, LoraJob
from cpu_offload.kernels import blas
from cpu_offload.kernels import team as team_module
from cpu_offload.kernels.blas import lora_rows, lora_task
from cpu_offload.kernels.team import Team
from cpu_offload.protocol import DONE, Task

ATOL = 1e-4  # fp32 sums of a few hundred terms of size ~1/sqrt(n)
LAYERS = 2
RANK = 8
TARGETS = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "big": (1024, 1024)}  # in, out
BIG_RANK = 64  # the "big" target: ~10 ms of work per worker


def _rank(target: str) -> int:
    return BIG_RANK if target == "big" else RANK


def _reference(x, a, b):
    return x.astype(np.float64) @ a.astype(np.float64) @ b.astype(np.float64)


class Arena:
    """A shared-memory segment holding one adapter for LAYERS layers, store layout."""

    def __init__(self) -> None:
        rng = np.random.default_rng(7)
        offsets, cursor = {}, 0
        for target, (fan_in, fan_out) in TARGETS.items():
            rank = _rank(target)
            offsets[target] = (cursor, cursor + 4 * fan_in * rank)
            cursor += 4 * rank * (fan_in + fan_out)
        self.layer_stride = cursor
        self.shm = shared_memory.SharedMemory(create=True, size=cursor * LAYERS)
        self.weights = {}
        for layer in range(LAYERS):
            for target, (fan_in, fan_out) in TARGETS.items():
                rank = _rank(target)
                a = rng.standard_normal((fan_in, rank), np.float32) / np.float32(np.sqrt(fan_in))
                b = rng.standard_normal((rank, fan_out), np.float32) / np.float32(np.sqrt(rank))
                a_off, b_off = (layer * cursor + offset for offset in offsets[target])
                self.view(a_off, a.shape)[...] = a
                self.view(b_off, b.shape)[...] = b
                self.weights[layer, target] = (a, b, LoraJob(a_off, b_off, rank, fan_out))

    def view(self, offset, shape):
        return np.ndarray(shape, np.float32, buffer=self.shm.buf, offset=offset)

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


@pytest.fixture(scope="module")
def arena():
    arena = Arena()
    yield arena
    gc.collect()  # the test-local views go before the segment is unmapped
    arena.close()


@pytest.fixture(scope="module")
def pool(arena):
    """The watchdog's pool: no stealing, so a stopped worker is waited for."""
    with CpuLoraPool(
        arena.shm.name,
        workers=2,
        max_rows=512,
        max_in=1024,
        max_out=1024,
        hang_after=2.0,
        steal_after=None,
    ) as pool:
        yield pool


def _wait_all_ready(pool, timeout=60.0):
    deadline = time.monotonic() + timeout
    while len(pool.ready_workers()) < pool.num_workers:
        assert time.monotonic() < deadline, "respawned workers never became ready"
        time.sleep(0.02)


def _x(rows, in_features, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, in_features), np.float32)


# -- the kernel --------------------------------------------------------------


def test_kernel_hand_made_rank_2():
    x = np.array([[1, 2, 3]], np.float32)
    a = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
    b = np.array([[1, 2], [3, 4]], np.float32)
    out = np.zeros((1, 2), np.float32)
    lora_rows(x, a, b, out)
    # h = x @ a = [1 + 3, 2 + 3] = [4, 5]; out = [4·1 + 5·3, 4·2 + 5·4] = [19, 28]
    np.testing.assert_array_equal(out, [[19, 28]])


def test_kernel_hand_made_rank_1_into_columns():
    x = np.array([[1, -1], [0.5, 2]], np.float32)
    a = np.array([[2], [1]], np.float32)
    b = np.array([[1, -2, 0.5]], np.float32)
    out = np.full((2, 5), 9.0, np.float32)
    lora_rows(x, a, b, out[:, 1:4])
    # h = [1·2 - 1·1, 0.5·2 + 2·1] = [1, 3]; rows = h · [1, -2, 0.5]; columns 0, 4 untouched
    np.testing.assert_array_equal(out, [[9, 1, -2, 0.5, 9], [9, 3, -6, 1.5, 9]])


@pytest.mark.parametrize("rank", [1, 5, 16, 64])
def test_kernel_matches_numpy(rank):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((13, 576), np.float32)
    a = rng.standard_normal((576, rank), np.float32) / np.float32(np.sqrt(576))
    b = rng.standard_normal((rank, 192), np.float32) / np.float32(np.sqrt(rank))
    out = np.empty((13, 192), np.float32)
    lora_rows(x, a, b, out)
    np.testing.assert_allclose(out, _reference(x, a, b), rtol=0, atol=ATOL)


@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("rank", [1, 16, 64])
def test_kernel_writes_strided_columns_in_place(rows, rank):
    """The second product goes straight into columns 5..581 of a 600-wide buffer (BLAS's
    leading dimension); the columns around them are not touched."""
    rng = np.random.default_rng(rows * 100 + rank)
    x = rng.standard_normal((rows, 576), np.float32)
    a = rng.standard_normal((576, rank), np.float32) / np.float32(np.sqrt(576))
    b = rng.standard_normal((rank, 576), np.float32) / np.float32(np.sqrt(rank))
    out = np.full((rows, 600), 9.0, np.float32)
    lora_rows(x, a, b, out[:, 5:581])
    np.testing.assert_allclose(out[:, 5:581], _reference(x, a, b), rtol=0, atol=ATOL)
    assert (out[:, :5] == 9).all() and (out[:, 581:] == 9).all()


@pytest.mark.parametrize("rows_per_call", [(0, 0), (8, 32), (16, 8)], ids=str)
def test_task_kernel_makes_each_product_in_calls_of_the_rows_its_job_gives(rows_per_call):
    """300 rows of a rank-16 product into 1536 columns (3..1539 of a wider output):
    whatever rows per sgemm call the job row gives each product (0: one call; else
    blocks, the last one short), every row is right and nothing around is touched."""
    rng = np.random.default_rng(len(rows_per_call))
    a = rng.standard_normal((576, 16), np.float32) / np.float32(np.sqrt(576))
    b = rng.standard_normal((16, 1536), np.float32) / np.float32(4)
    arena = np.concatenate([a.ravel(), b.ravel()])
    jobs = np.array([[0, 4 * a.size, 16, 1536, 3, *rows_per_call]], np.int64)
    x = rng.standard_normal((300, 576), np.float32)
    out = np.full((300, 1545), 9.0, np.float32)
    lora_task(arena, x, out, jobs)
    np.testing.assert_allclose(out[:, 3:1539], _reference(x, a, b), rtol=0, atol=ATOL)
    assert (out[:, :3] == 9).all() and (out[:, 1539:] == 9).all()


def test_rows_per_call_keeps_each_call_on_openblas_small_product_path():
    """On a core with OpenBLAS's small-product kernels, the most rows, a multiple of 8,
    whose call takes at most 100^3 multiply-adds and writes at most 256 KiB; elsewhere
    (or under 16 rows) one call."""
    cases = {  # (width, depth): rows
        (64, 576): 24, (64, 1536): 0, (16, 576): 104, (8, 192): 648, (64, 4096): 0,
        (1536, 8): 40, (576, 8): 112, (1536, 64): 0, (1, 1): 65536,
    }  # fmt: skip
    for (width, depth), rows in cases.items():
        assert blas.rows_per_call(width, depth, "SkylakeX") == rows, (width, depth)
        assert rows * width * depth <= blas.SMALL_PRODUCT_MADDS
        assert 4 * rows * width <= blas.SMALL_PRODUCT_OUT_BYTES
    for core in ("Haswell", "Zen", "unknown"):
        assert blas.rows_per_call(16, 576, core) == 0


def test_kernel_refuses_an_output_that_is_not_whole_rows():
    x, a, b = np.ones((2, 3), np.float32), np.ones((3, 1), np.float32), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="unit column stride"):
        lora_rows(x, a, b, np.zeros((2, 4), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="shapes do not match"):
        lora_rows(x, a, b, np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("core", ["Haswell", "Sandybridge"])
def test_blas_core_names_the_kernels_openblas_was_told_to_run(core):
    """OPENBLAS_CORETYPE picks OpenBLAS's kernels at load: a process started with it set
    reports that core (the benchmarks record it beside their figures)."""
    code = "from cpu_offload.kernels.blas import blas_core; print(blas_core())"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    own = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if own.stdout.strip() == "unknown":
        pytest.skip("SciPy's BLAS here is not an OpenBLAS that names its core")
    told = subprocess.run(
        [sys.executable, "-c", code], env={**env, "OPENBLAS_CORETYPE": core},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert told.stdout.strip() == core


def test_task_kernel_hand_made_two_jobs_into_their_columns():
    # arena (floats): A0 = [[1], [2]] at 0, B0 = [[3, 4]] at 2, A1 = [[1], [-1]] at 4,
    # B1 = [[5]] at 6; job rows in bytes: (a_offset, b_offset, rank, out, column), then
    # rows per sgemm call of each product (job 0: one row a call; job 1: all in one).
    arena = np.array([1, 2, 3, 4, 1, -1, 5, 0], np.float32)
    jobs = np.array([[0, 8, 1, 2, 3, 1, 1], [16, 24, 1, 1, 0, 0, 0]], np.int64)
    x = np.array([[1, 1], [2, 0]], np.float32)
    y = np.full((2, 6), 7.0, np.float32)
    lora_task(arena, x, y, jobs)
    # job 0: x @ A0 = [3, 2] -> [[9, 12], [6, 8]] into columns 3..4
    # job 1: x @ A1 = [0, 2] -> [[0], [10]] into column 0; columns 1, 2 and 5 untouched
    np.testing.assert_array_equal(y, [[0, 7, 7, 9, 12, 7], [10, 7, 7, 6, 8, 7]])


def test_task_kernel_matches_numpy_on_the_arena_layout(arena):
    """Every target of one layer in one call, at shuffled columns of a wider output."""
    floats = np.frombuffer(arena.shm.buf, np.float32)
    x = _x(21, 64, seed=5)
    targets, columns = ("q", "k", "v"), (100, 0, 40)
    task = Task(0, 21, 64, 170, tuple(arena.weights[1, t][2] for t in targets), columns)
    jobs = task.job_rows()
    y = np.full((21, 170), np.nan, np.float32)
    lora_task(floats, x, y, jobs)
    del floats
    for target, column in zip(targets, columns, strict=True):
        a, b, job = arena.weights[1, target]
        got = y[:, column : column + job.out_features]
        np.testing.assert_allclose(got, _reference(x, a, b), rtol=0, atol=ATOL)
    assert np.isnan(y[:, 32:40]).all() and np.isnan(y[:, 72:100]).all()  # no job's columns


# -- the pool ----------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("layer", range(LAYERS))
def test_pool_matches_numpy(pool, arena, workers, layer):
    """q, k and v of one layer share x; their products come back side by side."""
    x = _x(37, 64, seed=layer)
    weights = [arena.weights[layer, target] for target in ("q", "k", "v")]
    fallbacks = pool.fallbacks
    y = pool.collect(pool.submit(x, [job for _, _, job in weights], threads=workers), 10.0)
    assert y.dtype == np.float32 and y.shape == (37, 64 + 32 + 32)
    expected = np.concatenate([_reference(x, a, b) for a, b, _ in weights], axis=1)
    np.testing.assert_allclose(y, expected, rtol=0, atol=ATOL)
    assert pool.fallbacks == fallbacks  # served by the workers


@pytest.mark.parametrize("workers", [1, 2])
def test_pool_puts_each_job_in_its_columns_and_zeros_the_rest(pool, arena, workers):
    """q at column 64 and v at column 0 of a 200-wide output: the columns no job covers
    come back zero, even right after a submit that wrote products there."""
    x = _x(19, 64, seed=9)
    big = arena.weights[0, "big"][2]
    pool.collect(pool.submit(_x(19, 1024), [big], threads=workers))  # fills the region
    (aq, bq, q), (av, bv, v) = arena.weights[0, "q"], arena.weights[0, "v"]
    ticket = pool.submit(x, [q, v], columns=[64, 0], out_total=200, threads=workers)
    y = pool.collect(ticket, 10.0)
    assert y.dtype == np.float32 and y.shape == (19, 200)
    np.testing.assert_allclose(y[:, 64:128], _reference(x, aq, bq), rtol=0, atol=ATOL)
    np.testing.assert_allclose(y[:, 0:32], _reference(x, av, bv), rtol=0, atol=ATOL)
    assert (y[:, 32:64] == 0).all() and (y[:, 128:] == 0).all()


def test_pool_collects_into_the_callers_buffer(pool, arena):
    """`out` gets the ticket's rows (the view returned); the rows after them are left
    for the caller (the host callback zeroes its padding rows itself)."""
    a, b, job = arena.weights[1, "k"]
    x = _x(6, 64, seed=2)
    out = np.full((9, 40), 5.0, np.float32)
    result = pool.collect(pool.submit(x, [job], columns=[8], out_total=40), out=out)
    assert result.base is out and result.shape == (6, 40)
    np.testing.assert_allclose(out[:6, 8:40], _reference(x, a, b), rtol=0, atol=ATOL)
    assert (out[:6, :8] == 0).all() and (out[6:] == 5).all()
    ticket = pool.submit(x, [job])
    with pytest.raises(ValueError, match="out: float32"):
        pool.collect(ticket, out=np.zeros((5, 32), np.float32))  # fewer rows than the ticket
    pool.collect(ticket)


def _rows_for(pool: CpuLoraPool, ms: float, flops_per_token: int) -> int:
    """The rows of a product that take `ms` on one core by the pool's start-up profile
    (a fixed shape takes longer on a slow core than on a fast one)."""
    profile = pool.profile
    return math.ceil(ms * profile.tokens_per_ms * profile.flops_per_token / flops_per_token)


def test_threads_for_follows_the_profile(pool):
    """A thread per target_ms (1 ms) of work, up to the workers."""
    assert pool.profile.tokens_per_ms > 0
    assert pool.threads_for(1, 64, 8, 64) == 1
    flops = 2 * 64 * (1024 + 1024)  # rank 64, in 1024, out 1024
    assert pool.threads_for(_rows_for(pool, 0.5, flops), 1024, 64, 1024) == 1
    assert pool.threads_for(_rows_for(pool, 1.5, flops), 1024, 64, 1024) == 2
    assert pool.threads_for(_rows_for(pool, 3.0, flops), 1024, 64, 1024) == pool.num_workers
    small, large = pool.threads_for(64, 576, 1, 576), pool.threads_for(64, 576, 64, 576)
    assert small <= large


def test_a_pool_of_threads_splits_what_a_pool_of_processes_keeps_whole(pool, arena):
    """target_ms's defaults: a product of ~0.3 ms on one core is split over a pool of
    threads' three (a helper that is awake takes its share in microseconds) and stays on
    one worker process (a hand-off costs tens of microseconds)."""
    flops = 2 * 16 * (576 + 576)  # rank 16, in 576, out 576
    with _local_pool(arena) as local:
        assert (local.target_ms, pool.target_ms) == (0.05, 1.0)
        assert local.threads_for(_rows_for(local, 0.3, flops), 576, 16, 576) == 3
        assert pool.threads_for(_rows_for(pool, 0.3, flops), 576, 16, 576) == 1


def _big_product(pool, arena):
    a, b, job = arena.weights[1, "big"]
    x = _x(512, 1024, seed=3)
    return x, pool.submit(x, [job], threads=2), _reference(x, a, b)


def _assert_served_by_workers_again(pool, arena):
    _wait_all_ready(pool)
    fallbacks = pool.fallbacks
    x, ticket, expected = _big_product(pool, arena)
    np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
    assert pool.fallbacks == fallbacks


def test_killed_worker_loses_nothing(pool, arena):
    _wait_all_ready(pool)
    fallbacks, respawns = pool.fallbacks, pool.respawns
    victim = pool._workers[0].process.pid
    os.kill(victim, signal.SIGSTOP)  # so that it cannot finish before it is killed
    x, ticket, expected = _big_product(pool, arena)
    os.kill(victim, signal.SIGKILL)
    np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
    assert pool.fallbacks == fallbacks + 1
    assert pool.respawns == respawns + 1
    assert pool._workers[0].process.pid != victim
    _assert_served_by_workers_again(pool, arena)


def test_hung_worker_is_replaced(pool, arena):
    _wait_all_ready(pool)
    fallbacks, respawns = pool.fallbacks, pool.respawns
    os.kill(pool._workers[1].process.pid, signal.SIGSTOP)
    x, ticket, expected = _big_product(pool, arena)
    start = time.monotonic()
    np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
    assert time.monotonic() - start >= pool.hang_after * 0.9
    assert (pool.fallbacks, pool.respawns) == (fallbacks + 1, respawns + 1)
    _assert_served_by_workers_again(pool, arena)


def test_a_late_workers_rows_are_computed_by_the_caller(arena):
    """A worker that has not taken its share `steal_after` seconds after the submit
    (stopped: as if descheduled) has its rows computed in the calling process, well
    before `hang_after`; resumed, it does not compute the task it lost (the rows it
    would write stay as they are) and serves the next one."""
    with CpuLoraPool(
        arena.shm.name,
        workers=2,
        max_rows=512,
        max_in=1024,
        max_out=1024,
        hang_after=60.0,
        steal_after=1e-3,
    ) as pool:
        victim = pool._workers[0].process.pid
        os.kill(victim, signal.SIGSTOP)
        try:
            x, ticket, expected = _big_product(pool, arena)
            start = time.monotonic()
            np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
            assert time.monotonic() - start < 30.0
            assert (pool.steals, pool.fallbacks, pool.respawns) == (1, 0, 0)
            [stolen] = [share for share in ticket.shares if share.worker == 0]
            region = pool._block.y(ticket.rows, ticket.out_total)
            region[stolen.task.row_start : stolen.task.row_end] = np.nan
        finally:
            os.kill(victim, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while int(pool._block.slots[0, DONE]) < stolen.seq:  # it has seen the task
            assert time.monotonic() < deadline, "the resumed worker never caught up"
            time.sleep(0.005)
        assert np.isnan(region[stolen.task.row_start : stolen.task.row_end]).all()
        del region
        x, ticket, expected = _big_product(pool, arena)
        np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
        assert pool.fallbacks == 0 and pool.respawns == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_pool_of_local_threads_computes_straight_into_the_callers_buffer(arena, threads):
    """`local_threads`: no worker processes; `collect` computes the whole submit on the
    caller's threads, into its own buffer (the shared output region stays as it was),
    with zeros in the columns no job covers."""
    with CpuLoraPool(
        arena.shm.name, workers=0, local_threads=3, max_rows=64, max_in=64, max_out=200
    ) as pool:
        assert pool.num_workers == 0 and pool.max_threads == 3
        assert pool.threads_for(512, 1024, 1024, 1024) == 3  # ~20 ms of work on one core
        (aq, bq, q), (av, bv, v) = arena.weights[1, "q"], arena.weights[1, "v"]
        x = _x(21, 64, seed=4)
        ticket = pool.submit(x, [q, v], columns=[64, 0], out_total=200, threads=threads)
        assert [share.worker for share in ticket.shares] == [-1]
        assert ticket.local and ticket.threads == threads
        region = pool._block.y(21, 200)
        region[:] = np.nan  # where workers would have put the products
        out = np.full((21, 200), 5.0, np.float32)
        pool.collect(ticket, 10.0, out=out)
        np.testing.assert_allclose(out[:, 64:128], _reference(x, aq, bq), rtol=0, atol=ATOL)
        np.testing.assert_allclose(out[:, 0:32], _reference(x, av, bv), rtol=0, atol=ATOL)
        assert (out[:, 32:64] == 0).all() and (out[:, 128:] == 0).all()
        assert np.isnan(region).all()
        del region
        assert (pool.steals, pool.fallbacks) == (0, 0)


def _local_pool(arena) -> CpuLoraPool:
    return CpuLoraPool(
        arena.shm.name, workers=0, local_threads=3, max_rows=64, max_in=64, max_out=200
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_run_on_local_threads_reads_x_where_it_is(arena, threads):
    """`run` on a pool of threads: a submit's products at once, straight from x (the
    shared input region is never written) into the caller's buffer, zeros in the
    columns no job covers, the rows after x's left to the caller; bit for bit what a
    submit and its collect give."""
    with _local_pool(arena) as pool:
        (aq, bq, q), (av, bv, v) = arena.weights[1, "q"], arena.weights[1, "v"]
        x = _x(21, 64, seed=5)
        region = pool._block.x(21, 64)
        region[:] = np.nan
        out = np.full((24, 200), 5.0, np.float32)
        result = pool.run(x, [q, v], columns=[64, 0], out_total=200, threads=threads, out=out)
        assert result.base is out and result.shape == (21, 200)
        np.testing.assert_allclose(out[:21, 64:128], _reference(x, aq, bq), rtol=0, atol=ATOL)
        np.testing.assert_allclose(out[:21, 0:32], _reference(x, av, bv), rtol=0, atol=ATOL)
        assert (out[:21, 32:64] == 0).all() and (out[:21, 128:] == 0).all()
        assert (out[21:] == 5).all()
        assert np.isnan(region).all()
        del region
        ticket = pool.submit(x, [q, v], columns=[64, 0], out_total=200, threads=threads)
        assert np.array_equal(pool.collect(ticket), result)


def test_jobs_checked_once_are_checked_again_in_another_layout(arena):
    """A pool remembers the jobs it checked (a prefill repeats them every layer), by
    everything a check reads: the same jobs in other columns get those columns, and a
    bad layout of them still fails, however often the good ones ran."""
    with _local_pool(arena) as pool:
        (aq, bq, q), (av, bv, v) = arena.weights[1, "q"], arena.weights[1, "v"]
        x = _x(5, 64, seed=9)
        for _ in range(2):
            side_by_side = pool.run(x, [q, v])
            swapped = pool.run(x, [q, v], columns=[32, 0], out_total=100)
            for columns, bad in ([0, 32], "overlap"), (None, "out_total"):
                with pytest.raises(ValueError, match=bad):
                    pool.run(x, [q, v], columns=columns, out_total=None if columns else 2048)
        assert side_by_side.shape == (5, 96) and swapped.shape == (5, 100)
        for out, (q_at, v_at) in (side_by_side, (0, 64)), (swapped, (32, 0)):
            np.testing.assert_allclose(out[:, q_at : q_at + 64], _reference(x, aq, bq), atol=ATOL)
            np.testing.assert_allclose(out[:, v_at : v_at + 32], _reference(x, av, bv), atol=ATOL)
        assert (swapped[:, 96:] == 0).all()


def test_run_on_worker_processes_is_a_submit_and_its_collect(pool, arena):
    a, b, job = arena.weights[0, "v"]
    x = _x(9, 64, seed=8)
    fallbacks = pool.fallbacks
    np.testing.assert_allclose(pool.run(x, [job], threads=2), _reference(x, a, b), atol=ATOL)
    assert pool.fallbacks == fallbacks  # the workers computed it


@pytest.mark.parametrize(
    "field, call",
    [
        ("x.dtype", lambda p, x, job: p.run(x.astype(np.float64), [job])),
        ("rows", lambda p, x, job: p.run(np.zeros((65, 64), np.float32), [job])),
        ("overlap", lambda p, x, job: p.run(x, [job, job], columns=[0, 63])),
        ("threads", lambda p, x, job: p.run(x, [job], threads=0)),
        ("out: float32", lambda p, x, job: p.run(x, [job], out=np.zeros((2, 64), np.float32))),
        ("not been collected", lambda p, x, job: (p.submit(x, [job]), p.run(x, [job]))),
    ],
)
def test_a_bad_run_names_the_field_and_changes_nothing(arena, field, call):
    with _local_pool(arena) as pool:
        a, b, job = arena.weights[0, "q"]
        x = _x(3, 64)
        with pytest.raises((ValueError, RuntimeError), match=field):
            call(pool, x, job)
        if pool._inflight is not None:
            pool.collect(pool._inflight)
        np.testing.assert_allclose(pool.run(x, [job]), _reference(x, a, b), atol=ATOL)


def _two_jobs(arena):
    """The q and k targets of layer 0 into columns 0-63 and 70-101 of 110: f32 arena,
    the jobs' rows (`Task.job_rows`), and the float64 product of x."""
    floats = np.frombuffer(arena.shm.buf, np.float32)
    chosen = ((arena.weights[0, "q"], 0), (arena.weights[0, "k"], 70))
    jobs = Task(0, 0, 64, 110, tuple(j for (_, _, j), _ in chosen), (0, 70)).job_rows()

    def expected(x):
        product = np.zeros((x.shape[0], 110))
        for (a, b, _), column in chosen:
            product[:, column : column + b.shape[1]] = _reference(x, a, b)
        return product

    return floats, jobs, expected


@pytest.mark.parametrize("threads", [2, 3])
def test_a_team_computes_each_share_as_the_one_thread_kernel_would(arena, threads):
    """Each of `threads` contiguous row ranges gets, bit for bit, what the one-thread
    kernel gives that range alone (not against one call over all rows: OpenBLAS picks
    its sgemm kernels by the matrix's size), the whole equals the float64 product, and
    no column beyond y's or between the jobs' is written. Called until the helpers,
    woken by the first calls, have computed shares of their own."""
    floats, jobs, expected = _two_jobs(arena)
    team = Team(threads)
    try:
        for rows in (1, 2, 37):
            x = _x(rows, 64, seed=6)
            parts = min(threads, rows)
            alone = np.zeros((rows, 110), np.float32)
            for i in range(parts):
                start, end = rows * i // parts, rows * (i + 1) // parts
                lora_task(floats, x[start:end], alone[start:end], jobs)
            np.testing.assert_allclose(alone, expected(x), atol=ATOL)
            deadline = time.monotonic() + 10
            helped = team.helped
            while team.helped == helped and time.monotonic() < deadline and rows > 1:
                wide = np.zeros((rows, 120), np.float32)  # y: a strided view of it
                wide[:, 110:] = 7.0
                team.run(floats, x, wide[:, :110], jobs, threads)
                np.testing.assert_array_equal(wide[:, :110], alone)
                assert (wide[:, 110:] == 7.0).all()
            assert rows == 1 or team.helped > helped, "no helper took a share in 10 s"
    finally:
        team.close()
    del floats


def test_a_caller_takes_back_the_shares_no_helper_claimed(arena):
    """The caller never waits for a helper that has not claimed its share: with helpers
    awake but not polling, it takes back and computes both posted ranges itself; with
    none awake it posts nothing. The same bits either way."""
    floats, jobs, expected = _two_jobs(arena)
    x = _x(37, 64, seed=7)
    results = []
    for awake, counts in ((1, (0, 2)), (0, (0, 0))):
        mail = np.zeros((2, team_module.BOX), np.int64)
        mail[:, team_module.AWAKE] = awake
        y = np.zeros((37, 110), np.float32)
        assert team_module._split(floats, x, y, jobs, mail, 2) == counts
        assert (mail[:, team_module.TASK] == team_module.EMPTY).all()
        results.append(y)
    np.testing.assert_allclose(results[0], expected(x), atol=ATOL)
    np.testing.assert_array_equal(results[0], results[1])
    del floats


def test_a_busy_or_closed_team_computes_every_range_on_the_calling_thread(arena):
    """A second caller while another has the team, or a caller after close(), computes
    the same row ranges itself, so the same bits; close() ends the helper threads."""
    floats, jobs, _ = _two_jobs(arena)
    x = _x(37, 64, seed=8)
    ranges = np.zeros((37, 110), np.float32)
    for start, end in ((0, 18), (18, 37)):
        lora_task(floats, x[start:end], ranges[start:end], jobs)
    team = Team(2)
    assert any(t.name == "jlora-lora-helper-1" for t in threading.enumerate())
    team.words[team_module.BUSY] = 1  # another caller has it
    y = np.zeros((37, 110), np.float32)
    team.run(floats, x, y, jobs, 2)
    team.words[team_module.BUSY] = 0
    np.testing.assert_array_equal(y, ranges)
    assert (team.helped, team.taken_back) == (0, 0)
    team.close()
    assert not any(t.name == "jlora-lora-helper-1" for t in threading.enumerate())
    y = np.zeros((37, 110), np.float32)
    team.run(floats, x, y, jobs, 2)
    np.testing.assert_array_equal(y, ranges)
    assert (team.helped, team.taken_back) == (0, 0)
    del floats


def test_collect_timeout_keeps_the_ticket(pool, arena):
    _wait_all_ready(pool)
    fallbacks, worker = pool.fallbacks, pool._workers[0].process.pid
    os.kill(worker, signal.SIGSTOP)  # paused for less than hang_after
    try:
        x, ticket, expected = _big_product(pool, arena)
        with pytest.raises(TimeoutError):
            pool.collect(ticket, 0.05)
    finally:
        os.kill(worker, signal.SIGCONT)
    np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)
    assert pool.fallbacks == fallbacks


def test_a_discarded_ticket_frees_the_pool_for_the_next(pool, arena):
    """A caller that fails between submit and collect lets its ticket go: once the
    workers are done with it, the next submit runs as if nothing happened."""
    _wait_all_ready(pool)
    x, ticket, _ = _big_product(pool, arena)
    with pytest.raises(RuntimeError, match="not been collected"):
        pool.submit(x, [arena.weights[1, "big"][2]])
    pool.discard(ticket, 30.0)
    pool.discard(ticket, 30.0)  # no longer in flight: nothing to do
    with pytest.raises(ValueError, match="not the one in flight"):
        pool.collect(ticket)
    x, ticket, expected = _big_product(pool, arena)
    np.testing.assert_allclose(pool.collect(ticket, 30.0), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "field, call",
    [
        ("rows", lambda p, x, job: p.submit(np.zeros((513, 64), np.float32), [job])),
        ("in_features", lambda p, x, job: p.submit(np.zeros((4, 2048), np.float32), [job])),
        ("x.dtype", lambda p, x, job: p.submit(x.astype(np.float64), [job])),
        ("x.shape", lambda p, x, job: p.submit(x[0], [job])),
        ("len(jobs)", lambda p, x, job: p.submit(x, [])),
        ("len(jobs)", lambda p, x, job: p.submit(x, [job] * (MAX_JOBS + 1))),
        ("out_features", lambda p, x, job: p.submit(x, [job, LoraJob(0, 0, 1, 1024)])),
        ("a_offset", lambda p, x, job: p.submit(x, [LoraJob(-4, 0, 8, 64)])),
        ("b_offset", lambda p, x, job: p.submit(x, [LoraJob(0, 2, 8, 64)])),
        ("b_offset", lambda p, x, job: p.submit(x, [LoraJob(0, 1 << 30, 8, 64)])),
        ("threads", lambda p, x, job: p.submit(x, [job], threads=0)),
        ("len(columns)", lambda p, x, job: p.submit(x, [job, job], columns=[0])),
        ("overlap", lambda p, x, job: p.submit(x, [job, job], columns=[0, 63])),
        ("leave the output", lambda p, x, job: p.submit(x, [job], columns=[1], out_total=64)),
        ("leave the output", lambda p, x, job: p.submit(x, [job], columns=[-1])),
        ("out_total", lambda p, x, job: p.submit(x, [job], out_total=2048)),
    ],
)
def test_bad_submit_names_the_field_and_changes_nothing(pool, arena, field, call):
    a, b, job = arena.weights[0, "q"]
    x = _x(3, 64)
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        call(pool, x, job)
    np.testing.assert_allclose(pool.collect(pool.submit(x, [job])), _reference(x, a, b), atol=ATOL)


def test_max_jobs_fit_in_a_slot(pool, arena):
    a, b, job = arena.weights[0, "k"]
    x = _x(5, 64)
    y = pool.collect(pool.submit(x, [job] * MAX_JOBS))
    np.testing.assert_allclose(y, np.tile(_reference(x, a, b), MAX_JOBS), atol=ATOL)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"arena_name": "jlora-test-no-such-segment"}, "arena_name"),
        ({"arena_name": "../etc/passwd"}, "arena_name"),
        ({"workers": 0}, "workers"),
        ({"local_threads": -1}, "local_threads"),
        ({"workers": 1, "local_threads": 2}, "not both"),
        ({"max_rows": -1}, "max_rows"),
        ({"hang_after": 0.0}, "hang_after"),
        ({"steal_after": -1.0}, "steal_after"),
    ],
)
def test_bad_pool_arguments_name_the_field(arena, kwargs, field):
    arguments = {
        "arena_name": arena.shm.name,
        "workers": 1,
        "max_rows": 8,
        "max_in": 8,
        "max_out": 8,
    }
    with pytest.raises(ValueError, match=field):
        CpuLoraPool(**(arguments | kwargs))


def _shm_listing() -> set[str]:
    """This process's control segments (other processes on the machine create their own)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"jlora_cpu_{os.getpid()}_")}


def test_close_stops_workers_and_leaves_no_segment(arena):
    before = _shm_listing()
    pool = CpuLoraPool(arena.shm.name, workers=1, max_rows=16, max_in=64, max_out=64)
    assert pool.control_name in _shm_listing()
    a, b, job = arena.weights[1, "q"]
    x = _x(16, 64)
    np.testing.assert_allclose(pool.collect(pool.submit(x, [job])), _reference(x, a, b), atol=ATOL)
    assert pool.fallbacks == 0
    processes = [worker.process for worker in pool._workers]
    pool.close()
    pool.close()
    assert not any(process.is_alive() for process in processes)
    assert _shm_listing() - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(x, [job])


def test_forgotten_pool_is_finalized(arena):
    before = _shm_listing()
    pool = CpuLoraPool(arena.shm.name, workers=1, max_rows=16, max_in=64, max_out=64)
    name, process = pool.control_name, pool._workers[0].process
    del pool
    gc.collect()  # the finalizer may also run on the watchdog thread, which can hold it briefly
    deadline = time.monotonic() + 10
    while name in _shm_listing() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert name not in _shm_listing()
    assert _shm_listing() - before == set()
    process.join(timeout=10)
    assert not process.is_alive()
